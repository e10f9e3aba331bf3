"""`colibri convert HF_DIR OUT_DIR [--dtype D] [--expert-dtype E] [--head-dtype H] [--attention-dtype A]`: a Hugging
Face safetensors checkpoint -> a model directory."""

from __future__ import annotations

import argparse

from common import dtypes
from common.errors import ConfigError, ModelFormatError
from common.model_format import ModelDir


def _dense_dtype(text: str) -> str:
    """--dtype's value: a dense dtype or its alias (as --expert-dtype and --head-dtype take them) -> its name."""
    try:
        return dtypes.canonical_dtype(text)
    except ModelFormatError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "hf_dir",
        metavar="HF_DIR",
        help="checkpoint directory: config.json + *.safetensors "
        "(single file or sharded with model.safetensors.index.json) + tokenizer files",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="model directory to write (created if missing)")
    parser.add_argument(
        "--dtype",
        type=_dense_dtype,
        metavar="DTYPE",
        default=None,
        help="storage dtype of every tensor but the routed experts': float32, float16 or bfloat16 (aliases fp32, "
        "fp16, bf16; default: the checkpoint's; bfloat16 for an fp8 checkpoint); overflowing conversions are refused",
    )
    parser.add_argument(
        "--expert-dtype",
        metavar="DTYPE",
        default=None,
        help="storage of the routed experts: bfloat16, float16, float32, int8 (per-channel scales) or fp8 "
        "(float8_e4m3fn, scales per --fp8-scale) (default: as --dtype; an fp8 checkpoint's experts keep "
        "their fp8 bytes and block scales)",
    )
    parser.add_argument(
        "--fp8-scale",
        choices=("block128", "channel"),
        default=None,
        help="fp8 experts' scales: one per 128x128 block (default, as published fp8 checkpoints) or one per "
        "output channel (an fp8 checkpoint's experts are re-scaled to it)",
    )
    parser.add_argument(
        "--expert-dtype-file",
        metavar="FILE",
        default=None,
        help="JSON or YAML choosing the dtype per layer / per expert, and optionally keeping the experts a "
        "routing table marks hot in the dense dtype (docs/quantization.md)",
    )
    parser.add_argument(
        "--head-dtype",
        metavar="DTYPE",
        default=None,
        help="storage of the LM head: int8 or fp8 (float8_e4m3fn), one float32 scale per row, or the dense dtype "
        "(default); a tied model's 8-bit head is quantized from the embedding, which stays in the dense dtype",
    )
    parser.add_argument(
        "--attention-dtype",
        metavar="DTYPE",
        default=None,
        help="storage of the attention projections (q_proj, k_proj, v_proj, o_proj of every layer): int8 or fp8 "
        "(float8_e4m3fn), one float32 scale per row, or the dense dtype (default); biases and q/k norms stay dense; "
        "the cpu backend runs them, the cuda backend not yet",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    from expert_service.tools.convert import convert

    if not args.out_dir:  # Path("") is the working directory: the model's files would land wherever it was run
        raise ConfigError("OUT_DIR: empty (name the model directory to write)")

    out = convert(
        args.hf_dir,
        args.out_dir,
        dtype=args.dtype,
        progress=not args.no_progress,
        expert_dtype=args.expert_dtype,
        fp8_scale=args.fp8_scale,
        expert_dtype_file=args.expert_dtype_file,
        head_dtype=args.head_dtype,
        attention_dtype=args.attention_dtype,
    )
    model = ModelDir.open(out, verify=False)
    print(
        f"converted {args.hf_dir} -> {out}: {model.config.family}, {len(model.entries)} tensors, "
        f"{model.total_bytes:,} bytes {model.dtype}, experts {' + '.join(model.expert_formats) or 'none'}"
        + (f", head {model.head_format.dtype}" if model.head_format else "")
        + (f", attention {model.attention_format.dtype}" if model.attention_format else "")
    )
    return 0
