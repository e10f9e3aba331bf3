"""`colibri convert HF_DIR OUT_DIR [--dtype D]`: a Hugging Face safetensors checkpoint -> a model directory."""

from __future__ import annotations

import argparse

from common.model_format import ModelDir


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
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="storage dtype (default: the checkpoint's); overflowing conversions are refused",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    from expert_service.tools.convert import convert

    out = convert(args.hf_dir, args.out_dir, dtype=args.dtype, progress=not args.no_progress)
    model = ModelDir.open(out, verify=False)
    print(
        f"converted {args.hf_dir} -> {out}: {model.config.family}, {len(model.entries)} tensors, "
        f"{model.total_bytes:,} bytes {model.dtype}"
    )
    return 0
