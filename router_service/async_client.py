"""The asyncio twin of router_service.client.ColibriClient (grpc.aio), for services that run an event loop.

    async with AsyncColibriClient("localhost:50051") as client:
        print((await client.generate("Hello", max_new_tokens=16)).text)
        async for piece in client.stream("Hello", max_new_tokens=16):
            print(piece.text, end="", flush=True)
        reply = await client.chat([{"role": "user", "content": "Hi"}], max_new_tokens=16)

The same arguments as ColibriClient (timeout, token or token_file, tls / tls_ca / tls_cert / tls_key); errors
surface as grpc.aio.AioRpcError (a grpc.RpcError: `retry_delay` reads it too). Cancelling a task that iterates a
stream cancels the call, which frees the request on the router.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from common.pb import router_pb2, router_pb2_grpc
from router_service.client import build_chat_request, build_request


class AsyncColibriClient:
    """Create it inside the event loop that uses it; `timeout` (seconds) is the deadline of each call."""

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
    ):
        from router_service.client import connection  # the same token and TLS handling

        self.timeout = timeout
        self._metadata, options, credentials = connection(
            token, token_file, tls, tls_ca, tls_cert, tls_key, tls_server_name, max_message_bytes
        )
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(target, credentials, options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._stub = router_pb2_grpc.GenerationServiceStub(self._channel)

    async def __aenter__(self) -> AsyncColibriClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _call(self) -> dict:
        return {"timeout": self.timeout, "metadata": self._metadata}

    async def generate(
        self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None, request_id: str = "", **parameters
    ) -> router_pb2.GenerateResponse:
        return await self._stub.Generate(build_request(prompt, token_ids, request_id, **parameters), **self._call())

    async def stream(
        self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None, request_id: str = "", **parameters
    ) -> AsyncIterator[router_pb2.GenerateStreamResponse]:
        call = self._stub.GenerateStream(
            build_request(prompt, token_ids, request_id, stream=True, **parameters), **self._call()
        )
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()  # a no-op once the stream ended; frees the request when the caller stops early

    async def chat(
        self,
        messages,
        *,
        request_id: str = "",
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        **parameters,
    ) -> router_pb2.ChatResponse:
        request = build_chat_request(messages, request_id, continue_final_message, chat_template_kwargs, **parameters)
        return await self._stub.Chat(request, **self._call())

    async def chat_stream(
        self,
        messages,
        *,
        request_id: str = "",
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        **parameters,
    ) -> AsyncIterator[router_pb2.ChatStreamResponse]:
        request = build_chat_request(
            messages, request_id, continue_final_message, chat_template_kwargs, stream=True, **parameters
        )
        call = self._stub.ChatStream(request, **self._call())
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = router_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._stub.Tokenize(request, **self._call())).token_ids)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        request = router_pb2.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return (await self._stub.Detokenize(request, **self._call())).text

    async def model_info(self) -> router_pb2.ModelInfoResponse:
        return await self._stub.ModelInfo(router_pb2.ModelInfoRequest(), **self._call())
