"""A small deterministic random-weight test model: an MoE checkpoint with a byte-level tokenizer.

``make_tiny(out_dir)`` writes a Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json)
into ``out_dir/hf`` and converts it into ``out_dir``. Everything comes from numpy and the `tokenizers`
library (runtime dependencies only); the tensor list comes from ``common.models.tensor_specs``, so the
checkpoint always has exactly the tensors the converter expects. Same seed -> byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.errors import ConfigError
from common.files import write_new
from common.models import FAMILIES, config_from_hf, tensor_specs

# Ids 0-2 are the specials (Llama convention: unk, bos, eos); byte b is token 3 + b.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL = len(SPECIAL_TOKENS)
VOCAB_SIZE = NUM_SPECIAL + 256
# The tiny model's and the default model's chat template (tool calls in the generic format).
PLAIN_CHAT_TEMPLATE = Path(__file__).with_name("plain_chat_template.jinja")

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=UNK_ID,
    initializer_range=0.02,
    use_cache=True,
    dtype="float32",
)
# Per family: the keys its HF config class reads; small, but each family's variants are switched on.
_FAMILY_KEYS = {
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        router_aux_loss_coef=0.02,
    ),
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"],
        intermediate_size=128,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        qkv_bias=True,
        use_sliding_window=False,
        sliding_window=None,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        head_dim=24,
        intermediate_size=128,
        moe_intermediate_size=96,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
    ),
    "olmoe": dict(
        architectures=["OlmoeForCausalLM"],
        intermediate_size=96,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        clip_qkv=None,
        attention_bias=False,
    ),
}


def tiny_hf_config(family: str = "mixtral") -> dict:
    """The HF config.json dict of the tiny model of `family` (one of ``common.models.FAMILIES``)."""
    if family not in _FAMILY_KEYS:
        raise ConfigError(f"--family: {family!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    return {"model_type": family, **_COMMON, **_FAMILY_KEYS[family]}


def tiny_weights(hf_config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF tensor name -> float32 array, one independent stream per tensor so the order never matters.

    Projections use std 1/sqrt(fan_in) and embeddings std 1.0 (not the 0.02 initialiser): with 0.02 the
    residual stream is just the embedding and greedy generation repeats one token forever.
    """
    config = config_from_hf(hf_config)
    weights = {}
    for index, spec in enumerate(tensor_specs(config)):
        rng = np.random.default_rng([seed, index])
        leaf = spec.name.rsplit(".", 1)[-1]
        if leaf.endswith("norm"):
            values = 1.0 + 0.1 * rng.standard_normal(spec.shape)
        elif leaf.endswith("bias"):
            values = 0.1 * rng.standard_normal(spec.shape)
        elif leaf == "embed_tokens":
            values = rng.standard_normal(spec.shape)
        else:
            values = rng.standard_normal(spec.shape) / np.sqrt(spec.shape[-1])
        weights[spec.hf_name] = values.astype(np.float32)
    return weights


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is one token, so any text round-trips."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable character; order the vocabulary by byte value.
    byte_chars = sorted(alphabet, key=lambda ch: _BYTE_OF_CHAR[ch])
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: NUM_SPECIAL + i for i, ch in enumerate(byte_chars)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS[UNK_ID]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_OF_CHAR = {ch: b for b, ch in _bytes_to_unicode().items()}


def write_tiny_checkpoint(hf_dir: str | Path, family: str = "mixtral", seed: int = 0) -> Path:
    """Writes config.json, model.safetensors and the tokenizer files of the tiny model into `hf_dir`, each a new
    file at its name (common.files): a link planted there is replaced, never written through."""
    from safetensors.numpy import save

    hf_dir = Path(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    hf_config = tiny_hf_config(family)
    write_new(hf_dir / "config.json", (json.dumps(hf_config, indent=2) + "\n").encode())
    write_new(hf_dir / "model.safetensors", save(tiny_weights(hf_config, seed), metadata={"format": "pt"}))
    write_new(hf_dir / "tokenizer.json", byte_tokenizer().to_str(pretty=True).encode())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "pad_token": SPECIAL_TOKENS[UNK_ID],
        "model_max_length": hf_config["max_position_embeddings"],
    }
    write_new(hf_dir / "tokenizer_config.json", (json.dumps(tokenizer_config, indent=2) + "\n").encode())
    write_new(hf_dir / "chat_template.jinja", PLAIN_CHAT_TEMPLATE.read_bytes())
    return hf_dir


def make_tiny(
    out_dir: str | Path, family: str = "mixtral", seed: int = 0, progress: bool = False, expert_dtype: str | None = None
) -> Path:
    """Writes the HF checkpoint into `out_dir/hf` and converts it into `out_dir` (the experts in
    `expert_dtype` when given); returns `out_dir`."""
    from expert_service.tools.convert import convert

    out_dir = Path(out_dir)
    hf_dir = out_dir / "hf"
    if hf_dir.is_symlink():  # a link planted at the name make-tiny chose: writing into it would write elsewhere
        hf_dir.unlink()
    hf_dir = write_tiny_checkpoint(hf_dir, family, seed)
    return convert(hf_dir, out_dir, progress=progress, expert_dtype=expert_dtype)
