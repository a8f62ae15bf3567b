"""Pipeline parallelism for Hugging Face Llama-family causal LMs (techniques/pipeline_hf.py):
the shared split (tenfold.pipeline_layout), stages that compute exactly what the whole
transformers model computes (rotary tables and causal / sliding-window masks rebuilt from the
position ids on every stage), and pp=2 through torch.distributed.pipelining on gloo against the
plain one-process loop: every schedule, an uneven --pp-split, Mistral and Qwen2, ZeRO-1 and
ZeRO-3 on pp 2 x dp 2, and pp 2 x tp 2. Loss curves at rel 1e-6, the first step's gradient of
every parameter within 1e-6.

The multi-process helpers (launch, run_case, the reference loop) are tests/test_pipeline.py's:
one code path for tenfold's GPT and Hugging Face models, as in the engine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="Hugging Face tests need the hf extra: pip install 'tenfold[hf]'")

from conftest import hf_cli  # noqa: E402
from pipeline_harness import (  # noqa: E402
    SEQ, assert_close_curve, assert_matches_fsdp_bf16, assert_same_grads, assert_tied_norms, launch, load_full_grads,
    reference_run,
)

from tenfold.errors import UserError  # noqa: E402
from tenfold.models.hf import build_hf_model  # noqa: E402
from tenfold.pipeline_layout import STAGE_NAMES, split_fqns, stage_layout  # noqa: E402
from tenfold.terms import layer_counts  # noqa: E402
from tenfold.techniques import pipeline as pp  # noqa: E402

DATA = Path(__file__).parent / "data"
LLAMA, MISTRAL, QWEN2 = (str(DATA / f"{name}-tiny" / "config.json") for name in ("llama", "mistral", "qwen2"))
TIED = str(DATA / "llama-tied-tiny" / "config.json")  # 4 layers, tie_word_embeddings: true

pytestmark = pytest.mark.usefixtures("one_thread")


def llama_with(tmp_dir: Path, **changes) -> str:
    """llama-tiny's config.json with `changes` (e.g. 4 layers for 2 ranks x 2 virtual stages)."""
    path = tmp_dir / ("llama-" + "-".join(f"{k}{v}" for k, v in sorted(changes.items())) + ".json")
    path.write_text(json.dumps({**json.loads(Path(LLAMA).read_text()), **changes}))
    return str(path)


# --------------------------------------------------------------------------- the split


def test_one_split_for_both_model_kinds_differing_only_in_names():
    for n_layers, stages in [(3, 2), (4, 4), (8, 3), (32, 4)]:
        counts = layer_counts(n_layers, stages)
        gpt, hf = split_fqns(n_layers, counts), split_fqns(n_layers, counts, kind="hf")
        rename = {"tok_emb": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
        assert [[rename.get(n, n.replace("layers.", "model.layers.")) for n in stage] for stage in gpt] == hf
    layout = stage_layout(3, 2, kind="hf")
    assert layout.counts == [2, 1]
    assert layout.fqns == [["model.embed_tokens", "model.layers.0", "model.layers.1"], ["model.layers.2", "model.norm", "lm_head"]]
    assert stage_layout(3, 2, [0, 3], kind="hf").fqns[0] == ["model.embed_tokens"]
    assert STAGE_NAMES["hf"].head == ("model.norm", "lm_head")
    with pytest.raises(UserError, match=r"pp_split \[2, 2\] must be non-negative block counts summing to model.n_layers \(3\)"):
        stage_layout(3, 2, [2, 2], kind="hf")


@pytest.mark.parametrize("config", [LLAMA, MISTRAL, QWEN2], ids=["llama", "mistral", "qwen2"])
def test_chained_stages_compute_the_whole_model_bit_for_bit(config):
    """Three stages (embedding + block 0, blocks 1-2, norm + head) on one process give the
    model's own logits exactly, with positions 0..s-1 and with packed rows whose positions
    restart (a block-diagonal mask). Mistral and Qwen2 have an 8-token sliding window on 16
    tokens (Qwen2 on layers 1-2 only), so a stage that picked the wrong mask would differ."""
    model = build_hf_model(hf_config=config)
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    packed = torch.cat([torch.arange(5), torch.arange(SEQ - 5)]).repeat(2, 1)
    split = pp.split_model(model, 0, 1, layer_counts(model.config.num_hidden_layers, 3))
    assert split.counts == [1, 2, 0] and [len(m.blocks) for m in split.modules] == [1, 2, 0]
    for positions in (None, packed):
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False, **({} if positions is None else {"position_ids": positions})).logits
            h = ids
            for stage in split.modules:
                h = stage(h, **pp.stage_kwargs(stage, ids, positions))
        assert torch.equal(h, want)


def test_stages_keep_the_hugging_face_names_and_tensors():
    model = build_hf_model(hf_config=LLAMA)
    full = model.state_dict()
    split = pp.split_model(model, 0, 1, layer_counts(model.config.num_hidden_layers, 3))
    seen: dict[str, torch.Tensor] = {}
    for stage in split.modules:
        for name, t in stage.state_dict().items():
            assert name not in seen, f"{name} owned by two stages"
            seen[name] = t
    assert set(seen) == set(full)  # no rotary inv_freq (not persistent), nothing renamed
    assert all(t.data_ptr() == full[name].data_ptr() for name, t in seen.items())
    lines = pp.describe_split(split)
    assert lines[0].startswith("stage 0 (pp rank 0): layer 0 + model.embed_tokens;")
    assert lines[2].startswith("stage 2 (pp rank 0): no blocks + model.norm, lm_head;")
    assert sum(split.params) == sum(p.numel() for p in model.parameters())


def test_models_the_split_cannot_cut_are_refused_in_one_line():
    from tenfold.capabilities import pipeline_model_problem
    from tenfold.config import build_config
    from tenfold.run import resolve_run

    gpt2 = str(DATA / "gpt2-tiny" / "config.json")
    cfg = build_config({"model": {"hf_config": gpt2}, "train": {"grad_accum": 2}, "parallel": {"pp_degree": 2}})
    with pytest.raises(UserError, match=r"cuts tenfold's GPT and Hugging Face model_types llama, mistral, qwen2 .*"
                                        r"model_type 'gpt2' cannot be split"):
        resolve_run(cfg, 2)
    assert pipeline_model_problem(2, "hf", "qwen2") is None
    assert "a user's own model cannot be split" in pipeline_model_problem(2, "user")


def test_a_tied_model_is_one_parameter_on_one_rank_and_two_copies_across_ranks():
    """tie_word_embeddings: stages on one rank share lm_head's Parameter with model.embed_tokens
    (chained, they give the model's logits); on another rank the last stage's lm_head is its own
    zero-filled copy (the broadcast from the first stage fills it: techniques/tied_embeddings.py)."""
    from tenfold.techniques.tied_embeddings import TiedPair

    model = build_hf_model(hf_config=TIED)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    split = pp.split_model(model, 0, 1, layer_counts(4, 3))
    assert split.tied == TiedPair("model.embed_tokens.weight", "lm_head.weight") and split.tied_local == ()
    assert split.modules[-1].lm_head.weight is split.modules[0].model.embed_tokens.weight
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = ids
        for stage in split.modules:
            h = stage(h, **pp.stage_kwargs(stage, ids))
        assert torch.equal(h, model(input_ids=ids, use_cache=False).logits)
    last = pp.split_model(build_hf_model(hf_config=TIED), 1, 2)
    assert last.tied_local == ("lm_head.weight",) and not last.modules[0].lm_head.weight.any()


def test_an_older_transformers_is_refused_in_one_line(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(UserError, match=r"needs transformers>=5, found 4.57.1; upgrade it .* or use --pp 1"):
        pp.split_model(build_hf_model(hf_config=LLAMA), 0, 2)


# --------------------------------------------------------------------------- multi-process

FP32_RTOL = 1e-6  # loss, gradient norm and eval loss curves
GRAD_TOL = 1e-6  # the first step's gradient of every parameter (rtol and atol)


def assert_matches(res: dict, ref: dict, grads: dict, rtol: float = FP32_RTOL, grad_tol: float = GRAD_TOL,
                   tied: bool = False) -> None:
    what = res.get("case", "")
    assert_close_curve(res["loss"], ref["loss"], rtol, f"{what} loss")
    if tied:  # the two copies' gradients summed in another order (pipeline_harness.assert_tied_norms)
        assert_tied_norms(res["grad_norm"], ref["grad_norm"], what)
    else:
        assert_close_curve(res["grad_norm"], ref["grad_norm"], rtol, f"{what} grad norm")
    assert math.isclose(res["eval_sum"], ref["eval_sum"], rel_tol=rtol), what
    assert res["names"] == sorted(ref["grads"]), what  # the stages hold the model's own names
    assert_same_grads(grads, ref["grads"], grad_tol, grad_tol, what)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return llama_with(tmp_path_factory.mktemp("cfg"), num_hidden_layers=4)


def pp2_cases(llama4: str) -> list[dict]:
    return [
        {"hf": LLAMA, "pp": 2, "schedule": "gpipe", "m": 4},
        {"hf": LLAMA, "pp": 2, "schedule": "1f1b", "m": 4},
        {"hf": llama4, "pp": 2, "schedule": "interleaved", "v": 2, "m": 4},
        {"hf": llama4, "pp": 2, "schedule": "zero-bubble", "v": 2, "m": 4},
        {"hf": LLAMA, "pp": 2, "schedule": "1f1b", "m": 2, "split": [1, 2], "ac": "full"},
        {"hf": MISTRAL, "pp": 2, "schedule": "1f1b", "m": 4},
        {"hf": QWEN2, "pp": 2, "schedule": "1f1b", "m": 4},
        {"hf": LLAMA, "pp": 2, "schedule": "1f1b", "m": 4, "dtype": "bf16"},
        {"hf": TIED, "pp": 2, "schedule": "1f1b", "m": 4},  # lm_head tied to model.embed_tokens
        {"hf": TIED, "pp": 2, "schedule": "interleaved", "v": 2, "m": 4},
    ]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_every_schedule_and_family_matches_one_process(tmp_path, llama4):
    cases = pp2_cases(llama4)
    results = launch(2, cases, tmp_path)
    assert len(results) == len(cases), results[-1]
    refs: dict = {}
    for case, res in zip(cases, results):
        res["case"] = f"{Path(case['hf']).parent.name if 'tiny' in case['hf'] else 'llama4'} {case}"
        dtype = torch.bfloat16 if case.get("dtype") == "bf16" else torch.float32
        key = (case["hf"], dtype)
        if key not in refs:
            refs[key] = reference_run(dtype, hf=case["hf"])
        if dtype == torch.bfloat16:  # autocast rounds per micro-batch matmul alike; the sums differ
            assert_matches(res, refs[key], load_full_grads(tmp_path, case), rtol=2e-3, grad_tol=2e-3)
        else:
            assert_matches(res, refs[key], load_full_grads(tmp_path, case),
                           tied=case["hf"] == TIED)
        if case["hf"] == TIED:
            assert res["tied_copies_differ_by"] == 0.0, res["case"]
        rep = res["report"]
        assert rep["blocks_per_stage"] == (case.get("split") or layer_counts(
            json.loads(Path(case["hf"]).read_text())["num_hidden_layers"], 2 * case.get("v", 1)))


DP_TP_CASES = [  # pp 2 x dp 2: ZeRO-1 (DDP + ZeroRedundancyOptimizer), ZeRO-3 (FSDP2); pp 2 x tp 2
    {"hf": LLAMA, "pp": 2, "schedule": "1f1b", "m": 2, "zero": 1},
    {"hf": LLAMA, "pp": 2, "schedule": "gpipe", "m": 2, "zero": 3},
    {"hf": LLAMA, "pp": 2, "schedule": "1f1b", "m": 2, "tp": 2},
    {"hf": LLAMA, "pp": 2, "schedule": "1f1b", "m": 2, "zero": 3, "dtype": "bf16"},  # bf16 between stages
    # tied embeddings: ZeRO-1 and ZeRO-3 on dp 2 (interleaved), tp 2, 4 pipeline ranks
    {"hf": TIED, "pp": 2, "schedule": "1f1b", "m": 2, "zero": 1},
    {"hf": TIED, "pp": 2, "schedule": "interleaved", "v": 2, "m": 2, "zero": 3},
    {"hf": TIED, "pp": 2, "schedule": "1f1b", "m": 2, "tp": 2},
    {"hf": TIED, "pp": 4, "schedule": "1f1b", "m": 4},
]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_with_zero_on_dp2_or_tp2_matches_one_process(tmp_path):
    results = launch(4, DP_TP_CASES, tmp_path)
    assert len(results) == len(DP_TP_CASES), results[-1]
    refs = {LLAMA: reference_run(hf=LLAMA), TIED: reference_run(hf=TIED)}
    for case, res in zip(DP_TP_CASES, results):
        res["case"] = str(case)
        if case.get("dtype") == "bf16":
            assert_matches_fsdp_bf16(res, reference_run(torch.bfloat16, hf=LLAMA), str(case))
        else:
            assert_matches(res, refs[case["hf"]], load_full_grads(tmp_path, case),
                           tied=case["hf"] == TIED)
        if case["hf"] == TIED:
            assert res["tied_copies_differ_by"] == 0.0, res["case"]


# --------------------------------------------------------------------------- trainer, checkpoints, export


def _cli_train(out: Path, *flags: str, config: str = LLAMA) -> dict:
    r = hf_cli("train", "--hf-config", config, "--steps", "4", "--micro-batch", "2", "--grad-accum", "2",
            "--precision", "fp32", "--seq-len", "32", "--lr", "3e-3", "--eval-every", "0", "--no-progress",
            "--out", str(out), "--set", "data.max_bytes=200000", "--set", "train.warmup_steps=0",
            "--set", "train.eval_batches=1", "--set", "log.tensorboard=false", *flags, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tenfold_train_pp2_resumes_exactly_and_exports_hugging_face_folders(tmp_path):
    """`tenfold train --hf-config llama --nproc 2 --pp 2`: the one-process loss curve through the
    real trainer and loader; its checkpoints hold the Hugging Face names, so a resumed run
    continues the same curve, and the end-of-run save_pretrained folder and `tenfold export`
    of the pipelined checkpoint load in transformers with the one-process model's logits."""
    from hf_runs import logits, train
    from transformers import AutoModelForCausalLM

    from tenfold.cli import main

    one, ref = train(tmp_path / "one", Path(LLAMA), train={"steps": 4, "micro_batch": 2, "grad_accum": 2})
    full = _cli_train(tmp_path / "pp", "--nproc", "2", "--pp", "2", "--checkpoint-every", "2")
    np_close = lambda a, b, rtol: all(math.isclose(x, y, rel_tol=rtol) for x, y in zip(a, b, strict=True))  # noqa: E731
    assert np_close(full["losses"], ref["losses"], 1e-5), (full["losses"], ref["losses"])
    assert full["pipeline"]["blocks_per_stage"] == [2, 1]

    resumed = _cli_train(tmp_path / "resumed", "--nproc", "2", "--pp", "2",
                         "--resume", str(tmp_path / "pp" / "checkpoints" / "step_2"))
    assert np_close(resumed["losses"][-2:], full["losses"][-2:], 1e-6), (resumed["losses"], full["losses"])

    want = logits(one.model)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pp" / "hf", local_files_only=True)
    torch.testing.assert_close(logits(loaded), want, rtol=1e-4, atol=1e-5)
    assert main(["export", str(tmp_path / "pp"), "--dtype", "fp32", "--out", str(tmp_path / "exported")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True)
    torch.testing.assert_close(logits(exported), logits(loaded), rtol=0, atol=0)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_tied_model_pipelined_resumes_exactly_at_pp2_and_pp1_and_exports_one_weight(tmp_path):
    """tie_word_embeddings through `tenfold train --nproc 2 --pp 2`: a run resumed from its step-2
    checkpoint continues the same curve (pp 2) and, resharded to one process (pp 1: the two
    copies' names load into the one tied Parameter), the same curve within fp32 reduction order;
    the end-of-run save_pretrained folder and `tenfold export` hold ONE tied weight and load in
    transformers with lm_head tied and the same logits."""
    from hf_runs import logits
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tenfold.cli import main

    full = _cli_train(tmp_path / "pp", "--nproc", "2", "--pp", "2", "--checkpoint-every", "2", config=TIED)
    step2 = str(tmp_path / "pp" / "checkpoints" / "step_2")
    resumed = _cli_train(tmp_path / "resumed", "--nproc", "2", "--pp", "2", "--resume", step2, config=TIED)
    assert resumed["losses"][-2:] == full["losses"][-2:], (resumed["losses"], full["losses"])
    one = _cli_train(tmp_path / "one", "--resume", step2, config=TIED)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(one["losses"][-2:], full["losses"][-2:], strict=True))

    assert main(["export", str(tmp_path / "pp"), "--dtype", "fp32", "--out", str(tmp_path / "exported")]) == 0
    for folder in (tmp_path / "pp" / "hf", tmp_path / "exported"):
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names, folder
    loaded, exported = (AutoModelForCausalLM.from_pretrained(tmp_path / name, local_files_only=True)
                        for name in ("pp/hf", "exported"))
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    torch.testing.assert_close(logits(exported), logits(loaded), rtol=0, atol=0)
