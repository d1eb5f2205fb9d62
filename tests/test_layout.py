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
