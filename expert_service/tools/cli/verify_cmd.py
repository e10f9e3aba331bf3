"""`colibri verify MODEL_DIR`: every structural check of the loader, then every tensor's crc32."""

from __future__ import annotations

import argparse

from common.errors import ConfigError
from common.model_format import ModelDir
from expert_service.tools.cli.paths import given_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a Colibri model directory (colibri.json)")
    parser.add_argument("--workers", type=int, default=None, help="checksum threads (default: min(8, CPUs))")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:  # the thread pool would refuse it with a bare ValueError
        raise ConfigError(f"--workers: must be >= 1, got {args.workers}")
    given_path(args.model_dir, "MODEL_DIR", "the model directory to verify")
    # Structural checks first (paths, sizes, dtypes, shapes), so a checksum never reads past a file's end.
    model = ModelDir.open(args.model_dir, verify=False)
    model.verify(progress=not args.no_progress, workers=args.workers)
    print(f"ok: {len(model.entries)} tensors, {model.total_bytes:,} bytes verified")
    return 0
