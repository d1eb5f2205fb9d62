"""Regenerate the protobuf and gRPC modules of this package from protos/.

    python -m specdec_rpc.generate            # rewrite specdec_rpc/specdec_pb2*.py
    python -m specdec_rpc.generate --check    # exit 1 if they are stale

protoc names the generated import after the proto path (`from specdec.v1 import ...`),
which would collide with the core package `specdec`; the import is rewritten to this
package so that the stubs stay out of the core.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "specdec/v1/specdec.proto"
OUT_DIR = Path(__file__).resolve().parent
GENERATED = ("specdec_pb2.py", "specdec_pb2.pyi", "specdec_pb2_grpc.py")


def render() -> dict[str, str]:
    """Run protoc into a temporary directory and return {file name: text}."""
    from grpc_tools import protoc
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        code = protoc.main(
            [
                "protoc",
                f"-I{ROOT / 'protos'}",
                f"-I{include}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(ROOT / "protos" / PROTO),
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        out = {}
        for name in GENERATED:
            text = (Path(tmp) / "specdec" / "v1" / name).read_text()
            out[name] = text.replace("from specdec.v1 import specdec_pb2", "from specdec_rpc import specdec_pb2")
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report whether the checked-in files are stale")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUT_DIR / name
        if not path.exists() or path.read_text() != text:
            stale.append(name)
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print(f"stale generated files: {', '.join(stale)}; run `python -m specdec_rpc.generate`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
