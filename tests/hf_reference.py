"""Tiny random Hugging Face checkpoints for parity tests (test-only: needs torch + transformers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from expert_service.tools.convert import convert

CONFIG_CLASSES = {
    "mixtral": transformers.MixtralConfig,
    "qwen2_moe": transformers.Qwen2MoeConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "olmoe": transformers.OlmoeConfig,
}

# Several shapes per family: sizes that are not multiples of 32, expert counts that are not powers of two,
# GQA and MQA, top-k from 1 to 4, dense layers, shared experts, q/k norms, clip_qkv.
CASES = {
    "mixtral-gqa-k2": (
        "mixtral",
        dict(
            hidden_size=96,
            intermediate_size=80,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_local_experts=5,
            num_experts_per_tok=2,
        ),
    ),
    "mixtral-mqa-k1": (
        "mixtral",
        dict(
            hidden_size=40,
            intermediate_size=24,
            num_attention_heads=5,
            num_key_value_heads=1,
            num_local_experts=3,
            num_experts_per_tok=1,
            rope_theta=1e6,
        ),
    ),
    "mixtral-window": (
        "mixtral",
        dict(
            hidden_size=48,
            intermediate_size=40,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
        ),
    ),
    "qwen2_moe-shared": (
        "qwen2_moe",
        dict(
            hidden_size=72,
            intermediate_size=56,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=44,
            num_attention_heads=6,
            num_key_value_heads=3,
            num_experts=7,
            num_experts_per_tok=3,
        ),
    ),
    "qwen2_moe-dense-norm": (
        "qwen2_moe",
        dict(
            hidden_size=48,
            intermediate_size=36,
            moe_intermediate_size=28,
            shared_expert_intermediate_size=24,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_experts=6,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            num_hidden_layers=3,
            decoder_sparse_step=1,
        ),
    ),
    "qwen2_moe-sparse-step": (
        "qwen2_moe",
        dict(
            hidden_size=40,
            intermediate_size=44,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=5,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            num_hidden_layers=3,
        ),
    ),
    "qwen3_moe-k4": (
        "qwen3_moe",
        dict(
            hidden_size=64,
            intermediate_size=48,
            moe_intermediate_size=36,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            num_experts=10,
            num_experts_per_tok=4,
            norm_topk_prob=True,
        ),
    ),
    "qwen3_moe-mqa": (
        "qwen3_moe",
        dict(
            hidden_size=56,
            intermediate_size=40,
            moe_intermediate_size=20,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=20,
            num_experts=6,
            num_experts_per_tok=1,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            num_hidden_layers=3,
        ),
    ),
    "olmoe-clip": (
        "olmoe",
        dict(
            hidden_size=64,
            intermediate_size=40,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=7,
            num_experts_per_tok=3,
            clip_qkv=0.6,
        ),
    ),
    "olmoe-gqa-norm": (
        "olmoe",
        dict(
            hidden_size=36,
            intermediate_size=28,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_experts=3,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
}


def make_hf_model(family: str, overrides: dict, seed: int):
    params = dict(
        vocab_size=211,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    params.update(overrides)
    theta = params.pop("rope_theta", 10000.0)
    params["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config = CONFIG_CLASSES[family](**params)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # RMSNorm weights start at 1; perturb them so a wrong norm cannot hide
        for _name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_and_convert(model, tmp: Path, dtype: str | None = None) -> Path:
    hf_dir, out_dir = tmp / "hf", tmp / "model"
    model.save_pretrained(hf_dir)
    return convert(hf_dir, out_dir, dtype=dtype, progress=False)


def hf_logits(model, token_ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


def hf_greedy(model, token_ids, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(token_ids)]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[0, len(token_ids) :].tolist()
