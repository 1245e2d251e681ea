"""Muon as a user writes it from the paper (Jordan et al., 2024, kellerjordan.github.io/posts/muon),
single device: the yardstick of DistributedMuon's step time in ``bench/bench_step.py`` (the same
algorithm and dtype, so the ratio measures the implementation, not the math).

Per matrix: ``B <- momentum B + G``, ``C = G + momentum B``, ``X = C / ||C||`` (the wide
orientation), five quintic Newton-Schulz iterations written as the formula reads, decoupled weight
decay, ``W <- W - lr sqrt(max(1, m/n)) X``; every other parameter with ``torch.optim.AdamW``
(foreach), as the Muon post recommends."""

from __future__ import annotations

from typing import Any

import torch


def _orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g.reshape(len(g), -1)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    return (x.T if tall else x).reshape(g.shape)


class PlainMuon:
    """Muon on ``groups[0]`` (matrices), AdamW (foreach) on ``groups[1]``."""

    def __init__(
        self, groups: list[dict[str, Any]], lr: float = 2e-3, momentum: float = 0.95, wd: float = 0.01
    ) -> None:
        self.matrices = list(groups[0]["params"])
        self.lr, self.momentum, self.wd = lr, momentum, wd
        self.bufs = [torch.zeros_like(p) for p in self.matrices]
        rest = list(groups[1]["params"]) if len(groups) > 1 else []
        self.adamw = (
            torch.optim.AdamW(rest, lr=groups[1].get("lr", lr), weight_decay=wd, foreach=True) if rest else None
        )

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        """Every parameter's state (the benchmark counts its bytes)."""
        out: dict[torch.Tensor, Any] = {p: {"momentum_buffer": b} for p, b in zip(self.matrices, self.bufs)}
        if self.adamw is not None:
            out.update(self.adamw.state)
        return out

    @torch.no_grad()
    def step(self) -> None:
        for p, buf in zip(self.matrices, self.bufs):
            g = p.grad
            buf.mul_(self.momentum).add_(g)
            update = _orthogonalize(g + self.momentum * buf)
            rows, cols = p.shape[0], p[0].numel()
            p.mul_(1 - self.lr * self.wd)
            p.add_(update, alpha=-self.lr * max(1.0, rows / cols) ** 0.5)
        if self.adamw is not None:
            self.adamw.step()
