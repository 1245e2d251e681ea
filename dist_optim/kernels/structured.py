"""Matrix products that skip the known zeros and mirrored halves of structured operands.

BLAS exposes ``trmm`` (a triangular matrix times a general one) and ``syrk`` (``A A^T``), but
torch has neither; a plain ``mm`` multiplies the zero half of a triangular operand and computes
both halves of a symmetric result. Kron's factors are upper triangular and its statistics are
Gram matrices, and Shampoo's factor update ``L <- b L + a G G^T`` is a symmetric rank-k update
(``gram_update_``, in place, lower triangle only, without a temporary of L's size), so these
products dominate their steps (a 4096-dim factor's update ``triu(D) @ Q`` is
69 GMAC as an ``mm``). The triangular products and ``gram`` split in halves recursively: the
diagonal blocks recurse, the off-diagonal block is one general ``mm``, and below ``min_size`` a
plain ``mm`` takes over (its call overhead and BLAS efficiency win on small blocks). On the CPU
they take a fraction of an ``mm``'s time, if more than their multiply-adds alone (upper x upper
needs about a sixth of an ``mm``'s, general x triangular half); measured once, not benched.
``gram_update_`` goes down the lower triangle in column panels instead (see there).

The results equal the plain products in exact arithmetic; in floating point the sums are grouped
differently (relative differences of order 1e-7 in fp32). The triangular operands are assumed
exactly triangular: entries on the other side of the diagonal are never read.

All of this is for processors whose matrix products are bound by their multiply-adds (the CPU).
On a GPU a launch costs more than the multiply-adds a block saves, so there every product here is
one plain ``mm`` (:func:`blocked` decides, for this module and its callers): blocked Newton-Schulz
products multiplied the ``mm`` launches of Muon's step and left it host-bound, far slower than a
plain Muon's (``bench/bench_step.py --device cuda``, docs/gpu_smoke.md).
"""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

from .multi_tensor import scale_
from .replay import replayable

__all__ = [
    "blocked",
    "matmul_triangular",
    "triangular_matmul",
    "upper_times_upper",
    "symmetric_product",
    "gram",
    "gram_update_",
    "gram_updates_",
    "symmetrize_",
    "mirror_lower_",
    "FP16_CPU_GEMM_DETOUR",
    "packed_size",
    "pack_lower",
    "unpack_symmetric",
    "pack_upper",
    "unpack_upper_triangular",
]

#: Below this size a block is multiplied with one ``mm`` (read at call time, so tests can lower it).
MIN_SIZE = 256
#: Columns per ``addmm_`` in :func:`gram_update_` (the fastest of the widths tried at Shampoo's block
#: sides; the update's time: ``bench/blas_triangle.py``).
PANEL = 128
#: The most bytes of ``rows @ rows.T`` products :func:`gram_updates_` holds at once (four of a
#: 1024-side factor in fp32): the launches it saves flatten out well below, the memory does not.
PRODUCT_BYTES = 16 * 2**20
#: Whether :func:`_times` routes CPU fp16 products around torch 2.5's slow gemm path, taken for
#: operands that are row-major blocks of larger matrices or a product into such a block: copying
#: the blocks whole costs a small fraction of that path, and Gram space in fp16 and Kron's factor
#: products run orders of magnitude faster with it (``bench/structured_half.py``). Not for bf16,
#: where the detour gains nothing. torch 2.13 has no such path (off there); versions between 2.5.1
#: and 2.13 were not checked, and are treated as 2.13.
FP16_CPU_GEMM_DETOUR = TorchVersion(torch.__version__) < "2.6"


def blocked(t: torch.Tensor) -> bool:
    """Whether products of ``t`` take this module's blocked forms (halving recursions, column
    panels): everywhere but on a GPU, where one ``mm`` is faster (module docstring). Meta tensors
    (the planner's) follow the CPU, the processor its runs are checked against."""
    return t.device.type != "cuda"


@replayable
def matmul_triangular(
    f: torch.Tensor, t: torch.Tensor, upper: bool = True, min_size: int | None = None
) -> torch.Tensor:
    """``f @ t`` for a general ``f`` of shape (m, n) and a triangular ``t`` (n, n), upper or
    lower; only ``t``'s triangle is read."""
    min_size = MIN_SIZE if min_size is None else min_size
    n = t.shape[0]
    if n <= min_size or not blocked(t):
        return _times(f, t.triu() if upper else t.tril(), None)
    h = n // 2
    f1, f2 = f[:, :h], f[:, h:]
    out = torch.empty(f.shape[0], n, dtype=torch.result_type(f, t), device=f.device)
    if upper:  # [F1 U11, F1 U12 + F2 U22]
        out[:, :h] = matmul_triangular(f1, t[:h, :h], True, min_size)
        out[:, h:] = _times(f1, t[:h, h:], (matmul_triangular(f2, t[h:, h:], True, min_size), 1.0, 1.0))
    else:  # [F1 L11 + F2 L21, F2 L22]
        out[:, :h] = _times(f2, t[h:, :h], (matmul_triangular(f1, t[:h, :h], False, min_size), 1.0, 1.0))
        out[:, h:] = matmul_triangular(f2, t[h:, h:], False, min_size)
    return out


def triangular_matmul(
    t: torch.Tensor, f: torch.Tensor, upper: bool = True, min_size: int | None = None
) -> torch.Tensor:
    """``t @ f`` for a triangular ``t`` (n, n) and a general ``f`` (n, m): ``(f^T t^T)^T``."""
    return matmul_triangular(f.T, t.T, not upper, min_size).T


@replayable
def upper_times_upper(a: torch.Tensor, b: torch.Tensor, min_size: int | None = None) -> torch.Tensor:
    """``a @ b`` for upper-triangular ``a`` and ``b`` (the result is upper triangular, its lower
    triangle exactly zero); only their upper triangles are read."""
    min_size = MIN_SIZE if min_size is None else min_size
    n = a.shape[0]
    if n <= min_size or not blocked(a):
        return _times(a.triu(), b.triu(), None)
    h = n // 2
    out = torch.zeros(n, n, dtype=torch.result_type(a, b), device=a.device)
    out[:h, :h] = upper_times_upper(a[:h, :h], b[:h, :h], min_size)
    out[h:, h:] = upper_times_upper(a[h:, h:], b[h:, h:], min_size)
    # A11 B12 + A12 B22: triangular x general plus general x triangular.
    out[:h, h:] = triangular_matmul(a[:h, :h], b[:h, h:], True, min_size).add_(
        matmul_triangular(a[:h, h:], b[h:, h:], True, min_size)
    )
    return out


@replayable
def symmetric_product(
    a: torch.Tensor,
    b: torch.Tensor,
    min_size: int | None = None,
    mirrored: bool = False,
    add: tuple[torch.Tensor, float, float] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b`` for a product known to be symmetric: a Gram matrix ``r @ r.T``, or two symmetric
    matrices that commute (polynomials in one matrix, as in Muon's Newton-Schulz iteration in Gram
    space). Each off-diagonal block is computed once (upper) and mirrored, the diagonal blocks
    recurse: 3/4 of the multiply-adds of ``mm`` at one halving, tending to 1/2. Off the diagonal
    blocks of size ``min_size`` or less (one ``mm`` each) the result is exactly symmetric: products
    that are symmetric only in exact arithmetic (commuting factors, rounded separately) take the
    upper blocks' rounding. On a GPU (:func:`blocked`) one ``mm``, symmetric up to rounding.
    ``mirrored``: exactly symmetric everywhere, bit for bit what :func:`mirror_lower_` of the
    result would make, by mirroring only what is not yet (the diagonal blocks' ``mm``, or the whole
    product on a GPU): for a result stored as symmetric, without a pass over all of it.
    ``add=(c, beta, alpha)`` (a symmetric ``c``): ``beta c + alpha a @ b``, each block one ``addmm``, so
    each element is rounded once, as ``torch.addmm`` rounds it (in bfloat16 a separate sum would
    round twice).
    ``out``: a contiguous ``n x n`` tensor the result is written to and returned, each block by its
    own product (no block-sized temporaries and copies: on the CPU a fresh one costs page faults),
    bit for bit the result without it; on the CPU a block of a larger matrix (unit column stride)
    will do, as the recursion writes its diagonal blocks so."""
    min_size = MIN_SIZE if min_size is None else min_size
    n = a.shape[0]
    if n <= min_size or not blocked(a):
        out = _times(a, b, add, out)
        return mirror_lower_(out) if mirrored else out
    h = n // 2
    if out is None:
        out = torch.empty(n, n, dtype=torch.result_type(a, b), device=a.device)
    for part in (slice(None, h), slice(h, None)):
        symmetric_product(a[part], b[:, part], min_size, mirrored, _block(add, part, part), out=out[part, part])
    off = _times(a[:h], b[:, h:], _block(add, slice(None, h), slice(h, None)), out[:h, h:])
    out[h:, :h] = off.T
    return out


def _times(
    a: torch.Tensor, b: torch.Tensor, add: tuple[torch.Tensor, float, float] | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b``, or with ``add=(c, beta, alpha)`` one ``addmm``: ``beta c + alpha a @ b``; into
    ``out`` if given (in place where ``out`` is ``c``). Every product of this module goes through
    it. In fp16 off a GPU (:func:`blocked`: the CPU, and the planner's meta tensors,
    which follow it) with :data:`FP16_CPU_GEMM_DETOUR`: operands that are blocks of larger matrices
    are copied whole first, and a product into a block of a larger ``out`` is made whole and copied
    in. The kernel then differs, not the product: Gram space's fp16 iteration gave the same bits or
    (after 5 steps) differed by a few fp16 ulps, within the accuracy tests' bounds either way; in
    fp32, bf16 and fp64 the bits are those of the plain ``torch`` call."""
    if FP16_CPU_GEMM_DETOUR and a.dtype == torch.float16 and blocked(a):
        a, b = _gemm_ready(a), _gemm_ready(b)
        if out is not None and not out.is_contiguous():
            return out.copy_(_times(a, b, add))
    if add is None:
        return a @ b if out is None else torch.mm(a, b, out=out)
    if out is None:
        return torch.addmm(add[0], a, b, beta=add[1], alpha=add[2])
    if out is add[0]:
        return out.addmm_(a, b, beta=add[1], alpha=add[2])
    return torch.addmm(add[0], a, b, beta=add[1], alpha=add[2], out=out)


def _gemm_ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where it is neither contiguous nor the transpose of a contiguous one."""
    return t if t.is_contiguous() or t.T.is_contiguous() else t.contiguous()


def _block(
    add: tuple[torch.Tensor, float, float] | None, rows: slice, cols: slice
) -> tuple[torch.Tensor, float, float] | None:
    """The block ``rows x cols`` of ``add``'s matrix, with its coefficients."""
    return None if add is None else (add[0][rows, cols], add[1], add[2])


def gram(rows: torch.Tensor, min_size: int | None = None) -> torch.Tensor:
    """``rows @ rows.T`` (symmetric) computing each off-diagonal block once."""
    return symmetric_product(rows, rows.T, min_size)


def gram_update_(
    c: torch.Tensor,
    rows: torch.Tensor,
    beta: float,
    alpha: float,
    min_size: int | None = None,
    panel: int | None = None,
) -> torch.Tensor:
    """``c <- beta * c + alpha * rows @ rows.T`` in place for a symmetric ``c`` (BLAS ``syrk``),
    computing **the lower triangle only** when ``c`` is larger than ``min_size``: only the lower
    triangle is read and kept current; the strict upper one is not maintained (partly updated,
    partly stale) until :func:`symmetrize_` mirrors the lower one. A caller that accumulates many
    updates mirrors once, when it reads the whole matrix (Shampoo: at a root refresh or a state
    export), instead of after every update.

    The lower triangle is computed in column panels of ``panel`` columns, each one ``addmm_``
    from the diagonal down (``c[i:, i:i+w] <- beta c + alpha rows[i:] rows[i:i+w]^T``, BLAS
    scaling fused, no temporary): only the upper halves of the diagonal tiles are computed
    needlessly (``panel / 2n`` of the work). On the CPU it comes close to an ideal ``syrk``'s half
    of ``rows @ rows.T``, ahead of a recursive halving with an exact mirror after every update
    (``bench/blas_triangle.py`` times it against torch's full product and BLAS's triangle kernels);
    this update is most of Shampoo's step before its first root.

    At or below ``min_size``, and on a GPU (where a panel's launch costs more than the multiply-adds
    it saves: with panels Shampoo's step before its first root trailed Meta's on an H100,
    ``bench/shampoo_vs_meta.py --device cuda``), the whole matrix is updated, rounded exactly as
    ``c * beta + (rows @ rows.T) * alpha``: early Shampoo factors of small blocks are nearly
    singular (rank-one sums plus a tiny epsilon) and SOAP's eigenbasis of their null space is
    decided by the last bits of the factor, so small blocks keep the plain formula's bits."""
    gram_updates_([c], [rows], beta, alpha, min_size, panel)
    return c


@replayable
def gram_updates_(
    cs: list[torch.Tensor],
    rows: list[torch.Tensor],
    beta: float,
    alpha: float,
    min_size: int | None = None,
    panel: int | None = None,
) -> None:
    """:func:`gram_update_` of every ``(c, rows)`` pair, with the same bits. The matrices updated
    whole go in chunks of at most :data:`PRODUCT_BYTES` of products: one ``mm`` each, then
    ``c * beta``, ``product * alpha`` and their sum as one ``torch._foreach_*`` call each over the
    chunk (one launch per chunk on a GPU instead of one per matrix; the same per-tensor operations
    on the CPU)."""
    min_size = MIN_SIZE if min_size is None else min_size
    panel = PANEL if panel is None else panel
    whole: list[tuple[torch.Tensor, torch.Tensor]] = []
    size = 0
    for c, r in zip(cs, rows):
        n = c.shape[0]
        if n <= min_size or not blocked(c):
            nbytes = n * n * c.element_size()
            if whole and size + nbytes > PRODUCT_BYTES:
                _gram_adds_(whole, beta, alpha)
                whole, size = [], 0
            whole.append((c, r))
            size += nbytes
            continue
        for i in range(0, _panels_end(c, panel), panel):
            j = min(n, i + panel)
            block = c[i:, i:j]
            _times(r[i:], r[i:j].T, (block, beta, alpha), out=block)
    if whole:
        _gram_adds_(whole, beta, alpha)


def symmetrize_(c: torch.Tensor, min_size: int | None = None, panel: int | None = None) -> torch.Tensor:
    """Mirror the lower triangle of ``c`` onto its strict upper triangle, in place, after
    :func:`gram_update_` (a no-op at or below ``min_size`` and on a GPU, where that updates both
    triangles)."""
    min_size = MIN_SIZE if min_size is None else min_size
    if c.shape[0] <= min_size or not blocked(c):
        return c
    return mirror_lower_(c, panel)


@replayable
def mirror_lower_(c: torch.Tensor, panel: int | None = None) -> torch.Tensor:
    """Mirror the lower triangle of ``c`` onto its strict upper triangle, in place, at every size
    and on every device: the one form of a symmetric matrix that a packed triangle
    (:func:`pack_lower`) holds bit for bit. On the CPU copies go panel by panel, so that no
    transposed temporary of ``c``'s size is made (a fresh one costs page faults); on a GPU
    (:func:`blocked`) it is that packing's round trip, :func:`pack_lower` then
    :func:`unpack_symmetric` (two gathers), since the panels' launches made a 1024-side mirror
    host-bound and slowed Shampoo's kept warm refresh, two mirrors per factor, several fold on an H100
    (``bench/shampoo_vs_meta.py --device cuda --drift 0``, docs/benchmarks.md). ``c`` is contiguous
    or a transposed view of contiguous memory (a factor's kept triangle); the symmetric result is
    the same written through either."""
    n = c.shape[0]
    if not blocked(c):
        unpack_symmetric(pack_lower(c), n, out=c if c.is_contiguous() else c.T)
        return c
    panel = PANEL if panel is None else panel
    lower = _lower_mask(panel, c.device)
    for i in range(0, _panels_end(c, panel), panel):
        j = min(n, i + panel)
        tile = c[i:j, i:j]
        tile.copy_(torch.where(lower[: j - i, : j - i], tile, tile.T))
        c[i:j, j:].copy_(c[j:, i:j].T)
    return c


_LOWER_MASKS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _lower_mask(size: int, device: torch.device) -> torch.Tensor:
    """``size x size`` bools, true on and below the diagonal, cached per size and device (one panel
    width per run): a diagonal tile of :func:`mirror_lower_` is one ``where`` over it, pure copies
    (as the packing's round trip makes them: a negative zero stays one), faster than the sum of
    its two triangles that it replaced (measured once, not benched). On meta tensors (the planner's) a fresh one each
    call: a temporary of the mirror, not memory the planner should see kept."""
    key = (size, device)
    mask = _LOWER_MASKS.get(key)
    if mask is None:
        mask = torch.ones(size, size, dtype=torch.bool, device=device).tril()
        if device.type != "meta":
            _LOWER_MASKS[key] = mask
    return mask


# ---- packed symmetric and triangular storage ------------------------------------------------------
def packed_size(n: int) -> int:
    """Elements of the packed lower triangle of an ``n x n`` matrix (diagonal included)."""
    return n * (n + 1) // 2


_INDICES: dict[tuple[str, int, bool, torch.device], torch.Tensor] = {}


def _index(kind: str, n: int, transposed: bool, device: torch.device) -> torch.Tensor:
    """Flat int64 indices, cached per size and device (a few sizes per model: the blocking's).
    ``"pack"``: position in an ``n x n`` matrix of each packed element, the lower triangle row by
    row (``transposed``: of the matrix's transpose, i.e. of a matrix given as a transposed view of
    contiguous memory); ``"unpack"``: packed position of every matrix element, ``(i, j)`` and
    ``(j, i)`` the same one. The unpack index is 8 bytes per element of the matrix: for the 1024
    blocks of Shampoo 8 MB per device, against 2 MB saved per packed fp32 matrix."""
    key = (kind, n, transposed, device)
    out = _INDICES.get(key)
    if out is None:
        rows = torch.arange(n, device=device)[:, None]
        cols = torch.arange(n, device=device)[None, :]
        if kind == "pack":
            r, c = torch.tril_indices(n, n, device=device)
            out = c * n + r if transposed else r * n + c
        else:
            hi, lo = torch.maximum(rows, cols), torch.minimum(rows, cols)
            out = (hi * (hi + 1) // 2 + lo).reshape(-1)
        _INDICES[key] = out
    return out


def pack_lower(m: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The lower triangle of the square ``m`` (diagonal included), row by row, as one 1-D tensor of
    :func:`packed_size` elements (into ``out`` when given). ``m`` is contiguous or a transposed
    view of contiguous memory (:func:`dist_optim.shampoo.blocking.kept_triangle`); its other
    triangle is not read. One ``index_select``: exact copies of the values."""
    n = m.shape[0]
    transposed = not m.is_contiguous()
    base = m.T if transposed else m
    if not base.is_contiguous():
        raise ValueError(f"pack_lower: a contiguous matrix or its transpose is needed, got strides {m.stride()}")
    index = _index("pack", n, transposed, m.device)
    if out is None:
        return torch.index_select(base.reshape(-1), 0, index)
    return torch.index_select(base.reshape(-1), 0, index, out=out)


def unpack_symmetric(packed: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The symmetric ``n x n`` matrix whose lower triangle :func:`pack_lower` packed into
    ``packed`` (into ``out``, a contiguous ``n x n`` tensor, when given): both triangles exact
    copies of the packed values, as :func:`mirror_lower_` leaves a matrix."""
    index = _index("unpack", n, False, packed.device)
    if out is None:
        return torch.index_select(packed, 0, index).view(n, n)
    torch.index_select(packed, 0, index, out=out.view(-1))
    return out


def pack_upper(m: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The upper triangle of the contiguous square ``m`` (diagonal included) as one 1-D tensor of
    :func:`packed_size` elements (into ``out`` when given): the lower triangle of its transpose
    row by row (:func:`pack_lower` of the transposed view), i.e. ``m``'s upper triangle column by
    column (LAPACK's ``'U'`` packed storage: ``m[i, j]``, ``i <= j``, at ``j (j + 1) / 2 + i``).
    ``m``'s strict lower triangle is not read. Exact copies of the values."""
    if not m.is_contiguous():
        raise ValueError(f"pack_upper: a contiguous matrix is needed, got strides {m.stride()}")
    return pack_lower(m.T, out=out)


def unpack_upper_triangular(packed: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The upper-triangular ``n x n`` matrix whose upper triangle :func:`pack_upper` packed into
    ``packed`` (into ``out``, a contiguous ``n x n`` tensor, when given): the triangle exact
    copies of the packed values, the strict lower triangle exactly ``+0``."""
    if out is None:
        out = torch.empty(n, n, dtype=packed.dtype, device=packed.device)
    flat = out.view(-1)
    flat.zero_()
    flat.index_copy_(0, _index("pack", n, True, packed.device), packed)
    return out


def _panels_end(c: torch.Tensor, panel: int) -> int:
    """Where the panel loops over ``c`` stop: after the last panel, or on the meta device (the
    planner's simulation, :mod:`dist_optim.plan`) after the first. Meta tensors carry no values, so
    a panel's op only checks shapes and allocates its temporaries; every panel is the same op on a
    smaller slice than the first, whose temporaries are the largest, freed before the next panel's.
    The first panel alone then leaves the same state and the same peak of live bytes as all of
    them, without dispatching ``n / panel`` meta ops through torch's Python decompositions (which
    took most of the planner's time for Shampoo on a 70B model)."""
    return min(panel, c.shape[0]) if c.is_meta else c.shape[0]


def _gram_adds_(pairs: list[tuple[torch.Tensor, torch.Tensor]], beta: float, alpha: float) -> None:
    """``c <- c * beta + (rows @ rows.T) * alpha`` for each ``(c, rows)`` pair, rounded as written."""
    cs = [c for c, _ in pairs]
    products = [_times(r, r.T, None) for _, r in pairs]
    if beta != 1.0:
        scale_(cs, beta)
    if alpha != 1.0:
        scale_(products, alpha)
    torch._foreach_add_(cs, products)
