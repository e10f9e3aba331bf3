"""The static routing table through both services: router-gen -> router plans -> worker.

A token-routed model (exact routing is a function of the token id) must give recall 1.0 and identical
outputs under routing=lut; a random model under routing=lut is labelled in every response.
"""

import asyncio
import json
import re

import grpc
import numpy as np
import pytest

from colibri.cli import main as colibri
from common.model_format import ModelDir
from common.pb import router_pb2 as rpb
from common.pb import worker_pb2 as wpb
from common.pb import worker_pb2_grpc
from expert_service.tools.tiny_model import make_tiny
from tests.helpers import BackgroundWorker, make_token_routed_model, running_router

pytestmark = pytest.mark.slow


def build_table(model, tmp_path, seed=0):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(map(str, np.random.default_rng(seed).integers(3, 259, 3000))))
    table = tmp_path / "table.bin"
    assert (
        colibri(
            [
                "router-gen",
                str(model),
                "--corpus",
                str(corpus),
                "--corpus-format",
                "ids",
                "--out",
                str(table),
                "--sequence-length",
                "100",
            ]
        )
        == 0
    )
    return table, json.loads((tmp_path / "table.bin.report.json").read_text())


def exact_greedy(model, prompt, n):
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    return build_engine(ModelDir.open(model), EngineConfig(backend="cpu")).generate(prompt, n)[0]


def run_requests(worker, model, table, prompts, n):
    async def body():
        async with running_router(
            worker.address if worker else "127.0.0.1:1",
            wait_ready=worker is not None,
            max_batch_tokens=24,
            model=str(model),
            routing_table=str(table),
        ) as (router, stub):
            requests = [
                rpb.GenerateRequest(
                    token_ids=rpb.TokenIds(ids=p), parameters=rpb.SamplingParameters(max_new_tokens=n, ignore_eos=True)
                )
                for p in prompts
            ]
            replies = await asyncio.gather(*(stub.Generate(r) for r in requests))
            return replies

    return asyncio.run(body())


@pytest.fixture(scope="module")
def token_routed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("token_routed")
    model = make_token_routed_model(tmp)
    table, report = build_table(model, tmp)
    return model, table, report


PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [1, 2], list(range(10, 40)), [200, 201, 202, 9]]


def test_token_routed_model_has_recall_one(token_routed):
    _, _, report = token_routed
    assert report["recall"] == 1.0 and all(r == 1.0 for r in report["recall_per_layer"])


def test_lut_routing_equals_exact_on_a_token_routed_model(token_routed):
    model, table, _ = token_routed
    expected = [exact_greedy(model, p, 10) for p in PROMPTS]
    worker = BackgroundWorker(model, routing="lut").start()
    try:
        replies = run_requests(worker, model, table, PROMPTS, 10)
    finally:
        worker.stop()
    assert [list(r.token_ids) for r in replies] == expected
    assert all(r.routing == "lut" for r in replies)  # lut routing runs only on the router's plans


def test_exact_worker_measures_plan_recall(token_routed):
    model, table, _ = token_routed
    worker = BackgroundWorker(model).start()
    try:
        replies = run_requests(worker, model, table, PROMPTS[:2], 5)
        recall = worker.servicer.metrics.routing_plan_recall._value.get()
    finally:
        worker.stop()
    assert all(r.routing == "exact" for r in replies)
    assert recall == 1.0


def test_lut_on_a_random_model_is_labelled(tmp_path):
    model = make_tiny(tmp_path / "random", family="mixtral", seed=5)
    table, report = build_table(model, tmp_path)
    assert 0.0 <= report["recall"] < 1.0  # contextual routing: the table only approximates it
    worker = BackgroundWorker(model, routing="lut").start()
    try:
        replies = run_requests(worker, model, table, PROMPTS[:2], 8)
        with grpc.insecure_channel(worker.address) as channel:
            info = worker_pb2_grpc.WorkerServiceStub(channel).Info(wpb.InfoRequest())
            with pytest.raises(grpc.RpcError) as e:  # lut without a plan is refused, naming the field
                worker_pb2_grpc.WorkerServiceStub(channel).Prefill(
                    wpb.PrefillRequest(
                        chunks=[
                            wpb.PrefillChunk(
                                request_id=1, token_ids=[3, 4], is_last=True, sampling=wpb.SamplingParams(top_p=1.0)
                            )
                        ]
                    )
                )
    finally:
        worker.stop()
    assert info.routing == "lut" and all(r.routing == "lut" for r in replies)
    assert not info.plans_with_gaps  # the plan is the routing: k experts every token
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "routing_plan" in e.value.details()


def test_router_refuses_a_table_for_another_model(token_routed, tmp_path):
    _, table, _ = token_routed
    other = make_tiny(tmp_path / "qwen2", family="qwen2_moe", seed=1)  # one MoE layer, not two
    from common.errors import ModelFormatError

    with pytest.raises(ModelFormatError, match="num_layers is 2, expected 1"):
        run_requests(None, other, table, [], 1)


def test_router_refuses_a_table_for_another_model_of_the_same_shape(token_routed, tmp_path):
    """The header recorded only the model's shape: a table built for one mixtral loaded against another."""
    model, table, _ = token_routed
    other = make_tiny(tmp_path / "other", family="mixtral", seed=int(np.random.default_rng().integers(1, 1000)))
    assert ModelDir.open(other, verify=False).config.moe_layers == ModelDir.open(model, verify=False).config.moe_layers
    from common.errors import ModelFormatError

    with pytest.raises(
        ModelFormatError, match=rf"^{re.escape(str(table))}: model digest is sha256:\w+ .*, expected sha256:"
    ):
        run_requests(None, other, table, [], 1)


def test_lut_routing_with_cached_prefixes_equals_uncached(tmp_path):
    """The plan covers the step's tokens, a cached prefix's excluded: outputs equal an uncached run's."""
    model = make_tiny(tmp_path / "random", family="mixtral", seed=5)
    table, _ = build_table(model, tmp_path)
    system = list(range(30, 50))
    prompts = [system + [7, 8], system + [9], system + [10, 11, 12], system + [7, 8]]

    async def run(prefix_caching: bool):
        async with running_router(
            worker.address,
            max_batch_tokens=24,
            model=str(model),
            routing_table=str(table),
            prefix_caching=prefix_caching,
        ) as (router, stub):
            replies = []
            for p in prompts:  # one at a time: each finds the ones before it cached
                replies.append(
                    await stub.Generate(
                        rpb.GenerateRequest(
                            token_ids=rpb.TokenIds(ids=p),
                            parameters=rpb.SamplingParameters(max_new_tokens=6, ignore_eos=True, logprobs=True),
                        )
                    )
                )
            return replies

    worker = BackgroundWorker(model, routing="lut").start()
    try:
        cached, plain = asyncio.run(run(True)), asyncio.run(run(False))
    finally:
        worker.stop()
    assert [r.cached_prompt_tokens for r in cached[1:]] == [20, 20, 20] and cached[0].cached_prompt_tokens == 0
    assert [list(r.token_ids) for r in cached] == [list(r.token_ids) for r in plain]
    for a, b in zip(cached, plain):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)
