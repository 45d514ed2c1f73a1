"""The evaluator contract: statistics as sums, one all-reduce (SUM) across ranks, then compute()."""
from __future__ import annotations

from typing import Any

from torch import Tensor


class Evaluator:
    """Accumulates validation statistics as sums, so ranks can be combined by one all-reduce.

    Subclasses keep their running sums in ``self.sums`` (a 1-D float64 tensor on the device) or
    override :meth:`state` / :meth:`load_state` for non-tensor state (e.g. COCO detections).
    """

    def update(self, outputs: Any, batch: dict[str, Any]) -> None:
        raise NotImplementedError

    def state(self) -> Tensor:
        """1-D float64 tensor that is summed across ranks."""
        return self.sums

    def load_state(self, state: Tensor) -> None:
        self.sums = state

    def compute(self) -> dict[str, float]:
        raise NotImplementedError
