"""The router's answers -> OpenAI's JSON: choices and stream chunk choices, logprobs, usage and the envelope
around them. No I/O here (router_service/http_api.py sends and streams them)."""

from __future__ import annotations

import time

from router_service.frontend import Completion
from router_service.logprobs import PromptLogprob, TokenTexts, Top
from router_service.openai_request import ParsedRequest
from router_service.scheduler import FinishReason
from router_service.tool_replies import finish_reason as tool_finish_reason

FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.CONSTRAINT: "stop",
}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV came from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(reason: FinishReason | None) -> str | None:
    return FINISH_REASONS.get(reason) if reason is not None else None


def logprobs_field(kind: str, texts: TokenTexts, token_ids, logprobs, tops: list[Top], offset: int = 0) -> dict:
    """OpenAI's `logprobs` of a choice (or chunk): chat's `content` list, or completions' parallel lists. `tops`:
    each token's most likely tokens (empty when top log-probabilities were not asked for)."""
    tokens = [texts(i) for i in token_ids]
    if kind == "chat":
        tops = tops or [[] for _ in tokens]
        return {
            "content": [
                {
                    "token": t,
                    "logprob": lp,
                    "bytes": texts.bytes(i),
                    "top_logprobs": [{"token": texts(j), "logprob": v, "bytes": texts.bytes(j)} for j, v in top],
                }
                for i, t, lp, top in zip(token_ids, tokens, logprobs, tops)
            ]
        }
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": [{texts(i): v for i, v in top} for top in tops] if tops else None,
        "text_offset": offsets,
    }


def prompt_logprobs_field(texts: TokenTexts, entries: list[PromptLogprob]) -> list:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the most likely ones (rank: 1-based among those; null for a prompt token
    outside them)."""
    out: list[dict[str, dict[str, object]] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        ranks = {i: r for r, (i, _) in enumerate(e.top, 1)}
        scored: dict[str, dict[str, object]] = {
            str(e.token_id): {"logprob": e.logprob, "rank": ranks.get(e.token_id), "decoded_token": texts(e.token_id)}
        }
        scored.update(
            {str(i): {"logprob": v, "rank": ranks[i], "decoded_token": texts(i)} for i, v in e.top if i != e.token_id}
        )
        out.append(scored)
    return out


def choice(
    kind: str,
    text: str,
    reason,
    logprobs,
    stream: bool,
    first: bool = False,
    tool_calls=(),
    finish=None,
    index: int = 0,
) -> dict:
    """A choice (or chunk choice) at `index`. `tool_calls`: tool_calls.ToolCall (an answer) or ToolCallDelta (a
    chunk); `finish`: the finish_reason when it is not `reason`'s (router_service.tool_replies.finish_reason)."""
    finished = finish or finish_reason(reason)
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finished}
    if stream:
        delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = [tool_call_delta(d) for d in tool_calls]
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finished}
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:  # OpenAI's content is null when the reply is only calls
        message["content"] = text or None
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in tool_calls
        ]
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finished}


def tool_call_delta(piece) -> dict:
    """A streamed piece of a call: the first carries id, type and name, the next only argument fragments."""
    if piece.id:
        return {
            "index": piece.index,
            "id": piece.id,
            "type": "function",
            "function": {"name": piece.name, "arguments": piece.arguments},
        }
    return {"index": piece.index, "function": {"arguments": piece.arguments}}


def envelope(kind: str, request_id: str, model: str, created: int, choices: list, stream: bool) -> dict:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk" if stream else "chat.completion"
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }


def add_prompt_logprobs(body: dict, kind: str, texts: TokenTexts, entries: list[PromptLogprob] | None) -> None:
    """vLLM's placement: in the completion choice, at the top of a chat answer."""
    if entries is not None:
        target = body["choices"][0] if kind == "completion" and body["choices"] else body
        target["prompt_logprobs"] = prompt_logprobs_field(texts, entries)


def response(
    parsed: ParsedRequest,
    request_id: str,
    model: str,
    out: Completion,
    prompt_tokens: int,
    texts: TokenTexts,
    cached_tokens: int = 0,
) -> dict:
    lp = logprobs_field(parsed.kind, texts, out.token_ids, out.logprobs, out.top_logprobs) if parsed.logprobs else None
    body = envelope(
        parsed.kind,
        request_id,
        model,
        int(time.time()),
        [
            choice(
                parsed.kind,
                out.text,
                out.finish_reason,
                lp,
                stream=False,
                tool_calls=out.tool_calls,
                finish=tool_finish_reason(out.finish_reason, out.tool_calls, out.ended_in_call),
            )
        ],
        stream=False,
    )
    if parsed.prompt_logprobs:
        add_prompt_logprobs(body, parsed.kind, texts, out.prompt_logprobs or [])
    body["usage"] = usage(prompt_tokens, len(out.token_ids), cached_tokens)
    return body
