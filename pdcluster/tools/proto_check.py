"""Fail when the committed gRPC stubs differ from what `make proto` would generate."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pdcluster import SOURCE_ROOT as ROOT


def main() -> int:
    protos = sorted((ROOT / "protos").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "protos").mkdir()
        for proto in protos:
            shutil.copy(proto, out / "protos" / proto.name)
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.",
             "--grpc_python_out=.", "--pyi_out=.", *[f"protos/{p.name}" for p in protos]],
            cwd=out, check=True,
        )
        stale = [
            generated.name
            for generated in sorted((out / "protos").glob("*_pb2*.py*"))
            if not (ROOT / "protos" / generated.name).exists()
            or not filecmp.cmp(generated, ROOT / "protos" / generated.name, shallow=False)
        ]
    if stale:
        print(f"stale generated stubs (run `make proto`): {', '.join(stale)}", file=sys.stderr)
        return 1
    print(f"stubs up to date for {len(protos)} proto file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
