"""The structured products of dist_optim.kernels.structured against plain matrix products."""

from __future__ import annotations

import pytest
import torch

from dist_optim.kernels import structured
from dist_optim.kernels.structured import (
    gram,
    gram_update_,
    matmul_triangular,
    symmetric_product,
    symmetrize_,
    triangular_matmul,
    upper_times_upper,
)

SIZES = [1, 2, 5, 13, 37, 64]  # odd sizes cut unevenly at every level of the recursion


def _junk_below(t: torch.Tensor, upper: bool) -> torch.Tensor:
    """A triangular matrix with garbage in its other triangle, which must never be read."""
    junk = torch.full_like(t, float("nan"))
    return t.triu() + junk.tril(-1) if upper else t.tril() + junk.triu(1)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("min_size", [1, 3, 256])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("upper", [True, False])
def test_triangular_products(n: int, upper: bool, min_size: int) -> None:
    gen = torch.Generator().manual_seed(n)
    t = torch.randn(n, n, generator=gen, dtype=torch.float64)
    exact = t.triu() if upper else t.tril()
    f = torch.randn(7, n, generator=gen, dtype=torch.float64)
    _close(matmul_triangular(f, _junk_below(t, upper), upper, min_size), f @ exact)
    g = torch.randn(n, 9, generator=gen, dtype=torch.float64)
    _close(triangular_matmul(_junk_below(t, upper), g, upper, min_size), exact @ g)


@pytest.mark.parametrize("min_size", [1, 3, 256])
@pytest.mark.parametrize("n", SIZES)
def test_upper_times_upper_is_upper_with_exact_zeros(n: int, min_size: int) -> None:
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    b = torch.randn(n, n, generator=gen, dtype=torch.float64)
    out = upper_times_upper(_junk_below(a, True), _junk_below(b, True), min_size)
    _close(out, a.triu() @ b.triu())
    assert torch.equal(out.tril(-1), torch.zeros_like(out))


@pytest.mark.parametrize("min_size", [1, 3, 256])
@pytest.mark.parametrize("n", SIZES)
def test_gram(n: int, min_size: int) -> None:
    rows = torch.randn(n, 11, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    _close(gram(rows, min_size), rows @ rows.T)


@pytest.mark.parametrize("min_size", [1, 3, 256])
@pytest.mark.parametrize("n", SIZES)
def test_symmetric_product_of_commuting_symmetric_matrices(n: int, min_size: int) -> None:
    """Polynomials in one symmetric matrix commute, so their product is symmetric (Muon's Gram-space
    iteration): the blocked product equals the plain one, and its off-diagonal blocks mirror each
    other exactly."""
    gen = torch.Generator().manual_seed(n)
    r = torch.randn(n, n + 3, generator=gen, dtype=torch.float64)
    a = r @ r.T
    p = 0.5 * a @ a - 2.0 * a + 3.0 * torch.eye(n, dtype=torch.float64)
    out = symmetric_product(p, a, min_size)
    _close(out, p @ a)
    if n > min_size:
        h = n // 2
        assert torch.equal(out[h:, :h], out[:h, h:].T)


@pytest.mark.parametrize("min_size", [1, 3, 256])
@pytest.mark.parametrize("n", SIZES)
def test_symmetric_product_with_an_added_matrix_is_addmm(n: int, min_size: int) -> None:
    """``add=(c, beta, alpha)`` is ``torch.addmm(c, a, b, beta=beta, alpha=alpha)`` for a symmetric
    ``c`` (Muon's Gram-space updates ``a Q + B Q``): equal in float64, and in bfloat16 each block is
    one ``addmm`` of the same operands, so with no blocking the result is addmm's bit for bit."""
    gen = torch.Generator().manual_seed(n)
    r = torch.randn(n, n + 3, generator=gen, dtype=torch.float64)
    a = r @ r.T
    p = 0.5 * a @ a - 2.0 * a
    _close(symmetric_product(p, a, min_size, add=(a, 3.4, -0.7)), torch.addmm(a, p, a, beta=3.4, alpha=-0.7))
    a16, p16 = a.bfloat16(), p.bfloat16()
    unblocked = symmetric_product(p16, a16, max(n, 1), add=(a16, 3.4, -0.7))
    assert torch.equal(unblocked, torch.addmm(a16, p16, a16, beta=3.4, alpha=-0.7))


@pytest.mark.parametrize("min_size", [1, 3, 256])
@pytest.mark.parametrize("n", [*SIZES, 300, 513])
def test_mirrored_symmetric_product_is_the_mirror_of_its_lower_triangle(n: int, min_size: int) -> None:
    """``mirrored=True`` (a stored root) is bit for bit ``mirror_lower_`` of the plain result, the
    form a packed root holds, though it mirrors only the diagonal blocks' ``mm``: fp32, where the
    two triangles of ``Q D Q^T`` round apart."""
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, n, generator=gen)
    scaled = q * torch.rand(n, generator=gen)
    expected = structured.mirror_lower_(symmetric_product(scaled, q.T, min_size))
    got = symmetric_product(scaled, q.T, min_size, mirrored=True)
    assert torch.equal(got, expected)
    assert torch.equal(got, got.T)
    if n >= 13:  # there the plain product is not exactly symmetric, so the checks above can fail
        plain = symmetric_product(scaled, q.T, n)
        assert not torch.equal(plain, plain.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("min_size", [1, 3, 256])
@pytest.mark.parametrize("n", [*SIZES, 300, 513])
def test_symmetric_product_into_out_is_the_product_without_it(n: int, min_size: int, dtype: torch.dtype) -> None:
    """``out=`` (a warm root refresh's scratch, each block written by its own product) gives the
    bits of the product without it, plain, mirrored and with ``add``, into a contiguous tensor and
    into a block of a larger one (a view at an unaligned offset), which is returned and whose
    surroundings are left as they were."""
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, n, generator=gen).to(dtype)
    scaled = q * torch.rand(n, generator=gen).to(dtype)
    c = scaled @ scaled.T
    for mirrored, add in ((False, None), (True, None), (False, (c, 0.7, -1.3))):
        want = symmetric_product(scaled, q.T, min_size, mirrored, add)
        whole = torch.full((n + 2, n + 3), 7.0, dtype=dtype)
        for out in (torch.empty(n, n, dtype=dtype), whole[1 : n + 1, 3:]):
            got = symmetric_product(scaled, q.T, min_size, mirrored, add, out=out)
            assert got is out and torch.equal(got, want), (mirrored, add is not None)
        untouched = torch.ones_like(whole, dtype=torch.bool)
        untouched[1 : n + 1, 3:] = False
        assert bool((whole[untouched] == 7.0).all())


@pytest.mark.parametrize("n", [5, 37, 64])
def test_gram_is_the_symmetric_product_of_rows_and_their_transpose(n: int) -> None:
    """gram keeps its bits (Kron's statistics): the same blocks as symmetric_product(rows, rows.T)."""
    rows = torch.randn(n, 11, generator=torch.Generator().manual_seed(n))
    assert torch.equal(gram(rows, 3), symmetric_product(rows, rows.T, 3))


@pytest.mark.parametrize("min_size,panel", [(1, 1), (1, 3), (3, 2), (256, 128)])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("beta,alpha", [(0.9, 0.1), (1.0, 1.0)])
def test_gram_update_in_place(n: int, min_size: int, panel: int, beta: float, alpha: float) -> None:
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    c = a @ a.T
    c = (c + c.T) / 2  # exactly symmetric
    rows = torch.randn(n, 11, generator=gen, dtype=torch.float64)
    expected = beta * c + alpha * (rows @ rows.T)
    if n > min_size:  # above min_size only the lower triangle is read
        c = c.tril() + torch.full_like(c, float("nan")).triu(1)
    ptr = c.data_ptr()
    out = gram_update_(c, rows, beta, alpha, min_size, panel)
    assert out.data_ptr() == ptr == c.data_ptr()
    _close(c.tril(), expected.tril())
    assert symmetrize_(c, min_size, panel).data_ptr() == ptr
    _close(c, expected)
    if n > min_size:  # every strict-upper entry is a copy of its mirror
        assert torch.equal(c, c.T)
    # Rows given as a transposed view (Shampoo's factor of a block's second dim).
    cols = torch.randn(11, n, generator=gen, dtype=torch.float64)
    c2 = torch.zeros(n, n, dtype=torch.float64)
    gram_update_(c2, cols.T, 1.0, 1.0, min_size, panel)
    _close(symmetrize_(c2, min_size, panel), cols.T @ cols)


def test_gram_update_small_blocks_round_as_the_plain_formula() -> None:
    """At or below min_size the update has exactly the bits of ``c * beta + (G G^T) * alpha``
    (SOAP's eigenbases of nearly singular small factors depend on them)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 7, generator=gen)
    c = rows[:, :3] @ rows[:, :3].T
    expected = c * 0.95 + (rows @ rows.T) * 0.05
    assert torch.equal(gram_update_(c, rows, 0.95, 0.05), expected)


def test_min_size_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = torch.addmm

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(structured, "MIN_SIZE", 4)
    monkeypatch.setattr(torch, "addmm", counting)
    f, t = torch.randn(3, 16), torch.randn(16, 16)
    torch.testing.assert_close(matmul_triangular(f, t), f @ t.triu())
    assert calls, "a lowered MIN_SIZE must make the product recurse"


@pytest.mark.parametrize("n,panel", [(300, 128), (1024, 128), (1000, 96)])
@pytest.mark.parametrize("transposed", [False, True])
def test_meta_panels_leave_the_whole_loops_state_and_peak(
    monkeypatch: pytest.MonkeyPatch, n: int, panel: int, transposed: bool
) -> None:
    """On meta tensors (the planner) the panel loops stop after their first panel: the factor keeps
    its shape and strides, and the live bytes the planner measures (its peak: the temporaries of
    the largest panel) are those of running every panel."""
    from dist_optim.plan.traffic import LiveBytes

    def measure() -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
        c = torch.empty(n, n, device="meta")
        c = c.T if transposed else c  # Shampoo's factor of a block's second dim
        rows = torch.empty(n, 64, device="meta")
        with LiveBytes() as live:
            gram_update_(c, rows, 0.9, 0.1, panel=panel)
            symmetrize_(c, panel=panel)
        return live.peak, live.live, tuple(c.shape), c.stride()

    first = measure()
    monkeypatch.setattr(structured, "_panels_end", lambda c, panel: c.shape[0])
    every = measure()
    assert first == every
    assert first[0] > 0  # the panels' temporaries were seen


def _gemm_ready(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.T.is_contiguous()


def test_fp16_products_avoid_torch_2_5s_slow_cpu_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """With FP16_CPU_GEMM_DETOUR (torch 2.5's CPU fp16 gemm is slow from row-major blocks of larger
    matrices and into them; set here whatever the torch): every ``mm``/``addmm``/``addmm_`` that the
    blocked products issue in fp16 (Muon's symmetric products, Kron's triangular products and Gram
    updates) takes operands that are contiguous or transposed contiguous, and none writes into a
    block of a larger matrix. Seen at torch's dispatcher, as the kernels are called."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[tuple[str, bool, bool]] = []
    products = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func._overloadpacket in products:
                out = args[0] if func._overloadpacket is torch.ops.aten.addmm_ else kwargs.get("out")
                seen.append((str(func), all(_gemm_ready(t) for t in args[-2:]), out is None or out.is_contiguous()))
            return func(*args, **kwargs)

    monkeypatch.setattr(structured, "FP16_CPU_GEMM_DETOUR", True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 700, generator=gen).half()
    g = x @ x.T
    t = torch.randn(300, 300, generator=gen).half()
    for run in (
        lambda: symmetric_product(x, x.T, 64),
        lambda: symmetric_product(g, g, 64, add=(g, 0.5, 2.0)),
        lambda: matmul_triangular(x.T, t, True, 64),
        lambda: matmul_triangular(x.T, t, False, 64),
        lambda: upper_times_upper(t, t, 64),
        lambda: gram_update_(g.clone(), x, 0.9, 0.1, 64, 32),
    ):
        seen.clear()
        with Products():
            run()
        assert len(seen) > 5, seen  # the blocked recursion or the panels ran
        bad = [s for s in seen if not (s[1] and s[2])]
        assert not bad, bad[:5]
