"""What one worker output means for its request: the Delta its client receives (token, text, log-probabilities,
finish reason), or the error that ends it. The grammar consumes the token here, and the detokenizer and the stop
sequences see it, in the order the client must observe them."""

from __future__ import annotations

import logging
import time

from common.errors import InvalidRequestError
from common.rate_limited_log import RateLimitedLog
from router_service.constraints import GrammarError
from router_service.errors import GenerationFailed, RouterError, Unavailable
from router_service.logprobs import prompt_logprobs
from router_service.request_state import Delta, RequestState
from router_service.scheduler import FinishReason

log = logging.getLogger("colibri.router.batching_loop")
GRAMMAR_LIMITS_LOG = RateLimitedLog(log)


def advance_grammar(state: RequestState, out) -> GenerationFailed | InvalidRequestError | None:
    """Consumes `out`'s token (a wire RequestOutput without an error) in `state`'s grammar, if it has one; the
    error the request ends with, or None. The batching loop does this ahead of the rest of the delivery for
    requests whose next grammar mask it must send at once."""
    if state.matcher is None:
        return None
    try:
        if state.grammar_error:
            raise GrammarError(state.grammar_error)
        state.matcher.consume(out.token_id)
    except GrammarError as e:
        # e names the sampled token (and llguidance's view of the client's grammar): only the client's own
        # answer may carry it; the log gets counts.
        if e.outside_mask:
            log.error(
                "constrained decoding failed: the sampled token was outside the grammar's mask, after %d tokens",
                state.num_generated,
                extra={"request_id": state.request_id},
            )
            return GenerationFailed(
                "constrained decoding failed: a sampled token was outside the mask", reason="CONSTRAINT"
            )
        # the grammar outgrew llguidance's limits (constraints.LIMITS) mid-output: the client's doing, and any
        # client can repeat it
        GRAMMAR_LIMITS_LOG.warning(
            "a request's grammar failed after %d tokens (request %s)", state.num_generated, state.request_id
        )
        return InvalidRequestError("parameters.constraint", f"failed after {state.num_generated} tokens: {e}")
    return None


def output_delta(
    state: RequestState, out, on_token, grammar_advanced: bool = False
) -> Delta | RouterError | InvalidRequestError:
    """The Delta of `out` (a wire RequestOutput) for `state`'s client, or the error its request ends with.
    Advances the request's grammar (unless `grammar_advanced`: advance_grammar ran), detokenizer, stop matcher
    and token counters; `on_token(state, now)` (the metrics hook) sees the request before its token counts."""
    if out.error == "DRAINING":  # the worker is shutting down and took no new sequence: safe to retry
        return Unavailable("the worker is shutting down; retry", reason="DRAINING")
    if out.error:
        return GenerationFailed(f"generation failed on the worker: {out.error}", reason=out.error)
    reason = out.finish_reason
    if state.matcher is not None:
        error = None if grammar_advanced else advance_grammar(state, out)
        if error is not None:
            return error
        if reason is None and state.matcher.is_stopped:  # complete: the grammar allows nothing more
            reason = FinishReason.CONSTRAINT
    now = time.monotonic()
    on_token(state, now)
    state.last_token_at = now
    state.num_generated += 1
    text = ""
    if state.detokenizer is not None:
        # As EOS and the stop ids, stop sequences count only from min_new_tokens on.
        armed = state.num_generated >= state.req.min_new_tokens
        text, stopped = state.stops.push(state.detokenizer.step(out.token_id), armed)
        if not stopped and reason is not None:
            tail, stopped = state.stops.push(state.detokenizer.flush(), armed)
            text += tail + state.stops.flush()
        if stopped:
            reason = FinishReason.STOP_SEQUENCE
    logprobs = [out.logprob] if state.req.logprobs and out.logprob is not None else []
    top = out.top.tops() if out.top is not None and state.req.top_logprobs else []
    prompt = (
        prompt_logprobs(state.req.prompt_ids, out.prompt)
        if out.prompt is not None and state.req.prompt_logprobs is not None
        else None
    )
    return Delta([out.token_id], text, logprobs, reason, top, prompt)


def split_for_late_masks(outputs, requests, late_masks_due: bool):
    """A step's outputs (wire RequestOutputs) as (deliver now, deliver after the next send: each (output, its
    grammar advanced)), and (sequence, error) of the requests failing now. With late masks due, the next message
    carries grammar masks computed from these tokens: every constrained request takes its token into its grammar
    now, and the rest of the delivery (detokenizing, stops, the client's queue) waits for that send. Outputs that
    end their request (a worker error, a finish, a completed grammar) are delivered now, so the next message
    frees the request instead of asking its mask: the worker released a failed sequence already and refuses a
    whole message with a late mask for it. Without late masks everything is now."""
    now: list[tuple[object, bool]] = []
    later: list[tuple[object, bool]] = []
    failed: list[tuple[int, RouterError | InvalidRequestError]] = []
    for out in outputs:
        state = requests.get(out.request_id)
        if not late_masks_due or state is None or out.error:
            now.append((out, False))
        elif state.matcher is None:
            (now if out.finish_reason is not None else later).append((out, False))
        elif (error := advance_grammar(state, out)) is not None:
            failed.append((state.seq_id, error))
        elif out.finish_reason is not None or state.matcher.is_stopped:
            now.append((out, True))
        else:
            later.append((out, True))
    return now, later, failed
