"""A busy machine and bad input: how long a user waits, quiet and with one busy process.

Each case runs `tenfold` as a user types it, in a fresh process with an empty cache folder
(TENFOLD_CACHE_DIR: no cached CPU peak), first on the machine as it is ("quiet"), then with
`python3 -c "while True: pass"` beside it ("busy"; killed at the end), and reports seconds from
start to each milestone:

* `train --steps 4` (the demo's model): the memory prediction line, step 1, the end; whether
  the peak was measured before step 1 (it never should be: the cache file appears after the
  last step);
* `train --config FLEET.toml --dry-run` of `plan --model llama-70b --gpu h100-sxm --gpus 64
  --search --emit FLEET.toml`;
* the bad-input examples: exit status, lines on stderr, seconds.

The baseline is the quiet machine in the same run: `busy / quiet` per milestone. The load average
before each pass is printed (other work on a shared box moves both).

    python benchmarks/bench_busy.py [--steps 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TENFOLD = [sys.executable, "-m", "tenfold"]
ROOT = Path(__file__).resolve().parents[1]


def timed_lines(cmd: list[str], env: dict, marks: dict[str, str], cache: Path) -> dict:
    """Seconds from start to the first line starting with each of `marks`, and to the end."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: dict = {}
    for line in proc.stdout:
        for name, prefix in marks.items():
            if name not in out and line.startswith(prefix):
                out[name] = round(time.perf_counter() - start, 2)
                if name == "step 1":
                    out["peak cached before step 1"] = (cache / "cpu_peak.json").exists()
    out["exit"] = proc.wait()
    out["end"] = round(time.perf_counter() - start, 2)
    return out


def bad_inputs(folder: Path) -> dict[str, list[str]]:
    fifo = folder / "fifo.toml"
    if not fifo.exists():
        os.mkfifo(fifo)
    hpz = folder / "ds.json"
    hpz.write_text('{"zero_optimization": {"stage": 3, "zero_hpz_partition_size": -2}}')
    steps = folder / "steps.toml"
    steps.write_text('[train]\nsteps = "2"\n')
    huge = json.loads((ROOT / "tests" / "data" / "llama-tiny" / "config.json").read_text())
    (folder / "huge.json").write_text(json.dumps(huge | {"num_hidden_layers": 10_000_000}))
    return {
        "plan --hf-config /dev/zero": ["plan", "--hf-config", "/dev/zero", "--gpu", "a100-80gb"],
        "train --hf-config /dev/zero --dry-run": ["train", "--hf-config", "/dev/zero", "--dry-run"],
        "train --config FIFO --dry-run": ["train", "--config", str(fifo), "--dry-run"],
        "DeepSpeed zero_hpz_partition_size -2": ["train", "--deepspeed", str(hpz), "--dry-run"],
        "plan --emit ''": ["plan", "--emit", ""],
        "steps = \"2\" in the file, --steps 3": ["train", "--config", str(steps), "--steps", "3", "--dry-run"],
        "train --hf-config (10M layers) --steps 1": ["train", "--hf-config", str(folder / "huge.json"), "--steps", "1",
                                                     "--out", str(folder / "never")],
    }


def one_pass(folder: Path, steps: int) -> dict:
    cache = Path(tempfile.mkdtemp(dir=folder))
    env = {**os.environ, "TENFOLD_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    result: dict = {"load_average": os.getloadavg()[0]}
    train = [*TENFOLD, "train", "--steps", str(steps), "--out", str(folder / "run"), "--overwrite", "--no-progress"]
    result["train"] = timed_lines(train, env, {"memory": "memory per rank", "step 1": "step 1/"}, cache)
    fleet = folder / "FLEET.toml"
    if not fleet.exists():
        subprocess.run([*TENFOLD, "plan", "--model", "llama-70b", "--gpu", "h100-sxm", "--gpus", "64", "--search",
                        "--emit", str(fleet)], env=env, capture_output=True, check=True)
    dry_cache = Path(tempfile.mkdtemp(dir=folder))
    result["fleet dry-run"] = timed_lines([*TENFOLD, "train", "--config", str(fleet), "--dry-run"],
                                          {**env, "TENFOLD_CACHE_DIR": str(dry_cache)}, {}, dry_cache)
    result["fleet dry-run"]["measured"] = any(dry_cache.iterdir())
    result["bad input"] = {}
    for name, argv in bad_inputs(folder).items():
        start = time.perf_counter()
        proc = subprocess.run([*TENFOLD, *argv], env=env, capture_output=True, text=True, timeout=120)
        result["bad input"][name] = {"exit": proc.returncode, "lines": len(proc.stderr.strip().splitlines()),
                                     "s": round(time.perf_counter() - start, 2)}
    return result


def report(quiet: dict, busy: dict) -> None:
    def ratio(b, q):
        return f"{b / q:.2f}" if isinstance(b, (int, float)) and q else "-"

    print(f"load average (1 min) before: quiet {quiet['load_average']:.2f}, busy {busy['load_average']:.2f}")
    print(f"{'milestone':<48} {'quiet s':>8} {'busy s':>8} {'busy/quiet':>10}")
    for name in ("memory", "step 1", "end"):
        q, b = quiet["train"].get(name), busy["train"].get(name)
        print(f"{'train --steps 4: ' + name:<48} {q!s:>8} {b!s:>8} {ratio(b, q):>10}")
    print(f"{'  peak cached before step 1 (quiet, busy)':<48} {quiet['train'].get('peak cached before step 1')!s:>8} "
          f"{busy['train'].get('peak cached before step 1')!s:>8}")
    q, b = quiet["fleet dry-run"]["end"], busy["fleet dry-run"]["end"]
    print(f"{'train --config FLEET.toml --dry-run':<48} {q!s:>8} {b!s:>8} {ratio(b, q):>10}  "
          f"(measured a peak: {quiet['fleet dry-run']['measured'] or busy['fleet dry-run']['measured']})")
    for name, q in quiet["bad input"].items():
        b = busy["bad input"][name]
        print(f"{name[:48]:<48} {q['s']!s:>8} {b['s']!s:>8} {ratio(b['s'], q['s']):>10}  "
              f"exit {q['exit']}/{b['exit']}, lines {q['lines']}/{b['lines']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", help="write the figures here too")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        quiet = one_pass(folder, a.steps)
        busy_loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(1.0)
            busy = one_pass(folder, a.steps)
        finally:
            busy_loop.kill()
            busy_loop.wait()
    report(quiet, busy)
    if a.json:
        Path(a.json).write_text(json.dumps({"quiet": quiet, "busy": busy, "command": " ".join(sys.argv)}, indent=1))


if __name__ == "__main__":
    main()
