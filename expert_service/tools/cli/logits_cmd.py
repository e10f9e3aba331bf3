"""`colibri logits --model DIR --tokens 1,2,3 --out FILE.npy`: float32 prefill logits [num_tokens, vocab]."""

from __future__ import annotations

import argparse

import numpy as np

from expert_service.tools.cli.offline import add_model_arguments, open_engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--out", required=True, metavar="FILE.npy", help="where to write the logits")


def run(args: argparse.Namespace) -> int:
    engine, ids = open_engine(args)
    logits = engine.prompt_logits(ids).astype(np.float32)
    # Opened here, not by np.save, which would append ".npy" to any other name and write elsewhere; the
    # close flushes, so a full disk or device raises here instead of reporting success.
    try:
        with open(args.out, "wb") as f:
            np.save(f, logits)
    except OSError as e:
        raise OSError(e.errno, e.strerror, args.out) from None
    print(f"wrote {args.out}: float32 {list(logits.shape)}")
    return 0
