"""What identifies a model across the router/worker split: SHA-256 digests of a model directory's manifest
(colibri.json: the HF config, the dense dtype and every tensor's crc32, so another checkpoint or conversion has
another digest) and of its tokenizer.json. The worker reports both in Info (`model_digest`, `tokenizer_digest`);
the router compares them with its own model directory's and refuses a worker that serves another model."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "colibri.json"
TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class ModelDigests:
    """The "sha256:<hex>" digests of the directory's colibri.json and tokenizer.json; "" for a file it lacks."""

    manifest: str = ""
    tokenizer: str = ""

    @classmethod
    def of_dir(cls, model_dir: str | os.PathLike | None) -> ModelDigests:
        if not model_dir:
            return cls()
        root = Path(model_dir)
        return cls(file_digest(root / MANIFEST), file_digest(root / TOKENIZER))


def file_digest(path: Path) -> str:
    """The "sha256:<hex>" digest of the file's bytes; "" when it is not a readable file (no tokenizer)."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return "sha256:" + hashlib.sha256(data).hexdigest()
