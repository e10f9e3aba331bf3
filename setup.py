"""Generates the gRPC stubs (common/pb/colibri/<service>/v1/*_pb2*.py and .pyi) from protos/ whenever the
package is built or installed (`pip install .`, `pip install -e .`), so a fresh clone works without running
`make proto`. The packages they land in have committed __init__.py files: setuptools lists packages before
build_py runs, so a folder that only the generation creates would be left out of the wheel."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = ["protos/colibri/router/v1/router.proto", "protos/colibri/worker/v1/worker.proto"]


def generate_stubs() -> None:
    import grpc_tools
    from grpc_tools import protoc
    # The well-known types (google/protobuf/struct.proto) ship inside grpc_tools: `python -m grpc_tools.protoc`
    # adds that include itself, protoc.main does not.
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    args = ["grpc_tools.protoc", "-Icommon/pb=protos", f"-I{well_known}", "--python_out=.", "--pyi_out=.",
            "--grpc_python_out=.", *PROTOS]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTOS}")


class BuildWithStubs(build_py):
    def run(self):
        import os
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            generate_stubs()
        finally:
            os.chdir(cwd)
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
