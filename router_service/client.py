"""A small Python client of the router's public API, for scripts and other services.

    with ColibriClient("localhost:50051") as client:
        print(client.generate("Hello", max_new_tokens=16).text)
        for piece in client.stream(token_ids=[1, 2, 3], max_new_tokens=8):
            print(piece.text, end="", flush=True)
        print(client.chat([{"role": "user", "content": "Hi"}], max_new_tokens=16).text)

The asyncio twin is router_service.async_client.AsyncColibriClient.

Errors surface as grpc.RpcError; `retry_delay(error)` reads the RetryInfo of a RESOURCE_EXHAUSTED answer.
TLS: `tls_ca` (the CA that signed the router's certificate; `tls=True` alone trusts the system's CAs), plus
`tls_cert`/`tls_key` where the router requires client certificates; `token` or `token_file` for bearer auth. A
token gRPC metadata cannot carry, or a token or TLS file that is unreadable or wrong, is a ConfigError
(common.errors) when the client is made.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from common.auth import MAX_TOKEN_FILE_BYTES, WatchedFiles, fixed_token, token_lines
from common.errors import ConfigError
from common.pb import router_pb2, router_pb2_grpc
from common.tls_files import check_certificates, check_pair

SAMPLING_FIELDS = {f.name for f in router_pb2.SamplingParameters.DESCRIPTOR.fields}


def build_request(
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    request_id: str = "",
    stream: bool = False,
    **parameters,
) -> router_pb2.GenerateRequest | router_pb2.GenerateStreamRequest:
    """A GenerateRequest (GenerateStreamRequest with `stream`) from a text prompt or token ids plus
    SamplingParameters fields as keywords."""
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of prompt or token_ids")
    unknown = set(parameters) - SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)} (known: {sorted(SAMPLING_FIELDS)})")
    params = router_pb2.SamplingParameters(**{k: v for k, v in parameters.items() if v is not None})
    message = router_pb2.GenerateStreamRequest if stream else router_pb2.GenerateRequest
    if token_ids is None:  # exactly one of the two is given (checked above)
        return message(text=prompt, parameters=params, request_id=request_id)
    return message(token_ids=router_pb2.TokenIds(ids=list(token_ids)), parameters=params, request_id=request_id)


def chat_messages(messages) -> list[router_pb2.ChatMessage]:
    """ChatMessages from {"role", "content"} dicts, (role, content) pairs or ChatMessages."""
    out = []
    for m in messages:
        if isinstance(m, router_pb2.ChatMessage):
            out.append(m)
        elif isinstance(m, dict):
            out.append(router_pb2.ChatMessage(role=m["role"], content=m.get("content") or ""))
        else:
            role, content = m
            out.append(router_pb2.ChatMessage(role=role, content=content))
    return out


def build_chat_request(
    messages,
    request_id: str = "",
    continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None,
    stream: bool = False,
    **parameters,
):
    """A ChatRequest (ChatStreamRequest with `stream`) from messages plus SamplingParameters fields as keywords."""
    unknown = set(parameters) - SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)} (known: {sorted(SAMPLING_FIELDS)})")
    params = router_pb2.SamplingParameters(**{k: v for k, v in parameters.items() if v is not None})
    request = (router_pb2.ChatStreamRequest if stream else router_pb2.ChatRequest)(
        messages=chat_messages(messages),
        parameters=params,
        request_id=request_id,
        continue_final_message=continue_final_message,
    )
    if chat_template_kwargs:
        request.chat_template_kwargs.update(chat_template_kwargs)
    return request


def retry_delay(error: grpc.RpcError) -> float | None:
    """Seconds the server asked us to wait (RetryInfo), or None."""
    status = rpc_status.from_call(error) if hasattr(error, "trailing_metadata") else None
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


# How errors name the token and TLS arguments; `colibri generate` passes its flags (--token-file, ...).
ARGUMENT_NAMES = {name: name for name in ("token", "token_file", "tls_ca", "tls_cert", "tls_key")}


def read_token_file(path: str, what: str = "token_file") -> str:
    """The first token of a token file (one per line; blank lines and # comments skipped), read as the router
    and worker read theirs (common/auth.py): a FIFO or device is refused, never waited on. ConfigError naming
    `what` and the file."""
    tokens = WatchedFiles([path], token_lines(path), what, MAX_TOKEN_FILE_BYTES).value
    return tokens[0].decode("ascii")  # token_lines stripped it and checked gRPC metadata can carry it


def channel_credentials(
    tls_ca: str = "", tls_cert: str = "", tls_key: str = "", names: dict[str, str] = ARGUMENT_NAMES
) -> grpc.ChannelCredentials:
    """TLS credentials from PEM files: the CA to trust (empty = the system's) and an optional client pair. Each is
    read and checked as the router checks its own (common/tls_files.py), so that a file that is no PEM
    certificate, or a key of another certificate, is a ConfigError naming it now, not a failed connection."""
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError(f"{names['tls_cert']} and {names['tls_key']} go together")
    ca = WatchedFiles([tls_ca], _certificates(tls_ca), names["tls_ca"]).value if tls_ca else None
    cert = key = None
    if tls_cert:
        what = f"{names['tls_cert']}, {names['tls_key']}"
        cert, key = WatchedFiles([tls_cert, tls_key], _pair(tls_cert, tls_key), what).value
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _certificates(path: str):
    def parse(contents: list[bytes]) -> bytes:
        check_certificates(contents[0], path)
        return contents[0]

    return parse


def _pair(cert_path: str, key_path: str):
    def parse(contents: list[bytes]) -> list[bytes]:
        try:
            check_pair(*contents)
        except ValueError as e:
            raise ValueError(f"{cert_path}, {key_path}: {e}") from None
        return contents

    return parse


def connection(
    token: str,
    token_file: str,
    tls: bool,
    tls_ca: str,
    tls_cert: str,
    tls_key: str,
    tls_server_name: str,
    max_message_bytes: int,
    names: dict[str, str] = ARGUMENT_NAMES,
):
    """(call metadata, channel options, TLS credentials or None) from the clients' constructor arguments; a token
    or TLS file that cannot serve is a ConfigError naming it (by `names`), before anything connects."""
    if token.strip():
        token = fixed_token(token, names["token"]).decode("ascii")
    else:
        token = read_token_file(token_file, names["token_file"]) if token_file else ""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    secure = tls or tls_ca or tls_cert or tls_key
    return metadata, options, channel_credentials(tls_ca, tls_cert, tls_key, names) if secure else None


class ColibriClient:
    """Blocking client; `timeout` (seconds) is the deadline of each call, `token` (or the first line of
    `token_file`) a bearer token; TLS when `tls` or any of the tls_* files is given."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = 600.0,
        token: str = "",
        token_file: str = "",
        tls: bool = False,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_server_name: str = "",
        max_message_bytes: int = 16 << 20,
        argument_names: dict[str, str] = ARGUMENT_NAMES,
    ):
        self.timeout = timeout
        self._metadata, options, credentials = connection(
            token, token_file, tls, tls_ca, tls_cert, tls_key, tls_server_name, max_message_bytes, argument_names
        )
        if credentials is not None:
            self._channel = grpc.secure_channel(target, credentials, options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = router_pb2_grpc.GenerationServiceStub(self._channel)

    def __enter__(self) -> ColibriClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None, request_id: str = "", **parameters
    ) -> router_pb2.GenerateResponse:
        request = build_request(prompt, token_ids, request_id, **parameters)
        return self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)

    def stream(
        self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None, request_id: str = "", **parameters
    ) -> Iterator[router_pb2.GenerateStreamResponse]:
        request = build_request(prompt, token_ids, request_id, stream=True, **parameters)
        yield from self._stub.GenerateStream(request, timeout=self.timeout, metadata=self._metadata)

    def chat(
        self,
        messages,
        *,
        request_id: str = "",
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        **parameters,
    ) -> router_pb2.ChatResponse:
        """The assistant's reply to `messages` (rendered with the model's chat template on the router)."""
        request = build_chat_request(messages, request_id, continue_final_message, chat_template_kwargs, **parameters)
        return self._stub.Chat(request, timeout=self.timeout, metadata=self._metadata)

    def chat_stream(
        self,
        messages,
        *,
        request_id: str = "",
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        **parameters,
    ) -> Iterator[router_pb2.ChatStreamResponse]:
        request = build_chat_request(
            messages, request_id, continue_final_message, chat_template_kwargs, stream=True, **parameters
        )
        yield from self._stub.ChatStream(request, timeout=self.timeout, metadata=self._metadata)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = router_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._stub.Tokenize(request, timeout=self.timeout, metadata=self._metadata).token_ids)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        request = router_pb2.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._stub.Detokenize(request, timeout=self.timeout, metadata=self._metadata).text

    def model_info(self) -> router_pb2.ModelInfoResponse:
        return self._stub.ModelInfo(router_pb2.ModelInfoRequest(), timeout=self.timeout, metadata=self._metadata)
