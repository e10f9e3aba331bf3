"""setup.py's stub generation (`make proto` and every pip install): a proto that imports another proto of the
tree compiles, and the generated modules import each other under common.pb."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHARED = """syntax = "proto3";
package colibri.shared.v1;
message Shared { uint32 count = 1; }
"""
USER = """syntax = "proto3";
package colibri.user.v1;
import "colibri/shared/v1/shared.proto";
import "google/protobuf/struct.proto";
service UserService { rpc Use(UseRequest) returns (UseResponse); }
message UseRequest { colibri.shared.v1.Shared shared = 1; google.protobuf.Struct extra = 2; }
message UseResponse { colibri.shared.v1.Shared shared = 1; }
"""
CHECK = """
from common.pb.colibri.shared.v1 import shared_pb2
from common.pb.colibri.user.v1 import user_pb2, user_pb2_grpc
request = user_pb2.UseRequest(shared=shared_pb2.Shared(count=7))
assert user_pb2.UseRequest.FromString(request.SerializeToString()).shared.count == 7
assert user_pb2.DESCRIPTOR.name == "colibri/user/v1/user.proto"
assert user_pb2_grpc.UserServiceStub and user_pb2.UseRequest.DESCRIPTOR.fields[0].message_type is \\
    shared_pb2.Shared.DESCRIPTOR
print("ok")
"""


def _setup_module():
    spec = importlib.util.spec_from_file_location("colibri_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines generate_stubs without running setup()
    return module


def test_a_proto_importing_another_generates_modules_that_import_under_common_pb(tmp_path):
    for path, text in (
        ("protos/colibri/shared/v1/shared.proto", SHARED),
        ("protos/colibri/user/v1/user.proto", USER),
        ("common/__init__.py", ""),
        ("common/pb/__init__.py", ""),
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    generated = _setup_module().generate_stubs(tmp_path)
    assert len(generated) == 6
    grpc_module = (tmp_path / "common/pb/colibri/user/v1/user_pb2_grpc.py").read_text()
    assert "from common.pb.colibri.user.v1 import user_pb2" in grpc_module
    assert (
        "from common.pb.colibri.shared.v1 import shared_pb2"
        in (tmp_path / "common/pb/colibri/user/v1/user_pb2.py").read_text()
    )
    for package in ("colibri", "colibri/shared", "colibri/shared/v1", "colibri/user", "colibri/user/v1"):
        assert (tmp_path / "common/pb" / package / "__init__.py").is_file(), package
    # A fresh interpreter in the tree: `common` resolves to tmp_path's, the default descriptor pool is empty.
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
