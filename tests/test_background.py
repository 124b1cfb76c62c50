"""The background-compile base module imports nothing from iterops, and the base of every Op does not import
the warm-up command (checked on the source: a module-level or function-level import would both count)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "iterops"


def _imports(path):
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_background_module_imports_nothing_from_iterops():
    assert not [n for n in _imports(PACKAGE / "_background.py") if n.split(".")[0] == "iterops"]


def test_fused_does_not_import_the_warmup_command():
    assert not [n for n in _imports(PACKAGE / "_fused.py") if "warmup" in n]
