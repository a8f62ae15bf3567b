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
# The one crossing allowed: `tenfold plan --trace` runs the engine in child processes; the
# planner's command line imports only the trace's launcher and report, which load without torch
# (test_planner_and_resolved_run_load_without_torch).
ALLOWED = {"plan/cli.py": ("tenfold.engine.preview.trace", "tenfold.engine.preview.trace_report")}
# single modules every layer may import: they must stay torch-free and import no layer above
TORCH_FREE = ("terms.py", "host.py", "choices.py", "run.py", "run_args.py", "config.py", "errors.py", "capabilities.py", "pipeline_layout.py",
              "lora_terms.py", "quiet.py")


def imports_of(path: Path, root: Path = SRC) -> list[str]:
    """Every module `path` imports: module level, inside functions and under `if TYPE_CHECKING:`
    (an import for annotations still ties the two modules together). A relative import is
    resolved against the package of `path` below `root` (`from . import x` in tenfold/engine/a.py
    names tenfold.engine.x; `from .x import y` names tenfold.engine.x.y where that is a module)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom):
            names += relative_import(path, node, root)
    return names


def relative_import(path: Path, node: ast.ImportFrom, root: Path) -> list[str]:
    """The absolute names of `from .x import y` (or `from . import y`) in `path`: the base
    package, and base.y for each name that is a module or package below `root`."""
    package = path.parent.relative_to(root.parent).parts
    base = ".".join(package[: len(package) - node.level + 1] + ((node.module,) if node.module else ()))
    folder = root.parent.joinpath(*base.split("."))
    subs = [f"{base}.{a.name}" for a in node.names
            if (folder / f"{a.name}.py").is_file() or (folder / a.name / "__init__.py").is_file()]
    return subs or [base]


def _hits(path: Path, forbidden: tuple[str, ...], root: Path = SRC) -> list[str]:
    return [n for n in imports_of(path, root) if any(n == f or n.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_import_only_downwards(package):
    bad = {str(p.relative_to(SRC)): _hits(p, FORBIDDEN[package]) for p in (SRC / package).rglob("*.py")}
    bad = {k: [n for n in v if n not in ALLOWED.get(k, ())] for k, v in bad.items()}
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("name", TORCH_FREE)
def test_shared_modules_are_torch_free(name):
    forbidden = ("torch", "tenfold.engine", "tenfold.techniques", "tenfold.plan", "tenfold.ladder", "tenfold.data",
                 "tenfold.tune", CLI)
    assert not _hits(SRC / name, forbidden)


def test_the_rule_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from tenfold.engine.loop.trainer import Trainer\n    import torch.nn\n"
                   "    from tenfold.cli import main\n")
    assert _hits(bad, FORBIDDEN["plan"]) == ["tenfold.engine.loop.trainer", "torch.nn", "tenfold.cli"]
    assert _hits(bad, FORBIDDEN["tune"]) == ["tenfold.cli"]


def test_the_rule_sees_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "tenfold"
    (pkg / "engine" / "loop").mkdir(parents=True)
    (pkg / "plan").mkdir()
    for f in ("__init__.py", "cli.py", "engine/__init__.py", "engine/loop/__init__.py", "engine/loop/trainer.py",
              "plan/__init__.py"):
        (pkg / f).write_text("")
    bad = pkg / "plan" / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\nfrom .. import cli\nfrom ..engine.loop.trainer import Trainer\n"
                   "if TYPE_CHECKING:\n    from ..engine.loop import trainer\nfrom . import other_name\n")
    assert _hits(bad, FORBIDDEN["plan"], pkg) == ["tenfold.cli", "tenfold.engine.loop.trainer", "tenfold.engine.loop.trainer"]
    assert "tenfold.plan" in imports_of(bad, pkg)  # a name of the package itself
    assert _trainer_importers(pkg) == {"plan/bad.py": ["tenfold.engine.loop.trainer", "tenfold.engine.loop.trainer"]}


# The Trainer is the front of the Python API: the command line and the package root build it;
# every part below (fit, outputs, memory, techniques) takes the parts and config it uses.
TRAINER = "tenfold.engine.loop.trainer"
TRAINER_IMPORTERS = ("__init__.py", "cli.py", "engine/loop/trainer.py")


def _trainer_importers(root: Path = SRC) -> dict[str, list[str]]:
    found = {str(p.relative_to(root)): _hits(p, (TRAINER,), root) for p in root.rglob("*.py")}
    return {k: v for k, v in found.items() if v and k not in TRAINER_IMPORTERS}


def test_only_the_command_line_and_the_package_root_import_the_trainer():
    assert not _trainer_importers()


def test_only_the_command_line_imports_the_command_line():
    """tenfold.cli sits on top of every package and module: nothing below it imports it back."""
    top = {SRC / "cli.py", SRC / "__main__.py"}
    bad = {str(p.relative_to(SRC)): _hits(p, (CLI,)) for p in SRC.rglob("*.py") if p not in top}
    assert not {k: v for k, v in bad.items() if v}


# --------------------------------------------------------------------------- import cycles


def module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """module -> the tenfold modules it imports (module level and inside functions). A relative
    import is resolved against its package; `from pkg import name` counts as the submodule
    `pkg.name` where there is one, else as `pkg`; `import a.b.c` as the deepest module named.
    Imports under `if TYPE_CHECKING:` are left out: they never run, they only name types for
    annotations."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names if a.name.split(".")[0] == top}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                if base.split(".")[0] != top:
                    continue
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base) for a in node.names}
        graph[mod] = targets - {mod, None}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    """A cycle hidden in a function still couples two modules both ways: each is moved to
    the module that owns the shared piece instead."""
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_sees_function_and_relative_imports(tmp_path):
    pkg = tmp_path / "tenfold"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from tenfold.sub.b import f\n")
    (pkg / "sub" / "a.py").write_text("def g():\n    from . import b\n")
    (pkg / "sub" / "b.py").write_text("from tenfold.sub import a\ndef f():\n    pass\n")
    (pkg / "c.py").write_text("import tenfold.sub.a\n")
    graph = import_graph(pkg)
    assert graph["tenfold.sub.a"] == {"tenfold.sub.b"} and graph["tenfold.c"] == {"tenfold.sub.a"}
    assert cycles(graph) == [["tenfold.sub.a", "tenfold.sub.b"]]
    (pkg / "sub" / "a.py").write_text("from ..sub import helper_name\n")  # a name of the package itself
    assert cycles(import_graph(pkg)) == [["tenfold.sub", "tenfold.sub.a", "tenfold.sub.b"]]
    # an import that only names a type for annotations never runs: no edge
    (pkg / "sub" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
                                      "else:\n    import tenfold.c\n")
    assert import_graph(pkg)["tenfold.sub.a"] == {"tenfold.c"}


def test_planner_and_resolved_run_load_without_torch():
    code = ("import sys, tenfold.plan.api, tenfold.plan.for_run, tenfold.plan.cli, tenfold.run, tenfold.terms, "
            "tenfold.pipeline_layout, " + ", ".join(name for names in ALLOWED.values() for name in names) + "; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
