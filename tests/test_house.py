"""Size limits of the source (src/tenfold): no class over 250 lines, no function over 60, no
file over 600, so that every piece can be read in one sitting. Lines are counted from the
`def`/`class` line (decorators included) to the last line of the body."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "tenfold"
MAX_CLASS, MAX_FUNCTION, MAX_FILE = 250, 60, 600


def _span(node: ast.AST) -> int:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


def oversized(root: Path = SRC, max_class: int = MAX_CLASS, max_function: int = MAX_FUNCTION,
              max_file: int = MAX_FILE) -> list[str]:
    """`path: what name has N lines (limit L)` for every piece over its limit."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(root.parent)
        lines = len(text.splitlines())
        if lines > max_file:
            found.append(f"{where}: file has {lines} lines (limit {max_file})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                kind, limit = "class", max_class
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind, limit = "function", max_function
            else:
                continue
            if _span(node) > limit:
                found.append(f"{where}:{node.lineno}: {kind} {node.name} has {_span(node)} lines (limit {limit})")
    return found


def test_no_class_function_or_file_over_its_limit():
    found = oversized()
    assert not found, "over the size limits:\n" + "\n".join(found)


def test_the_check_names_what_is_over(tmp_path):
    pkg = tmp_path / "tenfold"
    pkg.mkdir()
    (pkg / "big.py").write_text(
        "class Big:\n" + "".join(f"    x{i} = {i}\n" for i in range(5))
        + "    @staticmethod\n    def long():\n" + "".join(f"        y{i} = {i}\n" for i in range(4))
    )
    found = oversized(pkg, max_class=6, max_function=4, max_file=10)
    assert found == [
        "tenfold/big.py: file has 12 lines (limit 10)",
        "tenfold/big.py:1: class Big has 12 lines (limit 6)",
        "tenfold/big.py:8: function long has 6 lines (limit 4)",
    ]
    assert oversized(pkg, max_class=12, max_function=6, max_file=12) == []
