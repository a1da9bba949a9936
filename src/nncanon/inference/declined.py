"""The values an inferred record declines, with what the inference tried: the record's ``declines=``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Declined:
    """The values an inferred record does not serve, with what the inference tried (``declines=``)."""

    reasons: tuple[tuple[str, str], ...]

    def __call__(self, config: Any, layer: int) -> dict:
        return dict(self.reasons)
