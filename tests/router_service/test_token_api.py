"""Tokenize (special tokens, pieces, offsets), Detokenize, truncate_input_tokens and ModelInfo's version and
generation_config, against a real router and CPU worker."""

import asyncio
import json
import shutil

import grpc
import pytest

from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import BOS_ID, EOS_ID, SPECIAL_TOKENS, byte_tokenizer
from router_service.async_client import AsyncColibriClient
from tests.helpers import byte_ids, running_router

pytestmark = pytest.mark.slow
GENERATION_CONFIG = {
    "bos_token_id": BOS_ID,
    "eos_token_id": [EOS_ID],
    "temperature": 0.6,
    "top_p": 0.95,
    "do_sample": True,
    "_from_model_config": True,
}


def router_model_dir(tiny_model, tmp_path):
    """The tiny model's router-side files, with a BOS-adding tokenizer and a generation_config.json."""
    from tokenizers.processors import TemplateProcessing

    out = tmp_path / "router-model"
    out.mkdir()
    shutil.copy(tiny_model / "tokenizer_config.json", out)
    tokenizer = byte_tokenizer()
    tokenizer.post_processor = TemplateProcessing(
        single=f"{SPECIAL_TOKENS[BOS_ID]} $A", special_tokens=[(SPECIAL_TOKENS[BOS_ID], BOS_ID)]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return out


def test_tokenize_detokenize_truncation_and_model_info(worker, tiny_model, tmp_path):
    model = router_model_dir(tiny_model, tmp_path)

    async def body():
        async with running_router(worker.address, model=str(model)) as (router, stub):
            text = "Hi é"
            reply = await stub.Tokenize(rpb.TokenizeRequest(text=text))
            assert list(reply.token_ids) == [BOS_ID] + byte_ids(text) and not reply.pieces and not reply.offsets
            reply = await stub.Tokenize(
                rpb.TokenizeRequest(text=text, add_special_tokens=False, return_pieces=True, return_offsets=True)
            )
            assert list(reply.token_ids) == byte_ids(text)
            assert list(reply.pieces) == ["H", "i", "Ġ", "Ã", "©"]  # byte-level: bytes shown as characters
            assert [(o.start, o.end) for o in reply.offsets] == [(0, 1), (1, 2), (2, 3), (3, 4), (3, 4)]
            reply = await stub.Tokenize(rpb.TokenizeRequest(text="x" * 3000, return_offsets=True))  # on a thread
            assert len(reply.offsets) == 3001 and reply.offsets[0].end == 0

            ids = [BOS_ID] + byte_ids(text) + [EOS_ID]
            assert (await stub.Detokenize(rpb.DetokenizeRequest(token_ids=ids))).text == "<s>Hi é</s>"
            assert (await stub.Detokenize(rpb.DetokenizeRequest(token_ids=ids, skip_special_tokens=True))).text == text
            long = (await stub.Detokenize(rpb.DetokenizeRequest(token_ids=byte_ids("ab" * 1500)))).text
            assert long == "ab" * 1500
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Detokenize(rpb.DetokenizeRequest(token_ids=[5, 10**6]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("token_ids[1]")

            prompt = list(range(10, 40))
            params = dict(max_new_tokens=4, ignore_eos=True, temperature=0.0)  # greedy, not the model's 0.6
            want = await stub.Generate(
                rpb.GenerateRequest(
                    token_ids=rpb.TokenIds(ids=prompt[-6:]), parameters=rpb.SamplingParameters(**params)
                )
            )
            got = await stub.Generate(
                rpb.GenerateRequest(
                    token_ids=rpb.TokenIds(ids=prompt),
                    parameters=rpb.SamplingParameters(truncate_input_tokens=6, **params),
                )
            )
            assert list(got.token_ids) == list(want.token_ids) and got.prompt_tokens == 6
            room = router.batching_loop.limits.max_sequence_length
            long_text = "y" * (room + 100)  # too long whole; fine once truncated
            got = await stub.Generate(
                rpb.GenerateRequest(
                    text=long_text, parameters=rpb.SamplingParameters(truncate_input_tokens=16, **params)
                )
            )
            assert got.prompt_tokens == 16 and got.generated_tokens == 4
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(rpb.GenerateRequest(text=long_text, parameters=rpb.SamplingParameters(**params)))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            info = await stub.ModelInfo(rpb.ModelInfoRequest())
            assert info.server_version
            config = dict(info.generation_config)
            assert config["temperature"] == pytest.approx(0.6) and list(config["eos_token_id"]) == [EOS_ID]
            assert "_from_model_config" not in config

            async with AsyncColibriClient(f"127.0.0.1:{router.port}") as client:
                assert await client.tokenize(text, add_special_tokens=False) == byte_ids(text)
                assert await client.detokenize(ids, skip_special_tokens=True) == text

    asyncio.run(body())
