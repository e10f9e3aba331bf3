"""A step's logits on the device (the cuda backend's `Logits`): argmax and finiteness already on the host, the
rows fetched on demand."""

from __future__ import annotations

import numpy as np

from expert_service.engine.token_masks import masked_allowed


class DeviceLogits:
    """Logits rows of a step on the device; argmax + finiteness already on the host, rows fetched lazily.
    The rows live in the workspace the decoder's next step overwrites: fetch them before then (a later fetch
    raises rather than return another step's rows); the argmax stays valid."""

    def __init__(
        self,
        decoder,
        rows: int,
        penalized: int = 0,
        ids: np.ndarray | None = None,
        nonfinite: np.ndarray | None = None,
        step: int | None = None,
        masks: np.ndarray | None = None,
    ):
        """ids, nonfinite: the step's argmax readbacks (default: the workspace's current host copy); step: the
        decoder's staged-step count when it staged this one (default: now)."""
        self.decoder, self.rows = decoder, rows
        self.step = decoder.staged_steps if step is None else step
        self.penalized = penalized  # the first rows, penalised in decoder.penalties (argmax of those)
        self._penalized_host: np.ndarray | None = None
        self.ids = (decoder.ws.host["greedy_ids"] if ids is None else ids)[:rows].copy()
        self.nonfinite = (decoder.ws.host["nonfinite"] if nonfinite is None else nonfinite)[:rows].copy()
        self._host: np.ndarray | None = None
        self.masks = masks  # [M, W] grammar masks of the first M rows, masked in decoder.token_masks
        self._masked_host: np.ndarray | None = None

    def greedy(self, row: int) -> tuple[int, bool]:
        return int(self.ids[row]), not bool(self.nonfinite[row])

    def _check_current(self) -> None:
        d = self.decoder
        if d.staged_steps != self.step:
            raise RuntimeError(
                f"logits of step {self.step} read after step {d.staged_steps} overwrote them "
                f"on the device: read a step's rows before the next step"
            )

    def _fetch(self) -> np.ndarray:
        if self._host is None:
            d = self.decoder
            self._check_current()
            host = d.ws.host["logits"][: self.rows]
            d.ws.logits[: self.rows].copy_to_host(host, stream=d.stream)
            d.stream.synchronize()
            self._host = host.copy()
        return self._host

    def __getitem__(self, row: int) -> np.ndarray:
        return self._fetch()[row]

    def allowed(self, row: int) -> np.ndarray | None:
        return masked_allowed(self.masks, row, self.decoder.config.vocab_size)

    def processed(self, row: int) -> np.ndarray:
        if self.masks is not None and row < len(self.masks):
            if self._masked_host is None:
                self._check_current()  # the next step rewrites the masked rows too
                self._masked_host = self.decoder.token_masks.download(len(self.masks))
            return self._masked_host[row]
        if row >= self.penalized:
            return self[row]
        if self._penalized_host is None:
            self._check_current()  # the next step rewrites the penalised rows too
            self._penalized_host = self.decoder.penalties.download(self.penalized)
        return self._penalized_host[row]

    def __len__(self) -> int:
        return self.rows

    def __iter__(self):
        return iter(self._fetch())
