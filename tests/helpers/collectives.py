"""The collectives a process issues through ``torch.distributed``, counted where they are called.

Inside :func:`counting_collectives` every collective function of ``torch.distributed``
(:data:`COLLECTIVES`) is replaced, in ``torch.distributed`` and in
``torch.distributed.distributed_c10d`` (where they are defined, and where torch's own object
collectives look up the tensor collectives they are made of), by a wrapper that records the call
and passes it on. Anything that looks a collective up on either module at call time is seen:
dist_optim.comm does, and so would any other code in an optimizer step, which is the point of
counting here rather than inside the package. Nothing here imports dist_optim.

What one call sends and receives on this rank is defined here from how the collective moves
data, with ``g`` the size of its group and ``B`` a buffer's bytes (ring algorithms, as NCCL
implements them and as ``nccl-tests`` reports bus bandwidth):

* ``all_reduce``: a ring reduce-scatter then a ring all-gather, ``2 (g-1)`` steps each sending
  ``1/g`` of the buffer: ``2 (g-1)/g x B``.
* ``all_gather``, ``all_gather_into_tensor``: ``g-1`` ring steps, each forwarding one rank's input:
  ``(g-1) x B(input)``.
* ``reduce_scatter``, ``reduce_scatter_tensor``: ``g-1`` ring steps, each sending one
  output-sized partial sum: ``(g-1) x B(output)``.
* ``all_to_all_single``: the rows of the input addressed to other ranks (split sizes count rows
  of dim 0; without them, ``1/g`` of the rows each); ``all_to_all``: the input tensors of other ranks.
* ``broadcast``, ``reduce``: ``B`` on every rank. In a pipelined chain every rank but the last
  forwards the whole buffer once; which rank ends the chain is the backend's choice, so every
  rank is charged the buffer.
* ``gather``: ``B`` from each rank but the destination; ``scatter``: the other ranks' pieces
  from the source; ``send``/``isend``: ``B``; ``recv``/``irecv``, ``barrier``: nothing.
* The object collectives (``all_gather_object``, ``broadcast_object_list``, ...) pickle the
  objects and move the bytes with tensor collectives: one call is one collective of its own name
  that sends what its inner collectives send. torch 2.5.1's ``all_gather_object`` all-gathers
  every rank's pickled size (an int64), then the pickled bytes padded to the largest:
  ``(g-1) x (8 + the largest pickle)``.

A collective called while another counted one runs (the inner calls of an object collective,
``_all_gather_base`` forwarding to ``all_gather_into_tensor``) is part of the outer one, never a
call of its own. Received bytes are those of the output buffers, this rank's own piece included.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["COLLECTIVES", "Collectives", "Issued", "counting_collectives"]


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _ring_all_reduce(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    return Fraction(2 * (g - 1) * _bytes(a["tensor"]), g), _bytes(a["tensor"])


def _ring_all_reduce_coalesced(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    return Fraction(2 * (g - 1) * _bytes(*a["tensors"]), g), _bytes(*a["tensors"])


def _ring_all_gather(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    return Fraction((g - 1) * _bytes(a["tensor"])), _bytes(*a["tensor_list"])


def _ring_all_gather_into_tensor(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    return Fraction((g - 1) * _bytes(a["input_tensor"])), _bytes(a["output_tensor"])


def _ring_all_gather_coalesced(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    received = sum(_bytes(*outs) for outs in a["output_tensor_lists"])
    return Fraction((g - 1) * _bytes(*a["input_tensor_list"])), received


def _ring_reduce_scatter(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    return Fraction((g - 1) * _bytes(a["output"])), _bytes(a["output"])


def _to_others_single(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    inp = a["input"]
    rows = inp.shape[0] if inp.dim() else 1
    row_bytes = _bytes(inp) // rows if rows else 0
    splits = a["input_split_sizes"] or [rows // g] * g
    return Fraction(sum(n for r, n in enumerate(splits) if r != me) * row_bytes), _bytes(a["output"])


def _to_others(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    sent = sum(_bytes(t) for r, t in enumerate(a["input_tensor_list"]) if r != me)
    return Fraction(sent), _bytes(*a["output_tensor_list"])


def _chain(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    return Fraction(_bytes(a["tensor"])), _bytes(a["tensor"])


def _gather(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    root = a["dst"] == dist.get_rank()
    return Fraction(0 if root else _bytes(a["tensor"])), _bytes(*(a["gather_list"] or []))


def _scatter(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    pieces = a["scatter_list"] if a["src"] == dist.get_rank() else None
    return Fraction(sum(_bytes(t) for r, t in enumerate(pieces or []) if r != me)), _bytes(a["tensor"])


def _send(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    return Fraction(_bytes(a["tensor"])), 0


def _recv(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    return Fraction(0), _bytes(a["tensor"])


def _nothing(a: dict[str, Any], g: int, me: int) -> tuple[Fraction, int]:
    return Fraction(0), 0


#: (sent, received) of one call from its arguments (by name), its group's size and this rank's
#: index in it; None: what its inner collectives send and receive (the object collectives).
Rule = Callable[[dict[str, Any], int, int], tuple[Fraction, int]]

#: Every collective of torch.distributed that is counted, with its rule.
COLLECTIVES: dict[str, Rule | None] = {
    "all_reduce": _ring_all_reduce,
    "all_reduce_coalesced": _ring_all_reduce_coalesced,
    "all_gather": _ring_all_gather,
    "all_gather_into_tensor": _ring_all_gather_into_tensor,
    "_all_gather_base": _ring_all_gather_into_tensor,
    "all_gather_coalesced": _ring_all_gather_coalesced,
    "reduce_scatter": _ring_reduce_scatter,
    "reduce_scatter_tensor": _ring_reduce_scatter,
    "_reduce_scatter_base": _ring_reduce_scatter,
    "all_to_all_single": _to_others_single,
    "all_to_all": _to_others,
    "broadcast": _chain,
    "reduce": _chain,
    "gather": _gather,
    "scatter": _scatter,
    "send": _send,
    "isend": _send,
    "recv": _recv,
    "irecv": _recv,
    "barrier": _nothing,
    "monitored_barrier": _nothing,
    "all_gather_object": None,
    "broadcast_object_list": None,
    "gather_object": None,
    "scatter_object_list": None,
    "send_object_list": None,
    "recv_object_list": None,
}

# Read once from the real functions: inside a block the modules hold the wrappers.
_SIGNATURES = {name: inspect.signature(getattr(c10d, name)) for name in COLLECTIVES}


@dataclass(frozen=True)
class Issued:
    """One counted call as it was made: the torch.distributed function's name, its ``group``
    argument (None: the default group) and its reduction ``op`` (None where it takes none)."""

    name: str
    group: Any
    op: Any


@dataclass
class Collectives:
    """What this rank issued inside a :func:`counting_collectives` block, by torch.distributed
    function name: calls, bytes sent and bytes received (the conventions of this module), and
    every counted call in the order issued (:attr:`issued`)."""

    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    sent: collections.defaultdict[str, Fraction] = field(default_factory=lambda: collections.defaultdict(Fraction))
    received: collections.Counter[str] = field(default_factory=collections.Counter)
    issued: list[Issued] = field(default_factory=list)

    @property
    def bytes_sent(self) -> Fraction:
        return sum(self.sent.values(), Fraction(0))

    def received_bytes(self, *names: str) -> int:
        """Bytes received in the calls of the named collectives (e.g. ``"all_to_all_single"``)."""
        return sum(self.received[name] for name in names)


@dataclass
class _Call:
    sent: Fraction = Fraction(0)
    received: int = 0
    #: True: sizes from its own rule; inner calls add nothing to it.
    ruled: bool = False


@contextlib.contextmanager
def counting_collectives() -> Iterator[Collectives]:
    """Count every collective this process issues through torch.distributed inside the block (see
    the module docstring); the real functions are restored on exit. A call on a group this rank
    is not a member of moves nothing here and is not counted."""
    seen = Collectives()
    running: list[_Call] = []  # the counted calls in progress, outermost first
    modules = (dist, c10d)
    saved = [(m, name, getattr(m, name)) for m in modules for name in COLLECTIVES if hasattr(m, name)]

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        rule, signature = COLLECTIVES[name], _SIGNATURES[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            group = bound.arguments.get("group")
            me = dist.get_rank(group)
            if me < 0:
                return fn(*args, **kwargs)
            mine = _Call()
            if rule is not None:
                mine.sent, mine.received = rule(bound.arguments, dist.get_world_size(group), me)
                mine.ruled = True
            running.append(mine)
            try:
                out = fn(*args, **kwargs)
            finally:
                running.pop()
            if running:
                if not running[-1].ruled:
                    running[-1].sent += mine.sent
                    running[-1].received += mine.received
            else:
                seen.counts[name] += 1
                seen.issued.append(Issued(name, group, bound.arguments.get("op")))
                seen.sent[name] += mine.sent
                seen.received[name] += mine.received
            return out

        return call

    for module, name, fn in saved:
        setattr(module, name, counted(name, fn))
    try:
        yield seen
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
