"""The reference of bench/offload.py: the same model in transformers, dispatched with accelerate at the same device
budget (everything but the MoE blocks on GPU 0, whole MoE blocks while they fit, the rest streamed from the host
by accelerate's hooks at every forward), timed on the same work as Colibri: the shapes below.
Needs `accelerate` (not a project dependency)."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import numpy as np

from bench.engine import cuda_time
from bench.offload_model import TokenSource, load_hf

# The timed work, the same for both engines (bench/offload_measure.py and bench/offload_args.py import it)
PREFILL_TOKENS = 512
DECODE_BATCHES = (1, 16)
DECODE_CONTEXT = 128
DECODE_STEPS = 16
HF_OFFLOAD_DECODE_STEPS = 4  # an offloaded HF step copies most layers: seconds each


def offload_map(model, budget: int) -> dict[str, object]:
    """The most favourable placement HF can be given at `budget` device bytes: everything but the MoE blocks
    on GPU 0, then whole MoE blocks (a layer's experts + router) on the GPU while they fit, the rest on the CPU
    (streamed to the GPU at every forward by accelerate's hooks)."""

    def nbytes(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    layers = model.model.layers
    moe = [next(name for name, child in layer.named_children() if hasattr(child, "experts")) for layer in layers]
    left = budget - (nbytes(model) - sum(nbytes(getattr(layer, name)) for layer, name in zip(layers, moe)))
    device_map: dict[str, object] = {}
    for name, _child in model.named_children():
        if name != "model":
            device_map[name] = 0
    for name, _child in model.model.named_children():
        if name != "layers":
            device_map[f"model.{name}"] = 0
    for i, (layer, block) in enumerate(zip(layers, moe)):
        for name, child in layer.named_children():
            size = nbytes(child)
            on_gpu = name != block or size <= left
            left -= size if name == block and on_gpu else 0
            device_map[f"model.layers.{i}.{name}"] = 0 if on_gpu else "cpu"
    return device_map


def bench_hf(base, budget: int | None, tokens: TokenSource) -> dict:
    """The HF model (held on the CPU) copied and placed: all on GPU 0 (budget None), else dispatched by
    accelerate with `offload_map`; prefill and decode timed as bench/engine.py's bench_hf does."""
    try:
        return _bench_hf(base, budget, tokens)
    except Exception as e:  # a broken reference must not lose Colibri's runs
        import torch

        gc.collect()
        torch.cuda.empty_cache()
        return {"budget_bytes": budget, "error": f"{type(e).__name__}: {e}"}


def _bench_hf(base, budget: int | None, tokens: TokenSource) -> dict:
    import torch

    model = copy.deepcopy(base)
    out = {"budget_bytes": budget, "offloaded_modules": [], "decode_ms": {}}
    if budget is None:
        model.to("cuda")
    else:
        from accelerate import dispatch_model

        device_map = offload_map(model, budget)
        dispatch_model(model, device_map, main_device=0)
        out["offloaded_modules"] = sorted(name for name, device in device_map.items() if device == "cpu")
    torch.cuda.synchronize()
    out["device_weight_bytes"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    steps, repeats = (DECODE_STEPS, 2) if budget is None else (HF_OFFLOAD_DECODE_STEPS, 1)
    take = tokens.sampler()
    with torch.no_grad():
        ids = torch.tensor(take(PREFILL_TOKENS)[None], device="cuda")
        out["prefill_tok_s"] = PREFILL_TOKENS / cuda_time(lambda: model(ids), repeats)
        gen = dict(do_sample=False, pad_token_id=0)
        for b in DECODE_BATCHES:
            ids = torch.tensor(np.stack([take(DECODE_CONTEXT) for _ in range(b)]), device="cuda")
            t1 = cuda_time(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen), repeats)
            tn = cuda_time(
                lambda: model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **gen), repeats
            )
            out["decode_ms"][str(b)] = (tn - t1) / steps * 1e3
    out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    model = None  # free the device copy before the next budget
    gc.collect()
    torch.cuda.empty_cache()
    return out


def bench_hf_budgets(entry: dict, reference, tokens: TokenSource) -> dict:
    """The HF reference (the model on the host, or the checkpoint folder to load it from) at each fraction's
    device budget, all of it on the GPU when every expert fits."""
    try:
        base = load_hf(reference) if isinstance(reference, Path) else reference
    except Exception as e:  # a broken reference must not lose Colibri's runs
        return {fraction: {"budget_bytes": None, "error": f"{type(e).__name__}: {e}"} for fraction in entry["runs"]}
    out = {}
    for fraction, runs in entry["runs"].items():
        slot_bytes = next(iter(runs.values()))["slot_bytes"]
        budget = None if "resident" in runs else entry["non_expert_bytes"] + slot_bytes
        out[fraction] = bench_hf(base, budget, tokens)
    return out
