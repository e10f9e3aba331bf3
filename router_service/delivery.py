"""What one worker output means for its request: the Delta its client receives (token, text, log-probabilities,
finish reason), or the error that ends it. The grammar consumes the token here, and the detokenizer and the stop
sequences see it, in the order the client must observe them."""

from __future__ import annotations

import logging
import time

from common.errors import InvalidRequestError
from router_service.constraints import GrammarError
from router_service.errors import GenerationFailed, RouterError, Unavailable
from router_service.logprobs import prompt_logprobs
from router_service.request_state import Delta, RequestState
from router_service.scheduler import FinishReason

log = logging.getLogger("colibri.router.batching_loop")


def output_delta(state: RequestState, out, on_token) -> Delta | RouterError | InvalidRequestError:
    """The Delta of `out` (a wire RequestOutput) for `state`'s client, or the error its request ends with.
    Advances the request's grammar, detokenizer, stop matcher and token counters; `on_token(state, now)` (the
    metrics hook) sees the request before its token counts."""
    if out.error == "DRAINING":  # the worker is shutting down and took no new sequence: safe to retry
        return Unavailable("the worker is shutting down; retry", reason="DRAINING")
    if out.error:
        return GenerationFailed(f"generation failed on the worker: {out.error}", reason=out.error)
    reason = out.finish_reason
    if state.matcher is not None:
        try:
            if state.grammar_error:
                raise GrammarError(state.grammar_error)
            state.matcher.consume(out.token_id)
        except GrammarError as e:
            if e.outside_mask:
                log.error("constraint failed for request %s: %s", state.request_id, e)
                return GenerationFailed(f"constrained decoding failed: {e}", reason="CONSTRAINT")
            # the grammar outgrew llguidance's limits (constraints.LIMITS) mid-output: the client's
            log.warning("constraint failed for request %s: %s", state.request_id, e)
            return InvalidRequestError("parameters.constraint", f"failed after {state.num_generated} tokens: {e}")
        if reason is None and state.matcher.is_stopped:  # complete: the grammar allows nothing more
            reason = FinishReason.CONSTRAINT
    now = time.monotonic()
    on_token(state, now)
    state.last_token_at = now
    state.num_generated += 1
    text = ""
    if state.detokenizer is not None:
        text, stopped = state.stops.push(state.detokenizer.step(out.token_id))
        if not stopped and reason is not None:
            tail, stopped = state.stops.push(state.detokenizer.flush())
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
