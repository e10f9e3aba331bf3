"""`colibri verify MODEL_DIR`: every structural check of the loader, then every tensor's crc32."""
from __future__ import annotations

import argparse

from common.errors import ColibriError
from common.model_format import ModelDir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a Colibri model directory (colibri.json)")
    parser.add_argument("--workers", type=int, default=None, help="checksum threads (default: min(8, CPUs))")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    # Structural checks first (paths, sizes, dtypes, shapes), so a checksum never reads past a file's end.
    try:
        model = ModelDir.open(args.model_dir, verify=False)
        model.verify(progress=not args.no_progress, workers=args.workers)
    except OSError as e:   # disk full, permissions, I/O errors: the operator's to fix, not a bug
        raise ColibriError(f"{e.filename or '?'}: {e.strerror or e}") from None
    print(f"ok: {len(model.entries)} tensors, {model.total_bytes:,} bytes verified")
    return 0
