"""GaLore (Zhao et al. 2024): see :mod:`.optimizer`."""

from .optimizer import (
    ADAM_STYLES,
    DEFAULT_TARGETS,
    GROUP_DEFAULTS,
    PROJ_TYPES,
    DistributedGaLore,
    Piece,
    galore_param_groups,
    low_rank_shape,
    matrix_pieces,
    projection_side,
)

__all__ = [
    "DistributedGaLore",
    "galore_param_groups",
    "matrix_pieces",
    "Piece",
    "projection_side",
    "low_rank_shape",
    "PROJ_TYPES",
    "ADAM_STYLES",
    "GROUP_DEFAULTS",
    "DEFAULT_TARGETS",
]
