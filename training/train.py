"""Trains the default Colibri model: corpus -> BPE tokenizer -> Mixtral (transformers) -> HF checkpoint.

    python -m training.corpus                                    # once: training/data/corpus.txt
    python -m training.train --device cuda --out training/default-model-hf

Splits: the held-out books (the end of the New Testament, training/corpus.py) are never trained on nor
used for choices; every 40th remaining chapter is the validation set that picks the checkpoint (the
lowest validation loss of the evaluations). The tokenizer sees the training chapters only.
The loss trained is cross-entropy + router_aux_loss_coef x a per-layer load-balancing loss on the router
logits the model returns with output_router_logits (load_balancing_loss says why not transformers' own).
Writes into --out: config.json, generation_config.json, model.safetensors (bfloat16), tokenizer.json,
tokenizer_config.json, training_log.json and training_curve.png (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.corpus import DATA_DIR, SOURCE_NOTE, Chapter, read_chapters, split_heldout
from training.model import PRESETS, Preset, build_model, describe
from training.tokenizer import encode_documents, save_hf_tokenizer, train_tokenizer

VALIDATION_EVERY = 40  # every 40th training chapter is validation
CALIBRATION_STEPS = (5, 25)  # steps timed to fit --time-budget-s (inside warm-up, so the schedule holds)
SAMPLE_PROMPTS = ("In the beginning", "Jesus said to them,", "Yahweh is my shepherd", "The king of Babylon")


@dataclass(frozen=True)
class RunConfig:
    preset: str = "default"
    corpus: Path = DATA_DIR / "corpus.txt"
    out: Path = Path("training/default-model-hf")
    device: str = "auto"
    steps: int | None = None  # default: the preset's
    seed: int = 0
    time_budget_s: float | None = None
    samples: bool = True
    experts_implementation: str = "eager"


@dataclass(frozen=True)
class Splits:
    train: list[Chapter]
    validation: list[Chapter]
    heldout: list[Chapter]


def load_splits(corpus: Path) -> Splits:
    trainable, heldout = split_heldout(read_chapters(corpus))
    validation = trainable[VALIDATION_EVERY // 2 :: VALIDATION_EVERY]
    train = [c for i, c in enumerate(trainable) if i % VALIDATION_EVERY != VALIDATION_EVERY // 2]
    return Splits(train, validation, heldout)


def token_stream(tokenizer, chapters: list[Chapter]) -> np.ndarray:
    docs = encode_documents(tokenizer, [c.as_paragraph() for c in chapters])
    return np.fromiter((t for d in docs for t in d), dtype=np.int64)


def learning_rate(step: int, preset: Preset, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < preset.warmup_steps:
        return preset.learning_rate * (step + 1) / preset.warmup_steps
    progress = min(1.0, (step - preset.warmup_steps) / max(1, total_steps - preset.warmup_steps))
    return preset.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def next_token_loss(logits, ids):
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def load_balancing_loss(router_logits, top_k: int):
    """Switch Transformer's loss per MoE layer, averaged over layers: E x sum_e f_e x P_e, where f_e is the
    share of the layer's top-k assignments that go to expert e and P_e its mean router probability; 1.0
    when balanced. transformers' own aux_loss pools all layers first, so it cannot see a layer that sends
    everything to a few experts while another layer uses the others (seen in a first tiny run)."""
    import torch

    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        share = torch.zeros_like(probs[0]).scatter_add_(
            0, chosen.reshape(-1), torch.ones_like(chosen.reshape(-1), dtype=probs.dtype)
        )
        share = share / chosen.numel()
        losses.append(probs.shape[-1] * (share * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def load_balance(counts: np.ndarray) -> list[dict]:
    """Per layer: each expert's share of the top-k assignments, max share over the ideal 1/E, the
    coefficient of variation of the shares and their entropy over log(E) (1.0 = perfectly even)."""
    rows = []
    for layer_counts in counts:
        share = layer_counts / max(1, layer_counts.sum())
        nonzero = share[share > 0]
        rows.append(
            {
                "share": [round(float(s), 4) for s in share],
                "max_over_ideal": round(float(share.max() * len(share)), 3),
                "cv": round(float(share.std() / share.mean()), 3),
                "normalized_entropy": round(float(-(nonzero * np.log(nonzero)).sum() / math.log(len(share))), 4),
            }
        )
    return rows


def evaluate(model, stream: np.ndarray, sequence_length: int, device, batch_size: int, top_k: int) -> dict:
    """Mean next-token cross-entropy over non-overlapping windows, and each layer's expert counts."""
    import torch
    import torch.nn.functional as F

    model.eval()
    starts = list(range(0, len(stream) - 1, sequence_length))
    total_loss, total_tokens, counts = 0.0, 0, None
    with torch.no_grad():
        for i in range(0, len(starts), batch_size):
            windows = [stream[s : s + sequence_length] for s in starts[i : i + batch_size]]
            for window in _same_length_groups(windows):
                ids = torch.as_tensor(np.stack(window), device=device)
                out = model(input_ids=ids, output_router_logits=True)
                logits = out.logits[:, :-1].float()
                total_loss += float(
                    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
                )
                total_tokens += ids[:, 1:].numel()
                layer_counts = [
                    torch.bincount(torch.topk(r, top_k, dim=-1).indices.reshape(-1), minlength=r.shape[-1])
                    .cpu()
                    .numpy()
                    for r in out.router_logits
                ]
                counts = np.stack(layer_counts) if counts is None else counts + np.stack(layer_counts)
    model.train()
    if total_tokens == 0:
        raise ValueError("evaluate: the split holds fewer than two tokens (corpus too small for its splits)")
    loss = total_loss / total_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": total_tokens,
        "nats": total_loss,
        "expert_counts": counts,
    }


def _same_length_groups(windows):
    """The last window of a stream is shorter; stack it alone."""
    full = [w for w in windows if len(w) == len(windows[0])]
    rest = [w for w in windows if len(w) != len(windows[0]) and len(w) > 1]
    return [g for g in (full, *([w] for w in rest)) if g]


def generate_samples(model, tokenizer, device, seed: int) -> list[dict]:
    import torch

    model.eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt).ids], device=device)
        greedy = model.generate(ids, max_new_tokens=48, do_sample=False)
        torch.manual_seed(seed)
        sampled = model.generate(ids, max_new_tokens=48, do_sample=True, temperature=0.8, top_k=50)
        samples.append(
            {
                "prompt": prompt,
                "greedy": tokenizer.decode(greedy[0, ids.shape[1] :].tolist()),
                "sampled_t0.8_k50": tokenizer.decode(sampled[0, ids.shape[1] :].tolist()),
            }
        )
    model.train()
    return samples


def train(config: RunConfig) -> dict:
    import torch
    import transformers

    started = time.time()
    preset = PRESETS[config.preset]
    device = torch.device(
        "cuda"
        if config.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if config.device == "auto"
        else config.device
    )
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 weights, TF32 matmuls: no autocast dtype traps
    torch.backends.cudnn.allow_tf32 = True
    splits = load_splits(config.corpus)
    tokenizer = train_tokenizer((c.as_paragraph() for c in splits.train), preset.vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    streams = {name: token_stream(tokenizer, getattr(splits, name)) for name in ("train", "validation", "heldout")}
    heldout_chars = sum(len(c.as_paragraph()) for c in splits.heldout)
    print(
        f"tokenizer: {vocab_size} ids; tokens train {len(streams['train']):,} validation "
        f"{len(streams['validation']):,} held out {len(streams['heldout']):,} ({time.time() - started:.0f} s)",
        flush=True,
    )

    model = build_model(preset, vocab_size, config.seed, config.experts_implementation).to(device)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": preset.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=preset.learning_rate,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    rng = np.random.default_rng(config.seed)
    train_stream = torch.as_tensor(streams["train"], device=device)
    offsets = torch.arange(preset.sequence_length, device=device)
    total_steps = config.steps or preset.steps
    curve, evals, best = [], [], {"loss": float("inf"), "step": -1, "state": None}
    window = {"ce": 0.0, "aux": 0.0, "n": 0}
    eval_batch = max(1, preset.batch_size)
    step, calibration_start = 0, None
    while step < total_steps:
        lr = learning_rate(step, preset, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(streams["train"]) - preset.sequence_length, preset.batch_size)
        ids = train_stream[torch.as_tensor(starts, device=device)[:, None] + offsets]
        out = model(input_ids=ids, output_router_logits=True)
        ce = next_token_loss(out.logits, ids)
        aux = load_balancing_loss(out.router_logits, preset.experts_per_token)
        (ce + preset.router_aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window["ce"] += ce.item()
        window["aux"] += aux.item()
        window["n"] += 1
        step += 1
        if step == CALIBRATION_STEPS[0]:
            calibration_start = time.time()
        if step == CALIBRATION_STEPS[1] and config.time_budget_s:
            per_step = (time.time() - calibration_start) / (CALIBRATION_STEPS[1] - CALIBRATION_STEPS[0])
            fits = int((config.time_budget_s - (time.time() - started)) / (per_step * 1.15)) + step
            if fits < total_steps:
                print(f"time budget: {per_step * 1e3:.0f} ms a step, {total_steps} steps -> {fits}", flush=True)
                total_steps = max(fits, step + 1)
        if step % 10 == 0 or step == total_steps:
            curve.append(
                {
                    "step": step,
                    "train_ce": window["ce"] / window["n"],
                    "aux_loss": window["aux"] / window["n"],
                    "lr": lr,
                    "elapsed_s": round(time.time() - started, 1),
                }
            )
            window = {"ce": 0.0, "aux": 0.0, "n": 0}
        if step % preset.eval_every == 0 or step == total_steps:
            result = evaluate(
                model, streams["validation"], preset.sequence_length, device, eval_batch, preset.experts_per_token
            )
            evals.append({"step": step, "validation_ce": result["loss"]})
            print(
                f"step {step}/{total_steps} train ce {curve[-1]['train_ce']:.3f} aux {curve[-1]['aux_loss']:.3f} "
                f"validation ce {result['loss']:.3f} ({time.time() - started:.0f} s)",
                flush=True,
            )
            if result["loss"] < best["loss"]:
                best = {
                    "loss": result["loss"],
                    "step": step,
                    "state": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
                }

    model.load_state_dict(best["state"])
    model.to(torch.bfloat16).to(torch.float32)  # measure exactly the weights that are shipped (bf16)
    heldout = evaluate(model, streams["heldout"], preset.sequence_length, device, eval_batch, preset.experts_per_token)
    validation = evaluate(
        model, streams["validation"], preset.sequence_length, device, eval_batch, preset.experts_per_token
    )
    samples = generate_samples(model, tokenizer, device, config.seed) if config.samples else []
    save_checkpoint(model, tokenizer, preset, config.out)
    log = {
        "preset": config.preset,
        "model": describe(preset),
        "vocab_size": vocab_size,
        "seed": config.seed,
        "steps": total_steps,
        "steps_requested": config.steps or preset.steps,
        "tokens_seen": total_steps * preset.batch_size * preset.sequence_length,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "corpus": {
            "source": SOURCE_NOTE,
            "file": _relative(config.corpus),
            "chapters": {k: len(getattr(splits, k)) for k in ("train", "validation", "heldout")},
            "tokens": {k: int(len(v)) for k, v in streams.items()},
            "heldout_books": list(dict.fromkeys(c.book for c in splits.heldout)),
            "heldout_characters": heldout_chars,
        },
        "curve": curve,
        "evals": evals,
        "best_step": best["step"],
        "final": {
            "heldout_ce": heldout["loss"],
            "heldout_perplexity": heldout["perplexity"],
            "heldout_bits_per_character": heldout["nats"] / math.log(2) / heldout_chars,
            "validation_ce": validation["loss"],
            "validation_perplexity": validation["perplexity"],
            "weights": "bfloat16 (as shipped)",
        },
        "expert_load_heldout": load_balance(heldout["expert_counts"]),
        "samples": samples,
        "wall_s": round(time.time() - started, 1),
    }
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    _plot(log, config.out / "training_curve.png")
    print(
        f"held-out ce {heldout['loss']:.3f} (perplexity {heldout['perplexity']:.1f}), best step {best['step']}, "
        f"{log['wall_s']} s -> {config.out}",
        flush=True,
    )
    return log


def _relative(path: Path) -> str:
    """Logged paths relative to the working directory, so that logs from two machines compare."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def save_checkpoint(model, tokenizer, preset: Preset, out: Path) -> None:
    import torch

    model.config.output_router_logits = False  # serving needs no router logits back
    model.to(torch.bfloat16).save_pretrained(out)
    model.to(torch.float32)
    model.config.output_router_logits = True
    save_hf_tokenizer(tokenizer, out, preset.sequence_length)


def _plot(log: dict, path: Path) -> None:
    try:
        from training.plot import plot_training
    except ImportError:  # matplotlib is optional (the bench extra)
        return
    plot_training(log, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--corpus", type=Path, default=RunConfig.corpus)
    parser.add_argument("--out", type=Path, default=RunConfig.out)
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1, ...")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--time-budget-s",
        type=float,
        help="fewer steps if the preset's would not fit (decided "
        "during warm-up and logged; rerun with --steps N to reproduce)",
    )
    parser.add_argument("--no-samples", action="store_true")
    parser.add_argument(
        "--experts-implementation",
        default="eager",
        help="transformers' experts kernel (eager, grouped_mm, batched_mm; default eager)",
    )
    args = parser.parse_args(argv)
    train(
        RunConfig(
            preset=args.preset,
            corpus=args.corpus,
            out=args.out,
            device=args.device,
            steps=args.steps,
            seed=args.seed,
            time_budget_s=args.time_budget_s,
            samples=not args.no_samples,
            experts_implementation=args.experts_implementation,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
