"""`colibri router` as a process: health SERVING once the worker is ready; SIGTERM drains and exits 0."""

import asyncio
import signal
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb import router_pb2_grpc
from tests.grpc_teardown import stopped
from tests.helpers import free_port
from tests.router_service.fake_worker import FakeWorker, ids_request, start_fake_worker


async def wait_serving(health, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        try:
            r = await health.Check(health_pb2.HealthCheckRequest(service="colibri.readiness"), timeout=1)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("router never became SERVING")


def test_sigterm_drains_in_flight_and_exits_zero():
    async def main():
        worker_server, address = await start_fake_worker(FakeWorker(step_delay=0.01))
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "colibri.cli",
            "router",
            "--worker",
            address,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--drain-timeout-s",
            "10",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            health = health_pb2_grpc.HealthStub(channel)
            stub = router_pb2_grpc.GenerationServiceStub(channel)
            await wait_serving(health)
            in_flight = stub.Generate(ids_request([1], max_new_tokens=40))
            await asyncio.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
            status = await health.Check(health_pb2.HealthCheckRequest(service="colibri.readiness"), timeout=1)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            try:
                await stub.Generate(ids_request([1], max_new_tokens=1), timeout=2)
                raise AssertionError("a request was admitted while draining")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert (await in_flight).generated_tokens == 40
            output = (await asyncio.wait_for(proc.communicate(), 20))[0].decode()
            assert proc.returncode == 0, output
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await channel.close()
            await stopped(worker_server)

    asyncio.run(main())
