"""A model's own tokenizer: a `tokenizer.json` file or a Hugging Face tokenizer folder, offline.

Encoding goes through the `tokenizers` library (Rust, batched), whatever wrote the folder.
Which tokens are BOS and EOS comes from the folder's `tokenizer_config.json` (or
`special_tokens_map.json`), as `transformers.AutoTokenizer` reads them; the BOS a tokenizer
puts in front of a text is its own post-processor's (Llama's `<s> $A` template adds one,
GPT-2's adds none). Chat templates are rendered by transformers' `AutoTokenizer` with
`local_files_only=True`, the only path that imports transformers.

A document is `encode(text, add_special_tokens=True) + [EOS]`: the tokenizer's own template,
then an end-of-document token so a model learns where a document stops (litgpt and torchtune
append EOS the same way). Nothing here downloads.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from tenfold.errors import UserError
from tenfold.textfiles import MAX_TOKENIZER_BYTES, check_file, read_text

FLAG = "data.tokenizer (--tokenizer)"
ALLOWED = "byte, bpe, a tokenizer.json file or a Hugging Face tokenizer folder"
# What a Hugging Face tokenizer folder can hold; all of it is copied into runs and exports.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
)
# End-of-document tokens of common tokenizers, for a bare tokenizer.json that names none.
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
KNOWN_BOS = ("<s>", "<|begin_of_text|>", "<bos>")


def has_tokenizer(folder: str | Path) -> bool:
    folder = Path(folder)
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _token_text(value: Any) -> str | None:
    """`"</s>"` or `{"content": "</s>", ...}` (both appear in tokenizer_config.json)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:  # a regular file of a few MB (tenfold.textfiles), not a device or FIFO read forever
        data = json.loads(read_text(path, FLAG))
    except ValueError as e:
        raise UserError(f"{FLAG} {path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus the BOS/EOS and chat template its folder defines."""

    def __init__(self, tok, source: Path, folder: Path | None, meta: dict):
        self._tok = tok
        self.source, self.folder = source, folder
        self.name = str(source)
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0  # added tokens may sit past the base vocab
        self.bos = _token_text(meta.get("bos_token")) or next((t for t in KNOWN_BOS if t in vocab), None)
        self.eos = _token_text(meta.get("eos_token")) or next((t for t in KNOWN_EOS if t in vocab), None)
        self.bos_id = vocab.get(self.bos) if self.bos else None
        self.eos_id = vocab.get(self.eos) if self.eos else None
        self.eot_id = self.eos_id  # the end-of-document token
        self.chat_template = bool(meta.get("chat_template")) or any(
            folder is not None and (folder / f).is_file() for f in ("chat_template.jinja", "chat_template.json"))
        self._auto = None

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str) -> list[int]:
        """Plain ids, no special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def document_ids(self, doc: str | bytes, index: int = 0) -> list[int]:
        """One document as the tokenizer frames it, then EOS (see the module docstring)."""
        del index  # every document carries its own frame, unlike the byte tokenizer's separator
        text = doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc
        ids = self._tok.encode(text, add_special_tokens=True).ids
        return self._with_eos(ids)

    def _with_eos(self, ids: list[int]) -> list[int]:
        if self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
            ids = ids + [self.eos_id]
        return ids

    def encode_documents(self, docs: list) -> np.ndarray:
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        encodings = self._tok.encode_batch(texts, add_special_tokens=True)
        parts = [np.asarray(self._with_eos(e.ids), dtype=self.dtype) for e in encodings]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    @property
    def dtype(self):
        return np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def prompt_ids(self, prompt: str) -> list[int]:
        """A prompt framed like the start of a document (BOS where the template adds one), with
        no trailing EOS: the completion continues it."""
        ids = self._tok.encode(prompt, add_special_tokens=True).ids
        appended_eos = ids and self.eos_id is not None and ids[-1] == self.eos_id  # an add_eos template
        return ids[:-1] if appended_eos else ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    # ------------------------------------------------------------------ chat

    def render_chat(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation rendered by the tokenizer's chat template, and the character spans of
        the assistant turns (each turn's text after the generation prompt, end-of-turn markup
        included, so a model learns to stop). A turn's span is found as the difference between
        rendering the messages before it with `add_generation_prompt=True` and with it."""
        auto = self._auto_tokenizer()

        def render(msgs: list[dict], generation_prompt: bool) -> str:
            return auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

        full = render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before, upto = render(messages[:i], True), render(messages[: i + 1], False)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise UserError(
                    "the tokenizer's chat template does not render a conversation as a prefix of its "
                    "continuation, so the assistant turns cannot be located; use data.format=prompt-completion")
            spans.append((len(before), len(upto)))
        return full, spans

    def _auto_tokenizer(self):
        if not self.chat_template:
            where = self.folder or self.source
            raise UserError(
                f"data.format=chat needs a chat template, and the tokenizer {where} has none (no "
                "chat_template in tokenizer_config.json, no chat_template.jinja); add one, or use "
                "data.format=prompt-completion")
        if self._auto is None:
            from tenfold.models.hf import _transformers

            try:
                self._auto = _transformers().AutoTokenizer.from_pretrained(_checked_folder(self.folder),
                                                                           local_files_only=True)
            except (OSError, ValueError) as e:
                raise UserError(f"{FLAG} {self.folder}: transformers cannot load it ({e})") from None
        return self._auto

    # ------------------------------------------------------------------ saving

    def describe(self) -> dict:
        return {"name": self.name, "kind": "huggingface", "vocab_size": self.vocab_size,
                "bos": self.bos, "eos": self.eos, "chat_template": self.chat_template,
                "sha256": self.fingerprint()}

    def fingerprint(self) -> str:
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]

    def save(self, folder: str | Path) -> Path:
        """Copy the tokenizer's files into `folder` (loadable with AutoTokenizer). A bare
        tokenizer.json gets a minimal tokenizer_config.json naming its BOS/EOS."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        if self.folder is not None:
            for f in TOKENIZER_FILES:
                if (self.folder / f).is_file():
                    shutil.copyfile(self.folder / f, out / f)
        if not (out / "tokenizer.json").is_file():
            self._tok.save(str(out / "tokenizer.json"))
        if not (out / "tokenizer_config.json").is_file():
            write_tokenizer_config(out, self.bos, self.eos)
        return out


def write_tokenizer_config(out: Path, bos: str | None, eos: str | None) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v}, indent=1) + "\n")


def load_tokenizer_path(path: str | Path) -> HFTokenizer:
    """A `tokenizer.json` file (its folder's tokenizer_config.json, if any, names BOS/EOS) or a
    Hugging Face tokenizer folder. Folders without a tokenizer.json (only a SentencePiece
    `tokenizer.model`) are converted by transformers' AutoTokenizer."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{FLAG} {path}: no such file or folder; allowed: {ALLOWED}")
    folder = p if p.is_dir() else (p.parent if (p.parent / "tokenizer_config.json").is_file() else None)
    tok_file = p / "tokenizer.json" if p.is_dir() else p
    meta = {}
    if folder is not None:
        meta = {**_read_json(folder / "special_tokens_map.json"), **_read_json(folder / "tokenizer_config.json")}
    if tok_file.exists() and not tok_file.is_dir():
        tok = _tokenizer_from_file(tok_file)
    elif p.is_dir() and has_tokenizer(p):
        tok = _converted_by_transformers(p)
    else:
        raise UserError(f"{FLAG} {path}: the folder holds no tokenizer (tokenizer.json, tokenizer_config.json "
                        f"or tokenizer.model); allowed: {ALLOWED}")
    return HFTokenizer(tok, p.resolve(), folder.resolve() if folder else None, meta)


def _tokenizer_from_file(path: Path):
    from tokenizers import Tokenizer

    text = read_text(path, FLAG, MAX_TOKENIZER_BYTES)  # a regular file of bounded size, then parsed
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise UserError(f"{FLAG} {path}: not a tokenizers tokenizer.json ({str(e).splitlines()[0]})") from None


def _checked_folder(folder: Path) -> str:
    """`folder` once every tokenizer file in it that transformers opens by name is a regular file
    of bounded size (tenfold.textfiles)."""
    for name in TOKENIZER_FILES:
        if (folder / name).exists():
            check_file(folder / name, FLAG, MAX_TOKENIZER_BYTES, "a tokenizer file")
    return str(folder)


def _converted_by_transformers(folder: Path):
    from tenfold.models.hf import _transformers

    try:
        auto = _transformers().AutoTokenizer.from_pretrained(_checked_folder(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"{FLAG} {folder}: transformers cannot load it ({e})") from None
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"{FLAG} {folder}: only fast (tokenizers-backed) tokenizers are supported")
    return backend


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> Path | None:
    """A run's saved tokenizer (OUT/tokenizer) into an export folder; None when the run saved none."""
    src, dst = Path(src), Path(dst)
    files = [src / f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not files or src.resolve() == dst.resolve():
        return dst if files else None
    dst.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, dst / f.name)
    return dst
