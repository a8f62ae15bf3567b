"""The planner's calibration (tenfold.plan.fit) and the machine constants it fits: recovered from
synthetic runs the planner itself produced with chosen constants plus noise; constants no run
depends on stay where they were; the measured constants enter the time model as documented;
the calibrated machine survives a hardware file. Torch-free and fast."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from tenfold.errors import UserError
from tenfold.plan.api import predict
from tenfold.plan.fit import Observation, constants_for, fit, leave_one_out, median_abs_error
from tenfold.plan.hardware import CATALOG, Hardware, hardware_toml, load_hardware_toml

from conftest import planned

# A CPU-like machine as the prior (the `cpu` entry measures this machine; a test needs fixed numbers).
PRIOR = Hardware(name="box", peak_flops={"fp32": 2e10, "bf16": 6e10, "fp16": 1e9}, memory_bytes=16 * 2**30,
                 hbm_bw=10e9, intra_node_bw=2e9, nic_bw=2e9, gpus_per_node=2, intra_latency_s=50e-6,
                 inter_latency_s=50e-6, collective_latency_s=0.0, bus_efficiency=1.0, gemm_efficiency=1.0,
                 matmul_fraction=1.0, runtime_overhead_bytes=0.0, shared_compute=True)
# The "real" machine: every constant off the prior by a factor 1.7-40, overheads where the prior has none.
TRUTH = replace(PRIOR, achieved_matmul_flops={"fp32": 1.2e10, "bf16": 2.5e10}, hbm_bw=2e9, intra_node_bw=0.05e9,
                intra_latency_s=2e-4, step_overhead_s=0.05, microbatch_overhead_s=0.01)
LAYOUTS = ((0.5, 0, "none", 1), (0, 0, "none", 1), (0.25, 3, "none", 1), (0.25, 0, "full", 2))  # (mb / global, zero, ac, pp)


def synthetic(noise: float, seed: int = 0, gpus: int = 2, machine: Hardware = TRUTH) -> list[Observation]:
    """Runs the planner predicts on `machine`, each rate times exp(N(0, noise)): two models, two
    global batches, two precisions, four layouts (32 runs)."""
    rng, out = random.Random(seed), []
    for model, seq in (("tiny", 128), ("small", 64)):
        for glob in (4, 32):
            for precision in ("bf16", "fp32"):
                for share, zero, ac, pp in LAYOUTS:
                    if gpus == 1 and (zero or pp > 1):
                        continue
                    run = planned(model, gpus, precision=precision, micro_batch=max(1, int(glob * share)),
                                  global_batch=glob, seq_len=seq, zero_stage=zero, recompute=ac, pp=pp)
                    rate = predict(run, machine).tokens_per_s * math.exp(rng.gauss(0, noise))
                    out.append(Observation(f"t{len(out) + 1}", run, rate))
    return out


def _truth(key: str) -> float:
    c = next(c for c in constants_for(["bf16", "fp32"]) if c.key == key)
    return c.get(TRUTH) / c.scale


def test_calibration_recovers_known_constants():
    obs = synthetic(noise=0.01)
    f = fit(obs, PRIOR, noise=0.01, min_noise=0.01)
    got = {c.key: c for c in f.constants}
    # the speeds every run depends on (the prior is 1.7x-40x off): within 5% (noise 1%); the
    # elementwise bandwidth, a smaller share of each run's time, within 15%
    for key, tolerance in (("matmul:bf16", 0.05), ("matmul:fp32", 0.05), ("collective_bw", 0.05), ("elementwise_bw", 0.15)):
        assert got[key].determined, key
        assert got[key].fitted == pytest.approx(_truth(key), rel=tolerance), key
    # overheads (a small share of these runs' time): within 30%
    for key in ("step_overhead", "microbatch_overhead"):
        assert got[key].fitted == pytest.approx(_truth(key), rel=0.3), key
    # every constant, determined or not: the truth inside its reported 3-sigma band (ln units)
    for c in f.constants:
        lo, hi = c.fitted * (c.low / c.fitted) ** 3, c.fitted * (c.high / c.fitted) ** 3
        assert lo <= _truth(c.key) <= hi, (c.key, c.low, c.high, _truth(c.key))
    measured = {o.name: o.tokens_per_s for o in obs}
    assert median_abs_error(f.predicted_prior, measured) > 0.5
    assert median_abs_error(f.predicted, measured) < 0.015


def test_each_constant_names_the_runs_it_governs():
    obs = synthetic(noise=0.01)
    f = fit(obs, PRIOR, noise=0.01, min_noise=0.01)
    got = {c.key: c for c in f.constants}
    precision = {o.name: o.run.precision for o in obs}
    for dtype in ("bf16", "fp32"):
        runs = [name for name, _ in got[f"matmul:{dtype}"].determined_by]
        assert runs and {precision[n] for n in runs} == {dtype}  # a dtype's matmul rate: its own runs only
    shares = dict(got["collective_bw"].determined_by)
    assert all(0.05 <= s <= 1 for s in shares.values())
    # the pipeline runs' p2p sends and the ZeRO/DDP collectives, not the single-rank...: every such run uses two ranks
    assert all(o.run.world_size == 2 for o in obs if o.name in shares)


def test_constants_no_run_depends_on_stay_at_the_prior():
    obs = synthetic(noise=0.03, gpus=1)  # one rank: no collective at all
    f = fit(obs, PRIOR)
    got = {c.key: c for c in f.constants}
    for key in ("collective_bw", "collective_latency"):
        assert not got[key].determined and got[key].determined_by == []
        assert got[key].fitted == pytest.approx(got[key].prior, rel=1e-6)
    assert got["matmul:bf16"].determined


def test_calibration_with_realistic_noise_predicts_within_it():
    obs = synthetic(noise=0.05, seed=3)
    f = fit(obs, PRIOR)
    measured = {o.name: o.tokens_per_s for o in obs}
    assert median_abs_error(f.predicted, measured) < 0.06
    assert 0.03 < f.noise < 0.08  # the run-to-run spread it estimates
    loo = leave_one_out(obs[:6], PRIOR)  # out of sample: each run predicted without it
    assert median_abs_error(loo, {k: measured[k] for k in loo}) < 0.2


def test_a_prediction_for_an_untried_run_carries_its_uncertainty():
    obs = synthetic(noise=0.02)
    f = fit([o for o in obs if o.run.precision == "bf16"], PRIOR, constants_for(["bf16", "fp32"]))
    fp32 = next(o for o in obs if o.run.precision == "fp32")
    bf16 = next(o for o in obs if o.run.precision == "bf16")
    _, sigma_seen = f.predictive(bf16.run)
    _, sigma_unseen = f.predictive(fp32.run)
    assert sigma_unseen > 3 * sigma_seen  # no fp32 run: its matmul rate is the prior's guess


# --------------------------------------------------------------------------- the constants in the model


def test_overheads_add_to_the_step_as_documented():
    s = planned("tiny", 2, precision="bf16", micro_batch=2, global_batch=16, seq_len=128)
    plain = predict(s, PRIOR)
    with_overhead = predict(s, replace(PRIOR, step_overhead_s=0.05, microbatch_overhead_s=0.01))
    m = plain.grad_accum
    assert m == 4
    assert with_overhead.step_time_s == pytest.approx(plain.step_time_s + 0.05 + m * 0.01, rel=1e-9)
    assert with_overhead.time.overhead_s == pytest.approx(0.05 + m * 0.01)


def test_an_achieved_matmul_rate_prices_the_gemms_and_leaves_mfu_against_the_peak():
    s = planned("llama-7b", 8, precision="bf16", micro_batch=8, global_batch=64, seq_len=4096)  # GEMM-bound
    hw = CATALOG["h100-sxm"]
    rate = hw.peak("bf16") * hw.gemm_efficiency  # what the datasheet model assumes

    def at(share: float):
        return predict(s, replace(hw, achieved_matmul_flops={"bf16": rate * share}))

    base = predict(s, hw)
    assert at(1.0).step_time_s == pytest.approx(base.step_time_s, rel=1e-9)
    compute = {x: at(x).time.compute_s for x in (0.25, 0.125, 0.0625)}
    # once every GEMM is compute-bound (max(FLOPs / rate, bytes / bandwidth); at half the rate a
    # few small ones are still bandwidth-bound), their time goes as 1 / rate
    assert compute[0.0625] - compute[0.125] == pytest.approx(2 * (compute[0.125] - compute[0.25]), rel=1e-6)
    assert compute[0.125] - compute[0.25] > 0.5 * compute[0.25]  # and they are most of the compute
    assert at(0.5).mfu == pytest.approx(base.mfu * base.step_time_s / at(0.5).step_time_s)  # same peak, longer step


def test_a_calibrated_machine_survives_its_hardware_file(tmp_path):
    f = fit(synthetic(noise=0.02), PRIOR)
    path = tmp_path / "hw.toml"
    path.write_text(hardware_toml(replace(f.hardware, sources={"matmul": "tenfold tune"})))
    back = load_hardware_toml(path)
    for key, value in f.hardware.to_dict().items():
        if key == "sources":
            continue
        got = getattr(back, key)
        if isinstance(value, dict):
            assert got.keys() == {k for k, v in value.items() if v} and all(
                got[k] == pytest.approx(v, rel=1e-12) for k, v in got.items() if v)
        elif isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-12), key
        else:
            assert got == value, key
    s = planned("tiny", 2, precision="fp32", micro_batch=2, global_batch=8, seq_len=64, zero_stage=3)
    assert predict(s, back).tokens_per_s == pytest.approx(predict(s, f.hardware).tokens_per_s)


@pytest.mark.parametrize("line, message", [
    ("shared_compute = 1", "shared_compute must be true or false"),
    ("step_overhead_s = -1", "step_overhead_s must be a finite non-negative number"),
    ("[achieved_matmul_tflops]\nint8 = 3", "[achieved_matmul_tflops] takes fp32, bf16, fp16"),
])
def test_bad_measured_keys_in_a_hardware_file_are_named(tmp_path, line, message):
    text = 'name = "x"\nmemory_gb = 1\nhbm_gbs = 1\nintra_node_gbs = 1\nnic_gbs = 1\n'
    head, _, table = line.partition("\n")
    body = text + (head + "\n" if not head.startswith("[") else "") + "[peak_tflops]\nfp32 = 1\n"
    if head.startswith("["):
        body += head + "\n" + table + "\n"
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_hardware_toml(path)


GOOD_FILE = {"name": '"x"', "memory_gb": "80", "hbm_gbs": "2000", "intra_node_gbs": "300", "nic_gbs": "25"}


@pytest.mark.parametrize("change, needles", [
    ({"memory_gb": "nan"}, ["memory_gb must be a finite positive number", "nan"]),
    ({"hbm_gbs": "inf"}, ["hbm_gbs must be a finite positive number", "inf"]),
    ({"nic_gbs": "-inf"}, ["nic_gbs must be a finite positive number"]),
    ({"memory_gb": '"80"'}, ["memory_gb must be a finite positive number", "'80'"]),
    ({"intra_node_gbs": "0"}, ["intra_node_gbs must be a finite positive number"]),
    ({"name": "3"}, ["name must be a non-empty text"]),
    ({"gpus_per_node": "8.0"}, ["gpus_per_node must be a positive integer"]),
    ({"gpus_per_node": '"8"'}, ["gpus_per_node must be a positive integer"]),
    ({"bus_efficiency": "1.5"}, ["bus_efficiency must be a number in (0, 1]"]),
    ({"collective_latency_s": "nan"}, ["collective_latency_s must be a finite non-negative number"]),
    ({"flops": "3"}, ["unknown key 'flops'", "allowed: name, memory_gb"]),
    ({"peak": "bf16 = -312"}, ["[peak_tflops] bf16 must be a finite positive number (TFLOP/s)", "-312"]),
    ({"peak": "bf16 = inf"}, ["[peak_tflops] bf16 must be a finite positive number"]),
    ({"peak": 'bf16 = "312"'}, ["[peak_tflops] bf16", "'312'"]),
    ({"peak": ""}, ["[peak_tflops] needs at least one of fp32, bf16, fp16"]),
    ({"memory_gb": None}, ["missing key(s) memory_gb; required: name, memory_gb"]),
])
def test_a_hardware_file_is_typed_as_strictly_as_a_run_config(tmp_path, capsys, change, needles):
    """`plan --hardware-file`: a negative peak, a NaN memory, an infinite bandwidth, a string
    for a number: exit 2, one line naming the key (no MFU of -12%, no "of nan GiB")."""
    from tenfold.cli import main

    keys = {**GOOD_FILE, **{k: v for k, v in change.items() if k != "peak"}}
    body = "".join(f"{k} = {v}\n" for k, v in keys.items() if v is not None)
    body += "[peak_tflops]\n" + change.get("peak", "bf16 = 312") + "\n"
    path = tmp_path / "hw.toml"
    path.write_text(body)
    assert main(["plan", "--model", "tiny", "--hardware-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"tenfold: error: --hardware-file {path}"), err
    assert all(n in err for n in needles), err


@pytest.mark.parametrize("content, needle", [
    (bytes(range(128, 256)) * 3, "is not UTF-8 text"),
    (b"name = \"x\"\nmemory_gb = [", "invalid TOML"),
    (None, "is a directory; expected a text file"),
])
def test_a_hardware_file_that_is_not_toml_text_is_one_line(tmp_path, capsys, content, needle):
    from tenfold.cli import main

    path = tmp_path / "hw"
    path.mkdir() if content is None else path.write_bytes(content)
    assert main(["plan", "--model", "tiny", "--hardware-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and str(path) in err, err
