"""Model and optimisation presets, and the transformers Mixtral built from them.

`default` is the model Colibri ships: ~7 M parameters, 13.9 MB in bfloat16, 8 experts top-2 in each of 6
layers. `large` (~320 M parameters, 32 experts) exists to measure the expert cache on a GPU; it is never
stored in the repository; its 400 steps see as many tokens as the default model's 800 and are sized for about
three minutes on one H200 (a step is bound by transformers' eager expert loop, not by FLOPs: 256 expert
iterations with host syncs per step). `tiny` is for the CPU tests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from training.tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass(frozen=True)
class Preset:
    # architecture (Mixtral: Llama attention, top-k softmax router renormalised, SwiGLU experts)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int
    experts_per_token: int
    expert_ffn_size: int
    vocab_size: int
    sequence_length: int  # training windows; also max_position_embeddings
    tie_embeddings: bool
    # optimisation
    batch_size: int  # windows per step
    steps: int
    learning_rate: float
    warmup_steps: int
    weight_decay: float
    router_aux_loss_coef: float  # Switch-style load-balancing loss weight
    eval_every: int


PRESETS = {
    # Tied embeddings: 1 M parameters saved for the experts; the 4096-token vocabulary gets ~4 characters a
    # token out of this corpus.
    "default": Preset(
        hidden_size=256,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        num_experts=8,
        experts_per_token=2,
        expert_ffn_size=128,
        vocab_size=4096,
        sequence_length=1024,
        tie_embeddings=True,
        batch_size=16,
        steps=800,
        learning_rate=2e-3,
        warmup_steps=100,
        weight_decay=0.1,
        router_aux_loss_coef=0.02,
        eval_every=100,
    ),
    "large": Preset(
        hidden_size=768,
        num_layers=8,
        num_heads=12,
        num_kv_heads=4,
        num_experts=32,
        experts_per_token=2,
        expert_ffn_size=512,
        vocab_size=4096,
        sequence_length=1024,
        tie_embeddings=False,
        batch_size=32,
        steps=400,
        learning_rate=6e-4,
        warmup_steps=40,
        weight_decay=0.1,
        router_aux_loss_coef=0.02,
        eval_every=100,
    ),
    "tiny": Preset(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        num_experts=4,
        experts_per_token=2,
        expert_ffn_size=32,
        vocab_size=300,
        sequence_length=64,
        tie_embeddings=True,
        batch_size=8,
        steps=30,
        learning_rate=1e-2,
        warmup_steps=5,
        weight_decay=0.0,
        router_aux_loss_coef=0.02,
        eval_every=10,
    ),
}


def hf_config(preset: Preset, vocab_size: int):
    """The transformers MixtralConfig of `preset` with the tokenizer's actual vocabulary size."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.expert_ffn_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        num_local_experts=preset.num_experts,
        num_experts_per_tok=preset.experts_per_token,
        max_position_embeddings=preset.sequence_length,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=preset.tie_embeddings,
        sliding_window=None,
        router_aux_loss_coef=preset.router_aux_loss_coef,
        router_jitter_noise=0.0,
        output_router_logits=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
        architectures=["MixtralForCausalLM"],
    )


def build_model(preset: Preset, vocab_size: int, seed: int, experts_implementation: str = "eager"):
    """Eager experts by default: transformers' grouped_mm path wants bfloat16 weights, training keeps fp32."""
    import torch
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(hf_config(preset, vocab_size))
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts_implementation)
    model.generation_config.pad_token_id = PAD_ID
    return model


def parameter_count(preset: Preset, vocab_size: int | None = None) -> dict[str, int]:
    """Parameters by kind, from the shapes alone (no model is built)."""
    p, vocab = preset, vocab_size or preset.vocab_size
    head_dim = p.hidden_size // p.num_heads
    attention = p.hidden_size * head_dim * (2 * p.num_heads + 2 * p.num_kv_heads)
    experts = p.num_experts * 3 * p.hidden_size * p.expert_ffn_size
    per_layer = attention + experts + p.num_experts * p.hidden_size + 2 * p.hidden_size
    embeddings = vocab * p.hidden_size * (1 if p.tie_embeddings else 2)
    counts = {
        "embeddings": embeddings,
        "attention": attention * p.num_layers,
        "experts": experts * p.num_layers,
        "total": embeddings + per_layer * p.num_layers + p.hidden_size,
    }
    counts["active_per_token"] = (
        counts["total"] - counts["experts"] + counts["experts"] * p.experts_per_token // p.num_experts
    )
    return counts


def describe(preset: Preset) -> dict:
    return {**asdict(preset), "parameters": parameter_count(preset)}
