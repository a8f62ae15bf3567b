"""The import layering of docs/architecture.md, checked on every import statement (module level
and inside functions): dependencies point one way, so the planner runs without torch and the
techniques can be used without the trainer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tenfold"

# package -> what its modules must never import. The command line (tenfold.cli) sits on top:
# the flags that make a run's config are tenfold.run_args, below every library package.
CLI = "tenfold.cli"
FORBIDDEN = {
    "models": ("tenfold.techniques", "tenfold.engine", "tenfold.plan", "tenfold.ladder", CLI),
    "techniques": ("tenfold.engine", "tenfold.plan", "tenfold.ladder", CLI),
    "plan": ("torch", "tenfold.engine", "tenfold.techniques", "tenfold.ladder", "tenfold.tune", CLI),
    "data": ("tenfold.engine", "tenfold.techniques", "tenfold.plan", "tenfold.ladder", CLI),
    "engine": ("tenfold.ladder", "tenfold.tune", CLI),
    "ladder": ("tenfold.tune", CLI),
    "tune": (CLI,),  # a tune measures its trials with the ladder's runner
}
# single modules every layer may import: they must stay torch-free and import no layer above
TORCH_FREE = ("terms.py", "run.py", "run_args.py", "config.py", "errors.py", "capabilities.py", "pipeline_layout.py")


def imports_of(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _hits(path: Path, forbidden: tuple[str, ...]) -> list[str]:
    return [n for n in imports_of(path) if any(n == f or n.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_import_only_downwards(package):
    bad = {str(p.relative_to(SRC)): _hits(p, FORBIDDEN[package]) for p in (SRC / package).rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("name", TORCH_FREE)
def test_shared_modules_are_torch_free(name):
    forbidden = ("torch", "tenfold.engine", "tenfold.techniques", "tenfold.plan", "tenfold.ladder", "tenfold.data",
                 "tenfold.tune", CLI)
    assert not _hits(SRC / name, forbidden)


def test_the_rule_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from tenfold.engine.trainer import Trainer\n    import torch.nn\n"
                   "    from tenfold.cli import main\n")
    assert _hits(bad, FORBIDDEN["plan"]) == ["tenfold.engine.trainer", "torch.nn", "tenfold.cli"]
    assert _hits(bad, FORBIDDEN["tune"]) == ["tenfold.cli"]


def test_planner_and_resolved_run_load_without_torch():
    code = ("import sys, tenfold.plan.api, tenfold.plan.for_run, tenfold.run, tenfold.terms, tenfold.pipeline_layout; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
