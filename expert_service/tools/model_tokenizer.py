"""A model directory's tokenizer.json, for the offline tools (`colibri complete`, `colibri router-gen`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.errors import ModelFormatError
from common.files import read_regular
from common.model_format import ModelDir

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def read_tokenizer(model: ModelDir) -> Tokenizer | None:
    """The model's tokenizer, or None when it has no tokenizer.json. One that the library cannot read is a
    ModelFormatError naming the file: it raised a bare Exception, a traceback (after a whole completion)."""
    path = model.tokenizer_path()
    if path is None:
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(read_regular(path).decode("utf-8"))  # a FIFO swapped in is refused, not waited on
    except OSError as e:
        raise ModelFormatError(f"{path}: {e.strerror or e}") from None
    except Exception as e:  # the library raises bare Exceptions with a message
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ModelFormatError(f"{path}: not a valid tokenizer.json ({reason})") from None
