"""The model's generation_config.json as request defaults, as vLLM applies it by default.

Its eos_token_id (an id or a list) joins the model's EOS ids: generation stops there too, unless ignore_eos.
Its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens become the defaults of requests
that leave the field unset (an explicit value always wins; max_new_tokens stays within the router's own cap).
do_sample is not read: a temperature in the file applies whatever do_sample says, as in vLLM. A value out of
range is left out with a warning naming the file and the key, so a bad file costs its defaults, not the service.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("colibri.router.generation_defaults")
FILE_NAME = "generation_config.json"
# Temperatures a float32 softmax survives: 0 = greedy, else in [MIN_TEMPERATURE, MAX_TEMPERATURE] (requests are
# held to the same range).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 100.0


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None) -> GenerationDefaults:
        """The defaults in `model_dir`/generation_config.json; none when there is no such file."""
        path = Path(model_dir) / FILE_NAME if model_dir else None
        if path is None or not path.is_file():
            return cls()
        try:
            value = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        except ValueError as e:
            log.warning("%s: not valid JSON (%s); its defaults are not applied", path, e)
            return cls()
        if not isinstance(value, dict):
            log.warning("%s: not a JSON object; its defaults are not applied", path)
            return cls()
        return cls.from_dict(value, str(path))

    @classmethod
    def from_dict(cls, config: dict, source: str = FILE_NAME) -> GenerationDefaults:
        def number(key, ok, kind=float):
            v = config.get(key)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v) or (kind is int and v != int(v)):
                log.warning("%s: %s = %r is out of range; that default is not applied", source, key, v)
                return None
            return kind(v)

        eos = config.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos if isinstance(eos, list) else []
        valid_eos = tuple(i for i in eos if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 32)
        if len(valid_eos) != len(eos):
            log.warning("%s: eos_token_id %r holds values that are not token ids; those are ignored", source, eos)
        finite = math.isfinite
        return cls(
            eos_token_ids=valid_eos,
            temperature=number(
                "temperature", lambda v: v == 0 or (finite(v) and MIN_TEMPERATURE <= v <= MAX_TEMPERATURE)
            ),
            top_p=number("top_p", lambda v: finite(v) and 0 < v <= 1),
            top_k=number("top_k", lambda v: v >= 0 and v < 1 << 32, int),
            repetition_penalty=number("repetition_penalty", lambda v: finite(v) and v > 0),
            min_p=number("min_p", lambda v: finite(v) and 0 <= v <= 1),
            max_new_tokens=number("max_new_tokens", lambda v: 1 <= v < 1 << 31, int),
        )

    def describe(self) -> str:
        """One line for the start-up log: what requests inherit."""
        parts = [
            f"{k}={getattr(self, k)}"
            for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
            if getattr(self, k) is not None
        ]
        if self.eos_token_ids:
            parts.append(f"eos_token_ids={list(self.eos_token_ids)}")
        return ", ".join(parts) or "none"
