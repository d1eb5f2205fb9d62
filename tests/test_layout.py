"""The generated stubs are fresh, the core package stays free of gRPC, imports point down, and none loop."""

from __future__ import annotations

import ast
from pathlib import Path

from specdec_rpc import generate

ROOT = Path(__file__).resolve().parent.parent


def test_generated_protobuf_code_matches_protos():
    stale = [name for name, text in generate.render().items() if (generate.OUT_DIR / name).read_text() != text]
    assert not stale, f"{stale} are stale: run `python -m specdec_rpc.generate`"


def test_core_package_never_imports_grpc():
    offenders = []
    for path in (ROOT / "specdec").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("grpc", "specdec_rpc")]
    assert not offenders, offenders


# The house (STYLE.md): each folder is a floor; a file imports its own floor or below, never above,
# lazy imports inside functions included. The two services share a floor and never import each other.
FLOORS = {"specdec": 0, "specdec_rpc": 1, "drafter_service": 2, "verifier_service": 2, "client": 3, "gateway": 4,
          "bench": 5, "cli": 6}


def test_imports_point_down_only():
    offenders = []
    for top, floor in FLOORS.items():
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    target = name.split(".")[0]
                    if target in FLOORS and target != top and FLOORS[target] >= floor:
                        offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders


def _module_imports() -> dict[str, set[str]]:
    """Each module of the floors -> the modules of the floors it imports (lazy imports included;
    `from pkg import name` points at pkg.name when that is a module, else at pkg)."""
    paths = {}
    for top in FLOORS:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def test_no_modules_import_each_other_in_a_loop():
    graph = _module_imports()
    assert {"cli.commands", "client.speculative"} <= graph["cli"] | graph["cli.commands"]  # the walk sees lazy imports
    loops = []
    for start in graph:  # a depth-first walk from each module back to itself
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    loops.append(" -> ".join(path + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    assert not loops, loops
