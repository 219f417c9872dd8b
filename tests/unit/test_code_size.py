"""The size rule of issue 29: no module of ``kvdiag`` over ``MODULE_LINES`` lines and no
function over ``FUNCTION_LINES`` lines, unless its docstring states why in a sentence that
starts with ``Long:``.

Sizes are counted from the source with :mod:`ast` (a function: its ``def`` line to its last
line, decorators left out; a module: its lines).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvdiag"
MODULE_LINES = 400
FUNCTION_LINES = 60
REASON = "Long:"


def _has_reason(doc: str | None) -> bool:
    return doc is not None and REASON in doc


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


@functools.cache
def offenders() -> dict[str, int]:
    """Every module and function over its limit without a stated reason: name -> lines."""
    out: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        lines = len(source.splitlines())
        if lines > MODULE_LINES and not _has_reason(ast.get_docstring(tree)):
            out[rel] = lines
        for name, node in _functions(tree):
            length = node.end_lineno - node.lineno + 1
            if length > FUNCTION_LINES and not _has_reason(ast.get_docstring(node)):
                out[f"{rel}::{name}"] = length
    return out


def test_counting_matches_a_hand_count(tmp_path):
    """The counter itself, on a function whose length is known by construction."""
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))  # def line + 60 = 61
    tree = ast.parse(f"@staticmethod\ndef f():\n{body}\n\nclass C:\n    def g(self):\n        pass\n")
    found = {name: n.end_lineno - n.lineno + 1 for name, n in _functions(tree)}
    assert found == {"f": FUNCTION_LINES + 1, "C.g": 2}


def test_no_long_module_or_function():
    over = offenders()
    assert not over, (f"over {MODULE_LINES} lines (module) or {FUNCTION_LINES} (function): split "
                      f"it, or state why in its docstring with a sentence starting {REASON!r}: {over}")
