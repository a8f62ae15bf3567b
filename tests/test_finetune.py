"""Fine-tuning a Hugging Face model with its own tokenizer (CPU, nothing downloaded): a small
Llama-style folder made here (tests/hf_folder.py), prompt/completion and chat records, the loss
on completion / assistant tokens only, packed examples that attend only to themselves, the
tokenizer recorded, saved and exported, and the export generating in transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="Hugging Face tests need the hf extra: pip install 'tenfold[hf]'")
os.environ["HF_HUB_OFFLINE"] = "1"

from conftest import hf_cli as cli  # noqa: E402
from hf_folder import write_chat, write_llama_folder, write_prompt_completion, write_tokenizer_folder  # noqa: E402

from tenfold import Trainer  # noqa: E402
from tenfold.config import DataSection  # noqa: E402
from tenfold.data import IGNORE_INDEX, build_data  # noqa: E402
from tenfold.errors import UserError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return write_llama_folder(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def pc_file(tmp_path_factory) -> Path:
    return write_prompt_completion(tmp_path_factory.mktemp("pc") / "train.jsonl")


def ft_config(out: Path, hf_dir: Path, data: Path, **sections) -> dict:
    cfg = {
        "model": {"hf_pretrained": str(hf_dir)},
        "data": {"path": str(data), "seq_len": 64, "val_fraction": 0.1},
        "train": {"steps": 4, "micro_batch": 2, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 0,
                  "eval_every": 0, "eval_batches": 1},
        "precision": {"dtype": "fp32"},
        "log": {"out": str(out), "progress": False, "tensorboard": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg





def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rows_examples(tok, records: list[dict], input_ids: torch.Tensor) -> list[tuple[int, list[int], list[int]]]:
    """Independently of tenfold's packer: (start, prompt ids, completion ids + EOS) of each
    example in a row, in record order (rows of the in-memory set are in order)."""
    bos_positions = (input_ids == tok.token_to_id("<s>")).nonzero().flatten().tolist()
    out = []
    for start, record in zip(bos_positions, records):
        prompt = tok.encode(record["prompt"]).ids  # the template adds <s>
        completion = tok.encode(record["completion"], add_special_tokens=False).ids + [tok.token_to_id("</s>")]
        out.append((start, prompt, completion))
    return out


# --------------------------------------------------------------------------- prompt / completion


def test_labels_are_the_completions_and_a_prompt_only_batch_has_zero_gradient(tmp_path, hf_dir, pc_file):
    """Through the trainer's own step (accumulate_gradients): the labels of a packed row are
    exactly the completions + EOS, the prompt positions carry no loss (their gradient is
    zero), and the step's loss is the token-weighted mean over completion tokens only."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    trainer = Trainer(ft_config(tmp_path / "run", hf_dir, pc_file))
    trainer.setup()
    assert trainer.parts.data.format == "prompt-completion" and trainer.parts.data.tokenizer.name == str(hf_dir.resolve())
    batch = trainer.parts.data.train[[0]].to_batch()  # what the loader hands the trainer (to_batch of rows)
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    examples = _rows_examples(tok, _records(pc_file), ids)
    assert len(examples) >= 3  # packed: several examples in one row
    prompt_positions, expected = torch.zeros_like(labels, dtype=torch.bool), torch.full_like(labels, IGNORE_INDEX)
    for start, prompt, completion in examples:
        assert ids[start : start + len(prompt)].tolist() == prompt
        first = start + len(prompt)
        expected[first - 1 : first - 1 + len(completion)] = torch.tensor(completion)  # label t = the id after t
        prompt_positions[start : first - 1] = True
    assert torch.equal(labels, expected)

    prompt_labels = torch.where(prompt_positions, labels, torch.full_like(labels, IGNORE_INDEX))
    trainer.accumulate_gradients([{**batch, "labels": prompt_labels[None]}])
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert grads and all(float(g.abs().max()) == 0.0 for g in grads)

    trainer.optimizer.zero_grad(set_to_none=True)
    loss, tokens = trainer.accumulate_gradients([batch])
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    keep = expected != IGNORE_INDEX
    reference = torch.nn.functional.cross_entropy(logits[keep], expected[keep])  # mean over targets only
    assert tokens == int(keep.sum())
    assert loss == pytest.approx(float(reference), rel=1e-5)


def test_packed_examples_attend_only_to_themselves(tmp_path, hf_dir, pc_file):
    """Where each example of a row starts and ends is found from the records themselves (BOS
    and the tokenized prompt + completion), not from the position_ids under test: position_ids
    restart at 0 at every example, and the logits of every example in the packed row equal
    those of the example run alone; the run header says so. tenfold's GPT (no document mask)
    says that attention crosses."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    trainer = Trainer(ft_config(tmp_path / "run", hf_dir, pc_file))
    trainer.setup()
    assert "attention masked per example" in trainer.parts.data.describe()
    batch = trainer.parts.data.train[[0]].to_batch()
    ids, positions = batch["input_ids"][0], batch["position_ids"][0]
    spans = [(start, min(start + len(prompt) + len(completion), len(ids)))
             for start, prompt, completion in _rows_examples(tok, _records(pc_file), ids)]
    assert len(spans) >= 3 and spans[0][0] == 0
    assert all(end == next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))  # packed back to back
    for a, b in spans:
        assert positions[a:b].tolist() == list(range(b - a)), (a, b, positions[a:b].tolist())
    model = trainer.model.eval()
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        for a, b in spans:
            alone = model(input_ids=batch["input_ids"][:, a:b]).logits[0]
            torch.testing.assert_close(packed[a:b], alone, rtol=1e-4, atol=1e-5)
    gpt = Trainer({**ft_config(tmp_path / "gpt", hf_dir, pc_file), "model": {"name": "tiny", "n_layers": 1, "d_model": 32,
                                                                                 "n_heads": 2, "d_ff": 64, "vocab_size": 512}})
    gpt.setup()
    assert "attention crosses example boundaries" in gpt.parts.data.describe()
    assert "position_ids" not in gpt.parts.data.train[[0]].to_batch()


def test_finetune_records_the_tokenizer_and_exports_a_folder_that_generates(tmp_path, hf_dir, pc_file):
    """The fine-tuning path end to end: `--hf-pretrained` on prompt/completion JSONL
    trains with the folder's tokenizer (named in summary.json, saved in OUT/tokenizer), and
    both the run's OUT/hf and `tenfold export` load in transformers and generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tenfold.cli import main

    out = tmp_path / "run"
    summary = Trainer(ft_config(out, hf_dir, pc_file, train={"steps": 6}, checkpoint={"every": 6})).fit()
    assert summary["tokenizer"]["name"] == str(hf_dir.resolve()) and summary["tokenizer"]["eos"] == "</s>"
    assert summary["tokenizer"]["saved"] == str(out / "tokenizer") and (out / "tokenizer" / "tokenizer.json").is_file()
    assert summary["losses"][-1] < summary["losses"][0]
    assert main(["export", str(out), "--dtype", "fp32", "--out", str(tmp_path / "exported")]) == 0
    for folder in (out / "hf", tmp_path / "exported"):
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        ids = tokenizer("what is 2 plus three ? ", return_tensors="pt").input_ids
        assert ids[0, 0].item() == tokenizer.bos_token_id  # the folder's own BOS
        generated = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert generated.shape[1] > ids.shape[1]
        assert isinstance(tokenizer.decode(generated[0]), str)


def test_the_finetune_example_trains_as_documented(tmp_path, hf_dir):
    """examples/finetune.toml with its sample data, run the way its header says (the model folder
    passed with --set), only shorter: a prompt/completion run of the folder's model whose loss
    falls and whose summary names the format and tokenizer."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ft"
    r = subprocess.run([sys.executable, "-m", "tenfold", "train", "--config", "examples/finetune.toml",
                        "--set", f"model.hf_pretrained={hf_dir}", "--set", "train.steps=6", "--set", "train.eval_every=0",
                        "--set", "train.lr=3e-3", "--set", "train.warmup_steps=0",  # a tiny random model: a rate that shows in 6 steps
                        "--seq-len", "64", "--precision", "fp32", "--out", str(out)],
                       cwd=root, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["data"]["path"] == "examples/sft_sample.jsonl" and summary["tokenizer"]["name"] == str(hf_dir.resolve())
    assert summary["losses"][-1] < summary["losses"][0]


# --------------------------------------------------------------------------- chat


def test_chat_loss_is_on_the_assistant_turns_only(tmp_path, hf_dir):
    data = write_chat(tmp_path / "chat.jsonl", n=4)
    bundle = build_data(DataSection(path=str(data), tokenizer=str(hf_dir), val_fraction=0), 64, 0)
    assert bundle.format == "chat"
    batch = bundle.train[[0]].to_batch()
    labels = batch["labels"][0]
    trained = bundle.tokenizer.decode([int(t) for t in labels[labels != IGNORE_INDEX]])
    assert trained == "five .</s>\nthe sky is blue .</s>\n"  # both assistant turns, with their end-of-turn
    assert "<|assistant|>" in bundle.tokenizer.decode(batch["input_ids"][0])

    no_template = write_tokenizer_folder(tmp_path / "plain_tok", chat_template=False)
    with pytest.raises(UserError, match="chat template"):
        build_data(DataSection(path=str(data), tokenizer=str(no_template)), 64, 0)
    with pytest.raises(UserError, match="chat template"):
        build_data(DataSection(path=str(data), tokenizer="byte"), 64, 0)


def test_data_format_is_detected_and_can_be_forced(tmp_path, hf_dir, pc_file):
    assert build_data(DataSection(path=str(pc_file), tokenizer=str(hf_dir)), 64, 0).format == "prompt-completion"
    text = build_data(DataSection(path=str(pc_file), tokenizer=str(hf_dir), format="text"), 16, 0)
    assert text.format == "text" and text.tokenizer.decode(text.train[0]).startswith('<s>{"prompt"')  # the file as text
    with pytest.raises(UserError, match="'prompt'.*must be a string"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"prompt": 3, "completion": "x"}) + "\n")
        build_data(DataSection(path=str(bad), tokenizer=str(hf_dir)), 64, 0)


# --------------------------------------------------------------------------- bad input


def test_mismatched_or_missing_tokenizer_exits_2(tmp_path, hf_dir, pc_file):
    """A tokenizer bigger than the embedding exits 2 in one line; a pretrained folder without
    a tokenizer is never silently paired with bytes (exit 2 naming --tokenizer) unless asked."""
    small = write_llama_folder(tmp_path / "small_vocab", vocab_size=256)
    base = ["train", "--data", str(pc_file), "--steps", "1", "--micro-batch", "1", "--seq-len", "32",
            "--no-progress", "--precision", "fp32", "--set", "log.tensorboard=false"]
    r = cli(*base, "--hf-pretrained", str(small), "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "has 364 tokens" in r.stderr and "embedding has 256 rows" in r.stderr
    assert not (tmp_path / "a").exists()

    bare = tmp_path / "weights_only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_dir / name, bare / name)
    r = cli(*base, "--hf-pretrained", str(bare), "--out", str(tmp_path / "b"))
    assert r.returncode == 2 and "--tokenizer" in r.stderr and "holds no tokenizer" in r.stderr
    r = cli(*base, "--hf-pretrained", str(bare), "--tokenizer", "byte", "--out", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["tokenizer"]["name"] == "byte"
    r = cli(*base, "--tokenizer", str(tmp_path / "nope.json"), "--out", str(tmp_path / "d"))
    assert r.returncode == 2 and "nope.json" in r.stderr and "tokenizer.json" in r.stderr


def test_tokenizer_json_file_bos_eos_follow_its_folder(tmp_path, hf_dir):
    from tenfold.data.hf_tokenizer import load_tokenizer_path

    tok = load_tokenizer_path(hf_dir / "tokenizer.json")  # tokenizer_config.json beside it names BOS/EOS
    assert (tok.bos, tok.eos) == ("<s>", "</s>")
    assert tok.document_ids("the sky")[0] == tok.bos_id and tok.document_ids("the sky")[-1] == tok.eos_id
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(hf_dir / "tokenizer.json", alone / "tokenizer.json")
    bare = load_tokenizer_path(alone / "tokenizer.json")  # no config: the known names in its vocabulary
    assert (bare.bos, bare.eos) == ("<s>", "</s>")
    saved = bare.save(tmp_path / "saved")
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    assert auto.eos_token == "</s>" and auto("the sky").input_ids == tok.document_ids("the sky")[:-1]
    np.testing.assert_array_equal(tok.encode_documents(["a b", "c"]), tok.document_ids("a b") + tok.document_ids("c"))
