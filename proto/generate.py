"""Regenerate the Python modules for every schema in proto/.

    python -m skippy.proto.generate [--out DIR]     # default: proto/ itself (`make proto`)

Runs grpc_tools.protoc (pinned in pyproject.toml, so the output is reproducible) and then
rewrites protoc's top-level imports of sibling modules (`import stage_pb2 as ...`) to
`from skippy.proto import stage_pb2 as ...`: the folder is installed as `skippy.proto`,
never as a top-level `proto` package (DESIGN.md §3).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE = "skippy.proto"

_SIBLING_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def rewrite_imports(text: str) -> str:
    return _SIBLING_IMPORT.sub(rf"from {PACKAGE} import \1 as \2", text)


def generate(out: Path = PROTO_DIR, src: Path = PROTO_DIR) -> list[Path]:
    """Compile every .proto in `src` into `out`; returns the files written (sorted)."""
    try:
        from grpc_tools import protoc
    except ImportError as e:  # a test extra, not a runtime dependency
        raise SystemExit("grpc_tools is missing: pip install -e '.[test]'") from e
    import importlib.resources

    schemas = sorted(src.glob("*.proto"))
    if not schemas:
        raise SystemExit(f"no .proto files in {src}")
    out.mkdir(parents=True, exist_ok=True)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    # protoc names each schema relative to -I src ("source: stage.proto" in the output),
    # so the result does not depend on where the repository lives.
    args = ["grpc_tools.protoc", f"-I{src}", f"-I{well_known}",
            f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}",
            *(str(s) for s in schemas)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted(p for s in schemas
                     for p in out.glob(f"{s.stem}_pb2*") if p.suffix in (".py", ".pyi"))
    for path in written:
        text = path.read_text()
        fixed = rewrite_imports(text)
        if fixed != text:
            path.write_text(fixed)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skippy.proto.generate")
    p.add_argument("--out", type=Path, default=PROTO_DIR,
                   help="where the modules go (default: proto/)")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
