"""Generates the gRPC stubs (common/pb/*_pb2*.py and .pyi) from protos/ whenever the package is built or
installed (`pip install .`, `pip install -e .`), so a fresh clone works without running `make proto`."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = ["protos/router.proto", "protos/worker.proto"]


def generate_stubs() -> None:
    from grpc_tools import protoc
    args = ["grpc_tools.protoc", "-Icommon/pb=protos", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.",
            *PROTOS]
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
