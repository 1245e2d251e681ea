"""A float64 reference of Muon with an auxiliary AdamW, written from the algorithm's statement
(torch.optim.Muon's documentation / Jordan et al.), and of NorMuon (Li et al. 2025, Algorithm 1
with the released code's norm-preserving rescale), independent of dist_optim.muon: plain per-step
formulas, no shared helpers, no fused kernels.

Each parameter is a float64 tensor; ``groups`` are dicts with ``params`` and the options of
``DistributedMuon`` (every option spelled out by the caller); a group with ``beta2`` and
``normalization_eps`` is NorMuon's."""

from __future__ import annotations

import math
from typing import Any

import torch

#: Every option of a reference group at DistributedMuon's defaults (a group spells all of them out).
DEFAULTS: dict[str, Any] = dict(
    lr=1e-3,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_coefficients=(3.4445, -4.775, 2.0315),
    eps=1e-7,
    ns_steps=5,
    adjust_lr_fn=None,
    momentum_ema=False,
    eps_form="max",
    adamw_betas=(0.9, 0.95),
    adamw_eps=1e-10,
    stacked=False,
)


def _orthogonalize(
    c: torch.Tensor, coefficients: list[tuple[float, float, float]], eps: float, add: bool
) -> torch.Tensor:
    m = c.shape[0]
    x = c.reshape(m, -1).clone()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    norm = torch.sqrt((x * x).sum())
    x = x / (norm + eps if add else torch.maximum(norm, torch.tensor(eps, dtype=x.dtype)))
    for a, b, cc in coefficients:
        gram = x @ x.t()
        x = a * x + (b * gram + cc * (gram @ gram)) @ x
    if transposed:
        x = x.t()
    return x.reshape(c.shape)


def _normalize_rows(x: torch.Tensor, v: torch.Tensor, beta2: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon on one ``rows x cols`` matrix: the row second moment's EMA, each row divided by its
    root, the Frobenius norm of ``x`` restored."""
    v = beta2 * v + (1 - beta2) * (x * x).sum(dim=1) / x.shape[1]
    u = x / (torch.sqrt(v) + eps)[:, None]
    u = u * torch.sqrt((x * x).sum()) / (torch.sqrt((u * u).sum()) + eps)
    return u, v


class MuonReference:
    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.groups = groups
        self.state: dict[int, dict[str, Any]] = {}

    def step(self) -> None:
        for group in self.groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state.setdefault(id(p), {})
                lr, wd = group["lr"], group["weight_decay"]
                if group["use_muon"]:
                    mu = group["momentum"]
                    b = st.get("momentum_buffer", torch.zeros_like(p))
                    if group["momentum_ema"]:
                        b = mu * b + (1 - mu) * g
                        c = (1 - mu) * g + mu * b if group["nesterov"] else b
                    else:
                        b = mu * b + g
                        c = g + mu * b if group["nesterov"] else b
                    st["momentum_buffer"] = b
                    coeffs = group["ns_coefficients"]
                    if len(coeffs) == 3 and not isinstance(coeffs[0], (tuple, list)):
                        coeffs = [tuple(coeffs)] * group["ns_steps"]
                    add = group["eps_form"] == "add"
                    if group["stacked"] and p.dim() > 2:  # one matrix per slice along dim 0
                        x = torch.stack([_orthogonalize(s, list(coeffs), group["eps"], add) for s in c])
                        rows, cols = p.shape[1], p[0].numel() // p.shape[1]
                    else:
                        x = _orthogonalize(c, list(coeffs), group["eps"], add)
                        rows, cols = p.shape[0], p.numel() // p.shape[0]
                    if "beta2" in group:  # NorMuon: each matrix's rows normalized
                        mats = x if group["stacked"] and p.dim() > 2 else x[None]
                        vs = st.get("neuron_second_moment", torch.zeros(mats.shape[:2], dtype=p.dtype))
                        vs = vs.reshape(mats.shape[:2])
                        done = [
                            _normalize_rows(m.reshape(m.shape[0], -1), v, group["beta2"], group["normalization_eps"])
                            for m, v in zip(mats, vs)
                        ]
                        x = torch.stack([u.reshape(m.shape) for (u, _), m in zip(done, mats)]).reshape(x.shape)
                        v_new = torch.stack([v for _, v in done])
                        st["neuron_second_moment"] = v_new if group["stacked"] and p.dim() > 2 else v_new[0]
                    if group["adjust_lr_fn"] == "match_rms_adamw":
                        step_size = 0.2 * lr * math.sqrt(max(rows, cols))
                    else:
                        step_size = lr * math.sqrt(max(1.0, rows / cols))
                    p.data = p.data * (1 - lr * wd) - step_size * x
                else:
                    beta1, beta2 = group["adamw_betas"]
                    t = st.get("step", 0) + 1
                    m = beta1 * st.get("exp_avg", torch.zeros_like(p)) + (1 - beta1) * g
                    v = beta2 * st.get("exp_avg_sq", torch.zeros_like(p)) + (1 - beta2) * g * g
                    st.update(step=t, exp_avg=m, exp_avg_sq=v)
                    m_hat = m / (1 - beta1**t)
                    v_hat = v / (1 - beta2**t)
                    p.data = p.data * (1 - lr * wd) - lr * m_hat / (torch.sqrt(v_hat) + group["adamw_eps"])
