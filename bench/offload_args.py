"""bench/offload.py's command line: the flags, and every check made before anything runs (a bad flag, table or
checkpoint fails at once, not after an hour of runs)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np

from bench.engine import SHAPES
from bench.offload_hf import DECODE_CONTEXT, DECODE_STEPS, PREFILL_TOKENS
from bench.offload_model import TokenSource, load_table, open_model, text_source
from bench.offload_plan import check_plan_cuts, parse_plan_min_share, parse_plan_top_k
from bench.offload_report import CUDA_OPTIONS, OPTIONS, option_defaults
from common.errors import ColibriError
from common.model_format import ModelDir
from expert_service.experts.cache import POLICIES

FRACTIONS = (1.0, 0.5, 0.25, 0.125)
PREFETCH_MODES = ("none", "plan", "lookahead", "plan+lookahead")
TINY = "tiny"  # test-only shape: expert_service.tools.tiny_model's Mixtral (cpu backend, no HF)
SAMPLED_TEMPERATURE = 0.8  # the sampled continuations' temperature unless --temperature says otherwise


def parse_args(
    argv: list[str] | None, description: str | None
) -> tuple[argparse.Namespace, tuple[ModelDir, TokenSource] | None]:
    """The parsed and checked flags, and (model, prompts) with --model; `description`: bench/offload.py's docstring."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--model", help="a converted Colibri model directory to run instead of --shapes")
    parser.add_argument(
        "--prompts",
        help="text to take prompts from (tokenised with the model's tokenizer.json); default: uniform random token ids",
    )
    parser.add_argument(
        "--table",
        help="routing table for the plan prefetch (with --model; default: "
        "MODEL/routing_table.bin); without --model one is traced from random ids",
    )
    parser.add_argument("--hf-model", help="the Hugging Face checkpoint --model was converted from (the reference)")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--prefetch-modes", default=",".join(PREFETCH_MODES))
    parser.add_argument("--decode-steps", type=int, default=DECODE_STEPS, help="timed decode steps per batch size")
    parser.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--workdir", default="/dev/shm/colibri-offload")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--policy", choices=POLICIES, default="lru", help="the expert cache's replacement policy")
    parser.add_argument(
        "--temperature",
        type=float,
        default=SAMPLED_TEMPERATURE,
        help="the decode phases also run with continuations sampled at this temperature (fixed seeds), beside the "
        "greedy ones; 0: greedy only",
    )
    parser.add_argument(
        "--plan-source",
        choices=("worker", "router"),
        default="worker",
        help="where the plan prefetch's plan comes from: the worker's own lookup of each step's tokens in the table "
        "(on the device on cuda; steps then also run two in flight, as served) or the router's plan sent with "
        "each step",
    )
    parser.add_argument(
        "--plan-top-k",
        help="run each plan mode once per k (1,2): with the table's k most likely predictions a token, keyed "
        "MODE/topK below the table's own k (default: the table as it is)",
    )
    parser.add_argument(
        "--plan-min-share",
        help="also run each plan mode once per F (0.3,0.5) with the table gated by share, keyed MODE/shareF (needs "
        "the table's counts file: colibri router-gen --save-counts)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="cuda: record one more decode step per batch size kernel by kernel (streams, waits) into the JSON",
    )
    defaults = option_defaults()
    for option in OPTIONS:  # each run keyed by the options it changes (option_key)
        default = "on" if defaults[option] else "off"
        owner = "CudaOptions" if option in CUDA_OPTIONS else "EngineConfig"
        help_text = f"{owner}.{option} of the cached runs: on, off or on,off (both, side by side)"
        parser.add_argument("--" + option.replace("_", "-"), default=default, help=help_text)
    parser.add_argument(
        "--expert-dtype",
        default=None,
        help="convert the --shapes models' experts to this dtype (int8, fp8, ...; default bf16); a --model "
        "directory keeps the experts it was converted with",
    )
    args = parser.parse_args(argv)
    if args.expert_dtype is not None and args.model:
        parser.error(
            "--expert-dtype: converts the --shapes models; convert --model with colibri convert --expert-dtype"
        )
    args.fractions = [float(f) for f in args.fractions.split(",")]
    args.prefetch_modes = args.prefetch_modes.split(",")
    if bad := [m for m in args.prefetch_modes if m not in PREFETCH_MODES]:
        parser.error(f"--prefetch-modes: {bad} not in {', '.join(PREFETCH_MODES)}")
    settings = {"on": True, "off": False}
    for option in OPTIONS:
        values = [settings.get(v, v) for v in dict.fromkeys(getattr(args, option).split(","))]
        if bad := [v for v in values if not isinstance(v, bool)]:
            parser.error(f"--{option.replace('_', '-')}: {bad} not in on, off")
        default = defaults[option]
        setattr(args, option, sorted(values, key=lambda v, d=default: v != d))  # the default first: MODE's key
    if not (np.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature: a finite number >= 0, got {args.temperature}")
    if args.decode_steps < 1:
        parser.error(f"--decode-steps: must be >= 1, got {args.decode_steps}")
    try:
        args.plan_top_k = parse_plan_top_k(args.plan_top_k)
        args.plan_min_share = parse_plan_min_share(args.plan_min_share)
        for flag in ("plan_top_k", "plan_min_share"):
            if getattr(args, flag) and not any("plan" in m for m in args.prefetch_modes):
                parser.error(f"--{flag.replace('_', '-')}: no plan mode in --prefetch-modes")
        model_input = _check_model_args(parser, args)
    except ColibriError as e:
        parser.error(str(e))
    if not args.skip_hf and args.shapes != TINY and importlib.util.find_spec("accelerate") is None:
        parser.error("the HF reference needs accelerate (pip install 'accelerate>=1.15'); or pass --skip-hf")
    return args, model_input


def token_source(model: ModelDir, prompts: str | None) -> TokenSource:
    longest = max(PREFILL_TOKENS, DECODE_CONTEXT)
    return text_source(model, prompts, longest) if prompts else TokenSource(model.config.vocab_size)


def _check_model_args(parser, args) -> tuple[ModelDir, TokenSource] | None:
    """--model, --table, --hf-model and --prompts checked before anything runs; (model, prompts) with --model."""
    if args.model is None:
        for flag in ("table", "hf_model"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} needs --model")
        if args.shapes != TINY and args.prompts:
            parser.error("--prompts needs a model with a tokenizer: --model DIR (or --shapes tiny)")
        return None
    if not args.skip_hf and args.hf_model is None:
        parser.error(
            "--model: the HF reference needs --hf-model HF_DIR (the checkpoint --model was converted "
            "from); or pass --skip-hf"
        )
    if not args.skip_hf and not (Path(args.hf_model) / "config.json").is_file():
        parser.error(
            f"--hf-model: {args.hf_model} has no config.json (expected the checkpoint --model was converted from)"
        )
    model = open_model(args.model)
    default_table = model.path / "routing_table.bin"
    if args.table is None and (default_table.is_file() or any("plan" in m for m in args.prefetch_modes)):
        args.table = str(default_table)
    if args.table is not None:  # a missing or mismatched table (or counts file) fails now, not after an hour
        check_plan_cuts(load_table(model, args.table)[0], Path(args.table), args.plan_top_k, args.plan_min_share)
    return model, token_source(model, args.prompts)
