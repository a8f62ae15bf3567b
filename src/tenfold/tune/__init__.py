"""`tenfold tune`: the planner's most promising strategies, measured here; the planner
recalibrated on what was measured; the fastest kept as a config `tenfold train` runs.

    tenfold tune --model small --nproc 2 --budget 600 --out runs/tune
    tenfold tune --config run.toml --budget 1800 --fixed precision     # keep your precision
    tenfold train --config runs/tune/best.toml                         # train the winner
    tenfold plan --config runs/tune/best.toml --hardware-file runs/tune/hardware.toml --gpus 64

The run to tune is described with train's own flags (--config, --deepspeed, --set, --model,
--nproc, --global-batch, ...): it is the baseline, tried first, and the global batch, model,
data and processes stay fixed. The candidates are `tenfold plan --search`'s runnable
strategies that fit the memory limit with a margin, in every precision this device runs fast:
precision, micro-batch and accumulation, recompute policy, ZeRO stage, pipeline stages,
schedule and virtual stages (and tensor parallelism where the engine has it).

Each trial is a real `tenfold train` in a subprocess for a short measured window; after each,
the planner's machine constants are refitted by least squares to everything measured, the
untried candidates are re-ranked, and those that can no longer beat the best measured rate are
pruned; the rest of the budget confirms the best by running them again (successive halving).
Running the same command again resumes: no finished trial runs again.
Outputs in --out: tune.json, tune.md, tune.png, best.toml, hardware.toml, trials/.
"""

from __future__ import annotations

import argparse

from tenfold.tune.candidates import KNOBS
from tenfold.tune.setup import DEFAULT_BUDGET_S, DEFAULT_MARGIN, DEFAULT_OUT, DEFAULT_WINDOW_S


def register(subparsers) -> argparse.ArgumentParser:
    from tenfold.run_args import add_run_arguments

    p = subparsers.add_parser("tune", help="measure the planner's best strategies here; calibrate the planner",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)  # the run to tune, as train reads it
    for action in p._actions:  # argparse has no public way to re-word an inherited flag's help
        if action.dest == "out":
            action.help = f"the tune's folder (default {DEFAULT_OUT}); the same folder resumes"
        elif action.dest == "no_progress":
            action.help = "no progress bar (one line per run is printed either way)"
    g = p.add_argument_group("tune")
    g.add_argument("--budget", type=float, help=f"seconds of trials (default {DEFAULT_BUDGET_S:.0f}); no run starts "
                                                "after it once a trial has been measured, so a tune ends within it and "
                                                "one run (until one is measured, up to 3 runs more)")
    g.add_argument("--memory-limit", help="memory per rank a trial's tracked tensors may peak at, e.g. 40GiB (default: the device's; "
                                          "on a CPU its RAM shared by the ranks); a trial over it is recorded as oom")
    g.add_argument("--margin", type=float, help=f"candidates must be predicted to need at most (1 - margin) x the limit "
                                                f"(default {DEFAULT_MARGIN})")
    g.add_argument("--fixed", metavar="KNOB,...", help=f"keep these at your configuration's values: {', '.join(KNOBS)}")
    g.add_argument("--window", type=float, help=f"seconds each trial is measured for, after its warm-up "
                                                f"(default {DEFAULT_WINDOW_S:.0f}; at least 2 steps)")
    g.add_argument("--trial-timeout", type=float, help="seconds one run may take before it is stopped and recorded "
                                                       "as timeout (default: 4 x its expected time, at least 120)")
    g.add_argument("--max-trials", type=float, help="try at most this many candidates besides the baseline")
    g.add_argument("--hardware-file", help="start from these machine constants (e.g. an earlier tune's hardware.toml) "
                                           "instead of the planner's entry for this device")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from tenfold.tune.report import finish
    from tenfold.tune.setup import prepare

    from tenfold.ladder.runner import exit_on_sigterm

    setup = prepare(args)
    tune = _start(setup, args)
    exit_on_sigterm()  # a stopped tune stops its running trial's ranks too (measure._run)
    try:
        tune.run()
    finally:
        tune.save()
    return finish(tune)


def _start(setup, args):
    from tenfold.tune import candidates, state
    from tenfold.tune.progress import TuneLog
    from tenfold.tune.runner import Tune

    base = candidates.baseline(setup.cfg, setup.nproc, setup.hardware, setup.baseline_precision)
    space = candidates.search_space(setup.cfg, base, setup.hardware, setup.nproc, setup.precisions,
                                    setup.limit_bytes, setup.margin, setup.fixed)
    setup.out.mkdir(parents=True, exist_ok=True)
    key = state.fingerprint(setup.cfg, setup.nproc, setup.device, base.run.global_batch, base.run.seq_len)
    trials = state.load(setup.out / "tune.json", key)
    log = TuneLog(setup.budget_s, show_bar=not args.no_progress)
    tune = Tune(setup, base, space, trials, log, fingerprint=key)
    log.say(f"tune: {len(tune.candidates)} candidate(s) on {setup.nproc} x {setup.hardware.name} "
            f"(global batch {base.run.global_batch}, seq {base.run.seq_len}); "
            f"{len(trials)} trial(s) already in {setup.out}; budget {setup.budget_s:,.0f} s")
    return tune
