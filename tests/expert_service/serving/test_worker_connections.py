"""The worker's gRPC ports hold at most grpc_max_connections connections each: gRPC core closes one opened past the
cap as it opens, while the connections already open (the router's) are served. The setting is a positive integer
gRPC core can take, refused in one line otherwise."""

from __future__ import annotations

import dataclasses
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import resolve
from common.errors import ConfigError
from common.pb import worker_pb2 as pb
from expert_service.serving.main import WorkerConfig
from tests.helpers import BackgroundWorker, free_port

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # channels of one process otherwise share a connection


def check(target: str) -> tuple[grpc.Channel, grpc.StatusCode]:
    """A fresh connection's health check: (its channel, left open, and how the call ended)."""
    channel = grpc.insecure_channel(target, options=OWN_CONNECTION)
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return channel, grpc.StatusCode.OK
    except grpc.RpcError as e:
        return channel, e.code()


def gauge(metric) -> float:
    (value,) = [sample.value for family in metric.collect() for sample in family.samples]
    return value


def test_past_the_cap_a_connection_is_closed_and_the_router_is_still_served(tiny_model):
    worker = BackgroundWorker(tiny_model)
    worker.config = dataclasses.replace(worker.config, grpc_max_connections=2, health_port=free_port())
    worker.start()
    try:
        router, code = check(worker.address)  # the router's connection, and one more
        assert code == grpc.StatusCode.OK
        other, code = check(worker.address)
        assert code == grpc.StatusCode.OK
        extra, code = check(worker.address)
        assert code == grpc.StatusCode.UNAVAILABLE
        extra.close()
        # the gauge counts the two connections held (the refused one never opened), the health port's apart
        assert gauge(worker.servicer.metrics.worker_grpc_connections) == 2
        assert gauge(worker.servicer.metrics.worker_grpc_health_connections) == 0
        # a connection that never speaks is closed at once too
        silent = socket.create_connection(("127.0.0.1", worker.port))
        silent.settimeout(5)
        assert silent.recv(1) == b""
        silent.close()
        info = router.unary_unary(
            "/colibri.worker.v1.WorkerService/Info",
            request_serializer=pb.InfoRequest.SerializeToString,
            response_deserializer=pb.InfoResponse.FromString,
        )(pb.InfoRequest(), timeout=10)
        assert info.vocab_size == 259
        probe, code = check(f"127.0.0.1:{worker.config.health_port}")  # the health port counts apart
        assert code == grpc.StatusCode.OK
        probe.close()
        other.close()
        deadline = time.monotonic() + 5
        while (code := check(worker.address))[1] != grpc.StatusCode.OK and time.monotonic() < deadline:
            time.sleep(0.1)  # the worker sees the close a moment later
        assert code[1] == grpc.StatusCode.OK
        code[0].close()
        router.close()
    finally:
        worker.stop()


@pytest.mark.parametrize("value", [0, -3, 2**20 + 1, 2**31])
def test_a_cap_grpc_cannot_take_is_refused_in_one_line(value):
    with pytest.raises(ConfigError, match=r"^grpc_max_connections: must be in \[1, 1048576\]") as error:
        WorkerConfig(grpc_max_connections=value)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="grpc_max_connections"):
        resolve(WorkerConfig, env={"COLIBRI_WORKER_GRPC_MAX_CONNECTIONS": str(value)})
    assert resolve(WorkerConfig, env={"COLIBRI_WORKER_GRPC_MAX_CONNECTIONS": "3"}).grpc_max_connections == 3
