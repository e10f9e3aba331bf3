"""The expert worker over real gRPC on loopback: steps, freeing, health, reflection, errors."""

import json
import queue
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.model_format import ModelDir
from common.pb import worker_pb2 as pb
from common.pb import worker_pb2_grpc
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import Engine, SequenceOutput, StepResult
from expert_service.engine.step import StepTrace
from expert_service.experts.cache import CacheStats
from expert_service.experts.slots import SlotPlan
from expert_service.serving import wire
from expert_service.serving.step_stream import StepPump
from tests.reflection_client import reflected


@pytest.fixture
def stub(worker):
    channel = grpc.insecure_channel(worker.address)
    yield worker_pb2_grpc.WorkerServiceStub(channel)
    channel.close()


def test_info_describes_model_and_memory_plan(stub, tiny_model):
    info = stub.Info(pb.InfoRequest())
    assert info.family == "mixtral" and info.vocab_size == ModelDir.open(tiny_model).config.vocab_size
    assert info.kv_block_size == 4 and info.num_kv_blocks == 1024 and info.backend == "cpu"
    plan = {m.name: m.bytes for m in info.memory_plan}
    assert set(plan) == {"dense_weights", "expert_weights", "kv_cache", "penalties"}
    assert plan["penalties"] == info.max_batch_size * info.vocab_size * 2  # one uint16 word per slot and token
    assert json.loads(info.hf_config_json)["model_type"] == "mixtral"
    assert list(info.expert_dtypes) == [info.dtype] == ["float32"]  # no approximation: experts as the rest
    assert info.head_dtype == info.attention_dtype == info.dtype  # the head and attention in the dense dtype
    # what a router keeps its steps under, and the watchdog its step deadline must outlast
    assert info.max_message_bytes == 64 * 1024 * 1024 and info.step_timeout_s == 300.0
    assert info.plans_with_gaps  # routing=exact: a gated table's plans, some tokens with fewer than k experts
    assert info.plan_width == 0  # the cpu backend prefetches every prediction of a router's plan


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_info_names_an_8bit_heads_and_attentions_dtypes(tmp_path, tied):
    """An 8-bit LM head and 8-bit attention projections approximate the checkpoint's as 8-bit experts do: Info says
    so beside expert_dtypes."""
    from expert_service.tools.convert import convert
    from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint
    from tests.helpers import BackgroundWorker

    write_head_checkpoint(tmp_path / "hf", head_config("mixtral", tied))
    model = convert(tmp_path / "hf", tmp_path / "m", "float32", False, head_dtype="fp8", attention_dtype="int8")
    worker = BackgroundWorker(model).start()
    try:
        with grpc.insecure_channel(worker.address) as channel:
            info = worker_pb2_grpc.WorkerServiceStub(channel).Info(pb.InfoRequest())
    finally:
        worker.stop()
    assert (info.head_dtype, info.dtype, list(info.expert_dtypes)) == ("float8_e4m3fn", "float32", ["float32"])
    assert info.attention_dtype == "int8"


def test_messages_convert_through_the_types():
    """The servicer is a thin adapter: serving.wire converts messages to the engine's types and back."""
    chunk = wire.prefill_input(
        pb.PrefillChunk(request_id=4, token_ids=[5, 6], is_last=True, sampling=pb.SamplingParams(seed=3))
    )
    assert chunk.request_id == 4 and chunk.token_ids.tolist() == [5, 6] and chunk.sampling.seed == 3
    assert wire.prefill_input(pb.PrefillChunk(request_id=4, token_ids=[5])).sampling is None
    stats = CacheStats(hits=3, misses=1, bytes_copied=64, prefetches_issued=2, prefetches_used=1, stall_seconds=0.25)
    result = StepResult(
        [SequenceOutput(4, 7, -0.5), SequenceOutput(5), SequenceOutput(6, error="NON_FINITE_LOGITS")],
        1.5,
        0.5,
        StepTrace(),
        0.75,
        None,
        stats,
    )
    response = wire.unary_response(result, pb.PrefillResponse, kv_blocks_used=9, total_ms=3.0)
    assert isinstance(response, pb.PrefillResponse)
    assert [(g.request_id, g.has_token, g.token_id, g.error) for g in response.generations] == [
        (4, True, 7, ""),
        (5, False, 0, ""),
        (6, False, 0, "NON_FINITE_LOGITS"),
    ]
    assert response.timings.total_ms == 3.0 and response.kv_blocks_used == 9 and response.routing_plan_recall == 0.75
    assert response.expert_cache.hits == 3 and response.expert_cache.stall_ms == 250.0
    decode = wire.unary_response(StepResult([], 0, 0, StepTrace(), None, None), pb.DecodeResponse, 0, 0)
    assert isinstance(decode, pb.DecodeResponse) and not decode.HasField("routing_plan_recall")
    slots = wire.slot_plan(SlotPlan(2, 8, 3, 4096, 1 << 20), "lru", set())
    assert slots.cached and slots.slots_per_layer == 2 and slots.prefetch == "none" and slots.policy == "lru"


def test_greedy_steps_equal_offline_engine(stub, tiny_model):
    prompt = [5, 17, 42, 99, 3, 250, 7]
    expected, _, _ = build_engine(ModelDir.open(tiny_model), EngineConfig(backend="cpu")).generate(prompt, 8)
    sampling = pb.SamplingParams(temperature=0, top_p=1.0, seed=1)
    first = stub.Prefill(
        pb.PrefillRequest(
            chunks=[pb.PrefillChunk(request_id=11, token_ids=prompt[:4], sampling=sampling, is_last=False)]
        )
    )
    assert not first.generations[0].has_token and first.timings.total_ms > 0
    step = stub.Prefill(pb.PrefillRequest(chunks=[pb.PrefillChunk(request_id=11, token_ids=prompt[4:], is_last=True)]))
    tokens = [step.generations[0].token_id]
    while len(tokens) < 8:
        tokens.append(stub.Decode(pb.DecodeRequest(request_ids=[11])).generations[0].token_id)
    assert tokens == expected
    assert step.kv_blocks_used > 0
    freed = stub.FilterBatch(pb.FilterBatchRequest(keep_request_ids=[]))
    assert list(freed.freed_request_ids) == [11] and freed.kv_blocks_used == 0


def test_prefill_with_decodes_riding_along(stub):
    s = pb.SamplingParams(temperature=0, top_p=1.0)
    a = stub.Prefill(
        pb.PrefillRequest(chunks=[pb.PrefillChunk(request_id=1, token_ids=[1, 2, 3], sampling=s, is_last=True)])
    )
    b = stub.Prefill(
        pb.PrefillRequest(
            chunks=[pb.PrefillChunk(request_id=2, token_ids=[9, 8], sampling=s, is_last=True)], decode_request_ids=[1]
        )
    )
    assert [g.request_id for g in b.generations] == [2, 1] and all(g.has_token for g in b.generations)
    assert a.generations[0].has_token
    assert stub.ClearCache(pb.ClearCacheRequest()).freed_sequences == 2


@pytest.mark.parametrize("field", ["cache_block_ids", "prefix_block_ids"])
def test_the_unary_calls_cannot_cache_blocks_they_could_never_evict(stub, worker, field):
    """The unary calls carry no evictions and never end as a stream does: a block cached through them would stay
    out of the pool (and out of the router's count) until a ClearCache. Refused, the pool stays whole."""
    s = pb.SamplingParams(temperature=0, top_p=1.0)
    warm = pb.PrefillChunk(request_id=6, token_ids=list(range(1, 10)), sampling=s, is_last=True)
    getattr(warm, field).extend([1, 2])
    refused = None
    try:
        stub.Prefill(pb.PrefillRequest(chunks=[warm]))
    except grpc.RpcError as e:
        refused = e
    stub.FilterBatch(pb.FilterBatchRequest())  # frees every sequence the unary calls started
    allocator = worker.engine.allocator
    assert allocator.num_free_blocks == allocator.num_blocks and not allocator.cached
    assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in refused.details() and "step stream" in refused.details()


@pytest.mark.parametrize(
    "request_,code,needle",
    [
        (
            pb.PrefillRequest(chunks=[pb.PrefillChunk(request_id=3, token_ids=[1], is_last=True)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling",
        ),
        (
            pb.PrefillRequest(
                chunks=[
                    pb.PrefillChunk(
                        request_id=3, token_ids=[100000], is_last=True, sampling=pb.SamplingParams(top_p=1.0)
                    )
                ]
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_ids",
        ),
        (
            pb.PrefillRequest(
                chunks=[
                    pb.PrefillChunk(
                        request_id=3, token_ids=[1], is_last=True, sampling=pb.SamplingParams(temperature=-1, top_p=1.0)
                    )
                ]
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
        *[
            (
                pb.PrefillRequest(
                    chunks=[
                        pb.PrefillChunk(
                            request_id=3,
                            token_ids=list(range(1, n + 1)),
                            is_last=True,
                            sampling=pb.SamplingParams(**fields),
                        )
                    ]
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                needle,
            )
            for n, fields, needle in [
                (1, dict(logprobs=True, top_logprobs=21), "top_logprobs: must be in [0, 20]"),
                (1, dict(prompt_logprobs=21), "prompt_logprobs: must be in [0, 20]"),
                (65, dict(prompt_logprobs=0), "prompt_logprobs: 65 prompt tokens to score"),
                (1, dict(repetition_penalty=0.0), "repetition_penalty: must be a finite number > 0"),
                (1, dict(presence_penalty=3.0), "presence_penalty: must be in [-2, 2]"),
                (1, dict(frequency_penalty=float("nan")), "frequency_penalty: must be in [-2, 2]"),
            ]
        ],
    ],
)
def test_bad_steps_are_rejected_and_worker_stays_up(stub, request_, code, needle):
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(request_)
    assert e.value.code() == code and needle in e.value.details()
    unknown = stub.Decode(pb.DecodeRequest(request_ids=[12345])).generations
    assert [(g.request_id, g.has_token, g.error) for g in unknown] == [(12345, False, "UNKNOWN_SEQUENCE")]
    assert stub.Health(pb.HealthRequest()).ready


def _stream_step(step_id, chunks=(), decodes=(), frees=()):
    return pb.StepStreamRequest(
        step_id=step_id,
        chunks=list(chunks),
        decode_request_ids=np.asarray(decodes, "<u8").tobytes(),
        free_request_ids=np.asarray(frees, "<u8").tobytes(),
    )


def _outputs(response):
    errors = {e.request_id: e.code for e in response.errors}
    return [
        (r, t, errors.get(r, ""))
        for r, t in zip(
            np.frombuffer(response.request_ids, "<u8").tolist(), np.frombuffer(response.token_ids, "<i4").tolist()
        )
    ]


def test_step_stream_runs_steps_sent_ahead_and_equals_unary_steps(stub):
    """Steps sent before the previous result arrives decode from the worker's own last token; the tokens
    equal the unary Prefill/Decode path's, and the stream's end frees what it started."""
    s = pb.SamplingParams(temperature=0, top_p=1.0)
    chunk = pb.PrefillChunk(request_id=7, token_ids=[5, 6, 7, 8], sampling=s, is_last=True)
    unary = [stub.Prefill(pb.PrefillRequest(chunks=[chunk])).generations[0].token_id]
    unary += [stub.Decode(pb.DecodeRequest(request_ids=[7])).generations[0].token_id for _ in range(4)]
    stub.ClearCache(pb.ClearCacheRequest())
    requests = [_stream_step(1, chunks=[chunk])] + [_stream_step(i, decodes=[7]) for i in range(2, 6)]
    responses = list(stub.StepStream(iter(requests)))
    assert [r.step_id for r in responses] == [1, 2, 3, 4, 5]
    assert [_outputs(r)[0][1] for r in responses] == unary
    assert stub.ClearCache(pb.ClearCacheRequest()).freed_sequences == 0  # the stream's end freed seq 7


def test_a_streams_end_reaches_the_caller_after_its_sequences_are_freed(stub, monkeypatch):
    """The model thread is slow to finish the stream's last step (its answer is out, the job not yet done) when
    the stream ends and the caller's next call is queued: that call still finds the stream's sequence freed."""
    collect = StepPump._collect

    def slow_collect(self, pending):
        collect(self, pending)
        time.sleep(0.3)

    monkeypatch.setattr(StepPump, "_collect", slow_collect)
    chunk = pb.PrefillChunk(request_id=8, token_ids=[5, 6, 7], sampling=pb.SamplingParams(top_p=1.0), is_last=True)
    responses = list(stub.StepStream(iter([_stream_step(1, chunks=[chunk]), _stream_step(2, decodes=[8])])))
    assert [r.step_id for r in responses] == [1, 2] and not any(r.errors for r in responses)
    assert stub.ClearCache(pb.ClearCacheRequest()).freed_sequences == 0


def test_penalised_scored_sequences_stream_ahead_like_unary_steps(stub):
    """Steps sent ahead count each sampled token on the worker (the router has not seen it yet): tokens, their
    log-probabilities and the scored payloads equal the unary path's."""
    s = pb.SamplingParams(
        temperature=0,
        top_p=1.0,
        logprobs=True,
        top_logprobs=3,
        prompt_logprobs=2,
        repetition_penalty=1.5,
        presence_penalty=1.0,
        frequency_penalty=1.0,
    )
    chunk = pb.PrefillChunk(request_id=9, token_ids=[5, 6, 5, 8, 5], sampling=s, is_last=True)
    unary = [stub.Prefill(pb.PrefillRequest(chunks=[chunk])).generations[0]]
    unary += [stub.Decode(pb.DecodeRequest(request_ids=[9])).generations[0] for _ in range(6)]
    stub.ClearCache(pb.ClearCacheRequest())
    responses = list(
        stub.StepStream(iter([_stream_step(1, chunks=[chunk])] + [_stream_step(i, decodes=[9]) for i in range(2, 8)]))
    )
    assert [_outputs(r)[0][1] for r in responses] == [g.token_id for g in unary]
    assert [np.frombuffer(r.logprobs, "<f4")[0] for r in responses] == [np.float32(g.logprob) for g in unary]
    assert [r.scored[0] for r in responses] == [g.scored for g in unary]
    first = unary[0].scored
    assert first.HasField("prompt") and len(np.frombuffer(first.prompt.logprobs, "<f4")) == 5
    assert all(g.scored.sampled.top_k == 3 and not g.scored.HasField("prompt") for g in unary[1:])
    plain = pb.PrefillChunk(
        request_id=9, token_ids=[5, 6, 5, 8, 5], sampling=pb.SamplingParams(top_p=1.0), is_last=True
    )
    tokens = [stub.Prefill(pb.PrefillRequest(chunks=[plain])).generations[0].token_id]
    tokens += [stub.Decode(pb.DecodeRequest(request_ids=[9])).generations[0].token_id for _ in range(6)]
    stub.ClearCache(pb.ClearCacheRequest())
    assert tokens != [g.token_id for g in unary]  # the penalties changed the output


def test_step_stream_failures_stay_with_their_sequence_or_step(stub):
    s = pb.SamplingParams(temperature=0, top_p=1.0)
    good = pb.PrefillChunk(request_id=1, token_ids=[3, 4], sampling=s, is_last=True)
    requests = [
        _stream_step(1, chunks=[good]),
        _stream_step(2, decodes=[1, 999]),  # 999 never started
        pb.StepStreamRequest(step_id=3, decode_request_ids=b"\x01\x02\x03"),  # not whole uint64s
        _stream_step(4, chunks=[pb.PrefillChunk(request_id=2, token_ids=[10**6], sampling=s, is_last=True)]),
        _stream_step(5, decodes=[1], frees=[1]),  # freed first, then unknown
        _stream_step(6, chunks=[pb.PrefillChunk(request_id=3, token_ids=[1], sampling=s, is_last=True)]),
    ]
    r = list(stub.StepStream(iter(requests)))
    assert _outputs(r[0])[0][1] >= 0
    assert [(rid, err) for rid, _, err in _outputs(r[1])] == [(1, ""), (999, "UNKNOWN_SEQUENCE")]
    assert "decode_request_ids" in r[2].step_error and "token_ids" in r[3].step_error
    assert _outputs(r[4]) == [(1, -1, "UNKNOWN_SEQUENCE")]
    assert _outputs(r[5])[0][1] >= 0 and not r[5].step_error
    assert stub.Health(pb.HealthRequest()).ready


def test_late_masks_over_the_stream_and_a_malformed_message_that_held_them(stub):
    """A greedy constrained decode sent without its mask takes the next message's late mask; a late-only message
    is answered like a frees-only one; a message refused while parsing fails the row that waited for its late
    masks alone, in order, and the late masks after it are ignored."""
    vocab = stub.Info(pb.InfoRequest()).vocab_size
    rng = np.random.default_rng()
    allowed = [rng.choice(vocab, 3, replace=False) for _ in range(4)]

    def mask(i):
        bits = np.zeros(-(-vocab // 32) * 32, np.uint8)
        bits[allowed[i]] = 1
        return np.packbits(bits, bitorder="little").tobytes()

    def late(step, words):
        ids = np.asarray([1], "<u8").tobytes()
        return pb.StepStreamRequest(step_id=step, late_mask_request_ids=ids, late_token_masks=words)

    s = pb.SamplingParams(constrained=True)
    first = _stream_step(1, chunks=[pb.PrefillChunk(request_id=1, token_ids=[3, 4], sampling=s, is_last=True)])
    first.mask_request_ids, first.token_masks = np.asarray([1], "<u8").tobytes(), mask(0)
    requests = [first, _stream_step(2, decodes=[1]), late(3, mask(1)), _stream_step(4, decodes=[1])]
    requests += [
        late(5, mask(3)[:-1]),
        late(6, mask(3)),
        _stream_step(7, frees=[1]),
    ]
    r = list(stub.StepStream(iter(requests)))
    assert [_outputs(r[i])[0][1] in allowed[i] for i in range(2)] == [True, True]
    assert r[2].step_id == 3 and not r[2].request_ids and not r[2].step_error  # late masks alone: no step
    assert _outputs(r[3]) == [(1, -1, "MISSING_TOKEN_MASK")]
    assert r[4].step_error.startswith("late_token_masks: ") and not r[5].step_error
    assert stub.Health(pb.HealthRequest()).ready


def test_step_stream_cannot_touch_another_streams_sequences(stub):
    s = pb.SamplingParams(temperature=0, top_p=1.0)
    mine = pb.PrefillChunk(request_id=42, token_ids=[1, 2], sampling=s, is_last=True)
    # The owner's steps come from a queue, so it holds sequence 42 for as long as the intruder needs (a fixed
    # list of steps could run out, and the stream's end free 42, before the intruder's first step arrived).
    owner_steps: queue.Queue = queue.Queue()
    owner = stub.StepStream(iter(owner_steps.get, None))
    owner_steps.put(_stream_step(1, chunks=[mine]))
    answers = [next(owner)]
    intruder = list(
        stub.StepStream(
            iter([_stream_step(1, decodes=[42]), _stream_step(2, frees=[42]), _stream_step(3, chunks=[mine])])
        )
    )
    assert _outputs(intruder[0]) == [(42, -1, "FOREIGN_SEQUENCE")]
    assert _outputs(intruder[2]) == [(42, -1, "FOREIGN_SEQUENCE")]
    owner_steps.put(_stream_step(2, decodes=[42]))  # 42 is still the owner's and still steps
    answers.append(next(owner))
    owner_steps.put(None)
    answers += list(owner)
    assert all(not err for r in answers for _, _, err in _outputs(r))  # the owner never noticed
    assert [rid for rid, token, _ in _outputs(answers[1]) if token >= 0] == [42]


def test_standard_health_and_reflection(worker):
    with grpc.insecure_channel(worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "colibri.worker.v1.WorkerService"):
            assert (
                health.Check(health_pb2.HealthCheckRequest(service=service)).status
                == health_pb2.HealthCheckResponse.SERVING
            )
    # Exactly the worker's services: the router's, whose stubs share the process's descriptor pool, are neither
    # listed nor described.
    symbols = ("colibri.worker.v1.WorkerService", "colibri.router.v1.GenerationService")
    listed, described = reflected(worker.address, symbols)
    assert listed == {
        "colibri.worker.v1.WorkerService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert described == {"colibri.worker.v1.WorkerService": True, "colibri.router.v1.GenerationService": False}


def test_worker_fault_fails_the_call_and_exits_non_zero(tiny_model, monkeypatch):
    """An unexpected exception in a step (standing in for a CUDA error): the call gets INTERNAL, health
    turns NOT_SERVING and serve() returns exit code 1."""
    from tests.helpers import BackgroundWorker

    w = BackgroundWorker(tiny_model).start()

    def broken_step(self, *args, **kwargs):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(Engine, "launch", broken_step)
    with grpc.insecure_channel(w.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(
                pb.PrefillRequest(
                    chunks=[
                        pb.PrefillChunk(
                            request_id=1, token_ids=[1, 2], is_last=True, sampling=pb.SamplingParams(top_p=1.0)
                        )
                    ]
                )
            )
        assert e.value.code() == grpc.StatusCode.INTERNAL and "injected device fault" in e.value.details()
    w._thread.join(30)
    assert w.exit_code == 1


def test_worker_cli_rejects_bad_model_dir_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "worker", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3
    assert result.stderr.strip().count("\n") == 0 and "colibri.json" in result.stderr
