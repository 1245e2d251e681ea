"""The momentum buffers of a bucket's parameters for their updates (step 6 of the package
docstring), 32-bit or bitsandbytes' block-wise 8-bit (``optim_bits=8``; Dettmers et al., 2022,
"8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861).

The buffer is kept where the parameter is (a TP slice, a ZeRO chunk), so an 8-bit one is quantised
in blocks of the *full* flattened tensor with their absmax max-reduced over the ranks that hold
pieces (:class:`dist_optim.bnb_states.FullBlocks`): every code equals the single-device one. The
update runs on the fp32 values (as bitsandbytes' 8-bit kernels do), quantised again once the
bucket's updates are made, all of them with one max-reduction per process group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .. import bnb_states as bnb
from ..layout import ParamLayout

__all__ = ["keeps_8bit_momentum", "Momenta"]

KEY = "momentum_buffer"


def keeps_8bit_momentum(group: dict[str, Any], layout: ParamLayout) -> bool:
    """Whether a parameter of ``group`` keeps an 8-bit momentum buffer: momentum on, ``optim_bits=8``
    and at least ``min_8bit_size`` elements in its full tensor (bitsandbytes decides per tensor)."""
    return group["momentum"] > 0 and group["optim_bits"] == 8 and layout.full_numel >= group["min_8bit_size"]


class Momenta:
    """The momentum buffers of one bucket: the fp32 values of the 8-bit ones, read when the bucket's
    updates start (:meth:`read`) and stored quantised by :meth:`store`; the state's own tensors
    otherwise (updated in place)."""

    def __init__(self, states: Mapping[torch.Tensor, dict[str, Any]]) -> None:
        self._states = states
        self._values: dict[torch.Tensor, torch.Tensor] = {}
        self._requant: list[bnb.Requant] = []

    @classmethod
    def read(
        cls,
        states: Mapping[torch.Tensor, dict[str, Any]],
        params: Iterable[tuple[dict[str, Any], torch.Tensor]],
        layout_of: Callable[[torch.Tensor], ParamLayout],
    ) -> Momenta:
        """The buffers of ``params`` (group, parameter): an 8-bit one dequantised, or made (zero, or
        from a 32-bit buffer of a state saved with ``optim_bits=32``)."""
        out = cls(states)
        for group, p in params:
            layout = layout_of(p)
            if not keeps_8bit_momentum(group, layout):
                continue
            blocks = bnb.FullBlocks(layout, p.device)
            values = bnb.start_8bit(states[p], KEY, blocks, True, p.shape, p.device)
            out._values[p] = values
            out._requant.append(bnb.Requant(states[p], KEY, blocks, values, True))
        return out

    def buffer(self, p: torch.Tensor) -> torch.Tensor | None:
        """The buffer to update for ``p`` (None without momentum)."""
        values = self._values.get(p)
        return values if values is not None else self._states[p].get(KEY)

    def store(self) -> None:
        """Quantise the 8-bit buffers' new values into their state (collective where a parameter is
        held in pieces: one max-reduction of the block absmax per process group)."""
        if self._requant:
            bnb.write_8bit_many(self._requant)
