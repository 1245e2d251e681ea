"""The step-memory budget: one option, ``bucket_bytes``, that every optimizer takes.

An optimizer step that works on all parameters at once holds, for a moment, a buffer per
parameter (LAMB's updates, the pieces sent to owners and the results coming back, the owners'
work). With ``bucket_bytes`` the step goes through the parameters in buckets (consecutive
parameters in the optimizer's order) whose bytes sum to at most the budget, finishing each bucket
(its collectives, its math, its update applied) before the next, so the step's transient memory is
bounded by the budget instead of by the model. A parameter larger than the budget is a bucket of
its own; its exchange with the owners then runs in rounds (:func:`exchange_rounds`), so that
no send or receive buffer holds much more than the budget either. ``None`` is one bucket for
the whole step (the fewest collectives).

How the bytes of a parameter are counted is each optimizer's (the full gradient it moves, the
local update it holds), stated in its docstring. The math per parameter does not depend on the
bucketing: results are bit-identical whatever the budget; only the number of collectives
(one set per bucket) changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["DEFAULT_BUCKET_BYTES", "check_bucket_bytes", "buckets", "exchange_rounds"]

#: The default budget per bucket: 256 MiB, which keeps a step's peak transient at most 2 GB per
#: rank on the planner's Llama-2-7B and 70B rows (docs/planner.md).
DEFAULT_BUCKET_BYTES = 256 * 2**20


def check_bucket_bytes(value: Any) -> int | None:
    """``value`` as a budget: a positive int of bytes, or None (one bucket per step)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"bucket_bytes={value!r}: expected a positive int of bytes (e.g. 256 * 2**20), or None for one bucket"
        )
    return value


def buckets(sizes: Sequence[int], limit: int | None) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive items whose ``sizes`` (bytes) sum to at most ``limit``
    (an item larger than that alone); one bucket of everything when ``limit`` is None."""
    start = 0
    while start < len(sizes):
        stop, size = start, 0
        while stop < len(sizes) and (limit is None or stop == start or size + sizes[stop] <= limit):
            size += sizes[stop]
            stop += 1
        yield start, stop
        start = stop


def exchange_rounds(nbytes: int, limit: int | None) -> int:
    """The rounds (all_to_alls, :func:`dist_optim.comm.exchange`) in which to move a bucket whose
    tensors are ``nbytes`` in full: ``ceil(nbytes / limit)``, one when ``limit`` is None. Every rank
    of the exchange computes it from the same full sizes. An owner sends each holder its piece of a
    whole result, so its send buffer is about ``nbytes / rounds``: at 70B, Kron's 32000 x 8192
    embedding direction (1.05 GB in fp32) goes back in 4 rounds of about 262 MB under the default
    budget, beside the direction itself."""
    if limit is None or nbytes <= limit:
        return 1
    return -(-nbytes // limit)
