"""Engine benchmark: Colibri's cuda backend against Hugging Face transformers, same weights, one run.

For each reference shape (mixtral-shape: Mixtral-8x7B dimensions with 4 layers; qwen3moe-shape: Qwen3-30B-A3B
dimensions with 8 layers) it builds a random bf16 model on the GPU with transformers, writes the same weights
as a Colibri model directory (to --workdir, /dev/shm by default), and measures on both: prefill tok/s (b=1 x 512,
b=16 x 128; best of 5 after warm-up -- for Colibri an eager and a captured step, so the timed ones replay the
bucket's graphs), decode ms/step (b=1, 16, 64) and peak device memory (HF: torch's peak over all of that work, and
up to b=1; Colibri: device memory in use after building the engine or after the work, whichever is more, with a
KV pool sized for the work); for Colibri also the decode HBM-roofline fraction (bytes the step must read --
dense weights, the experts its tokens routed to, the KV it attends over -- / this GPU's streaming HBM read rate,
measured at the start of the run by bench/hbm_rate.py / measured time). Colibri's
decode is timed as the worker serves a step stream (`decode_ms`: a StepPump with two steps in flight from the
sender, so step t+1 runs on the device while step t is sampled and answered) and one step at a time
(`decode_ms_sequential`: Engine.step, each waiting for the one before). Writes JSON + PNG and prints ratios.

`--expert-dtype bfloat16,int8,fp8` runs Colibri once per routed-expert dtype on the same weights (the HF save
converted with `--expert-dtype int8` / `fp8` with 128x128 block scales) and adds `<dtype>_x_bfloat16` ratios
(`int8+head` / `fp8+head`: the LM head in the same 8 bits too, per-row scales, `--head-dtype`; `int8+head+attn` /
`fp8+head+attn`: the attention projections as well, `--attention-dtype`);
`colibri` holds the first dtype's figures, `colibri_by_expert_dtype` all of them, each with the HBM roofline of
the bytes its steps read (8-bit experts: their bytes and scales). The full-depth shape `qwen3moe-full`
(Qwen3-30B-A3B, all 48 layers: ~61 GB bf16, ~31 GB 8-bit) is written straight into the model format with random
weights (bench/random_model.py; no transformers model, no HF comparison); its dtypes run one after another, each
model deleted before the next is written (bf16 at full depth needs 61 GB free in --workdir). `--skip-hf` writes
every shape that way (seconds a model, where converting transformers' weights to 8 bits takes minutes), and the
JSON is rewritten after each dtype's run, so a run cut short keeps what it measured. Each run records the
MoE strategy its step sizes took (`moe_strategy`); bench/q8_mma.py sweeps the 8-bit strategies' thresholds.

    python bench/engine.py --out out/ [--shapes mixtral-shape,qwen3moe-shape] [--skip-hf]
    python bench/engine.py --out out/ --shapes qwen3moe-full --expert-dtype int8,fp8
    python bench/engine.py --out out/ --shapes mixtral-shape --skip-hf --cuda-options '{"decode_splits_per_step": true}'

`--cuda-options` builds the engines with those CudaOptions fields (recorded in the JSON as `cuda_options`).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hbm_rate  # noqa: E402
from bench.plotting import pyplot  # noqa: E402

SHAPES = {
    "mixtral-shape": (
        "mixtral",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=4096,
        ),
    ),
    "qwen3moe-shape": (
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            max_position_embeddings=4096,
        ),
    ),
}
FULL_DEPTH = {"qwen3moe-full": ("qwen3moe-shape", 48)}  # written with random weights, no HF model
PREFILL = ((1, 512), (16, 128))
DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXT = 128
DECODE_STEPS = 32
KV_BLOCK = 16


def build_hf(family: str, params: dict):
    import torch
    import transformers

    classes = {"mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig}
    config = classes[family](
        **params, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return model


def write_colibri(model, out: Path, expert_dtype: str | None = None) -> Path:
    """The HF model's own weights, saved by transformers (legacy per-expert names) and run through
    `colibri convert`, so both engines hold the same bf16 weights (the experts in `expert_dtype` when
    given: int8, fp8, ... as `colibri convert --expert-dtype`)."""
    from expert_service.tools.convert import convert

    hf_dir = out.parent / (out.name + "-hf")
    model.save_pretrained(hf_dir)
    try:
        return convert(hf_dir, out, progress=False, expert_dtype=expert_dtype)
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)


def cuda_time(fn, repeats: int = 3) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def bench_hf(model, vocab: int) -> dict:
    import torch

    rng = np.random.default_rng(0)
    out = {"prefill_tok_s": {}, "decode_ms": {}}
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for b, n in PREFILL:
            ids = torch.tensor(rng.integers(0, vocab, (b, n)), device="cuda")
            out["prefill_tok_s"][f"{b}x{n}"] = b * n / cuda_time(lambda: model(ids), repeats=5)
        for b in DECODE_BATCHES:
            ids = torch.tensor(rng.integers(0, vocab, (b, DECODE_CONTEXT)), device="cuda")
            gen = dict(do_sample=False, pad_token_id=0)
            t1 = cuda_time(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen), 2)
            tn = cuda_time(
                lambda: model.generate(ids, max_new_tokens=DECODE_STEPS + 1, min_new_tokens=DECODE_STEPS + 1, **gen), 2
            )
            out["decode_ms"][str(b)] = (tn - t1) / DECODE_STEPS * 1e3
            if b == 1:
                out["peak_memory_gib_b1"] = torch.cuda.max_memory_allocated() / 2**30
    out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30  # over all of the work above
    return out


def release_device_memory() -> None:
    """Frees what earlier engines left: Python garbage first, then Numba's pending deallocations (it batches them),
    so device_used_bytes measures this engine alone (a later free had made an int8 run's figure negative)."""
    from expert_service.cuda.device_memory import free_pending_deallocations

    free_pending_deallocations()  # the memory manager's queue: the context's own holds streams and events


def device_used_bytes() -> int:
    from cuda.bindings import driver as drv
    from numba import cuda

    cuda.current_context()  # cuMemGetInfo needs a current context; torch's device queries do not make one
    err, free, total = drv.cuMemGetInfo()
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemGetInfo: {err}")
    return total - free


def start_decodes(engine, ids: list[int], vocab: int, rng, context: int = DECODE_CONTEXT) -> None:
    """Random `context`-token prompts for sequences `ids`, prefilled in steps of 16 (the step budget), then three
    decode steps of all of them (eager, captured, replayed): the next decode step replays its bucket's graph."""
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    for start in range(0, len(ids), 16):
        engine.step(
            [PrefillInput(i, rng.integers(0, vocab, context), SamplingParams(), True) for i in ids[start : start + 16]]
        )
    for _ in range(3):
        engine.step(decode_ids=ids)


def pipelined_decode(engine, ids: list[int], thread, step_bytes) -> tuple[float, float]:
    """Decode steps as the worker serves a router's step stream: a StepPump on a model thread, two steps in
    flight from the sender (the router's pipeline_depth), so the worker launches step t+1 before it collects
    step t. Returns (seconds per step over DECODE_STEPS steps, median bytes a step must read)."""
    from expert_service.serving.step_stream import StepPump, StepRequest, StreamSession

    pump = StepPump(StreamSession(engine, {}), thread)
    empty, decodes = np.zeros(0, "<u8"), np.asarray(ids, "<u8")
    cached = sum(engine.sequences[i].num_cached for i in ids)  # step j's context: cached + (j + 1) * len(ids)
    sent = collections.deque(pump.submit(StepRequest(i, empty, [], decodes, None)) for i in range(2))
    for i in range(2, 6):  # warm: the pump reaches its steady state
        sent.popleft().result()
        sent.append(pump.submit(StepRequest(i, empty, [], decodes, None)))
    moved = []
    start = time.perf_counter()
    for i in range(DECODE_STEPS):
        result = sent.popleft().result().result
        sent.append(pump.submit(StepRequest(6 + i, empty, [], decodes, None)))
        moved.append(step_bytes(result, cached + (5 + i) * len(ids)))
    seconds = (time.perf_counter() - start) / DECODE_STEPS
    for future in sent:
        future.result()
    return seconds, float(np.median(moved))


def bench_colibri(model_dir: Path, vocab: int, cuda_options: dict | None, hbm_bytes_per_s: float) -> dict:
    """Colibri's figures on one model; `hbm_bytes_per_s` is the roofline fractions' denominator."""
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.engine.cuda_options import CudaOptions
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams
    from expert_service.serving.lifecycle import ModelThread

    rng = np.random.default_rng(0)
    release_device_memory()  # an engine measured before (another dtype) must not be freed during this one
    before = device_used_bytes()
    model = ModelDir.open(model_dir, verify=False)
    # sized for the work below, as HF's cache is: the largest batch's prompts and decode steps (timed one at a
    # time, then pipelined, each after a few warm-up steps), whole blocks
    kv_tokens = max(DECODE_BATCHES) * -(-(DECODE_CONTEXT + 2 * DECODE_STEPS + 12) // KV_BLOCK) * KV_BLOCK
    engine = build_engine(
        model,
        EngineConfig(
            backend="cuda",
            kv_block_size=KV_BLOCK,
            kv_cache_tokens=kv_tokens,
            max_batch_tokens=2048,
            max_batch_size=max(DECODE_BATCHES),
            cuda_options=CudaOptions(**(cuda_options or {})),
        ),
    )
    out = {
        "prefill_tok_s": {},
        "decode_ms": {},
        "roofline_fraction": {},
        "bytes_per_step": {},
        "decode_ms_sequential": {},
        "roofline_fraction_sequential": {},
        "memory_plan": dict(engine.decoder.memory_plan()),
        "device_memory_gib": (device_used_bytes() - before) / 2**30,
    }
    sync = engine.decoder.stream.synchronize
    for b, n in PREFILL:
        chunks = [PrefillInput(1000 + i, rng.integers(0, vocab, n), SamplingParams(), True) for i in range(b)]

        def prefill():
            engine.step(chunks)
            engine.clear()

        best = float("inf")
        for _ in range(2):  # eager, then captured: the timed steps replay the bucket's graph
            prefill()
        for _ in range(5):
            start = time.perf_counter()
            prefill()
            sync()
            best = min(best, time.perf_counter() - start)
        out["prefill_tok_s"][f"{b}x{n}"] = b * n / best
    cfg = model.config
    dense = engine.decoder.weights.dense_bytes - cfg.vocab_size * cfg.hidden_size * 2  # the embedding is gathered
    expert_bytes = model.max_expert_nbytes  # one routed expert's weights (and scales): one dtype per run here
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2

    def step_bytes(result, context: int) -> int:
        """Bytes a decode step must read: dense weights, the experts its tokens routed to, the KV it attends
        over (`context`: its sequences' tokens in the cache after the step)."""
        experts = sum(len(np.unique(e)) for e in result.trace.expert_ids.values())
        return dense + experts * expert_bytes + context * kv_per_token

    thread = ModelThread("bench-model")
    for b in DECODE_BATCHES:
        ids = list(range(b))
        start_decodes(engine, ids, vocab, rng)
        times, moved = [], []
        for _ in range(DECODE_STEPS):  # one step at a time: each waits for the one before
            start = time.perf_counter()
            result = engine.step(decode_ids=ids)
            times.append(time.perf_counter() - start)
            moved.append(step_bytes(result, sum(engine.sequences[i].num_cached for i in ids)))
        served, served_moved = pipelined_decode(engine, ids, thread, step_bytes)
        engine.clear()
        step, bytes_moved = float(np.median(times)), float(np.median(moved))
        out["decode_ms_sequential"][str(b)] = step * 1e3
        out["roofline_fraction_sequential"][str(b)] = bytes_moved / hbm_bytes_per_s / step
        out["decode_ms"][str(b)] = served * 1e3
        out["bytes_per_step"][str(b)] = served_moved
        out["roofline_fraction"][str(b)] = served_moved / hbm_bytes_per_s / served
    thread.shutdown()
    # which MoE strategy each timed step size took (Q8_MMA, Q8, GROUPED_MMA, per-expert cuBLAS, ...)
    out["moe_strategy"] = strategies(engine, sorted({*DECODE_BATCHES, *(b * n for b, n in PREFILL)}))
    # peak: the plan is allocated up front, but kernel modules, cuBLAS and graphs load as the work runs
    out["device_memory_gib_after_work"] = (device_used_bytes() - before) / 2**30
    out["device_memory_gib"] = max(out["device_memory_gib"], out["device_memory_gib_after_work"])
    engine.decoder.close()
    return out


def save_hf(model, out: Path) -> Path:
    """The HF model saved once (legacy per-expert names), converted per expert dtype by convert_expert_dtype."""
    hf_dir = out.parent / (out.name + "-hf")
    model.save_pretrained(hf_dir)
    return hf_dir


# a run's dtype: the routed experts' (bfloat16, int8, fp8), "+head" for the LM head in the same 8 bits, "+attn"
# for the attention projections too
RUN_DTYPES = ("bfloat16", "int8", "fp8", "int8+head", "fp8+head", "int8+head+attn", "fp8+head+attn")


def run_formats(dtype: str) -> tuple[str, str | None, str | None]:
    """A run's dtype -> (expert dtype, head dtype for `colibri convert --head-dtype`, attention dtype for
    `--attention-dtype`; None: the dense dtype)."""
    experts, *parts = dtype.split("+")
    eight_bit = {"int8": "int8", "fp8": "float8_e4m3fn"}.get(experts)
    return experts, eight_bit if "head" in parts else None, eight_bit if "attn" in parts else None


def convert_expert_dtype(hf_dir: Path, dtype: str) -> Path:
    from expert_service.tools.convert import convert

    out = hf_dir.parent / f"{hf_dir.name[: -len('-hf')]}-{dtype}"
    experts, head, attention = run_formats(dtype)
    return convert(
        hf_dir,
        out,
        progress=False,
        expert_dtype=None if experts == "bfloat16" else experts,
        head_dtype=head,
        attention_dtype=attention,
    )


def random_model(family: str, params: dict, out: Path, dtype: str) -> Path:
    from bench.random_model import write_random_model
    from expert_service.tools.tiny_model import tiny_hf_config

    hf_config = {**tiny_hf_config(family), **params, "tie_word_embeddings": False}
    start = time.perf_counter()
    experts, head, attention = run_formats(dtype)
    model = write_random_model(
        out.parent / f"{out.name}-{dtype}", hf_config, experts, head_dtype=head, attention_dtype=attention
    )
    print(f"wrote {model} in {time.perf_counter() - start:.0f} s", flush=True)
    return model


def expert_dtype_ratios(runs: dict) -> dict:
    """Each 8-bit run against bfloat16: decode speedup per batch (bf16 ms / ms) and prefill tok/s ratio."""
    ref = runs["bfloat16"]
    out = {}
    for dtype, run in runs.items():
        if dtype == "bfloat16":
            continue
        out.update(
            {f"decode_b{b}_{dtype}_x_bfloat16": ref["decode_ms"][b] / run["decode_ms"][b] for b in run["decode_ms"]}
        )
        out.update(
            {
                f"prefill_{k}_{dtype}_x_bfloat16": run["prefill_tok_s"][k] / ref["prefill_tok_s"][k]
                for k in run["prefill_tok_s"]
            }
        )
    return out


def strategies(engine, sizes) -> dict[str, str]:
    """The MoE strategy a step of each size takes on this engine, under its current options (the decoder's own
    choice, so every option that moves a step size is in it); "+w8a8" where its first MoE layer runs W8A8."""
    d = engine.decoder
    moe, first = d.model.moe, d.moe_layers[0] if d.moe_layers else None
    w8a8 = {T: first is not None and moe.runs_w8a8(first, T) for T in sizes}
    return {str(T): d._strategy(T).value + ("+w8a8" if w8a8[T] else "") for T in sizes}


def cuda_options_arg(parser, text: str) -> dict:
    """--cuda-options parsed and checked against CudaOptions (one line naming what is wrong, not a traceback)."""
    from common.errors import ConfigError
    from expert_service.engine.config import cuda_options_from_mapping

    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("must be a JSON object")
        cuda_options_from_mapping(fields)
    except (ValueError, ConfigError) as error:
        parser.error(f"--cuda-options {text}: {error}")
    return fields


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--workdir", default="/dev/shm/colibri-bench")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--expert-dtype",
        default="bfloat16",
        help=f"comma-separated: {', '.join(RUN_DTYPES)} (+head: the LM head too, +attn: the attention projections)",
    )
    parser.add_argument(
        "--cuda-options", default="{}", help='CudaOptions fields as a JSON object, e.g. {"wgmma_experts": false}'
    )
    hbm_rate.add_argument(parser)
    args = parser.parse_args()
    cuda_options = cuda_options_arg(parser, args.cuda_options)
    expert_dtypes = args.expert_dtype.split(",")
    if not set(expert_dtypes) <= set(RUN_DTYPES):
        parser.error(f"--expert-dtype {args.expert_dtype}: each must be one of {', '.join(RUN_DTYPES)}")
    import torch

    roofline = hbm_rate.roofline(args.hbm_bytes_per_s)  # before any model takes the device's memory
    print(roofline.summary(), flush=True)
    results = {
        **roofline.record(),
        "expert_dtypes": expert_dtypes,
        "cuda_options": cuda_options,
        "shapes": {},
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        if name not in SHAPES and name not in FULL_DEPTH:
            parser.error(f"--shapes: unknown shape {name!r} (known: {', '.join([*SHAPES, *FULL_DEPTH])})")
        entry = {"hf": None}
        workdir = Path(args.workdir) / name
        if name in FULL_DEPTH:
            base, layers = FULL_DEPTH[name]
            family, params = SHAPES[base][0], {**SHAPES[base][1], "num_hidden_layers": layers}
            model_of = functools.partial(random_model, family, params, workdir)
        elif args.skip_hf:  # no transformers model to compare with: random weights written straight, per dtype
            family, params = SHAPES[name]
            model_of = functools.partial(random_model, family, params, workdir)
        else:
            family, params = SHAPES[name]
            hf = build_hf(family, params)
            model_of = functools.partial(convert_expert_dtype, save_hf(hf, workdir))
            entry["hf"] = None if args.skip_hf else bench_hf(hf, params["vocab_size"])
            del hf
            gc.collect()
            torch.cuda.empty_cache()
        runs = {}
        for dtype in expert_dtypes:  # one model on disk at a time
            model_dir = model_of(dtype)
            runs[dtype] = bench_colibri(model_dir, params["vocab_size"], cuda_options, roofline.bytes_per_s)
            shutil.rmtree(model_dir, ignore_errors=True)
            results["shapes"][name] = {**entry, "colibri_by_expert_dtype": runs}  # what is done, if cut short
            (out_dir / "engine.json").write_text(json.dumps(results, indent=1))
        shutil.rmtree(workdir.parent / (workdir.name + "-hf"), ignore_errors=True)
        entry["colibri"], entry["colibri_by_expert_dtype"] = runs[expert_dtypes[0]], runs
        if "bfloat16" in runs:
            entry["expert_dtype_ratios"] = expert_dtype_ratios(runs)
        if entry["hf"]:
            c, h = entry["colibri"], entry["hf"]
            entry["ratios"] = {
                **{f"prefill_{k}_x_hf": c["prefill_tok_s"][k] / h["prefill_tok_s"][k] for k in c["prefill_tok_s"]},
                **{f"decode_b{k}_speedup_x_hf": h["decode_ms"][k] / c["decode_ms"][k] for k in c["decode_ms"]},
                "memory_x_hf": c["device_memory_gib"] / h["peak_memory_gib"],
                "memory_x_hf_b1": c["device_memory_gib"] / h["peak_memory_gib_b1"],
            }
        results["shapes"][name] = entry
        print(json.dumps({name: entry}, indent=1), flush=True)
        (out_dir / "engine.json").write_text(json.dumps(results, indent=1))
    _plot(results, out_dir / "engine.png")
    return 0


def _plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    shapes = results["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, (name, entry) in zip(axes[0], shapes.items()):
        batches = list(entry["colibri"]["decode_ms"])
        x = np.arange(len(batches))
        ax.bar(x - 0.2, [entry["colibri"]["decode_ms"][b] for b in batches], 0.4, label="colibri")
        if entry.get("hf"):
            ax.bar(x + 0.2, [entry["hf"]["decode_ms"][b] for b in batches], 0.4, label="transformers")
        ax.set(xticks=x, xticklabels=[f"b={b}" for b in batches], ylabel="ms / decode step", title=name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
