"""What identifies a model across the router/worker split: SHA-256 digests of a model directory's manifest
(colibri.json: the HF config, the dense dtype and every tensor's crc32, so another checkpoint or conversion has
another digest) and of its tokenizer.json. The worker reports both in Info (`model_digest`, `tokenizer_digest`);
the router compares them with its own model directory's and refuses a worker that serves another model."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from common.errors import ModelFormatError

MANIFEST = "colibri.json"
TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class ModelDigests:
    """The "sha256:<hex>" digests of the directory's colibri.json and of its tokenizer.json's vocabulary; "" for a
    file it lacks."""

    manifest: str = ""
    tokenizer: str = ""

    @classmethod
    def of_dir(cls, model_dir: str | os.PathLike | None) -> ModelDigests:
        if not model_dir:
            return cls()
        root = Path(model_dir)
        return cls(file_digest(root / MANIFEST), vocabulary_digest(root / TOKENIZER))


def bytes_digest(data: bytes) -> str:
    """The "sha256:<hex>" digest of `data`, as Info and routing tables name a model."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def file_digest(path: Path) -> str:
    """The "sha256:<hex>" digest of the file's bytes; "" when it is not a readable file (no tokenizer)."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return bytes_digest(data)


def vocabulary_digest(path: Path) -> str:
    """The "sha256:<hex>" digest of a tokenizer.json's vocabulary: its model's vocab (and merges) and its added
    tokens' ids and texts, which fix the ids a tokenizer produces. Its pre- and post-processing (a router's copy may
    add a BOS token, say) are left out, and so is how its merges are written ("a b", or ["a", "b"] as tokenizers
    0.20 and later save them); a file that is no tokenizer.json counts by its bytes. Raises ModelFormatError naming
    the file when it nests too deep for Python's JSON reader (no tokenizers version reads such a file either)."""
    try:
        tokenizer = json.loads(path.read_bytes())
        model = tokenizer["model"]
        added = [(token["id"], token["content"]) for token in tokenizer.get("added_tokens") or ()]
        merges = [_merge_pair(merge) for merge in model.get("merges") or ()]
        vocabulary = {"vocab": model.get("vocab"), "merges": merges, "added_tokens": sorted(added)}
        text = json.dumps(vocabulary, sort_keys=True)
    except OSError:
        return ""
    except (ValueError, TypeError, KeyError, AttributeError):
        return file_digest(path)
    except RecursionError:
        raise ModelFormatError(f"{path}: nested too deeply to be a tokenizer.json") from None
    return bytes_digest(text.encode())


def _merge_pair(merge) -> list:
    """A BPE merge as its pair of tokens, whichever way the file writes it ("a b" or ["a", "b"])."""
    return merge.split(" ", 1) if isinstance(merge, str) else list(merge)
