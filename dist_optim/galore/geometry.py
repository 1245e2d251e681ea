"""Where a rank's tensor lies in the full matrix, and the shapes GaLore's projection gives.

A rank holds a matrix whole, a TP slice of it, or a flat ZeRO chunk (of a TP slice): at most three
dense rectangles of the full matrix (:func:`matrix_pieces`), each a view of the local tensor
(:func:`piece_view`). :mod:`.projection` multiplies piece by piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import ParamLayout
from .options import PROJ_TYPES

__all__ = ["Rectangle", "matrix_pieces", "piece_view", "projection_side", "low_rank_shape", "projector_shapes"]


@dataclass(frozen=True)
class Rectangle:
    """A dense rectangle of the full matrix held by this rank.

    ``local[offset : offset + rows * cols].view(rows, cols)`` of the flat local tensor (or the
    whole local matrix when ``offset`` is None) is ``full[row0 : row0 + rows, col0 : col0 + cols]``.
    """

    offset: int | None
    rows: int
    cols: int
    row0: int
    col0: int


#: matrix_pieces by layout, each kept under its layout's group-free geometry (an lru_cache would
#: keep the first layout it was asked about, and its groups, alive).
_PIECES: dict[ParamLayout, tuple[Rectangle, ...]] = {}
_MAX_PIECES = 4096


def matrix_pieces(layout: ParamLayout) -> tuple[Rectangle, ...]:
    """The rectangles of the full 2-D matrix that this rank's tensor holds.

    A TP slice (or a whole matrix) is one rectangle. A flat ZeRO chunk ``[s, e)`` of the
    (TP-local) ``m x n`` matrix is at most three: the tail of row ``s // n``, the whole rows after
    it, and the head of the row where the chunk ends; padding and empty chunks give none.
    """
    found = _PIECES.get(layout)
    if found is None:
        if len(_PIECES) >= _MAX_PIECES:
            _PIECES.clear()
        found = _PIECES[layout.geometry] = _matrix_pieces(layout)
    return found


def _matrix_pieces(layout: ParamLayout) -> tuple[Rectangle, ...]:
    if layout.ndim != 2:
        raise ValueError(f"matrix_pieces: expected a 2-D layout, got full shape {layout.full_shape}")
    boxes = layout.local_boxes(layout.full_shape)
    assert boxes is not None, "a TP slice of a matrix is a box of it"
    whole = layout.zero is None  # the whole local matrix: offset None (a view of any tensor)
    return tuple(
        Rectangle(None if whole else offset, r1 - r0, c1 - c0, r0, c0) for ((r0, r1), (c0, c1)), offset in boxes
    )


def piece_view(tensor: torch.Tensor, piece: Rectangle) -> torch.Tensor:
    """The piece of ``tensor`` (a view when ``tensor`` is contiguous)."""
    if piece.offset is None:
        return tensor.reshape(piece.rows, piece.cols)
    return tensor.reshape(-1)[piece.offset : piece.offset + piece.rows * piece.cols].view(piece.rows, piece.cols)


def projection_side(shape: tuple[int, ...], proj_type: str) -> str:
    """``left``, ``right`` or ``full``: which singular vectors galore_torch's projector keeps."""
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    if proj_type in ("left", "right", "full"):
        return proj_type
    raise ValueError(f"proj_type must be one of {PROJ_TYPES}, got {proj_type!r}")


def low_rank_shape(shape: tuple[int, ...], side: str, rank: int) -> tuple[int, int]:
    """The shape of the low-rank gradient of an ``M x N`` matrix: ``r x N``, ``M x r`` or ``r x r``."""
    m, n = shape
    return {"left": (rank, n), "right": (m, rank), "full": (rank, rank)}[side]


def projector_shapes(shape: tuple[int, ...], side: str, rank: int) -> dict[str, tuple[int, int]]:
    """The projectors an ``M x N`` matrix keeps for ``side``, by state key, left first:
    ``proj_left`` (``M x r``) for ``left`` and ``full``, ``proj_right`` (``r x N``) for ``right`` and
    ``full``."""
    m, n = shape
    out = {}
    if side in ("left", "full"):
        out["proj_left"] = (m, rank)
    if side in ("right", "full"):
        out["proj_right"] = (rank, n)
    return out
