"""The dtypes collectives may travel in: every optimizer's ``communication_dtype`` option is
checked here (one message), and a bucket of mixed dtypes travels in the widest of them
(:mod:`dist_optim.comm`, :mod:`dist_optim.sharding.owners`)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..kernels.dtypes import promote

__all__ = ["COMMUNICATION_DTYPES", "check_communication_dtype", "widest_dtype"]

#: The dtypes an optimizer's ``communication_dtype`` may name; None: the widest dtype of the
#: tensors sent (:func:`widest_dtype`), i.e. exact.
COMMUNICATION_DTYPES: tuple[torch.dtype | None, ...] = (
    None,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
)


def widest_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype every one of ``tensors`` converts to without loss (``torch.promote_types`` over
    them): the default communication dtype of a bucket, so that no tensor is rounded through a
    narrower neighbour's dtype. The same on every rank when the ranks bucket the same tensors."""
    return functools.reduce(promote, (t.dtype for t in tensors))


def check_communication_dtype(value: Any, allowed: Sequence[torch.dtype | None] = COMMUNICATION_DTYPES) -> None:
    """The one check of every optimizer's ``communication_dtype`` option: a ValueError naming the
    value and what is accepted unless ``value`` is in ``allowed`` (default
    :data:`COMMUNICATION_DTYPES`; an optimizer that rounds its shared results in that dtype passes
    the narrower set it supports)."""
    if value not in allowed:
        names = ", ".join("None (the widest dtype of the tensors sent)" if a is None else str(a) for a in allowed)
        raise ValueError(f"communication_dtype must be one of {names}; got {value!r}")
