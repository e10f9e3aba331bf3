"""A worker restarted (or replaced) with another model than the router's is refused, with one WARNING naming what
differs, while the router answers UNAVAILABLE and keeps retrying; a restart of the same model with other limits
(KV pool, batch caps) is accepted, and requests (constrained ones included) are judged by the new limits."""

import asyncio
import json
import logging
import shutil

import grpc
import pytest

from common.model_identity import ModelDigests
from common.pb import router_pb2 as rpb
from common.pb import router_pb2_grpc, worker_pb2_grpc
from common.pb import worker_pb2 as pb
from router_service.config import RouterConfig
from router_service.constraints import ConstraintCompiler
from router_service.main import start_router
from router_service.validation import ModelLimits
from router_service.worker_identity import ModelCheck
from router_service.worker_info import kept_compiler
from tests.grpc_teardown import stopped
from tests.helpers import BackgroundWorker, byte_ids
from tests.router_service.fake_worker import FakeWorker, ids_request, wait_for


class ModelWorker(FakeWorker):
    """A fake worker whose Info names a model: `changes` overrides InfoResponse fields."""

    def __init__(self, changes=None, **kw):
        super().__init__(**kw)
        self.changes = changes or {}

    async def Info(self, request, context):
        info = await super().Info(request, context)
        for field, value in self.changes.items():
            if field == "eos_token_ids":
                del info.eos_token_ids[:]
                info.eos_token_ids.extend(value)
            else:
                setattr(info, field, value)
        return info


async def _serve(fake: FakeWorker, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def _restart(server: grpc.aio.Server, port: int, fake: FakeWorker) -> grpc.aio.Server:
    """The worker at `port` stops and another process (`fake`) starts there."""
    await server.stop(0)
    for _ in range(50):  # the port may linger a moment
        try:
            return (await _serve(fake, port))[0]
        except RuntimeError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"port {port} did not come free")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("colibri")]


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"vocab_size": 300}, "vocab_size 300"),
        ({"eos_token_ids": [7]}, "eos_token_ids [7]"),
        ({"family": "qwen3_moe"}, 'family "qwen3_moe"'),
        ({"hf_config_json": '{"num_local_experts": 16, "num_experts_per_tok": 2}'}, "config.json num_local_experts 16"),
        ({"tokenizer_digest": "sha256:" + "ab" * 32}, None),  # the first worker reported none: nothing to compare
    ],
)
def test_a_worker_restarted_with_another_model_is_refused_in_one_line(caplog, changes, named):
    async def main():
        server, port = await _serve(FakeWorker())
        config = RouterConfig(host="127.0.0.1", port=0, metrics_port=0, worker_retry_s=0.05)
        router = await start_router(config, f"127.0.0.1:{port}")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
        stub = router_pb2_grpc.GenerationServiceStub(channel)
        try:
            await wait_for(lambda: router.batching_loop.is_worker_ready)
            assert (await stub.Generate(ids_request([5], max_new_tokens=2))).generated_tokens == 2
            replaced = ModelWorker(changes)
            server = await _restart(server, port, replaced)
            await wait_for(lambda: "Info" in replaced.calls)
            await asyncio.sleep(0.5)  # many retries
            if named is None:
                await wait_for(lambda: router.batching_loop.is_worker_ready)
                return
            assert not router.batching_loop.is_worker_ready
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(ids_request([5], max_new_tokens=2))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # the router's model comes back: served again, without another warning
            server = await _restart(server, port, FakeWorker())
            await wait_for(lambda: router.batching_loop.is_worker_ready)
            assert (await stub.Generate(ids_request([5], max_new_tokens=2))).generated_tokens == 2
        finally:
            await channel.close()
            await router.stop(0.1)
            await stopped(server)

    with caplog.at_level(logging.INFO, logger="colibri.router"):
        asyncio.run(main())
    warnings = [w for w in _warnings(caplog) if "another model" in w]
    if named is None:
        assert not warnings, warnings
        return
    assert len(warnings) == 1, _warnings(caplog)
    line = warnings[0]
    assert named in line and "the first worker the router accepted" in line and "127.0.0.1:" in line, line
    assert "\n" not in line and "Traceback" not in line, line


def test_a_restart_with_the_same_model_and_another_pool_serves_constrained_requests_by_the_new_limits(tokenizer):
    """The same model with a KV pool of 8 blocks of 4 tokens (was 256): accepted at once; a constrained request
    past the new capacity is INVALID_ARGUMENT naming it, one within it is served under its constraint."""

    async def main():
        server, port = await _serve(FakeWorker(script=byte_ids("yes")))
        config = RouterConfig(host="127.0.0.1", port=0, metrics_port=0, worker_retry_s=0.05)
        router = await start_router(config, f"127.0.0.1:{port}", tokenizer=tokenizer)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
        stub = router_pb2_grpc.GenerationServiceStub(channel)
        loop = router.batching_loop

        def choice(n: int):
            params = rpb.SamplingParameters(max_new_tokens=n)
            params.constraint.choice.choices.extend(["yes", "no"])
            return rpb.GenerateRequest(text="ab", parameters=params)

        try:
            await wait_for(lambda: loop.is_worker_ready)
            assert (await stub.Generate(choice(100))).text == "yes"
            compiler = loop._constraints
            smaller = FakeWorker(script=byte_ids("yes"), num_blocks=8)
            server = await _restart(server, port, smaller)
            await wait_for(lambda: "ClearCache" in smaller.calls and loop.is_worker_ready)
            assert loop.limits.kv_capacity_tokens == 32 and loop.scheduler.limits.num_kv_blocks == 8
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(choice(100))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "32" in err.value.details()
            assert (await stub.Generate(choice(20))).text == "yes"
            assert loop._constraints is compiler  # same vocabulary and end tokens: its grammars stay compiled
        finally:
            await channel.close()
            await router.stop(0.1)
            await stopped(server)

    asyncio.run(main())


def test_the_constraint_compiler_is_rebuilt_when_the_vocabulary_or_end_tokens_change(tokenizer):
    compiler = ConstraintCompiler(tokenizer.to_json(), 259, (2,))

    def limits(vocab, eos):
        return ModelLimits(vocab_size=vocab, max_sequence_length=64, kv_capacity_tokens=64, eos_token_ids=eos)

    assert kept_compiler(compiler, limits(259, (2,))) is compiler
    assert kept_compiler(compiler, limits(260, (2,))) is None
    assert kept_compiler(compiler, limits(259, (2, 3))) is None
    assert kept_compiler(None, limits(259, (2,))) is None


@pytest.fixture(scope="module")
def other_models(tmp_path_factory, tiny_model):
    """Copies of the tiny model: one of other weights (another seed), one whose tokenizer.json differs."""
    from expert_service.tools.tiny_model import make_tiny

    root = tmp_path_factory.mktemp("other_models")
    reseeded = make_tiny(root / "reseeded", family="mixtral", seed=1)
    retokenized = root / "retokenized"
    shutil.copytree(tiny_model, retokenized)
    tokenizer = retokenized / "tokenizer.json"
    text = tokenizer.read_text()
    assert '"<s>"' in text
    tokenizer.write_text(text.replace('"<s>"', '"<start>"'))
    return reseeded, retokenized


def test_a_real_worker_is_held_to_the_routers_model_directory(tiny_model, other_models):
    """Against real workers: the router's own model directory is accepted, so is one of other weights on the same
    architecture and tokenizer (nothing the router holds depends on them), and a worker whose tokenizer.json
    differs is refused naming it."""
    reseeded, retokenized = other_models
    check = ModelCheck(str(tiny_model))
    for model_dir, named in ((tiny_model, None), (reseeded, None), (retokenized, "tokenizer.json")):
        worker = BackgroundWorker(model_dir).start()
        try:
            channel = grpc.insecure_channel(worker.address)
            info = worker_pb2_grpc.WorkerServiceStub(channel).Info(pb.InfoRequest(), timeout=10)
            channel.close()
        finally:
            worker.stop()
        assert (info.model_digest, info.tokenizer_digest) == (
            ModelDigests.of_dir(model_dir).manifest,
            ModelDigests.of_dir(model_dir).tokenizer,
        )
        problem = check.problem(info)
        if named is None:
            assert problem is None
            continue
        assert problem is not None and named in problem and str(tiny_model) in problem and "\n" not in problem


def test_the_vocabulary_digest_does_not_depend_on_how_merges_are_written(tmp_path):
    """tokenizers 0.20 and later save BPE merges as pairs (["a", "b"]) where earlier ones wrote "a b": a router's copy
    of the tokenizer saved by another version holds the same vocabulary and its worker is not refused for it."""
    from common.model_identity import vocabulary_digest

    tokenizer = {
        "added_tokens": [{"id": 3, "content": "<s>", "special": True}],
        "post_processor": None,
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
    }
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(tokenizer))
    new.write_text(json.dumps({**tokenizer, "model": {**tokenizer["model"], "merges": [["a", "b"]]}}))
    assert vocabulary_digest(old) == vocabulary_digest(new) != ""
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**tokenizer, "model": {**tokenizer["model"], "merges": [["b", "a"]]}}))
    assert vocabulary_digest(other) != vocabulary_digest(old)


def test_config_keys_that_name_the_checkpoint_not_the_model_are_not_compared(tmp_path):
    """A fine-tune (another _name_or_path, transformers_version) or a conversion of the same model's FP8 release
    (quantization_config, torch_dtype) has the router's architecture and tokenizer: served. An architectural key
    that differs is still refused."""
    config = {
        "model_type": "mixtral",
        "num_hidden_layers": 2,
        "_name_or_path": "base",
        "transformers_version": "4.51.0",
    }
    (tmp_path / "colibri.json").write_text(json.dumps({"family": "mixtral", "config": config}))
    check = ModelCheck(str(tmp_path))
    tuned = {
        **config,
        "_name_or_path": "org/tuned",
        "transformers_version": "4.57.1",
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }

    def info(hf_config: dict) -> pb.InfoResponse:
        return pb.InfoResponse(
            family="mixtral", hf_config_json=json.dumps(hf_config), model_digest="sha256:" + "0" * 64
        )

    assert check.problem(info(tuned)) is None
    check.accept(info(tuned))
    assert check.problem(info({**tuned, "transformers_version": "4.58.0"})) is None
    problem = check.problem(info({**tuned, "num_hidden_layers": 3}))
    assert problem is not None and "config.json num_hidden_layers 3" in problem


def test_a_nan_in_the_config_is_the_same_model_on_every_reconnect(tmp_path):
    """json.loads reads NaN (written by json.dumps, as HF configs hold it) as a float that equals nothing, itself
    included: a worker whose config held one was refused on every reconnect, and against its own model directory.
    NaN still differs from a number."""
    config = {"model_type": "mixtral", "router_jitter_noise": float("nan"), "rope_scaling": {"factor": float("nan")}}
    (tmp_path / "colibri.json").write_text(json.dumps({"family": "mixtral", "config": config}))
    check = ModelCheck(str(tmp_path))

    def info(hf_config: dict) -> pb.InfoResponse:
        return pb.InfoResponse(
            family="mixtral", hf_config_json=json.dumps(hf_config), model_digest="sha256:" + "0" * 64
        )

    assert check.problem(info(config)) is None
    check.accept(info(config))
    assert check.problem(info(config)) is None
    problem = check.problem(info({**config, "router_jitter_noise": 0.0}))
    assert problem is not None and "config.json router_jitter_noise 0.0" in problem
    problem = check.problem(info({**config, "rope_scaling": {"factor": 2.0}}))
    assert problem is not None and "config.json rope_scaling" in problem


def test_a_tokenizer_json_nested_past_pythons_stack_is_one_line_naming_it(tmp_path):
    """json.loads raised RecursionError on it: the router (and the worker, computing its digests) stopped at start-up
    with a traceback."""
    from common.errors import ModelFormatError

    depth = 100_000
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": ' + "[" * depth + "]" * depth + "}}")
    with pytest.raises(ModelFormatError) as raised:
        ModelCheck(str(tmp_path))
    message = str(raised.value)
    assert str(tmp_path / "tokenizer.json") in message and "\n" not in message
    with pytest.raises(ModelFormatError):
        ModelDigests.of_dir(tmp_path)


def test_a_config_nested_past_pythons_stack_is_not_compared_rather_than_a_traceback(tmp_path):
    """As an unreadable colibri.json or hf_config_json is: RecursionError escaped the router's start-up (its own
    colibri.json) or the worker's connection attempt (a worker's Info)."""
    depth = 100_000
    deep = "[" * depth + "]" * depth
    (tmp_path / "colibri.json").write_text('{"family": "mixtral", "config": {"x": ' + deep + "}}")
    check = ModelCheck(str(tmp_path))
    info = pb.InfoResponse(family="mixtral", hf_config_json='{"x": ' + deep + "}", model_digest="sha256:" + "0" * 64)
    assert check.problem(info) is None
