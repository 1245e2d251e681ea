"""The momentum buffers of a bucket's parameters for their updates (step 6 of the package
docstring), 32-bit or bitsandbytes' block-wise 8-bit (``optim_bits=8``; Dettmers et al., 2022,
"8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861).

The buffer is kept where the parameter is (a TP slice, a ZeRO chunk), so an 8-bit one is quantised
in blocks of the *full* flattened tensor with their absmax max-reduced over the ranks that hold
pieces (:class:`dist_optim.states.bnb.FullBlocks`): every code equals the single-device one. The
update runs on the fp32 values (as bitsandbytes' 8-bit kernels do), quantised again once the
bucket's updates are made, all of them with one max-reduction per process group
(:class:`dist_optim.states.bnb.Batch8bit`). A buffer saved with the other ``optim_bits`` is
carried over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..layout import ParamLayout
from ..states import bnb, codecs

__all__ = ["MOMENTUM", "keeps_8bit_momentum", "read_momenta", "momentum_buffer"]

KEY = "momentum_buffer"
#: The momentum buffer, bitsandbytes' signed 8-bit codes with ``optim_bits=8``.
MOMENTUM = codecs.Entry(KEY, codecs.BNB_SIGNED)


def keeps_8bit_momentum(group: dict[str, Any], layout: ParamLayout) -> bool:
    """Whether a parameter of ``group`` keeps an 8-bit momentum buffer: momentum on, ``optim_bits=8``
    and at least ``min_8bit_size`` elements in its full tensor (bitsandbytes decides per tensor)."""
    return group["momentum"] > 0 and codecs.EightBit.of(group).keeps(layout.full_numel)


def read_momenta(
    states: Mapping[torch.Tensor, dict[str, Any]],
    params: Iterable[tuple[dict[str, Any], torch.Tensor]],
    layout_of: Callable[[torch.Tensor], ParamLayout],
) -> bnb.Batch8bit:
    """The momentum buffers of one bucket's ``params`` (group, parameter) for their updates: an
    8-bit one read as fp32 values (made zero, or carried over from a 32-bit buffer of a state saved
    with ``optim_bits=32``), stored quantised by the batch's ``store`` once the bucket's updates
    are made; an 8-bit buffer of a state saved with ``optim_bits=8`` that this group keeps in 32
    bits dequantised into the state (the parameter's dtype)."""
    batch = bnb.Batch8bit()
    for group, p in params:
        layout = layout_of(p)
        if keeps_8bit_momentum(group, layout):
            MOMENTUM.codec.read(batch, states[p], KEY, layout, p)
        elif group["momentum"] > 0:
            MOMENTUM.codec.to_plain(batch, states[p], KEY, layout, p.device, p.dtype)
    return batch


def momentum_buffer(momenta: bnb.Batch8bit, state: dict[str, Any]) -> torch.Tensor | None:
    """The buffer to update for the parameter of ``state`` (None without momentum): the fp32
    values :func:`read_momenta` handed out for an 8-bit one, else the state's own tensor."""
    values = momenta.value(state, KEY)
    return values if values is not None else state.get(KEY)
