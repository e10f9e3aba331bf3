"""More than one choice on the OpenAI front: `n` samples of a prompt, completions' `best_of`, and prompt lists;
completions' `echo` too, one choice or more (router_service/openai_echo.py).

Each sample is a router request of its own, so everything else (validation, stops, logprobs, cancellation) is the
single-choice path; a prompt is rendered, tokenized and validated once, its samples derived from it (Frontend
`samples`); a chat offering tools reads each choice through a tool-call parser of its own. The samples of
one prompt share its KV blocks through the prefix cache: the first computes the prompt and the others, finding its
blocks claimed, wait for them and prefill only the prompt's last partial block (router_service/prefix_cache.py).
With a seed, sample j of a prompt samples with the seed advanced by j strides (sample 0 keeps it, so n = 1
answers as before), so siblings differ yet every run repeats.

Choices are prompt-major (index = prompt index * n + sample index), as OpenAI orders them. Usage counts each
prompt once (OpenAI's rule) and every generated token, best_of's discarded samples included;
`prompt_tokens_details.cached_tokens` counts, per prompt, the cached tokens of the sample that found the fewest
(the prompt's cost as computed once). best_of ranks its samples by cumulative log-probability (logprobs are
computed for the ranking and returned only when asked for) and cannot be streamed.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from common.errors import InvalidRequestError
from common.pb import router_pb2
from router_service import openai_echo
from router_service.frontend import Completion, collect, set_usage
from router_service.openai_errors import in_prompt_list
from router_service.openai_request import ParsedRequest, generate_request
from router_service.openai_response import (
    add_prompt_logprobs,
    choice,
    envelope,
    logprobs_field,
    prompt_logprobs_field,
    usage,
)
from router_service.openai_stream import Send, stream_events
from router_service.tool_replies import ToolReply, collect_reply, split
from router_service.tool_replies import finish_reason as tool_finish_reason
from router_service.validation import default_max_new_tokens


async def _submit_all(server, parsed: ParsedRequest, request_id: str) -> list[list]:
    """handles[prompt][sample], best_of per prompt (n when best_of is not asked); cancels them all on failure."""
    frontend, handles = server.frontend, []
    params = parsed.parameters
    if parsed.best_of > parsed.n and not params.logprobs:  # the ranking needs them; the answer leaves them out
        params = router_pb2.SamplingParameters()
        params.CopyFrom(parsed.parameters)
        params.logprobs = True
    prompts = parsed.prompts if parsed.kind == "completion" else [None]
    _check_fits(server, parsed, len(prompts))
    try:
        for index in range(len(prompts)):  # each prompt rendered, tokenized and validated once for its samples
            row: list = []
            handles.append(row)  # filled as its samples are submitted: a client gone part-way finds those here
            if parsed.kind == "chat":
                await frontend.submit_chat(
                    parsed.messages, params, request_id, None, parsed.stream, parsed.chat_options,
                    cache_salt=parsed.cache_salt, samples=parsed.best_of, into=row,
                )  # fmt: skip
            else:
                await submit_prompt(frontend, parsed, request_id, index, params, parsed.best_of, row)
    except asyncio.CancelledError:  # the client left: the loop counts the samples it had; none, counted here once
        if not any(handles):
            frontend.batching_loop.hooks.on_rejected("cancelled")
        _cancel(handles)
        raise
    except BaseException:
        _cancel(handles)
        raise
    return handles


async def submit_prompt(
    frontend, parsed: ParsedRequest, request_id: str, index: int = 0, parameters=None, samples: int = 1, into=None
) -> list:
    """Submits prompt `index` of a completion as `samples` requests (`into`: as Frontend.submit's); a 400 about a
    prompt of a list names which (`prompt[2][5]`)."""
    request = generate_request(parsed, request_id, parsed.prompts[index], parameters)
    try:
        return await frontend.submit(request, None, parsed.stream, samples=samples, into=into)
    except InvalidRequestError as e:
        if not parsed.prompt_list:
            raise
        raise in_prompt_list(e, index) from None


def _check_fits(server, parsed: ParsedRequest, num_prompts: int) -> None:
    """Admission reserves each sample's prompt + max_tokens blocks and is first come, first served: choices whose
    outputs alone exceed the KV capacity could never run together, so the request would hold the queue's head
    (every later request waiting behind it) for as long as its samples take one after another. Refused instead, as
    are more samples than the router admits at once (max_concurrent_requests)."""
    samples = num_prompts * parsed.best_of
    if samples == 1:
        return  # a single choice is checked against the capacity with its prompt, as any request
    limits = server.frontend.check_ready()
    capacity, asked = limits.kv_capacity_tokens, parsed.parameters.max_new_tokens
    max_tokens = asked or default_max_new_tokens(server.config, limits)
    tokens_name = parsed.max_tokens_name if asked else f"the default {parsed.max_tokens_name}"
    if parsed.best_of == 1:  # one sample a prompt: the prompt list asks for them all (the client sent no n)
        param, what = "prompt", f"{num_prompts} prompts"
    else:
        param = "best_of" if parsed.best_of > parsed.n else "n"
        what = f"{num_prompts} prompts x {param} {parsed.best_of}" if num_prompts > 1 else f"{param} {parsed.best_of}"
    admitted = server.config.max_concurrent_requests
    if samples > admitted:  # each sample is a request: a 429 here, which clients retry, would come back forever
        raise InvalidRequestError(
            param,
            f"{what} = {samples} samples exceed max_concurrent_requests ({admitted}), the requests the router "
            "admits at once: the choices could never run together; ask for fewer",
        )
    if samples * max_tokens > capacity:
        raise InvalidRequestError(
            param,
            f"{what} x {tokens_name} {max_tokens} = {samples * max_tokens} tokens exceed the KV capacity "
            f"({capacity} tokens): the choices could never run together; ask for fewer",
        )


def _cancel(handles) -> None:
    for row in handles:
        for handle in row:
            handle.cancel()


def _usage(handles, generated: int) -> dict:
    return usage(
        sum(row[0].num_prompt_tokens for row in handles),
        generated,
        sum(min(h.num_cached_tokens for h in row) for row in handles),
    )


def _reply(server, parsed: ParsedRequest) -> ToolReply | None:
    """A fresh tool-call parser for one choice of a chat that offers tools (None otherwise)."""
    return ToolReply.for_request(server.frontend, parsed.chat_options.tools) if parsed.kind == "chat" else None


async def _collect(server, parsed: ParsedRequest, handle) -> Completion:
    reply = _reply(server, parsed)
    return await (collect_reply(handle, reply) if reply is not None else collect(handle))


def makes_chunks(parsed: ParsedRequest, delta, text: str, calls: list, first: bool) -> bool:
    """Whether a delta is worth chunks: text, call pieces, a chat's first chunk (the role), the finish reason, or
    log-probabilities of its tokens. A token whose text is held back (half a character, a possible stop string or
    call tag) makes none."""
    scored = (parsed.logprobs or delta.prompt_logprobs is not None) and bool(delta.token_ids)
    return bool(text or calls or first or delta.finish_reason is not None or scored)


def delta_chunks(
    parsed: ParsedRequest,
    texts,
    echo: str,
    model: str,
    created: int,
    delta,
    text: str,
    calls: list,
    finish,
    lp,
    first: bool,
    index: int = 0,
) -> list[dict]:
    """The stream chunks of one delta of choice `index` (the single choice's and each of n's): `text` and the
    call pieces `calls` its tool-call parser gave (`finish`: the finish reason the calls make), a piece a chunk as
    OpenAI streams them; the text and the prompt's log-probabilities on the first chunk, the finish reason and the
    delta's log-probabilities `lp` on the last. `first`: no chunk of the choice went yet (a chat's carries the
    role)."""
    kind, chunks = parsed.kind, []
    pieces = [[call] for call in calls[:-1]] + [calls[-1:]]
    for n, piece in enumerate(pieces):
        last = n == len(pieces) - 1
        c = choice(
            kind, text if n == 0 else "", delta.finish_reason if last else None, lp if last else None,
            True, first and n == 0, piece, finish if last else None, index,
        )  # fmt: skip
        chunk = envelope(kind, echo, model, created, [c], True)
        if n == 0 and parsed.prompt_logprobs and (kind == "completion" or index == 0):  # a chat's: once, as unary
            add_prompt_logprobs(chunk, kind, texts, delta.prompt_logprobs)
        if parsed.include_usage:
            chunk["usage"] = None
        chunks.append(chunk)
    return chunks


def _best(outs: list[Completion], n: int) -> list[Completion]:
    """The n samples of highest cumulative log-probability, best first (ties: the earlier sample)."""
    order = sorted(range(len(outs)), key=lambda i: (-sum(outs[i].logprobs), i))
    return [outs[i] for i in order[:n]]


async def serve(server, request: web.Request, parsed: ParsedRequest, request_id: str) -> web.StreamResponse:
    """Answers a request of several choices (the caller maps what this raises to OpenAI's errors)."""
    handles = await _submit_all(server, parsed, request_id)
    try:
        echo = handles[0][0].request_id
        if parsed.stream:
            return await _stream(server, request, parsed, handles, echo)
        outs = [await asyncio.gather(*(_collect(server, parsed, h) for h in row)) for row in handles]
        for row, row_outs in zip(handles, outs):
            for handle, out in zip(row, row_outs):
                set_usage(handle, len(out.token_ids), out.finish_reason)
        generated = sum(len(out.token_ids) for row_outs in outs for out in row_outs)
        texts, kind, choices = server.texts(), parsed.kind, list[dict]()
        for prompt, (row, row_outs) in enumerate(zip(handles, outs)):
            for out in _best(row_outs, parsed.n) if parsed.best_of > parsed.n else row_outs:
                lp = (
                    logprobs_field(kind, texts, out.token_ids, out.logprobs, out.top_logprobs)
                    if parsed.logprobs
                    else None
                )
                text = out.text
                if parsed.echo:
                    text = openai_echo.prompt_text(parsed, prompt, texts, row[0]) + text
                    if parsed.logprobs:
                        scored = (out.token_ids, out.logprobs, out.top_logprobs)
                        lp = openai_echo.with_prompt(parsed, texts, out.prompt_logprobs, *scored)
                finish = tool_finish_reason(out.finish_reason, out.tool_calls, out.ended_in_call)
                c = choice(kind, text, out.finish_reason, lp, False, False, out.tool_calls, finish, len(choices))
                if parsed.prompt_logprobs and kind == "completion":
                    c["prompt_logprobs"] = prompt_logprobs_field(texts, out.prompt_logprobs or [])
                choices.append(c)
        body = envelope(kind, echo, server.frontend.model_name, int(time.time()), choices, stream=False)
        if parsed.prompt_logprobs and kind == "chat":
            body["prompt_logprobs"] = prompt_logprobs_field(texts, outs[0][0].prompt_logprobs or [])
        body["usage"] = _usage(handles, generated)
        return web.json_response(body, headers={"X-Request-Id": echo})
    finally:
        _cancel(handles)


async def _stream(server, request: web.Request, parsed: ParsedRequest, handles, echo: str) -> web.StreamResponse:
    """Every choice's deltas as they come, each chunk naming its choice's index."""
    flat = [h for row in handles for h in row]
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle) -> None:
        try:
            async for delta in handle:
                queue.put_nowait((index, delta, None))
        except Exception as e:  # surfaces in the loop below as the stream's error event
            queue.put_nowait((index, None, e))
            return
        queue.put_nowait((index, None, None))

    kind, model, created, texts = parsed.kind, server.frontend.model_name, int(time.time()), server.texts()
    offsets, generated = [0] * len(flat), [0] * len(flat)
    echoed = [False] * len(flat)
    replies = [_reply(server, parsed) for _ in flat]  # a parser per choice: each reply is read on its own

    async def chunks(event: Send) -> None:
        if kind == "chat":  # the SDKs' stream helpers place a choice at the position its first chunk arrives
            for index in range(len(flat)):
                chunk = envelope(
                    kind, echo, model, created, [choice(kind, "", None, None, True, True, (), None, index)], True
                )
                if parsed.include_usage:
                    chunk["usage"] = None
                await event(chunk)
        for _ in range(len(flat)):
            while True:
                index, delta, error = await queue.get()
                if error is not None:
                    raise error
                if delta is None:
                    break
                generated[index] += len(delta.token_ids)
                lp = None
                if parsed.logprobs:
                    lp = logprobs_field(
                        kind, texts, delta.token_ids, delta.logprobs, delta.top_logprobs, offsets[index]
                    )
                offsets[index] += sum(len(texts(i)) for i in delta.token_ids)
                reply = replies[index]
                text, calls = split(reply.feed(delta)) if reply is not None else (delta.text, [])
                if parsed.echo and not echoed[index]:  # the choice's first chunk starts with its prompt
                    echoed[index] = True
                    text = openai_echo.prompt_text(parsed, index // parsed.n, texts, flat[index]) + text
                    if parsed.logprobs:
                        scored = (delta.token_ids, delta.logprobs, delta.top_logprobs)
                        lp = openai_echo.with_prompt(parsed, texts, delta.prompt_logprobs, *scored)
                        offsets[index] = sum(len(t) for t in lp["tokens"])
                finish = reply.finish_reason(delta.finish_reason) if reply is not None else None
                if delta.finish_reason is not None:
                    set_usage(flat[index], generated[index], delta.finish_reason)
                if not makes_chunks(parsed, delta, text, calls, False):
                    continue
                args = (delta, text, calls, finish, lp, False, index)
                for chunk in delta_chunks(parsed, texts, echo, model, created, *args):
                    await event(chunk)
        if parsed.include_usage:
            chunk = envelope(kind, echo, model, created, [], True)
            chunk["usage"] = _usage(handles, sum(generated))
            await event(chunk)

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(flat)]
    try:
        return await stream_events(request, parsed, echo, server.config.http_write_timeout_s, chunks)
    finally:
        for task in tasks:
            task.cancel()
