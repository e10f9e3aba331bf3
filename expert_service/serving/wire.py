"""The worker's wire: protobuf messages in, the engine's plain types out, and back. Nothing below the serving
package sees a protobuf message.

Requests are checked against the worker's limits before their arrays are built (a hostile step costs no
conversion), and every id list travels packed (uint64 little-endian bytes), so a decode step converts no
message per sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from common.errors import InvalidRequestError
from common.pb import worker_pb2 as pb
from common.routing_plan import RoutingPlan
from common.tensors import from_pb as array_from_pb
from expert_service.engine.engine import PrefillInput, SequenceOutput, StepResult
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from expert_service.engine.token_masks import mask_words
from expert_service.experts.cache import CacheStats
from expert_service.experts.slots import SlotPlan
from expert_service.serving.step_stream import MAX_FREE_IDS, StepLimits, StepRequest

NO_TOKEN = -1  # token_ids of a stream answer: this sequence sampled nothing this step


# --- requests -----------------------------------------------------------------------------------
def sampling_params(p: pb.SamplingParams) -> SamplingParams:
    """The message's settings (top_p 0 reads as 1, off; an unset repetition penalty as 1), checked as any others."""
    _checked_bias(p)
    penalties = PenaltyParams(
        p.repetition_penalty if p.HasField("repetition_penalty") else 1.0, p.presence_penalty, p.frequency_penalty
    )
    return SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p or 1.0,
        seed=p.seed,
        stop_token_ids=tuple(p.stop_token_ids),
        min_new_tokens=p.min_new_tokens,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        penalties=penalties,
        min_p=p.min_p,
        logit_bias=tuple(sorted(p.logit_bias.items())),  # sorted: equal maps give equal params
        constrained=p.constrained,
    )


def _checked_bias(p: pb.SamplingParams) -> None:
    # a hostile map is refused before it is copied into a tuple (SamplingParams checks the same bound)
    if len(p.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError("logit_bias", f"{len(p.logit_bias)} entries, at most {MAX_LOGIT_BIAS_ENTRIES}")


def prefill_input(chunk: pb.PrefillChunk) -> PrefillInput:
    return PrefillInput(
        chunk.request_id,
        np.fromiter(chunk.token_ids, dtype=np.int64, count=len(chunk.token_ids)),
        sampling_params(chunk.sampling) if chunk.HasField("sampling") else None,
        chunk.is_last,
        tuple(chunk.prefix_block_ids),
        tuple(chunk.cache_block_ids),
        tuple(chunk.prefix_token_ids),
        chunk.start_position,
    )


def routing_plan(message: pb.RoutingPlan, moe_layers: Sequence[int]) -> RoutingPlan | None:
    """The plan a message carries (None when it names no layer); its shapes are checked here, its CSR contents
    when the engine reads its expert ids."""
    layers = [int(layer) for layer in message.layers]
    if not layers:
        return None
    if layers != list(moe_layers):
        raise InvalidRequestError("routing_plan.layers", f"must be the MoE layers {list(moe_layers)}, got {layers}")
    offsets = array_from_pb(message.offsets, "routing_plan.offsets", "int32")
    tokens = array_from_pb(message.token_indices, "routing_plan.token_indices", "int32")
    if offsets.ndim != 2 or tokens.ndim != 2 or offsets.shape[0] != len(layers) or tokens.shape[0] != len(layers):
        raise InvalidRequestError(
            "routing_plan",
            f"offsets {list(offsets.shape)} and token_indices "
            f"{list(tokens.shape)} need one row per layer ({len(layers)})",
        )
    return RoutingPlan(tuple(layers), offsets, tokens)


def _packed_ids(data: bytes, field: str) -> np.ndarray:
    if len(data) % 8:
        raise InvalidRequestError(field, f"{len(data)} bytes is not a whole number of uint64 ids")
    return np.frombuffer(data, dtype="<u8")


def _plan_of(request, limits: StepLimits) -> RoutingPlan | None:
    return routing_plan(request.routing_plan, limits.moe_layers) if request.HasField("routing_plan") else None


def token_masks(
    ids_bytes: bytes, masks_bytes: bytes, limits: StepLimits, names=("mask_request_ids", "token_masks")
) -> dict[int, np.ndarray] | None:
    """request id -> mask words of a message's packed masks (None: none); shapes checked here, contents by the
    engine. names: the message's fields (the on-time pair, or the late one)."""
    if not ids_bytes and not masks_bytes:  # most steps: nothing constrained
        return None
    ids = _packed_ids(ids_bytes, names[0])
    if len(ids) > limits.max_batch_size:
        raise InvalidRequestError(names[0], f"{len(ids)} ids, at most max_batch_size {limits.max_batch_size}")
    words = mask_words(limits.vocab_size)
    if len(masks_bytes) != len(ids) * words * 4:
        raise InvalidRequestError(
            names[1], f"{len(masks_bytes)} bytes for {len(ids)} masks of {words} uint32 words each"
        )
    masks = np.frombuffer(masks_bytes, "<u4").reshape(len(ids), words).astype(np.uint32)
    by_id = {int(rid): masks[i] for i, rid in enumerate(ids)}
    if len(by_id) != len(ids):
        raise InvalidRequestError(names[0], "a sequence is named twice")
    return by_id


LATE_MASK_FIELDS = ("late_mask_request_ids", "late_token_masks")


def step_request(request: pb.StepStreamRequest, limits: StepLimits) -> StepRequest:
    """A step of the step stream: frees, then prompt chunks, then decodes."""
    frees = _packed_ids(request.free_request_ids, "free_request_ids")
    decodes = _packed_ids(request.decode_request_ids, "decode_request_ids")
    evictions = _packed_ids(request.evict_block_ids, "evict_block_ids")
    sequence_blocks = _packed_ids(request.cache_sequence_blocks, "cache_sequence_blocks")
    if len(sequence_blocks) % 3:
        raise InvalidRequestError(
            "cache_sequence_blocks", f"{len(sequence_blocks)} ids is not a whole number of triples"
        )
    limits.check(request.chunks, len(decodes), len(frees), len(evictions) + len(sequence_blocks) // 3)
    return StepRequest(
        request.step_id,
        frees,
        [prefill_input(c) for c in request.chunks],
        decodes,
        _plan_of(request, limits),
        evict_ids=evictions,
        sequence_blocks=sequence_blocks.reshape(-1, 3),
        masks=token_masks(request.mask_request_ids, request.token_masks, limits),
        late_masks=token_masks(request.late_mask_request_ids, request.late_token_masks, limits, LATE_MASK_FIELDS),
    )


def refused_step_request(request: pb.StepStreamRequest, limits: StepLimits, reason: str) -> StepRequest:
    """A message refused before it became a step (`reason`): its frees and evictions still run, since the router
    counts them as done whatever the answer. Either list is dropped only when it is malformed itself."""
    return StepRequest(
        request.step_id,
        _bookkeeping_ids(request.free_request_ids, "free_request_ids", MAX_FREE_IDS),
        [],
        np.zeros(0, "<u8"),
        None,
        evict_ids=_bookkeeping_ids(request.evict_block_ids, "evict_block_ids", limits.max_block_ids),
        refusal=reason,
    )


def _bookkeeping_ids(data: bytes, field: str, most: int) -> np.ndarray:
    """The field's ids as step_request reads them, or none when they are malformed themselves."""
    try:
        ids = _packed_ids(data, field)
    except InvalidRequestError:
        return np.zeros(0, "<u8")
    return ids if len(ids) <= most else np.zeros(0, "<u8")


def unary_step_request(request: pb.PrefillRequest | pb.DecodeRequest, limits: StepLimits) -> StepRequest:
    """A unary Prefill (chunks, decodes riding along) or Decode call as a step."""
    if isinstance(request, pb.PrefillRequest):
        chunks, decodes = request.chunks, request.decode_request_ids
    else:
        chunks, decodes = (), request.request_ids
    limits.check(chunks, len(decodes), 0)
    if any(c.sampling.constrained for c in chunks):  # the unary calls carry no token masks
        raise InvalidRequestError("sampling.constrained", "constrained sequences run on the step stream only")
    for field in ("cache_block_ids", "prefix_block_ids"):  # nothing could evict blocks cached by a unary call
        if any(getattr(c, field) for c in chunks):
            raise InvalidRequestError(field, "prefix caching runs on the step stream only")
    return StepRequest(
        0,
        np.zeros(0, "<u8"),
        [prefill_input(c) for c in chunks],
        np.fromiter(decodes, "<u8", len(decodes)),
        _plan_of(request, limits),
    )


# --- answers ------------------------------------------------------------------------------------
def cache_stats(stats: CacheStats) -> pb.ExpertCacheStats:
    return pb.ExpertCacheStats(
        hits=stats.hits,
        misses=stats.misses,
        bytes_copied=stats.bytes_copied,
        prefetches_issued=stats.prefetches_issued,
        prefetches_used=stats.prefetches_used,
        stall_ms=stats.stall_seconds * 1e3,
    )


def slot_plan(plan: SlotPlan, policy: str, prefetch_sources: Iterable[str]) -> pb.ExpertSlotPlan:
    """`Info.expert_slots`, with the cache's replacement policy and prefetch sources ("plan,lookahead"; "none"
    when there is none)."""
    return pb.ExpertSlotPlan(
        slots_per_layer=plan.slots_per_layer,
        num_experts=plan.num_experts,
        num_moe_layers=plan.num_moe_layers,
        expert_block_bytes=plan.expert_block_bytes,
        budget_bytes=plan.budget_bytes,
        cached=plan.is_cached,
        policy=policy,
        prefetch=",".join(sorted(prefetch_sources, reverse=True)) or "none",
    )


def scored(output: SequenceOutput) -> pb.SequenceLogprobs | None:
    """The sequence's sampled and prompt log-probabilities (None: it asked for neither)."""
    if output.top is None and output.prompt is None:
        return None
    message = pb.SequenceLogprobs(request_id=output.request_id)
    for name, value in (("sampled", output.top), ("prompt", output.prompt)):
        if value is not None:
            getattr(message, name).CopyFrom(
                pb.TokenLogprobs(
                    top_k=value.top_ids.shape[1],
                    logprobs=value.logprobs.astype("<f4").tobytes(),
                    top_ids=value.top_ids.astype("<i4").tobytes(),
                    top_logprobs=value.top_logprobs.astype("<f4").tobytes(),
                )
            )
    return message


def _step_extras(response, result: StepResult) -> None:
    if result.routing_plan_recall is not None:
        response.routing_plan_recall = result.routing_plan_recall
    if result.expert_cache is not None:
        response.expert_cache.CopyFrom(cache_stats(result.expert_cache))


def unary_response(
    result: StepResult, message: type[pb.PrefillResponse | pb.DecodeResponse], kv_blocks_used: int, total_ms: float
) -> pb.PrefillResponse | pb.DecodeResponse:
    """The step's answer as a unary Prefill or Decode `message` (the two have the same fields); `total_ms` is the
    worker's whole time on it."""
    response = message(
        generations=[
            pb.Generation(
                request_id=o.request_id,
                has_token=o.token_id is not None,
                token_id=o.token_id or 0,
                logprob=o.logprob,
                error=o.error,
                scored=scored(o),
            )
            for o in result.outputs
        ],
        timings=pb.StepTimings(forward_ms=result.forward_ms, sample_ms=result.sample_ms, total_ms=total_ms),
        kv_blocks_used=kv_blocks_used,
    )
    _step_extras(response, result)
    return response


def stream_response(result: StepResult, step_id: int, kv_blocks_used: int, total_ms: float) -> pb.StepStreamResponse:
    """The step's answer on the step stream: packed arrays instead of one message per sequence."""
    outputs = result.outputs
    response = pb.StepStreamResponse(
        step_id=step_id,
        request_ids=np.fromiter((o.request_id for o in outputs), np.uint64, len(outputs)).tobytes(),
        token_ids=np.fromiter(
            (NO_TOKEN if o.token_id is None else o.token_id for o in outputs), np.int32, len(outputs)
        ).tobytes(),
        errors=[pb.SequenceError(request_id=o.request_id, code=o.error) for o in outputs if o.error],
        timings=pb.StepTimings(forward_ms=result.forward_ms, sample_ms=result.sample_ms, total_ms=total_ms),
        kv_blocks_used=kv_blocks_used,
    )
    if any(o.logprob for o in outputs):
        response.logprobs = np.fromiter((o.logprob for o in outputs), np.float32, len(outputs)).tobytes()
    response.scored.extend(message for message in map(scored, outputs) if message is not None)
    _step_extras(response, result)
    return response


def refused_response(step_id: int, reason: str, kv_blocks_used: int, total_ms: float) -> pb.StepStreamResponse:
    """A stream step that ran nothing: refused whole (`reason`), or only frees ("")."""
    return pb.StepStreamResponse(
        step_id=step_id, step_error=reason, kv_blocks_used=kv_blocks_used, timings=pb.StepTimings(total_ms=total_ms)
    )
