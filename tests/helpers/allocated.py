"""Bytes of tensor memory, measured in a test worker without dist_optim (the planner's own instruments
are dist_optim.plan.traffic.LiveBytes and dist_optim.plan.simulate.state_bytes; a test that checks
the planner measures the run with these): what a block allocates, followed until it is freed
(:class:`AllocatedBytes`), and what a structure holds (:func:`held_bytes`).

Every aten op inside the block passes through :class:`AllocatedBytes` (a ``TorchDispatchMode``).
A storage under an op's output that none of the op's tensor arguments already uses is memory
that op allocated: its bytes count from then until the storage dies, which a finalizer on the
storage's Python object tells (torch keeps that object alive as long as the storage: views,
autograd's saved tensors and C++ owners included). Views and in-place results share an argument's
storage and allocate nothing; storages that existed before the block never count.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AllocatedBytes", "held_bytes"]


def _storage(x: Any) -> torch.UntypedStorage | None:
    # Sparse and other non-strided tensors have no single storage.
    if isinstance(x, torch.Tensor) and x.layout == torch.strided:
        return x.untyped_storage()
    return None


def held_bytes(tree: Any) -> int:
    """Bytes of the storages under every tensor in ``tree`` (dicts, lists and tuples, nested: an
    optimizer's ``state``), each storage once however many tensors view it."""
    storages = {id(s): s.nbytes() for s in map(_storage, tree_leaves(tree)) if s is not None}
    return sum(storages.values())


class AllocatedBytes(TorchDispatchMode):
    """Inside the block: ``live``, the bytes of the storages allocated in it and still alive;
    ``peak``, the most of them alive at once; ``largest``, the largest single one."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0
        self._followed: set[int] = set()  # id() of the storage objects allocated in the block, alive

    def _freed(self, key: int, nbytes: int) -> None:
        self._followed.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {id(s) for s in map(_storage, tree_leaves((args, kwargs))) if s is not None}
        for storage in map(_storage, tree_leaves(out)):
            if storage is None or id(storage) in given or id(storage) in self._followed:
                continue
            nbytes = storage.nbytes()
            self._followed.add(id(storage))
            weakref.finalize(storage, self._freed, id(storage), nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, nbytes)
        return out
