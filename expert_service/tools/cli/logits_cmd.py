"""`colibri logits --model DIR --tokens 1,2,3 --out FILE.npy`: float32 prefill logits [num_tokens, vocab]."""

from __future__ import annotations

import argparse
from typing import BinaryIO

import numpy as np

from common.files import replaced_whole
from expert_service.tools.cli.offline import add_model_arguments, open_engine
from expert_service.tools.cli.paths import given_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--out", required=True, metavar="FILE.npy", help="where to write the logits")


def run(args: argparse.Namespace) -> int:
    # Opened first, so a path that cannot be written is told before the model loads; the logits replace the file
    # only once all are written (common.files.replaced_whole), never leaving it truncated.
    with replaced_whole(given_path(args.out, "--out", "the .npy file to write")) as f:
        engine, ids = open_engine(args)
        logits = engine.prompt_logits(ids).astype(np.float32)
        # Through a bare writer, not the file: np.save hands a real file to ndarray.tofile, whose short write on a
        # full disk is an OSError without errno or file name. Nor does it get a name, to which it would add ".npy".
        np.save(_Writer(f), logits)
    print(f"wrote {args.out}: float32 {list(logits.shape)}")
    return 0


class _Writer:
    def __init__(self, f: BinaryIO):
        self.write = f.write
