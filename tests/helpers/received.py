"""Bytes a rank receives through torch.distributed collectives, counted in a test worker."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist


@contextlib.contextmanager
def received_bytes(*names: str) -> Iterator[dict[str, int]]:
    """While the block runs, count in ``["n"]`` the bytes of the output tensor of every call of
    the named ``torch.distributed`` collectives (e.g. ``"all_to_all_single"``): what this rank
    receives, its own pieces included. dist_optim.comm looks the collectives up at call time, so
    its calls are counted; the originals are restored on exit."""
    received = {"n": 0}
    real = {name: getattr(dist, name) for name in names}

    def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(out: torch.Tensor, *a: Any, **k: Any) -> Any:
            received["n"] += out.numel() * out.element_size()
            return fn(out, *a, **k)

        return run

    for name, fn in real.items():
        setattr(dist, name, counting(fn))
    try:
        yield received
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
