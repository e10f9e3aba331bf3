"""The router's side of the worker protocol: the scheduler's plain steps out as protobuf messages, the worker's
answers back as plain outputs. Nothing else in the router builds or reads a worker message.

Id lists travel packed (uint64 little-endian bytes) and a step's answers come back as packed arrays, so a
decode step converts no message per request.
"""

from __future__ import annotations

import numpy as np

from common.pb import worker_pb2 as pb
from common.routing_plan import RoutingPlan
from common.tensors import to_pb as array_to_pb
from router_service.logprobs import Scored
from router_service.scheduler import Chunk, RequestOutput, ScheduledStep
from router_service.validation import ValidatedRequest


# --- to the worker ------------------------------------------------------------------------------
def sampling_params(request: ValidatedRequest, eos_token_ids) -> pb.SamplingParams:
    """The worker's sampling settings; it suppresses the stop ids (EOS unless ignored, then stop_token_ids)
    before min_new_tokens."""
    stop_ids = list(dict.fromkeys([*([] if request.ignore_eos else eos_token_ids), *request.stop_token_ids]))
    params = pb.SamplingParams(
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        seed=request.seed,
        stop_token_ids=stop_ids,
        min_new_tokens=request.min_new_tokens,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        min_p=request.min_p,
        logit_bias=dict(request.logit_bias),
        constrained=request.constraint is not None,
    )
    if request.prompt_logprobs is not None:
        params.prompt_logprobs = request.prompt_logprobs
    if request.repetition_penalty != 1.0:
        params.repetition_penalty = request.repetition_penalty
    return params


def routing_plan(plan: RoutingPlan) -> pb.RoutingPlan:
    return pb.RoutingPlan(
        layers=list(plan.layers), offsets=array_to_pb(plan.offsets), token_indices=array_to_pb(plan.token_indices)
    )


def prefill_chunk(chunk: Chunk) -> pb.PrefillChunk:
    message = pb.PrefillChunk(
        request_id=chunk.request_id, token_ids=chunk.token_ids, is_last=chunk.is_last, start_position=chunk.start
    )
    if chunk.is_first and chunk.sampling is not None:
        message.sampling.CopyFrom(chunk.sampling)
    if chunk.prefix_block_ids:
        message.prefix_block_ids.extend(chunk.prefix_block_ids)
    if chunk.cache_block_ids:
        message.cache_block_ids.extend(chunk.cache_block_ids)
    if chunk.prefix_token_ids:
        message.prefix_token_ids.extend(chunk.prefix_token_ids)
    return message


def step_request(
    step: ScheduledStep,
    step_id: int,
    plan: RoutingPlan | None = None,
    masks: dict[int, bytes] | None = None,
    late_masks: dict[int, bytes] | None = None,
) -> pb.StepStreamRequest:
    """The step on the step stream: frees first, then chunks, then decodes; `masks`: the grammar mask (packed
    uint32 words) of each constrained request sampling in the step whose last token is known; `late_masks`: those
    of the step sent before this one whose input token was still pending then."""
    request = pb.StepStreamRequest(
        step_id=step_id,
        free_request_ids=np.fromiter(step.free_ids, "<u8", len(step.free_ids)).tobytes(),
        chunks=[prefill_chunk(c) for c in step.prefill_chunks],
        decode_request_ids=np.asarray(step.decode_ids, "<u8").tobytes(),
        evict_block_ids=np.asarray(step.evict_block_ids, "<u8").tobytes(),
        cache_sequence_blocks=np.asarray(step.sequence_blocks, "<u8").tobytes(),
    )
    if masks:
        request.mask_request_ids = np.fromiter(masks, "<u8", len(masks)).tobytes()
        request.token_masks = b"".join(masks.values())
    if late_masks:
        request.late_mask_request_ids = np.fromiter(late_masks, "<u8", len(late_masks)).tobytes()
        request.late_token_masks = b"".join(late_masks.values())
    if plan is not None:
        request.routing_plan.CopyFrom(routing_plan(plan))
    return request


# --- from the worker ----------------------------------------------------------------------------
def scored(message: pb.TokenLogprobs) -> Scored:
    logprobs = np.frombuffer(message.logprobs, "<f4")
    n, k = len(logprobs), message.top_k
    top_ids, top_logprobs = np.frombuffer(message.top_ids, "<i4"), np.frombuffer(message.top_logprobs, "<f4")
    if top_ids.size != n * k or top_logprobs.size != n * k:
        raise ValueError(
            f"scored positions: {n} log-probabilities with top_k {k}, but {top_ids.size} ids and "
            f"{top_logprobs.size} top log-probabilities"
        )
    return Scored(logprobs, top_ids.reshape(n, k), top_logprobs.reshape(n, k))


def scored_by_request(messages) -> dict[int, tuple[Scored | None, Scored | None]]:
    """request id -> (sampled token's top tokens, prompt chunk's scores) of a step's SequenceLogprobs."""
    return {
        m.request_id: (
            scored(m.sampled) if m.HasField("sampled") else None,
            scored(m.prompt) if m.HasField("prompt") else None,
        )
        for m in messages
    }


def request_outputs(response: pb.StepStreamResponse) -> list[RequestOutput]:
    """The outputs of one step-stream answer (packed arrays: request ids, token ids with -1 for none)."""
    ids = np.frombuffer(response.request_ids, "<u8").tolist()
    tokens = np.frombuffer(response.token_ids, "<i4").tolist()
    logprobs = np.frombuffer(response.logprobs, "<f4").tolist() if response.logprobs else [0.0] * len(ids)
    if len(tokens) != len(ids) or len(logprobs) != len(ids):
        raise ValueError(
            f"step {response.step_id}: {len(ids)} request ids, {len(tokens)} tokens, {len(logprobs)} logprobs"
        )
    errors = {e.request_id: e.code for e in response.errors}
    scores = scored_by_request(response.scored) if response.scored else {}
    if not errors and not scores:  # the common decode step: one plain output per request
        return [
            RequestOutput(rid, None if token < 0 else token, logprob)
            for rid, token, logprob in zip(ids, tokens, logprobs)
        ]
    none = (None, None)
    return [
        RequestOutput(
            rid,
            None if token < 0 else token,
            logprob,
            error=errors.get(rid, ""),
            top=scores.get(rid, none)[0],
            prompt=scores.get(rid, none)[1],
        )
        for rid, token, logprob in zip(ids, tokens, logprobs)
    ]
