"""No function of the project longer than a screen, no class with more methods than a reader can hold (``ast``).

A function is measured from its ``def`` to its last line (its docstring and comments included), a class by the
functions defined directly in its body. What is still too long is named below, with who is splitting it; a name
comes off the list when it is split, and a new offender fails the test.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUNCTION_LINES_MAX = 80
CLASS_METHODS_MAX = 40

# Every package of the project: the service, the pure core, the audit, the benchmarks and the tests.
PACKAGES = ("georep", "topology", "offsets", "dedup", "cluster", "spark_jobs", "bench", "tests")

# "path:qualified name" -> who splits it. Empty when every split has landed.
LONG_FUNCTIONS: dict[str, str] = {}
BIG_CLASSES: dict[str, str] = {}


def definitions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every function and class of ``tree`` with its qualified name (``Consumer._fetch``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from definitions(node, f"{name}.")
        else:
            yield from definitions(node, prefix)


def offenders(root: Path = ROOT) -> tuple[dict[str, int], dict[str, int]]:
    """(functions over FUNCTION_LINES_MAX: their lines, classes over CLASS_METHODS_MAX: their methods)."""
    long_functions: dict[str, int] = {}
    big_classes: dict[str, int] = {}
    for path in sorted(p for package in PACKAGES for p in (root / package).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):  # generated (make proto)
            continue
        relative = path.relative_to(root).as_posix()
        for name, node in definitions(ast.parse(path.read_text(encoding="utf-8"), relative)):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(d, ast.FunctionDef | ast.AsyncFunctionDef) for d in node.body)
                if methods > CLASS_METHODS_MAX:
                    big_classes[f"{relative}:{name}"] = methods
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LINES_MAX:
                    long_functions[f"{relative}:{name}"] = lines
    return long_functions, big_classes


def test_no_function_over_a_screen_and_no_class_over_forty_methods() -> None:
    long_functions, big_classes = offenders()
    new_functions = {name: lines for name, lines in long_functions.items() if name not in LONG_FUNCTIONS}
    new_classes = {name: methods for name, methods in big_classes.items() if name not in BIG_CLASSES}
    assert not new_functions, f"functions over {FUNCTION_LINES_MAX} lines (split them): {new_functions}"
    assert not new_classes, f"classes over {CLASS_METHODS_MAX} methods (split them): {new_classes}"
    split = sorted({*LONG_FUNCTIONS} - {*long_functions} | {*BIG_CLASSES} - {*big_classes})
    assert not split, f"split already, so remove them from LONG_FUNCTIONS or BIG_CLASSES: {split}"
