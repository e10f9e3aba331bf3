"""A byte-level BPE tokenizer trained on the corpus with the `tokenizers` library.

Ids 0-2 are the specials in the Llama/Mixtral convention (<unk>, <s>, </s>; padding reuses <unk>), the
next 256 ids are the bytes, merges fill the rest. Encoding with special tokens prepends <s>, which is what
Colibri's router does with a prompt, and every training document starts with <s> too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from expert_service.tools.tiny_model import PLAIN_CHAT_TEMPLATE

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
PAD_ID = UNK_ID


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A `tokenizers.Tokenizer` with at most `vocab_size` ids (fewer when the text has too few merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos = SPECIAL_TOKENS[BOS_ID]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [UNK_ID, BOS_ID, EOS_ID]
    return tokenizer


def save_hf_tokenizer(tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json + chat_template.jinja (the plain chat template, so chat and tool
    calls work on the default model; transformers and the router both read it there), loadable with transformers' AutoTokenizer (4.x and 5.x both
    know the PreTrainedTokenizerFast class name, so the config is written by hand, not by save_pretrained)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    unk, bos, eos = SPECIAL_TOKENS
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": unk,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(PLAIN_CHAT_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")


def encode_documents(tokenizer, documents: Iterable[str]) -> list[list[int]]:
    """<s> document </s> for each document, as the model is trained and prompted."""
    encoded = tokenizer.encode_batch(list(documents), add_special_tokens=True)
    return [list(e.ids) + [EOS_ID] for e in encoded]
