"""Asking a server's gRPC reflection what it serves, as grpcurl does: its service list, and whether it describes a
symbol."""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc


def reflected(target: str, symbols: tuple[str, ...] = ()) -> tuple[set[str], dict[str, bool]]:
    """(the services reflection lists, {symbol: whether reflection hands out the file defining it})."""
    requests = [reflection_pb2.ServerReflectionRequest(list_services="")]
    requests += [reflection_pb2.ServerReflectionRequest(file_containing_symbol=s) for s in symbols]
    with grpc.insecure_channel(target) as channel:
        answers = list(
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter(requests), timeout=10)
        )
    listed = {s.name for s in answers[0].list_services_response.service}
    described = {s: a.HasField("file_descriptor_response") for s, a in zip(symbols, answers[1:], strict=True)}
    return listed, described
