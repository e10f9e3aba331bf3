"""What the worker fuzz tests share: message strategies (random and structurally wrong), the outcome checks,
and a log watcher. Imported by test_worker_fuzz.py and test_worker_soak.py."""

from __future__ import annotations

import logging
import threading

import grpc
import numpy as np
from hypothesis import strategies as st

from common.pb import worker_pb2 as pb
from expert_service.tools.tiny_model import VOCAB_SIZE
from tests.helpers import grpc_poller_of_a_closed_loop

SERVICE = "/colibri.worker.v1.WorkerService/"
UNARY_METHODS = ("Info", "Warmup", "Prefill", "Decode", "FilterBatch", "ClearCache", "Health")
# A request may fail for itself alone with these; anything else (INTERNAL, UNKNOWN, ...) is a finding.
ALLOWED_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
MAX_DETAILS = 400

# --- strategies -----------------------------------------------------------------------------------------------
request_ids = st.one_of(st.integers(0, 6), st.integers(0, 2**64 - 1))
token_ids = st.one_of(st.integers(0, VOCAB_SIZE + 1), st.integers(0, 2**32 - 1))
# Settings a step accepts (the edges of each range and the smallest positive floats included), so the
# sampler runs; and anything each field can hold.
plausible_sampling = st.builds(
    pb.SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1e-45, 1e-38, 1e-5, 3.4e38]),
    top_k=st.sampled_from([0, 1, 3, VOCAB_SIZE, 2**32 - 1]),
    top_p=st.sampled_from([0.0, 0.9, 1.0, 1e-45]),
    seed=st.integers(0, 2**64 - 1),
    min_new_tokens=st.integers(0, 4),
    logprobs=st.booleans(),
    stop_token_ids=st.lists(st.one_of(st.integers(VOCAB_SIZE - 2, VOCAB_SIZE + 2), token_ids), max_size=6),
    top_logprobs=st.sampled_from([0, 1, 20, 21]),
    prompt_logprobs=st.sampled_from([None, 0, 3, 20, 21]),
    repetition_penalty=st.sampled_from([None, 1e-38, 0.5, 1.0, 2.0, 3.4e38, 0.0]),
    presence_penalty=st.sampled_from([-2.0, 0.0, 2.0, 2.5]),
    frequency_penalty=st.sampled_from([-2.0, 0.0, 1.5]),
)
wild_sampling = st.builds(
    pb.SamplingParams,
    temperature=st.floats(width=32),
    top_k=st.integers(0, 2**32 - 1),
    top_p=st.floats(width=32),
    seed=st.integers(0, 2**64 - 1),
    stop_token_ids=st.lists(token_ids, max_size=6),
    min_new_tokens=st.integers(0, 2**32 - 1),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 2**32 - 1),
    prompt_logprobs=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    repetition_penalty=st.one_of(st.none(), st.floats(width=32)),
    presence_penalty=st.floats(width=32),
    frequency_penalty=st.floats(width=32),
)
sampling = st.one_of(plausible_sampling, wild_sampling)
dims = st.one_of(st.integers(-1, 12), st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, -(2**63)]))
tensors = st.builds(
    pb.Tensor,
    data=st.binary(max_size=96),
    dtype=st.sampled_from(["int32", "int64", "uint16", "float32", "", "int8", "bogus"]),
    shape=st.lists(dims, max_size=5),
)


@st.composite
def shaped_plans(draw) -> pb.RoutingPlan:
    """A plan with the right layers and plausible CSR shapes whose contents may still be wrong: tokens
    counted twice or not at all, a k other than the model's, an expert twice for one token."""
    tokens = draw(st.integers(0, 6))
    k = draw(st.integers(1, 3))
    rows = []
    for _ in range(2):
        experts = draw(st.lists(st.integers(0, 3), min_size=tokens * k, max_size=tokens * k))
        order = np.argsort(experts, kind="stable")
        offsets = np.zeros(5, np.int32)
        np.cumsum(np.bincount(np.asarray(experts, np.int64), minlength=4)[:4], out=offsets[1:])
        rows.append((offsets, (order // k).astype(np.int32)))
    offsets = np.stack([r[0] for r in rows])
    indices = np.stack([r[1] for r in rows]).reshape(2, tokens * k)
    if draw(st.booleans()):
        indices = np.asarray(
            draw(st.lists(st.integers(-1, 8), min_size=indices.size, max_size=indices.size)), np.int32
        ).reshape(indices.shape)
    return pb.RoutingPlan(
        layers=[0, 1],
        offsets=pb.Tensor(data=offsets.tobytes(), dtype="int32", shape=[2, 5]),
        token_indices=pb.Tensor(data=indices.tobytes(), dtype="int32", shape=list(indices.shape)),
    )


layers = st.one_of(st.just([0, 1]), st.lists(st.integers(0, 2**32 - 1), max_size=3))
plans = st.one_of(shaped_plans(), st.builds(pb.RoutingPlan, layers=layers, offsets=tensors, token_indices=tensors))
# Half of the chunks start a sequence that runs (ids in the vocabulary, plausible sampling), so sampling and
# the KV cache are exercised; the others carry anything.
plausible_chunks = st.builds(
    pb.PrefillChunk,
    request_id=request_ids,
    is_last=st.just(True),
    token_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=10),
    sampling=plausible_sampling,
)
chunks = st.one_of(
    plausible_chunks,
    st.builds(
        pb.PrefillChunk,
        request_id=request_ids,
        is_last=st.booleans(),
        token_ids=st.lists(token_ids, max_size=10),
        sampling=st.one_of(st.none(), sampling),
    ),
)
chunk_lists = st.one_of(st.lists(plausible_chunks, max_size=3), st.lists(chunks, max_size=4))


def _with_plan(message_strategy, **fields):
    return st.builds(
        lambda m, plan: (m.routing_plan.CopyFrom(plan) if plan is not None else None) or m,
        st.builds(message_strategy, **fields),
        st.one_of(st.none(), st.none(), plans),
    )


UNARY_REQUESTS = {
    "Info": st.just(pb.InfoRequest()),
    "Health": st.just(pb.HealthRequest()),
    "ClearCache": st.just(pb.ClearCacheRequest()),
    "Warmup": st.builds(pb.WarmupRequest, max_batch_tokens=st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1))),
    "FilterBatch": st.builds(pb.FilterBatchRequest, keep_request_ids=st.lists(request_ids, max_size=6)),
    "Prefill": _with_plan(pb.PrefillRequest, chunks=chunk_lists, decode_request_ids=st.lists(request_ids, max_size=4)),
    "Decode": _with_plan(pb.DecodeRequest, request_ids=st.lists(request_ids, max_size=6)),
}
# The step RPCs, where the work is, three times as often as the others.
unary_calls = st.sampled_from(sorted(UNARY_REQUESTS) + ["Prefill", "Decode"] * 2).flatmap(
    lambda method: st.tuples(st.just(method), UNARY_REQUESTS[method])
)


def packed_ids(values) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.lists(values, max_size=5).map(lambda ids: np.asarray(ids, "<u8").tobytes()), st.binary(max_size=20)
    )


stream_steps = st.builds(
    lambda step_id, chunks_, decodes, frees, plan, trace: pb.StepStreamRequest(
        step_id=step_id,
        chunks=chunks_,
        decode_request_ids=decodes,
        free_request_ids=frees,
        trace_context=trace,
        **({"routing_plan": plan} if plan is not None else {}),
    ),
    st.integers(0, 2**64 - 1),
    chunk_lists,
    packed_ids(request_ids),
    packed_ids(request_ids),
    st.one_of(st.none(), st.none(), plans),
    st.dictionaries(st.sampled_from(["traceparent", "tracestate", "baggage", "x"]), st.text(max_size=60), max_size=2),
)

# Other methods' messages, or any bytes: what a confused or hostile client puts on the wire.
foreign_bytes = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda m: m.SerializeToString(), st.one_of(*UNARY_REQUESTS.values())),
    st.builds(lambda m: m.SerializeToString(), stream_steps),
    st.binary(min_size=1, max_size=40).map(lambda b: b"\x0a\xff\xff\xff\xff\x0f" + b),  # a length past the end
)


# --- checks ---------------------------------------------------------------------------------------------------
def rpc_error_problem(error: grpc.RpcError) -> str | None:
    """Why an error status is a finding (None: a proper refusal of that call alone)."""
    details = error.details() or ""
    if error.code() not in ALLOWED_CODES:
        return f"{error.code().name}: {details[:200]}"
    if "\n" in details or len(details) > MAX_DETAILS or "Traceback" in details:
        return f"not a one-line error: {details[:200]!r}"
    return None


class LogWatcher(logging.Handler):
    """Collects records that show a fault: any ERROR, or anything logged with a traceback."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.findings: list[str] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if grpc_poller_of_a_closed_loop(record):
            return
        if record.levelno >= logging.ERROR or record.exc_info or "Traceback" in record.getMessage():
            with self._lock:
                self.findings.append(f"{record.name} {record.levelname}: {record.getMessage()[:200]}")

    def take(self) -> list[str]:
        with self._lock:
            found, self.findings = self.findings, []
        return found

    def __enter__(self) -> LogWatcher:
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self)


def kv_problem(engine) -> str | None:
    """Every KV block free exactly once and no sequence left (call once nothing may hold a sequence)."""
    allocator = engine.allocator
    if engine.sequences or allocator.tables:
        return f"left behind: sequences {sorted(engine.sequences)[:5]}, tables {sorted(allocator.tables)[:5]}"
    if sorted(allocator._free) != list(range(allocator.num_blocks)):
        return f"free list is not the whole pool once: {len(allocator._free)} of {allocator.num_blocks}"
    return None
