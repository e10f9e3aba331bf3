"""Strict requests on the gRPC front: a field this router's router.proto does not know (sent by a client built
from a newer one, say a decoding constraint) is INVALID_ARGUMENT naming where it is, never parsed and dropped."""

import asyncio

import grpc
import pytest

from common.errors import InvalidRequestError
from common.pb import router_pb2
from router_service.config import RouterConfig
from router_service.validation import ModelLimits, validate_request
from tests.helpers import running_router

LIMITS = ModelLimits(vocab_size=258, max_sequence_length=64, kv_capacity_tokens=1000, has_tokenizer=True)
UNKNOWN_40 = bytes([0xC2, 0x02, 2]) + b"{}"  # field 40 (tag varint 0xC2 0x02), length-delimited: a newer proto's


def with_unknown(message, field_path: str = ""):
    """A copy of `message` with field 40 appended to the submessage at `field_path` (or to itself)."""
    message = type(message).FromString(message.SerializeToString())
    target = message
    for name in filter(None, field_path.split(".")):
        target = getattr(target, name)
    extended = type(target).FromString(target.SerializeToString() + UNKNOWN_40)
    if target is message:
        return extended
    target.CopyFrom(extended)
    return message


def generate(**params):
    return router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=[1, 2]), parameters=router_pb2.SamplingParameters(**params)
    )


@pytest.mark.parametrize("where, field", [("", "request"), ("parameters", "parameters"), ("token_ids", "token_ids")])
def test_an_unknown_field_is_refused_naming_its_message(where, field):
    request = with_unknown(generate(top_k=3), where)
    with pytest.raises(InvalidRequestError) as e:
        validate_request(request, RouterConfig(), LIMITS)
    assert e.value.field == field and "field number 40" in str(e.value), str(e.value)
    assert validate_request(generate(top_k=3), RouterConfig(), LIMITS).top_k == 3  # known fields only: served


def test_chat_parameters_with_an_unknown_field_are_invalid_argument(worker, tiny_model, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")

    async def body():
        async with running_router(worker.address, model=str(tiny_model), chat_template=str(template)) as (_, stub):
            chat = router_pb2.ChatRequest(
                messages=[router_pb2.ChatMessage(role="user", content="Hi")],
                parameters=router_pb2.SamplingParameters(max_new_tokens=2),
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Chat(with_unknown(chat, "parameters"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "field number 40" in e.value.details()
            assert (await stub.Chat(chat)).generated_tokens <= 2  # still serving

    asyncio.run(body())


def test_a_chat_or_message_with_an_unknown_field_is_invalid_argument(worker, tiny_model, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")

    async def body():
        async with running_router(worker.address, model=str(tiny_model), chat_template=str(template)) as (_, stub):
            message = router_pb2.ChatMessage(role="user", content="Hi")
            chat = router_pb2.ChatRequest(
                messages=[message], parameters=router_pb2.SamplingParameters(max_new_tokens=2)
            )
            odd_message = router_pb2.ChatRequest(
                messages=[with_unknown(message)], parameters=router_pb2.SamplingParameters(max_new_tokens=2)
            )
            for request, where in ((with_unknown(chat), "request"), (odd_message, "messages")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Chat(request)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, where
                assert "field number 40" in e.value.details() and where in e.value.details(), e.value.details()
            assert (await stub.Chat(chat)).generated_tokens <= 2

    asyncio.run(body())
