"""`server/` reaches the engine only through its façade (`engine/client.py`, `system.md`), the
engine's configs and errors, and the grammar compiler it runs on requests' schemas."""

from __future__ import annotations

import ast
from pathlib import Path

import server

# Engine modules `server/` may import (anything under `engine.structured` included). The two
# `engine.distributed` ones are the command line's multi-GPU entry points: the rank processes
# of a node other than 0 (`serve_ranks`) and the EP-size check before the port is bound.
FACADE = (
    "engine.client",
    "engine.async_engine",
    "engine.distributed.config",
    "engine.distributed.multiprocess",
    "engine.distributed.memory",
    "engine.structured",
)


def _engine_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found |= {n for n in names if n == "engine" or n.startswith("engine.")}
    return found


def test_the_server_imports_the_engine_only_through_its_facade() -> None:
    root = Path(server.__file__).parent
    outside = {
        f"{path.relative_to(root.parent)}: {name}"
        for path in sorted(root.rglob("*.py"))
        for name in _engine_imports(path)
        if not any(name == m or name.startswith(f"{m}.") for m in FACADE)
    }
    assert not outside, sorted(outside)
