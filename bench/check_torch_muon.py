"""DistributedMuon converted from torch.optim.Muon against torch.optim.Muon itself, side by side.

The pinned torch (2.5.1) has no torch.optim.Muon; run this with a torch >= 2.9 (e.g. a scratch
virtualenv outside the repository)::

    PYTHONPATH=. /path/to/venv/bin/python bench/check_torch_muon.py

It prints, for two option sets, the largest difference of the parameters and momentum buffers after
10 steps on the same gradients, and whether the parameters are equal bit for bit (with torch 2.13.0
on the CPU: 0.0 and True for both: the conversion's EMA momentum, norm clamp and bfloat16 iteration
are torch's own), on small matrices and on 300 x 700 and 700 x 300 ones.
"""

from __future__ import annotations

import sys
import warnings

import torch

ROOT = __file__.rsplit("/bench/", 1)[0]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import dist_optim  # noqa: E402
from dist_optim.registry import class_path  # noqa: E402

SHAPES = [(16, 8), (8, 24), (12, 12), (300, 700), (700, 300)]


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.3) for s in SHAPES]


def main() -> None:
    if not hasattr(torch.optim, "Muon"):
        raise SystemExit(f"torch {torch.__version__} has no torch.optim.Muon: use torch >= 2.9")
    warnings.simplefilter("ignore")
    print("torch", torch.__version__, "class path", class_path(torch.optim.Muon))
    options = [dict(), dict(nesterov=False, adjust_lr_fn="match_rms_adamw", lr=2e-2, weight_decay=0.01, ns_steps=4)]
    for kwargs in options:
        theirs_params, our_params = _params(), _params()
        theirs = torch.optim.Muon(theirs_params, **kwargs)
        ours = dist_optim.convert(torch.optim.Muon(our_params, **kwargs))
        assert isinstance(ours, dist_optim.DistributedMuon)
        for step in range(10):
            gen = torch.Generator().manual_seed(100 + step)
            for a, b in zip(theirs_params, our_params):
                g = torch.randn(a.shape, generator=gen)
                a.grad, b.grad = g.clone(), g.clone()
            theirs.step()
            ours.step()
        param_diff = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(theirs_params, our_params))
        buf_diff = max(
            float((theirs.state[a]["momentum_buffer"] - ours.state[b]["momentum_buffer"]).abs().max())
            for a, b in zip(theirs_params, our_params)
        )
        same = all(torch.equal(a, b) for a, b in zip(theirs_params, our_params))
        print(f"{kwargs}: max relative param difference {param_diff}, momentum {buf_diff}, bit-equal {same}")


if __name__ == "__main__":
    main()
