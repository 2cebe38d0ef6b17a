"""`kernels/` is a leaf: no module of it imports `engine` (nor reads the environment)."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).parents[2] / "kernels"


def imported_modules(source: str) -> list[str]:
    """Every module an `import` / `from ... import` anywhere in `source` names (function bodies
    included; relative imports as `.name`)."""
    modules = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.append("." * node.level + (node.module or ""))
    return modules


def test_the_scan_sees_imports_inside_functions() -> None:
    source = "import os\ndef f():\n    from engine.models import x\n"
    assert imported_modules(source) == ["os", "engine.models"]


def test_no_kernel_module_imports_engine() -> None:
    offenders = {
        path.name: [m for m in imported_modules(path.read_text()) if m.split(".")[0] == "engine"]
        for path in sorted(KERNELS.glob("*.py"))
    }
    assert len(offenders) >= 8  # every kernel file was read
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def reads_environment(source: str) -> bool:
    """Whether `source` names `environ`, `getenv` or `putenv` (as `os.x` or imported bare)."""
    names = {"environ", "getenv", "putenv"}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            return True
        if isinstance(node, ast.alias) and node.name in names:
            return True
    return False


def test_no_kernel_module_reads_the_environment() -> None:
    """Environment variables are read in `engine/envs.py` only; Triton reads its own."""
    assert reads_environment("import os\nflag = os.environ.get('X')\n")
    assert reads_environment("from os import getenv\n")
    assert [p.name for p in sorted(KERNELS.glob("*.py")) if reads_environment(p.read_text())] == []
