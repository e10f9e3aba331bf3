"""The CPU overlay's pod, run as local processes: each container's command, args and environment exactly as
the rendered Deployment writes them, with its volumes mapped to directories (a volume shared by two
containers is one directory) and its declared ports mapped to free local ports. The kubelet's part is
played as written: init containers in order (the native sidecar must pass its startup probe before the
next container starts), then startup, readiness and liveness probes over gRPC health against the declared
ports and services. Streams run through the router; then every container gets SIGTERM at once: the
streams complete and both processes exit 0 within terminationGracePeriodSeconds."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.pb import router_pb2 as rpb
from common.pb import router_pb2_grpc
from tests.deploy.k8s import all_containers, container, find_tool, pod_spec, volume
from tests.expert_service.serving.worker_process import SERVING, free_port, health_status

pytestmark = pytest.mark.slow
PROBE_PERIOD_SCALE = 0.2  # the kubelet's periods, shortened for CI; thresholds and timeouts as declared
API_TOKEN = "pod-test-api-token"
NOT_SERVING = 2


class Pod:
    """A rendered pod spec mapped onto this machine."""

    def __init__(self, rendering, root: Path, model: Path):
        self.spec = pod_spec(rendering.one("Deployment", "colibri"))
        self.rendering, self.root = rendering, root
        self.ports = {p["containerPort"]: free_port() for c in all_containers(self.spec) for p in c.get("ports", [])}
        self.processes: dict[str, subprocess.Popen] = {}
        self._volumes(model)

    def _volumes(self, model: Path) -> None:
        """Volume name -> a directory; ConfigMaps written out; the model on the PVC; the API token Secret."""
        self.dirs = {}
        for v in self.spec["volumes"]:
            d = self.root / "v" / v["name"]
            d.mkdir(parents=True)
            self.dirs[v["name"]] = d
            if "configMap" in v:
                for key, text in self.rendering.one("ConfigMap", v["configMap"]["name"])["data"].items():
                    (d / key).write_text(text)
        shutil.copytree(model, self.dirs["models"] / "model")
        secret = volume(self.spec, "auth")["secret"]["secretName"]
        assert secret == "colibri-auth"  # created by the operator (docs/deploy.md): made here
        (self.dirs["auth"] / "tokens").write_text(API_TOKEN + "\n")

    def _rewrite(self, c: dict, text: str) -> str:
        """Mount paths -> their directories (subPath mounts -> the file), declared ports -> local ports."""
        mounts = {
            m["mountPath"].rstrip("/"): str(self.dirs[m["name"]] / m.get("subPath", ""))
            for m in c.get("volumeMounts", [])
        }
        pattern = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
        text = re.sub(rf"(?<![\w.-])({pattern})(?=/|$|[\s'\"=:;])", lambda m: mounts[m.group(1)].rstrip("/"), text)
        return re.sub(
            r"^(--[a-z-]*port)=(\d+)$", lambda m: f"{m.group(1)}={self.ports.get(int(m.group(2)), m.group(2))}", text
        )

    def start(self, name: str) -> subprocess.Popen:
        c = container(self.spec, name)
        command = c.get("command") or ["colibri"]  # the image's ENTRYPOINT
        argv = [self._rewrite(c, a) for a in command + c.get("args", [])]
        env = {
            "PATH": f"{Path(find_tool('colibri')).parent}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(self.root),
            "LANG": "C.UTF-8",
        }
        for source in c.get("envFrom", []):
            env.update(self.rendering.one("ConfigMap", source["configMapRef"]["name"])["data"])
        env.update({e["name"]: self._rewrite(c, e["value"]) for e in c.get("env", []) if "value" in e})
        log = open(self.root / f"{name}.log", "w")
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        self.processes[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()[-3000:]

    def check(self, name: str, kind: str) -> int | None:
        probe = container(self.spec, name)[kind]["grpc"]
        return health_status(
            f"127.0.0.1:{self.ports[probe['port']]}",
            probe["service"],
            container(self.spec, name)[kind]["timeoutSeconds"],
        )

    def run_probe(self, name: str, kind: str, within_s: float = 60.0) -> None:
        """Probes until it succeeds. A startup or liveness probe fails the container after the declared
        number of consecutive failures (the kubelet would restart it); a readiness failure only keeps the pod
        out of the Service, so that one is given `within_s`."""
        p = container(self.spec, name)[kind]
        limit = (
            p["failureThreshold"]
            if kind != "readinessProbe"
            else 1 + int(within_s / (p["periodSeconds"] * PROBE_PERIOD_SCALE))
        )
        for _ in range(limit):
            if self.check(name, kind) == SERVING:
                return
            assert self.processes[name].poll() is None, f"{name} exited: {self.log(name)}"
            time.sleep(p["periodSeconds"] * PROBE_PERIOD_SCALE)
        raise AssertionError(f"{name} {kind} failed {limit} times: {self.log(name)}")

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def pod(renderings, tiny_model, tmp_path_factory):
    if find_tool("colibri") is None:
        pytest.skip("the colibri command is not installed")
    root = Path(tmp_path_factory.mktemp("pod", numbered=True))
    p = Pod(renderings["cpu"], root, tiny_model)
    yield p
    p.stop_all()


def _stub(pod: Pod):
    port = pod.ports[container(pod.spec, "router")["ports"][0]["containerPort"]]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return router_pb2_grpc.GenerationServiceStub(channel), channel


def _check_http_api(pod: Pod) -> None:
    """The declared `http` port serves the OpenAI-compatible API, behind the same tokens as gRPC."""
    declared = {p["name"]: p["containerPort"] for p in container(pod.spec, "router")["ports"]}
    base = f"http://127.0.0.1:{pod.ports[declared['http']]}"
    assert urllib.request.urlopen(f"{base}/health", timeout=10).status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{base}/v1/models", timeout=10)
    assert e.value.code == 401
    request = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_TOKEN}"})
    models = json.loads(urllib.request.urlopen(request, timeout=10).read())
    assert len(models["data"]) == 1, models


def test_pod_starts_serves_and_stops_as_written(pod):
    init = [c["name"] for c in pod.spec["initContainers"]]
    assert init == ["prepare", "worker"] and [c["name"] for c in pod.spec["containers"]] == ["router"]
    assert pod.start("prepare").wait(60) == 0, pod.log("prepare")
    worker = pod.start("worker")
    pod.run_probe("worker", "startupProbe")  # a native sidecar: the next container waits for this
    router = pod.start("router")
    pod.run_probe("router", "startupProbe")
    for name in ("worker", "router"):
        pod.run_probe(name, "readinessProbe")
        pod.run_probe(name, "livenessProbe")
    for port in (9090, 9091):  # both processes can be scraped
        text = urllib.request.urlopen(f"http://127.0.0.1:{pod.ports[port]}/metrics", timeout=10).read().decode()
        assert "colibri_" in text
    _check_http_api(pod)

    stub, channel = _stub(pod)
    metadata = (("authorization", f"Bearer {API_TOKEN}"),)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(rpb.GenerateRequest(text="no token"), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    started = threading.Barrier(5)

    def generate(i: int) -> int:
        request = rpb.GenerateRequest(
            text=f"In the beginning {i}", parameters=rpb.SamplingParameters(max_new_tokens=120, ignore_eos=True)
        )
        tokens = 0
        for n, message in enumerate(stub.GenerateStream(request, metadata=metadata, timeout=120)):
            tokens += len(message.token_ids)
            if n == 0:
                started.wait(60)
        return tokens

    grace = pod.spec["terminationGracePeriodSeconds"]
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(generate, i) for i in range(4)]
        started.wait(60)
        stopped_at = time.monotonic()
        for process in (worker, router):  # every container at once
            process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert pod.check("router", "readinessProbe") in (NOT_SERVING, None)
        assert pod.check("worker", "readinessProbe") in (NOT_SERVING, None)
        assert [s.result(timeout=grace) for s in streams] == [120] * 4
    channel.close()
    for name, process in (("router", router), ("worker", worker)):
        left = grace - (time.monotonic() - stopped_at)
        assert process.wait(max(left, 0.1)) == 0, f"{name}: {pod.log(name)}"
    assert time.monotonic() - stopped_at < grace
    for name in ("worker", "router"):
        assert "Traceback" not in pod.log(name), pod.log(name)


def test_pod_processes_keep_secrets_out_of_argv(pod):
    """What `ps` shows of the running pod holds no token (they are read from the mounted files)."""
    assert pod.start("prepare").wait(60) == 0
    pod.start("worker")
    pod.run_probe("worker", "startupProbe")
    token = (pod.dirs["worker-token"] / "token").read_text().strip()
    assert len(token) >= 32
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert token not in ps and API_TOKEN not in ps
    assert (
        sys.platform != "linux"
        or token.encode() not in Path(f"/proc/{pod.processes['worker'].pid}/environ").read_bytes()
    )
