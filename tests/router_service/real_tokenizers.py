"""Tokenizers built the way real models' are, for tests of text in and out: `sentencepiece_bpe` like Llama's and
Mixtral's (Metaspace, BPE with byte fallback: a character outside the vocabulary is one `<0xNN>` token per UTF-8
byte), `chatml_byte_level` like Qwen's (byte-level BPE with `<|im_start|>` / `<|im_end|>` special tokens). Each is
trained on a small corpus without emoji or CJK, so those characters always span tokens."""

from __future__ import annotations

import json

CORPUS = [
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog.",
    "Bonjour le monde! Ça va? Très bien. é ü à",
    "def foo(x):\n    return x + 1\n",
    "  leading spaces and   multiple   spaces",
] * 20
LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def sentencepiece_bpe(vocab_size: int = 400, legacy: bool = False):
    """Mixtral's layout (Metaspace pre-tokenizer, prepend_scheme "first", no split); `legacy`: Llama 2's (a
    Prepend + Replace normalizer, no pre-tokenizer). The decoder strips the text's first space either way."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never" if legacy else "first")
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[*LLAMA_SPECIALS, *byte_tokens], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    if legacy:
        tok.pre_tokenizer = None
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    # The byte tokens belong to the vocabulary, not the added (special) tokens, as in Llama's tokenizer.json.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [dict(a, normalized=False) for a in spec["added_tokens"] if a["content"] in LLAMA_SPECIALS]
    return Tokenizer.from_str(json.dumps(spec))


def chatml_byte_level(vocab_size: int = 400):
    """Qwen's layout: byte-level BPE, `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` special (ids 0-2)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHATML_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_SPECIALS])
    return tok
