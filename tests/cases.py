"""Optimizer configurations the generic tests run: every public optimizer must appear here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dist_optim


@dataclass(frozen=True)
class Case:
    id: str
    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)


PARITY_CASES: list[Case] = [
    Case("lamb", dist_optim.DistributedLamb, dict(lr=1e-2, weight_decay=1e-2)),
    Case("lamb-nobc-clamp", dist_optim.DistributedLamb, dict(lr=2e-2, bias_correction=False, clamp_value=0.8)),
]
