"""`colibri generate --target ADDR "prompt"` (or `--tokens 1,2,3`): stream a completion to stdout.

Text goes to stdout as it arrives (token ids too, with --show-tokens); the stop reason and token counts go
to stderr so stdout stays pipeable, and so do the tokens' log-probabilities with --logprobs (one `id logprob`
line per token, followed by `id:logprob` of the most likely tokens of its position with --top-logprobs N). `--chat` sends the prompt as one user message (ChatStream: the router applies the model's chat
template), after an optional `--system` message. A failed call prints its status in one line (`colibri generate: error: CODE: details`) and exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from common.errors import ConfigError
from common.pb import router_pb2
from common.token_ids import parse_id_list
from router_service.client import ColibriClient


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="text prompt (needs a router started with --model)")
    parser.add_argument(
        "--target",
        default=os.environ.get("COLIBRI_TARGET") or "localhost:50051",  # set empty, it is unset, as settings are
        help="router address (default: localhost:50051; env COLIBRI_TARGET)",
    )
    parser.add_argument("--tokens", help="prompt as comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="0 = the router's default")
    parser.add_argument("--min-new-tokens", type=int, default=0)
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy; unset = the model's generation_config.json temperature, else greedy",
    )
    parser.add_argument("--top-k", type=int, default=0, help="0 = the model's default, else off")
    parser.add_argument("--top-p", type=float, default=0.0, help="in (0, 1]; 0 = the model's default, else off")
    parser.add_argument(
        "--repetition-penalty", type=float, default=None, help="> 0, 1 = off; unset = the model's default, else off"
    )
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], 0 = off")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], 0 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    parser.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--show-tokens", action="store_true", help="print generated token ids instead of text")
    parser.add_argument(
        "--raw",
        action="store_true",
        help="write control characters in the output as they are, even to a terminal (by default a "
        "terminal gets them escaped, e.g. \\x1b, so model output cannot drive it)",
    )
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message, through the model's chat template"
    )
    parser.add_argument("--system", default="", help="with --chat: a system message before the prompt")
    parser.add_argument(
        "--logprobs",
        action="store_true",
        help="print each generated token's log-probability (to stderr, after the text)",
    )
    parser.add_argument(
        "--top-logprobs",
        type=int,
        default=0,
        help="with --logprobs: also the N most likely tokens of each position (N <= 20)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds (default 600)")
    parser.add_argument(
        "--token",
        default=os.environ.get("COLIBRI_AUTH_TOKEN", ""),
        help="bearer token (env COLIBRI_AUTH_TOKEN; prefer the env or --token-file: argv shows in ps)",
    )
    parser.add_argument("--token-file", default="", help="file whose first line is the bearer token")
    parser.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    parser.add_argument("--tls-ca", default="", help="PEM CA that signed the router's certificate (implies --tls)")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate, for a router that requires one")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-server-name",
        default="",
        help="name to verify the router's certificate against (default: the target's host)",
    )


# C0 controls but newline and tab, DEL, and C1 controls: escaped before model output reaches a terminal.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0D, 0x20), 0x7F)}
_CONTROL |= {c: f"\\u{c:04x}" for c in range(0x80, 0xA0)}


def terminal_safe(text: str) -> str:
    """Model output with every control character shown as an escape, so it cannot move the cursor,
    change colours or send terminal commands."""
    return text.translate(_CONTROL)


MAX_UINT32, MAX_UINT64 = (1 << 32) - 1, (1 << 64) - 1
# How the client's errors name its token and TLS arguments: by the flags (the token may come from the environment).
FLAGS = {
    "token": "--token (or COLIBRI_AUTH_TOKEN)",
    "token_file": "--token-file",
    "tls_ca": "--tls-ca",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
}
MAX_TIMEOUT_S = 1e9  # about 31 years


def _check_integer_ranges(args: argparse.Namespace, tokens: list[int] | None) -> None:
    """Each integer flag fits its unsigned proto field (protobuf would raise a bare ValueError); what the
    values mean (--top-logprobs <= 20, ...) the router checks."""
    values = [
        ("--max-new-tokens", args.max_new_tokens, MAX_UINT32),
        ("--min-new-tokens", args.min_new_tokens, MAX_UINT32),
        ("--top-k", args.top_k, MAX_UINT32),
        ("--top-logprobs", args.top_logprobs, MAX_UINT32),
        ("--seed", args.seed, MAX_UINT64),
    ]
    values += [("--stop-token-id", v, MAX_UINT32) for v in args.stop_token_id]
    values += [(f"--tokens[{i}]", v, MAX_UINT32) for i, v in enumerate(tokens or [])]
    for flag, value, high in values:
        if value is not None and not 0 <= value <= high:
            raise ConfigError(f"{flag} must be in [0, {high}], got {value}")


def _check_text(args: argparse.Namespace) -> None:
    """Each text flag can be sent: bytes of the command line that are not UTF-8 reach Python as lone surrogates,
    which protobuf refuses only once the request is built, with a bare UnicodeEncodeError."""
    texts = [("the prompt", args.prompt), ("--system", args.system)] + [("--stop", s) for s in args.stop]
    for flag, text in texts:
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"{flag} is not UTF-8 text (an undecodable byte at character {e.start})") from None


def run(args: argparse.Namespace) -> int:
    tokens = None  # parsed here, for one line naming the flag (argparse adds its usage); args stay as given
    if args.tokens is not None:
        try:
            tokens = parse_id_list(args.tokens)
        except ValueError as e:
            raise ConfigError(f"--tokens: {e}") from None
        if not tokens:
            raise ConfigError("--tokens: the prompt is empty")
    if not args.target.strip():
        raise ConfigError("--target: empty (name the router's HOST:PORT, or leave it out for localhost:50051)")
    if (args.prompt is None) == (args.tokens is None):
        raise ConfigError("give a text prompt or --tokens, exactly one")
    _check_integer_ranges(args, tokens)
    _check_text(args)
    # gRPC takes a deadline of 0, a negative, NaN, inf or past ~2^63 ns since the epoch as already passed: the
    # call would fail at once with DEADLINE_EXCEEDED, which reads as a slow router.
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        raise ConfigError(f"--timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {args.timeout}")
    if args.chat and args.prompt is None:
        raise ConfigError("--chat needs a text prompt (the user message)")
    params = dict(
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.min_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_sequences=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        top_logprobs=args.top_logprobs,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    final, tops = None, []
    logprobs: list[tuple[int, float]] = []
    raw = args.raw or not sys.stdout.isatty()
    try:
        client = ColibriClient(
            args.target,
            timeout=args.timeout,
            token=args.token,
            token_file=args.token_file,
            tls=args.tls,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_server_name=args.tls_server_name,
            argument_names=FLAGS,
        )
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    try:
        with client:
            if args.chat:
                messages = ([("system", args.system)] if args.system else []) + [("user", args.prompt)]
                stream = client.chat_stream(messages, **params)
            else:
                stream = client.stream(args.prompt, token_ids=tokens, **params)
            for message in stream:
                logprobs += zip(message.token_ids, message.logprobs)
                tops += message.top_logprobs
                if args.show_tokens:
                    if message.token_ids:
                        print(" ".join(map(str, message.token_ids)), end=" ", flush=True)
                else:
                    print(message.text if raw else terminal_safe(message.text), end="", flush=True)
                final = message
    except KeyboardInterrupt:
        if final is not None:
            print()  # the text streamed so far ends its line, before the one saying it was interrupted
        raise
    except grpc.RpcError as e:
        if final is not None:
            print()  # ends the text streamed before the failure
        print(f"colibri generate: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print()
    for i, (token_id, logprob) in enumerate(logprobs):
        top = "".join(f"\t{t}:{v:.4f}" for t, v in zip(tops[i].token_ids, tops[i].logprobs)) if i < len(tops) else ""
        print(f"{token_id}\t{logprob:.4f}{top}", file=sys.stderr)
    if final is not None:
        reason = router_pb2.StopReason.Name(final.stop_reason)
        print(
            f"[{final.request_id}] {reason}, {final.prompt_tokens} prompt + {final.generated_tokens} generated tokens",
            file=sys.stderr,
        )
    return 0
