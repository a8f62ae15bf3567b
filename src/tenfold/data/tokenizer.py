"""Tokenizers: bytes (vocab 256, the default), a BPE trained with `tokenizers`, and ids.

Documents are joined with an end-of-document token so a model can learn where one file
stops: byte 0 for the byte tokenizer (NUL never occurs in text files, so it is free), the
special token `<|endoftext|>` (id 0) for BPE.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from tenfold.errors import UserError

EOT = "<|endoftext|>"
# The BPE is trained on at most this many bytes of the corpus: merges are learned from
# frequent pairs, and 2 MB of Python already gives stable ones in about 0.5 s.
BPE_TRAIN_BYTES = 2_000_000


class ByteTokenizer:
    """UTF-8 bytes as tokens; decoding replaces invalid sequences rather than failing."""

    name = "byte"
    vocab_size = 256
    eot_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_documents(self, docs: list[bytes]) -> np.ndarray:
        return np.frombuffer(bytes([self.eot_id]).join(docs), dtype=np.uint8)

    def document_ids(self, doc: str | bytes, index: int = 0) -> list[int]:
        """Document `index` of a stream: the separator before it (not before the first), then
        its bytes; concatenated, these are exactly `encode_documents`."""
        raw = doc if isinstance(doc, bytes) else doc.encode("utf-8")
        return ([self.eot_id] if index else []) + list(raw)

    def describe(self) -> dict:
        return {"name": self.name, "kind": "byte", "vocab_size": self.vocab_size, "bos": None, "eos": None,
                "sha256": "byte"}

    def save(self, folder: str | Path) -> Path:
        """A `tokenizer.json` that gives the same ids (byte b -> id b), so that transformers'
        AutoTokenizer can load a byte-level run's export."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        byte_level_tokenizer().save(str(out / "tokenizer.json"))
        from tenfold.data.hf_tokenizer import write_tokenizer_config

        write_tokenizer_config(out, None, None)
        return out


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenizer) from the `tokenizers` library."""

    name = "bpe"

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT)

    @classmethod
    def train(cls, docs: list[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
            show_progress=False,
        )
        tok.train_from_iterator(_bounded_sample(docs, BPE_TRAIN_BYTES), trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def save_file(self, path: str | Path) -> None:
        self._tok.save(str(path))

    def save(self, folder: str | Path) -> Path:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        self.save_file(out / "tokenizer.json")
        from tenfold.data.hf_tokenizer import write_tokenizer_config

        write_tokenizer_config(out, None, EOT)
        return out

    def describe(self) -> dict:
        return {"name": self.name, "kind": "bpe", "vocab_size": self.vocab_size, "bos": None, "eos": EOT,
                "sha256": hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]}

    def document_ids(self, doc: str | bytes, index: int = 0) -> list[int]:
        text = doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc
        return ([self.eot_id] if index else []) + self.encode(text)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def encode_documents(self, docs: list[str]) -> np.ndarray:
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        pieces: list[np.ndarray] = []
        eot = np.array([self.eot_id], dtype=dtype)
        for i, enc in enumerate(self._tok.encode_batch(docs, add_special_tokens=False)):
            if i:
                pieces.append(eot)
            pieces.append(np.asarray(enc.ids, dtype=dtype))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


class IdTokenizer:
    """For pre-tokenized `.bin` data, whose tokenizer tenfold does not know: ids as text."""

    name = "pre-tokenized"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def describe(self) -> dict:
        return {"name": self.name, "kind": "ids", "vocab_size": self.vocab_size, "bos": None, "eos": None}

    def save(self, folder: str | Path) -> None:
        return None  # nothing to save: the ids' tokenizer is unknown

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def resolve_tokenizer(data_cfg, hf_pretrained: str | None = None):
    """`data.tokenizer` -> a tokenizer; None for `bpe` (trained later, on the corpus).

    Unset: the `--hf-pretrained` folder's own tokenizer, else bytes. A pretrained model is
    never paired with the byte tokenizer unless the run asks for it (`--tokenizer byte`)."""
    from tenfold.data.hf_tokenizer import has_tokenizer, load_tokenizer_path

    spec = data_cfg.tokenizer
    if spec is None and hf_pretrained:
        from tenfold.models.hf import check_pretrained_folder

        check_pretrained_folder(hf_pretrained)  # a folder without weights is the first thing to say
        if not has_tokenizer(hf_pretrained):
            raise UserError(
                f"model.hf_pretrained (--hf-pretrained) {hf_pretrained} holds no tokenizer (tokenizer.json, "
                "tokenizer_config.json or tokenizer.model), and a pretrained model is not trained on bytes "
                "unless asked: pass --tokenizer PATH (a tokenizer.json or tokenizer folder), or --tokenizer byte")
        return load_tokenizer_path(hf_pretrained)
    if spec is None or spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        return None
    return load_tokenizer_path(spec)


def load_named_tokenizer(record: dict):
    """The tokenizer a `describe()` record names (a prepared .bin's FILE.json), when it can be
    loaded again: bytes, or a tokenizer path that still exists; else None."""
    from tenfold.data.hf_tokenizer import load_tokenizer_path

    if record.get("kind") == "byte":
        return ByteTokenizer()
    if record.get("kind") == "huggingface" and Path(str(record.get("name"))).exists():
        return load_tokenizer_path(record["name"])
    return None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (openai/gpt-2, src/encoder.py),
    the alphabet of byte-level tokenizers."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_level_tokenizer():
    """A `tokenizers` byte-level BPE with no merges and id = byte value: ByteTokenizer's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _bounded_sample(docs: list[str], max_chars: int) -> list[str]:
    """The first documents up to `max_chars` characters: deterministic, no random sampling."""
    out, total = [], 0
    for d in docs:
        out.append(d[: max_chars - total])
        total += len(out[-1])
        if total >= max_chars:
            break
    return out


# ---------------------------------------------------------------- BPE cache (keyed by content)


def bpe_cache_dir() -> Path:
    """`$TENFOLD_CACHE_DIR/bpe`, default `~/.cache/tenfold/bpe`. Entries are keyed by a hash of
    the corpus bytes, the vocabulary size and the `tokenizers` version, so a stale entry is
    never used; deleting the folder is always safe."""
    base = os.environ.get("TENFOLD_CACHE_DIR") or Path.home() / ".cache" / "tenfold"
    return Path(base) / "bpe"


def build_bpe(docs: list[bytes], vocab_size: int) -> tuple[BPETokenizer, np.ndarray]:
    """Train (or load from the cache) a BPE on `docs` and encode them all.

    Encoding all of the standard library takes ~5 s on 2 cores, training ~0.5 s; the cache
    makes every later run take ~0.1 s."""
    import tokenizers

    key = hashlib.sha256()
    for d in docs:
        key.update(len(d).to_bytes(8, "little"))
        key.update(d)
    key.update(f"|vocab={vocab_size}|train_bytes={BPE_TRAIN_BYTES}|tokenizers={tokenizers.__version__}".encode())
    entry = bpe_cache_dir() / key.hexdigest()[:32]
    if _complete(entry):
        try:
            return BPETokenizer.from_file(entry / "tokenizer.json"), np.load(entry / "tokens.npy", mmap_mode="r")
        except Exception:  # a damaged cache entry is rebuilt, not trusted
            shutil.rmtree(entry, ignore_errors=True)
    texts = [d.decode("utf-8", errors="replace") for d in docs]
    tok = BPETokenizer.train(texts, vocab_size)
    tokens = tok.encode_documents(texts)
    _write_cache(entry, tok, tokens)
    return tok, tokens


def _complete(entry: Path) -> bool:
    return (entry / "tokens.npy").is_file() and (entry / "tokenizer.json").is_file()


def _write_cache(entry: Path, tok: BPETokenizer, tokens: np.ndarray) -> None:
    """Write into a private temp folder, then rename: concurrent ranks never see half an entry.
    An entry that failed to load (damaged, partial) is replaced; one that another rank has
    just completed is kept (its content is identical)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.parent / f".{entry.name}.{os.getpid()}.tmp"
        tmp.mkdir(exist_ok=True)
        tok.save_file(tmp / "tokenizer.json")
        np.save(tmp / "tokens.npy", tokens)
        if entry.exists() and not _complete(entry):
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.replace(tmp, entry)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # a read-only home is fine: the cache only saves time

