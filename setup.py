"""Generates the gRPC stubs (common/pb/colibri/<service>/v1/*_pb2*.py and .pyi) from protos/ whenever the
package is built or installed (`pip install .`, `pip install -e .`), so a fresh clone works without running
`make proto`, which calls the same `generate_stubs`.

protoc runs with protos/ as the include root, so the files have the names every other language and buf give them
(colibri/router/v1/router.proto); the generated `from colibri.<package> import ..._pb2` lines (one proto importing
another, and every _pb2_grpc.py) are then pointed at common.pb.colibri, where the modules live (top-level
`colibri` is the CLI package).
The packages they land in have committed __init__.py files: setuptools lists packages before build_py runs, so a
folder that only the generation creates would be left out of the wheel (generate_stubs adds a missing one, to be
committed with a new proto package)."""

import re
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def generate_stubs(root: Path = ROOT) -> list[Path]:
    """Compiles every root/protos/**/*.proto into root/common/pb; returns the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    protos, out = root / "protos", root / "common" / "pb"
    files = sorted(str(p.relative_to(protos)) for p in protos.rglob("*.proto"))
    # The well-known types (google/protobuf/struct.proto) ship inside grpc_tools: `python -m grpc_tools.protoc`
    # adds that include itself, protoc.main does not.
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{protos}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(protos / f) for f in files),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}")
    roots = "|".join(sorted({Path(f).parts[0] for f in files}))  # colibri
    generated_import = re.compile(rf"^(from|import) ({roots})\.", re.MULTILINE)
    generated = []
    for file in files:
        stem = out / Path(file).with_suffix("")
        for path in (
            stem.with_name(stem.name + "_pb2.py"),
            stem.with_name(stem.name + "_pb2.pyi"),
            stem.with_name(stem.name + "_pb2_grpc.py"),
        ):
            path.write_text(generated_import.sub(r"\1 common.pb.\2.", path.read_text()))
            generated.append(path)
        package = stem.parent
        while package != out:  # colibri/router/v1, colibri/router, colibri
            if not (package / "__init__.py").exists():
                (package / "__init__.py").write_text("")
            package = package.parent
    return generated


class BuildWithStubs(build_py):
    def run(self):
        generate_stubs()
        super().run()


if __name__ == "__main__":  # setuptools runs this file as __main__; `make proto` imports it for generate_stubs
    setup(cmdclass={"build_py": BuildWithStubs})
