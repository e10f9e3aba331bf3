"""The gRPC contract as other languages see it: one package per folder, the language options every generator
reads, and the request/response types that exist once per RPC but must stay interchangeable on the wire (the
servicers handle both of a pair with one code path)."""

from __future__ import annotations

import importlib
import random
from pathlib import Path

import pytest
from google.protobuf import json_format

from common.pb import router_pb2, worker_pb2

PROTOS = Path(__file__).resolve().parents[2] / "protos"
PROTO_FILES = sorted(PROTOS.rglob("*.proto"))
TWINS = [
    (router_pb2.GenerateRequest, router_pb2.GenerateStreamRequest),
    (router_pb2.ChatRequest, router_pb2.ChatStreamRequest),
    (router_pb2.GenerateResponse, router_pb2.ChatResponse),
    (router_pb2.GenerateStreamResponse, router_pb2.ChatStreamResponse),
    (worker_pb2.PrefillResponse, worker_pb2.DecodeResponse),
]
# Fields only the second twin has: a chat reply's tool calls (a plain generation has no tools).
TWIN_EXTRAS = {"ChatResponse": {"tool_calls"}, "ChatStreamResponse": {"tool_calls"}}


def _generated(proto: Path):
    """The generated module of a file under protos/, as `make proto` lays it out under common/pb."""
    relative = proto.relative_to(PROTOS).with_suffix("")
    return importlib.import_module("common.pb." + ".".join(relative.parts) + "_pb2")


def test_every_proto_is_generated_under_common_pb_and_reexported():
    names = {p.relative_to(PROTOS).as_posix(): _generated(p) for p in PROTO_FILES}
    assert names["colibri/router/v1/router.proto"] is router_pb2
    assert names["colibri/worker/v1/worker.proto"] is worker_pb2
    for name, module in names.items():  # named from the include root protos/, as buf and other languages do
        assert module.DESCRIPTOR.name == name


@pytest.mark.parametrize("proto", PROTO_FILES, ids=lambda p: p.name)
def test_package_matches_folder_and_language_options_follow_it(proto):
    file = _generated(proto).DESCRIPTOR
    parts = proto.relative_to(PROTOS).parent.parts  # ("colibri", "router", "v1")
    assert file.package == ".".join(parts)
    pascal = [p[:1].upper() + p[1:] for p in parts]  # Colibri Router V1
    options = file.GetOptions()
    assert options.java_package == "com." + file.package
    assert options.java_multiple_files
    assert options.java_outer_classname == proto.stem.capitalize() + "Proto"
    assert options.go_package == f"colibri/gen/go/{'/'.join(parts)};{parts[-2]}{parts[-1]}"
    assert options.csharp_namespace == ".".join(pascal)
    assert options.php_namespace == "\\".join(pascal)
    assert options.ruby_package == "::".join(pascal)
    assert options.objc_class_prefix == "".join(p[0] for p in pascal[:-1]).upper() + "X"


def _fields(message) -> list[tuple]:
    return [
        (
            f.name,
            f.number,
            f.type,
            f.is_repeated,
            f.message_type and f.message_type.full_name,
            f.enum_type and f.enum_type.full_name,
            f.containing_oneof and f.containing_oneof.name,
            f.has_presence,
        )
        for f in message.DESCRIPTOR.fields
    ]


def _fill(message, rng: random.Random):
    """Every field of `message` set to a fresh random value (one member of each oneof)."""
    for field in message.DESCRIPTOR.fields:
        if field.containing_oneof is not None and message.WhichOneof(field.containing_oneof.name):
            continue
        repeated = field.is_repeated
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue
        if field.message_type is not None:
            if field.message_type.full_name == "google.protobuf.Struct":
                getattr(message, field.name).update({"k": rng.random()})
                continue
            targets = (
                [getattr(message, field.name).add() for _ in range(2)] if repeated else [getattr(message, field.name)]
            )
            for target in targets:
                _fill(target, rng)
            continue
        values = [_scalar(field, rng) for _ in range(3)]
        if repeated:
            getattr(message, field.name).extend(values)
        else:
            setattr(message, field.name, values[0])
    return message


def _scalar(field, rng: random.Random):
    t = field.type
    if t == field.TYPE_STRING:
        return "".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 8)))
    if t == field.TYPE_BYTES:
        return rng.randbytes(rng.randint(1, 8))
    if t == field.TYPE_BOOL:
        return True
    if t in (field.TYPE_FLOAT, field.TYPE_DOUBLE):
        return rng.randint(1, 1000) / 8  # exact in float32
    if t == field.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values if v.number])
    return rng.randint(1, 2**31 - 1)


@pytest.mark.parametrize("a,b", TWINS, ids=lambda m: m.DESCRIPTOR.name)
def test_twin_messages_have_the_same_fields_and_bytes(a, b):
    extras = TWIN_EXTRAS.get(b.DESCRIPTOR.name, set())
    assert {f.name for f in b.DESCRIPTOR.fields} >= extras
    assert _fields(a) == [f for f in _fields(b) if f[0] not in extras], (
        f"{a.DESCRIPTOR.name} and {b.DESCRIPTOR.name} differ"
    )
    for seed in range(3):
        original = _fill(a(), random.Random(seed))
        data = original.SerializeToString()
        assert len(original.ListFields()) >= len(a.DESCRIPTOR.oneofs) + 1
        assert json_format.MessageToDict(b.FromString(data)) == json_format.MessageToDict(original)
        assert b.FromString(data).SerializeToString(deterministic=True) == original.SerializeToString(
            deterministic=True
        )
