"""`colibri make-tiny OUT_DIR`: the small deterministic random-weight model used by `make run` and tests."""

from __future__ import annotations

import argparse

from common.models import FAMILIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "out_dir", metavar="OUT_DIR", help="model directory to write; the HF checkpoint goes to OUT_DIR/hf"
    )
    parser.add_argument("--family", choices=sorted(FAMILIES), default="mixtral", help="model family")
    parser.add_argument("--seed", type=int, default=0, help="weight seed; same seed -> identical files")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    from common.errors import ConfigError
    from common.model_format import ModelDir
    from expert_service.tools.cli.paths import given_path
    from expert_service.tools.tiny_model import make_tiny

    given_path(args.out_dir, "OUT_DIR", "the model directory to write")
    if args.seed < 0:  # numpy's generator refuses it only after OUT_DIR/hf was created, with a bare ValueError
        raise ConfigError(f"--seed: must be >= 0, got {args.seed}")
    out = make_tiny(args.out_dir, family=args.family, seed=args.seed, progress=not args.no_progress)
    model = ModelDir.open(out, verify=False)
    print(
        f"wrote tiny {args.family} (seed {args.seed}) to {out}: {len(model.entries)} tensors, "
        f"{model.total_bytes:,} bytes, vocab {model.config.vocab_size}"
    )
    return 0
