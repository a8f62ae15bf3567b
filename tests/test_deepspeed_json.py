"""DeepSpeed JSON -> tenfold config: the recipe's config loads and maps, every unsupported key
is reported, malformed input is a UserError naming the file and position."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tenfold.config import build_config
from tenfold.deepspeed_json import _NO_KNOB, KEYS, load_deepspeed_json, translate, unsupported_warning
from tenfold.terms import resolve_batch
from tenfold.errors import UserError

SEED = Path(__file__).parent / "data" / "ds_seed.json"


def _write(tmp_path: Path, obj_or_text, name: str = "ds.json") -> Path:
    p = tmp_path / name
    p.write_text(obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text))
    return p


def test_the_seeds_config_loads_and_maps():
    layer, unsupported, _ = load_deepspeed_json(SEED)
    assert unsupported == []
    assert layer == {
        "parallel": {"zero_stage": 3, "param_persistence_threshold": 10000, "contiguous_gradients": True},
        "checkpoint": {"export_16bit": True},
        "precision": {"dtype": "fp16", "loss_scale": 0.0, "loss_scale_window": 1000, "initial_scale_power": 16},
        "train": {"grad_clip": 1.0},
    }
    cfg = build_config(layer)
    assert cfg.precision.dtype == "fp16" and cfg.precision.hysteresis == 2  # DeepSpeed's default kept
    assert cfg.parallel.zero_stage == 3 and cfg.checkpoint.export_16bit is True


def test_a_full_config_maps_every_supported_key(tmp_path):
    ds = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "steps_per_print": 10,
        "bf16": {"enabled": True, "check_grad_overflow": True},
        "zero_optimization": {
            "stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True, "contiguous_gradients": False,
            "stage3_gather_fp16_weights_on_model_save": True, "reduce_scatter": True,
            "offload_optimizer": {"device": "none"},
        },
        "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                  "weight_decay": 0.1, "bias_correction": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 5}},
        "activation_checkpointing": {"partition_activations": False, "number_checkpoints": 4},
        "tensorboard": {"enabled": False},
        "wall_clock_breakdown": False,
    }
    layer, unsupported, _ = load_deepspeed_json(_write(tmp_path, ds))
    assert unsupported == []
    cfg = build_config(layer)
    t = cfg.train
    assert (t.global_batch, t.micro_batch, t.grad_accum, t.grad_clip) == (16, 2, 4, 0.5)
    assert resolve_batch(t.micro_batch, t.grad_accum, t.global_batch, 2) == (2, 4, 16)
    assert (t.lr, t.beta1, t.beta2, t.eps, t.weight_decay) == (3e-4, 0.9, 0.95, 1e-6, 0.1)
    assert t.schedule == "WarmupCosineLR"
    assert t.schedule_params == {"total_num_steps": 100, "warmup_num_steps": 5}
    assert cfg.precision.dtype == "bf16"
    p = cfg.parallel
    assert (p.zero_stage, p.reduce_bucket_size, p.overlap_comm, p.contiguous_gradients) == (2, 500_000_000, True, False)
    assert cfg.checkpoint.export_16bit is True  # the old alias
    assert cfg.recompute.policy == "segments:4"
    assert cfg.log.log_every == 10 and cfg.log.tensorboard is False


def test_deepspeed_defaults_apply_inside_its_own_sections(tmp_path):
    # an optimizer section without params gets DeepSpeed's FusedAdam defaults, not tenfold's
    layer, _, _ = load_deepspeed_json(_write(tmp_path, {"optimizer": {"type": "Adam"}}))
    t = build_config(layer).train
    assert (t.lr, t.beta1, t.beta2, t.eps, t.weight_decay) == (1e-3, 0.9, 0.999, 1e-8, 0.0)
    # no fp16/bf16 enabled -> DeepSpeed trains in fp32
    assert build_config(layer).precision.dtype == "fp32"
    # WarmupDecayLR's default warmup_max_lr (0.001) is made explicit and becomes the peak lr
    layer, _, _ = load_deepspeed_json(_write(tmp_path, {"scheduler": {"type": "WarmupDecayLR",
                                                                   "params": {"total_num_steps": 50}}}))
    t = build_config(layer).train
    assert t.schedule_params == {"total_num_steps": 50, "warmup_max_lr": 0.001} and t.lr == 0.001
    # cpu_checkpointing -> offload; pipeline activation_checkpoint_interval -> every:N
    layer, _, _ = load_deepspeed_json(_write(tmp_path, {"activation_checkpointing": {"cpu_checkpointing": True}}))
    assert build_config(layer).recompute.policy == "offload"
    layer, _, _ = load_deepspeed_json(_write(tmp_path, {"pipeline": {"activation_checkpoint_interval": 2}}))
    assert layer["recompute"]["policy"] == "every:2"


def test_auto_and_null_values_mean_not_given(tmp_path):
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
          "fp16": {"enabled": "auto", "loss_scale_window": 500}, "zero_optimization": {"overlap_comm": None}}
    layer, unsupported, _ = load_deepspeed_json(_write(tmp_path, ds))
    assert unsupported == []
    assert "global_batch" not in layer["train"] and layer["train"]["micro_batch"] == 4
    assert layer["precision"] == {"loss_scale_window": 500, "dtype": "fp32"}
    assert "overlap_comm" not in layer.get("parallel", {})


@pytest.mark.parametrize("value, reduce_dtype", [("bf16", "bf16"), ("BF16", "bf16"), ("fp32", "fp32"), ("Fp32", "fp32")])
def test_communication_data_type_sets_the_reduction_dtype(tmp_path, value, reduce_dtype):
    """DeepSpeed's `communication_data_type` (any case, as DeepSpeed lower-cases it) ->
    parallel.reduce_dtype; absent, tenfold's fp32 default stays (tests/test_zero.py observes the
    collectives' dtype on two ranks)."""
    layer, unsupported, _ = load_deepspeed_json(_write(tmp_path, {"communication_data_type": value,
                                                                  "bf16": {"enabled": True}}))
    assert unsupported == [] and build_config(layer).parallel.reduce_dtype == reduce_dtype
    layer, _, _ = load_deepspeed_json(_write(tmp_path, {"bf16": {"enabled": True}}))
    assert build_config(layer).parallel.reduce_dtype == "fp32"


def test_fp16_communication_is_reported_and_other_values_refused(tmp_path):
    layer, unsupported, _ = load_deepspeed_json(_write(tmp_path, {"communication_data_type": "fp16"}))
    assert unsupported == ['communication_data_type="fp16" (tenfold reduces in fp32 or bf16)']
    assert build_config(layer).parallel.reduce_dtype == "fp32"
    for bad in ("int8", 16, True):
        with pytest.raises(UserError, match="'communication_data_type'.*allowed: fp32, bf16"):
            load_deepspeed_json(_write(tmp_path, {"communication_data_type": bad}))


def test_unsupported_keys_are_all_reported_in_one_warning(tmp_path):
    ds = {
        "fp16": {"enabled": True, "auto_cast": True, "fp16_master_weights_and_grads": False},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7, "reduce_scatter": True,
                              "offload_param": {"device": "cpu", "pin_memory": False}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "amsgrad": True}},
        "activation_checkpointing": {"partition_activations": True},
        "wandb": {"enabled": True},
        "wall_clock_breakdown": True,
    }
    path = _write(tmp_path, ds)
    layer, unsupported, _ = load_deepspeed_json(path)
    assert set(unsupported) == {
        "fp16.auto_cast=true",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.offload_param.pin_memory=false",
        "optimizer.params.amsgrad=true",
        "activation_checkpointing.partition_activations=true",
        "wandb",
        "wall_clock_breakdown=true",
    }
    build_config(layer)  # the supported part still loads
    msg = unsupported_warning(path, unsupported)
    assert msg.count("\n") == 0 and "wandb" in msg and str(path) in msg
    assert unsupported_warning(path, []) is None


SEED_AS_PRINTED = Path(__file__).parent / "data" / "ds_seed_as_printed.json"  # the seed's snippet, verbatim


def test_the_seeds_snippet_pasted_as_printed_reads_with_one_notice():
    """`#` comments (as DeepSpeed's hjson reading accepts) and Python's `True` (one step further)."""
    ds = load_deepspeed_json(SEED_AS_PRINTED)
    assert ds.layer == load_deepspeed_json(SEED).layer and ds.unsupported == []
    assert len(ds.notices) == 1
    assert "True" in ds.notices[0] and "lines 6, 7, 10" in ds.notices[0] and "\n" not in ds.notices[0]


def test_what_deepspeeds_reader_accepts_is_accepted(tmp_path):
    plain = {"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale_window": 500}, "wandb": {"project": "x"}}
    hjson_text = """// DeepSpeed reads hjson
{
  # ZeRO off here
  "train_batch_size": 8,   /* a block comment */
  "fp16": {"enabled": true, "loss_scale_window": 500,},
  "wandb": {"project": "x"}
  ,
}
"""
    want = load_deepspeed_json(_write(tmp_path, plain, "plain.json"))
    got = load_deepspeed_json(_write(tmp_path, hjson_text))
    assert (got.layer, got.unsupported, got.notices) == (want.layer, want.unsupported, [])


def test_python_words_are_only_replaced_in_a_values_place(tmp_path):
    text = '{"wandb": {"project": "True, False"}, # None\n True: 1, "fp16": {"enabled": False}}'
    ds = load_deepspeed_json(_write(tmp_path, text))
    assert set(ds.unsupported) == {"wandb", "True"} and ds.layer["precision"]["dtype"] == "fp32"
    assert len(ds.notices) == 1 and "False" in ds.notices[0] and "True" not in ds.notices[0]


@pytest.mark.parametrize(
    "text, match",
    [
        ('{\n  "fp16": {"enabled": true}\n', r"ds.json, line 3 .*add the missing '\}'"),
        ('{"fp16" {"enabled": true}}', r"line 1 column 9.*put a ':' between the key and its value"),
        ('{"train_batch_size": 8,, }', r"line 1 .*delete the extra ','"),
        ('{"fp16": {}}}', r"line 1 .*delete what follows the config's closing"),
        ('{\n"fp16": {"loss_scale": NaN}\n}', r"line 2: 'NaN}' is read as text .* true, false or null"),
        ('{"wandb": "x}', r"line 1 .*close the string"),
        ('{"fp16": {}, "fp16": {}}', r"duplicate key 'fp16'"),
        ("  \n", "is empty"),
        ("[1, 2]", "must be a JSON object"),
        ('"fp16"', "must be a JSON object"),
        ('{"gradient_clipping": 1e400}', "out of range"),
    ],
)
def test_malformed_config_names_the_line_and_what_to_change(tmp_path, text, match):
    with pytest.raises(UserError, match=match) as e:
        load_deepspeed_json(_write(tmp_path, text))
    assert "\n" not in str(e.value)


def test_the_seeds_snippet_with_the_pages_next_word_says_what_to_delete(tmp_path):
    glued = SEED_AS_PRINTED.read_text().rstrip() + "python\n"  # as the recipe prints it: "}python"
    with pytest.raises(UserError, match=r"line 16 .*delete what follows"):
        load_deepspeed_json(_write(tmp_path, glued))


def test_a_binary_file_is_one_line(tmp_path):
    p = tmp_path / "ds.json"
    p.write_bytes(b"PK\x03\x04\xff\xfe\x00binary")
    with pytest.raises(UserError, match=r"ds.json is not UTF-8 text \(byte 0xff on line 1\)"):
        load_deepspeed_json(p)
    with pytest.raises(UserError, match="is a directory"):
        load_deepspeed_json(tmp_path)


@pytest.mark.parametrize(
    "ds, match",
    [
        ({"zero_optimization": {"stage": "three"}}, "'zero_optimization.stage'.*integer"),
        ({"zero_optimization": {"stage": 4}}, "expected 0, 1, 2 or 3"),
        ({"fp16": {"enabled": "yes"}}, "'fp16.enabled'.*true or false"),
        ({"fp16": {"loss_scale": -1}}, "'fp16.loss_scale'.*>= 0"),
        ({"fp16": {"min_loss_scale": 0}}, "'fp16.min_loss_scale'.*> 0"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "cannot both be enabled"),
        ({"optimizer": {"type": "Lamb"}}, "allowed: Adam, AdamW"),
        ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
        ({"scheduler": {"type": "OneCycle"}}, "allowed: WarmupLR, WarmupDecayLR, WarmupCosineLR"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_step": 3}}}, r"\['warmup_step'\].*allowed"),
        ({"train_batch_size": 2.5}, "'train_batch_size'.*integer"),
        ({"zero_optimization": [3]}, "expected a JSON object"),
    ],
)
def test_bad_values_name_the_deepspeed_key(tmp_path, ds, match):
    with pytest.raises(UserError, match=match):
        load_deepspeed_json(_write(tmp_path, ds))


@pytest.mark.parametrize("zero, offload", [
    ({"offload_optimizer": {"device": "cpu", "pin_memory": True}}, "optimizer"),
    ({"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu", "nvme_path": "/x", "buffer_count": 5}},
     "optimizer+params"),
    ({"offload_param": {"device": "cpu"}}, "optimizer+params"),  # FSDP2 moves the optimizer with them
    ({"cpu_offload": True}, "optimizer"),
    ({"cpu_offload": True, "cpu_offload_param": True}, "optimizer+params"),
    ({"offload_optimizer": {"device": "none"}, "cpu_offload": False}, None),
])
def test_offload_keys_set_parallel_offload(tmp_path, zero, offload):
    layer, unsupported, notices = load_deepspeed_json(_write(tmp_path, {"zero_optimization": {"stage": 3, **zero}}))
    assert unsupported == [] and notices == []
    assert layer["parallel"].get("offload") == offload
    assert build_config(layer).parallel.offload == (offload or "none")


def test_nvme_offload_is_refused_in_one_line(tmp_path):
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}}
    with pytest.raises(UserError, match=r"'zero_optimization.offload_param.device'.*allowed: none, cpu") as e:
        load_deepspeed_json(_write(tmp_path, ds))
    assert "\n" not in str(e.value)


def test_shard_group_keys(tmp_path):
    read = lambda zero: load_deepspeed_json(_write(tmp_path, {"zero_optimization": {"stage": 3, **zero}}))  # noqa: E731
    layer, unsupported, notices = read({"mics_shard_size": 8})
    assert layer["parallel"]["shard_group_size"] == 8 and unsupported == notices == []
    for off in ({"mics_shard_size": -1}, {"zero_hpz_partition_size": 1}):  # DeepSpeed's defaults: off
        layer, unsupported, notices = read(off)
        assert "shard_group_size" not in layer["parallel"] and unsupported == notices == []
    layer, unsupported, notices = read({"zero_hpz_partition_size": 8})
    assert layer["parallel"]["shard_group_size"] == 8 and unsupported == []
    assert len(notices) == 1 and "zero_hpz_partition_size=8" in notices[0] and "not over every rank" in notices[0]
    with pytest.raises(UserError, match="give one"):
        read({"mics_shard_size": 4, "zero_hpz_partition_size": 8})


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_deepspeed_json(tmp_path / "nope.json")


def test_inconsistent_batch_triplet_fails_with_deepspeeds_rule(tmp_path):
    layer, _, _ = load_deepspeed_json(_write(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3,
                                                     "gradient_accumulation_steps": 4}))
    t = build_config(layer).train
    with pytest.raises(UserError, match="16 must equal --micro-batch x --grad-accum x data-parallel size = 3 x 4 x 1"):
        resolve_batch(t.micro_batch, t.grad_accum, t.global_batch, 1)


def test_the_seeds_config_trains_through_the_trainer_and_overflows_skip_cleanly(tmp_path):
    """Integration: the recipe's JSON (fp16, ZeRO-3, clipping) drives the Trainer on one process.
    A start scale of 2**40 overflows fp16 for sure: every step must be skipped, the scale must
    follow DeepSpeed's hysteresis-then-halve rule, and neither weights nor lr may move."""
    torch = pytest.importorskip("torch", reason="the trainer needs torch (make test-py310 runs without it)")
    from conftest import read_metrics, small_config
    from tenfold.engine.loop.trainer import Trainer

    layer, _, _ = load_deepspeed_json(SEED)
    cfg = build_config(layer, small_config(tmp_path, precision={"dtype": "fp16", "initial_scale_power": 40},
                                           train={"steps": 4, "warmup_steps": 2}))
    assert cfg.parallel.zero_stage == 3 and cfg.train.grad_clip == 1.0
    trainer = Trainer(cfg)
    trainer.setup()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    lr0 = trainer.optimizer.param_groups[0]["lr"]
    trainer.fit()
    records = read_metrics(tmp_path / "run")
    assert [r["skipped"] for r in records] == [1, 2, 3, 4]
    assert [r["loss_scale"] for r in records] == [2.0**40, 2.0**39, 2.0**38, 2.0**37]  # after each update
    assert all(r["lr"] == lr0 for r in records)  # the schedule never advanced
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    # and with the recipe's own start scale (2**16) the same run takes its steps
    ok = build_config(layer, small_config(tmp_path / "ok", precision={"dtype": "fp16"}, train={"steps": 3}))
    losses = Trainer(ok).fit()["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert [r["skipped"] for r in read_metrics(tmp_path / "ok" / "run")] == [0, 0, 0]


# DeepSpeed's optimizer semantics (DeepSpeedEngine._configure_basic_optimizer): the type
# "Adam" decays decoupled (AdamW) unless adam_w_mode is false; "AdamW" always does. Omitted
# params take the constructor's defaults: FusedAdam weight_decay 0; with torch_adam,
# torch.optim.AdamW 0.01, or torch.optim.Adam 0 when adam_w_mode is false.
@pytest.mark.parametrize(
    "optimizer, weight_decay, l2_reported",
    [
        ({"type": "Adam"}, 0.0, False),
        ({"type": "AdamW", "params": {"torch_adam": True}}, 0.01, False),
        ({"type": "Adam", "params": {"torch_adam": True}}, 0.01, False),
        ({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, 0.0, False),
        ({"type": "Adam", "params": {"adam_w_mode": False}}, 0.0, False),  # nothing to decay
        ({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, 0.1, True),
        ({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1, "torch_adam": True}}, 0.1, True),
        ({"type": "AdamW", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, 0.1, False),  # AdamW wins
        ({"type": "adam", "params": {"adam_w_mode": True, "weight_decay": 0.1}}, 0.1, False),
    ],
)
def test_adam_weight_decay_follows_deepspeed(tmp_path, optimizer, weight_decay, l2_reported):
    layer, unsupported, _ = load_deepspeed_json(_write(tmp_path, {"optimizer": optimizer}))
    assert build_config(layer).train.weight_decay == weight_decay
    # tenfold only decays decoupled: an L2 penalty (Adam with adam_w_mode false) that would
    # decay anything is named in the warning, never trained silently as AdamW
    assert any(u.startswith("optimizer.params.adam_w_mode=false") for u in unsupported) == l2_reported


def test_the_cli_warns_about_adam_with_l2_weight_decay(tmp_path, capsys):
    from tenfold.cli import build_parser
    from tenfold.run_args import config_from_args

    ds = _write(tmp_path, {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}})
    args = build_parser(["train"]).parse_args(["train", "--deepspeed", str(ds)])
    config_from_args(args)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "warning" in err and "adam_w_mode=false" in err and str(ds) in err


def _nested(dotted: str, value) -> dict:
    head, _, rest = dotted.partition(".")
    return {head: _nested(rest, value) if rest else value}


QUIET = {k: key.quiet_at for k, key in KEYS.items() if key.quiet_at is not _NO_KNOB}


@pytest.mark.parametrize("dotted", sorted(QUIET))
def test_a_key_without_a_knob_is_quiet_only_at_tenfolds_behaviour(dotted):
    def config(value) -> dict:
        c = _nested(dotted, value)
        if "optimizer" in c:  # an optimizer section needs its type
            c["optimizer"]["type"] = "AdamW"
        return c

    quiet = QUIET[dotted]
    assert translate(config(quiet))[1] == []
    other = (not quiet) if isinstance(quiet, bool) else quiet + 1
    assert translate(config(other))[1] == [f"{dotted}={json.dumps(other)}"]


def test_the_seeds_snippet_as_printed_trains_from_the_cli(tmp_path, capsys, one_thread):
    from conftest import SMALL_FLAGS, read_metrics
    from tenfold.cli import main

    out = tmp_path / "run"
    code = main(["train", "--deepspeed", str(SEED_AS_PRINTED), "--out", str(out), "--steps", "2",
                 "--micro-batch", "2", "--set", "train.eval_every=0", *SMALL_FLAGS])
    err = capsys.readouterr().err
    assert code == 0, err
    assert [line for line in err.splitlines() if "note:" in line] == [
        f"tenfold: note: {SEED_AS_PRINTED}: read Python's True as JSON's true (lines 6, 7, 10); "
        "JSON writes true, false and null in lower case"
    ]
    assert "warning: " + str(SEED_AS_PRINTED) not in err  # every key of the recipe is supported
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["precision"]["dtype"] == "fp16" and summary["config"]["parallel"]["zero_stage"] == 3
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_the_docs_name_every_key_of_the_table():
    doc = (Path(__file__).parents[1] / "docs" / "precision.md").read_text()
    missing = [k for k in KEYS if f"`{k}`" not in doc and f"`{k}:" not in doc]
    assert missing == [], f"docs/precision.md §6 does not list {missing}"
