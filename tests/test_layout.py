"""The generated stubs are fresh, and the core package stays free of gRPC."""

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
