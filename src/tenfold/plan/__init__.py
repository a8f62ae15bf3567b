"""tenfold's planner: per-GPU memory, step time, MFU and days before a GPU is rented.

Pure Python (never imports torch). Entry points: `tenfold.plan.api.predict(model, hardware,
gpus, strategy) -> Plan`, `tenfold.plan.search.search(...)`, `tenfold.plan.ladder.run_ladder(...)`
and the CLI `tenfold plan` (`tenfold.plan.cli`). Formulas and sources: docs/planner.md.
"""
