"""The texts and bytes of scored tokens (router_service.logprobs.TokenTexts, OpenAI's logprobs fields) with the
tokenizers of real model families: a SentencePiece word keeps its leading space, and a token holding part of a
character gives that character's bytes, which its text shows as U+FFFD."""

import pytest

from router_service.logprobs import TokenTexts
from router_service.openai_response import logprobs_field
from router_service.tokenizer import REPLACEMENT, Tokenizer
from tests.router_service.real_tokenizers import chatml_byte_level, sentencepiece_bpe

TEXT = "Hello world, 日本 🙂 e\u0301!"
FAMILIES = {"mixtral": sentencepiece_bpe, "llama2": lambda: sentencepiece_bpe(legacy=True), "qwen": chatml_byte_level}


@pytest.mark.parametrize("family", FAMILIES)
def test_token_texts_read_as_in_the_text_and_bytes_are_the_tokens_own(family):
    """Before: Mixtral's tokens decoded alone ("▁world" as "world"), so the tokens did not add up to the text, and
    `bytes` were those of U+FFFD for each `<0xE6>`-style byte token."""
    tokenizer = Tokenizer(FAMILIES[family]())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    texts = TokenTexts(tokenizer)
    # as the output's first token (after a prompt), a SentencePiece word shows its space
    text = (" " if family != "qwen" else "") + TEXT
    assert b"".join(bytes(texts.bytes(i)) for i in ids) == text.encode()
    for i in ids:
        assert texts(i) == bytes(texts.bytes(i)).decode("utf-8", "replace")


@pytest.mark.parametrize("family", FAMILIES)
def test_openai_logprobs_fields_add_up_to_the_text(family):
    tokenizer = Tokenizer(FAMILIES[family]())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    texts, logprobs = TokenTexts(tokenizer), [-1.0] * len(ids)
    tops = [[(i, -1.0)] for i in ids]
    chat = logprobs_field("chat", texts, ids, logprobs, tops)["content"]
    text = (" " if family != "qwen" else "") + TEXT
    assert bytes(b for entry in chat for b in entry["bytes"]) == text.encode()
    assert [e["top_logprobs"][0]["bytes"] for e in chat] == [e["bytes"] for e in chat]
    completion = logprobs_field("completion", texts, ids, logprobs, tops)
    whole = completion["tokens"][: completion["tokens"].index(REPLACEMENT)]  # before the pieces of 日
    assert [text[o : o + len(t)] for t, o in zip(whole, completion["text_offset"])] == whole
    assert "".join(whole) == text[: text.index("日")]
