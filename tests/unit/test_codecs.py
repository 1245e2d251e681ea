"""The state codecs (dist_optim/states/codecs.py): what each stores, round trips, the predicate that
tells a saved value's form, the key rules the optimizers declare, and the one check of optim_bits."""

from __future__ import annotations

import pytest
import torch

import dist_optim
from dist_optim.kernels import structured
from dist_optim.lamb.optimizer import STATE as LAMB_STATE
from dist_optim.layout import whole_layout
from dist_optim.shampoo.state import STATE as SHAMPOO_STATE
from dist_optim.states import bnb, codecs, lowbit


def _symmetric(n: int, seed: int = 0) -> torch.Tensor:
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(seed))
    return a @ a.T


def test_plain_stores_the_tensor() -> None:
    x = torch.randn(3, 4)
    assert codecs.PLAIN.stored("m", (3, 4), torch.float32) == [("m", (3, 4), torch.float32)]
    assert codecs.PLAIN.keys("m") == ("m",)
    state = {"m": torch.zeros(3, 4)}
    codecs.PLAIN.encode(x, state, "m")
    assert codecs.PLAIN.decode(state, "m") is state["m"] and torch.equal(state["m"], x)


def test_blockwise_8bit_is_bitsandbytes_format() -> None:
    shape = (20, 30)  # 600 elements: 3 blocks of 256, the last one partial
    stored = codecs.BNB_UNSIGNED.stored("exp_avg_sq", shape, torch.float32)
    assert stored == [("exp_avg_sq", shape, torch.uint8), ("exp_avg_sq_absmax", (3,), torch.float32)]
    assert codecs.BNB_SIGNED.keys("exp_avg") == ("exp_avg", "exp_avg_absmax")
    # A TP slice's codes are its piece's shape, its absmax the full tensor's blocks.
    assert codecs.BNB_SIGNED.stored("m", (10, 30), torch.float32, full_numel=600)[1] == (
        "m_absmax",
        (3,),
        torch.float32,
    )

    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    blocks = bnb.FullBlocks(whole_layout(shape), x.device)
    state = {"exp_avg": torch.zeros(shape, dtype=torch.uint8), "exp_avg_absmax": torch.zeros(3)}
    codecs.BNB_SIGNED.encode(x, state, "exp_avg", blocks=blocks)
    # The same codes and values as bitsandbytes' own blockwise functions on the flat tensor.
    codes, absmax = torch.zeros(600, dtype=torch.uint8), torch.zeros(3)
    bnb.quantize_into(x.reshape(-1), codes, absmax, signed=True)
    assert torch.equal(state["exp_avg"].reshape(-1), codes) and torch.equal(state["exp_avg_absmax"], absmax)
    values = codecs.BNB_SIGNED.decode(state, "exp_avg", blocks=blocks)
    assert values.dtype == torch.float32 and values.shape == shape
    assert torch.equal(values.reshape(-1), bnb.dequantize_blockwise_8bit(codes, absmax, signed=True))
    assert (values - x).abs().max() <= 0.02 * x.abs().max()


def test_packed_triangles_round_trip_exactly() -> None:
    s = _symmetric(7)
    s = (s + s.T) / 2
    stored = codecs.PACKED_SYMMETRIC.stored("factor0", (7, 7), torch.float64)
    assert stored == [("factor0", (structured.packed_size(7),), torch.float64)]
    state = {"factor0": torch.zeros(structured.packed_size(7))}
    codecs.PACKED_SYMMETRIC.encode(s, state, "factor0")
    assert torch.equal(codecs.PACKED_SYMMETRIC.decode(state, "factor0", side=7), s)
    u = torch.triu(torch.randn(5, 5))
    packed = {"Q_0": torch.zeros(structured.packed_size(5))}
    codecs.PACKED_UPPER.encode(u, packed, "Q_0")
    assert torch.equal(codecs.PACKED_UPPER.decode(packed, "Q_0", side=5), u)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_lowbit_codes_keys_and_round_trip(bits: int, packed: bool) -> None:
    codec = codecs.LowBit(bits, codecs.PACKED_UPPER if packed else None)
    n = 9
    numel = structured.packed_size(n) if packed else n * n
    stored = codec.stored("basis0", (n, n), torch.float32)
    assert stored == [
        ("basis0", (lowbit.codes_numel(numel, bits),), torch.uint8),
        ("basis0_absmax", (lowbit.absmax_numel(numel, bits),), torch.float32),
    ]
    # The identity's multiples quantise exactly (zero and absmax are codes).
    eye = 3 * torch.eye(n)
    state = {key: torch.zeros(shape, dtype=dtype) for key, shape, dtype in stored}
    codec.encode(eye, state, "basis0")
    assert torch.equal(codec.decode(state, "basis0", side=n), eye)
    codes, absmax = codec.quantize(eye)
    assert torch.equal(codes, state["basis0"]) and torch.equal(absmax, state["basis0_absmax"])
    flat = codec.decode(state, "basis0", side=n, flat=True)
    assert flat.shape == (numel,)
    with pytest.raises(ValueError, match="bits must be 8 or 4, got 2"):
        codecs.LowBit(2)


def test_the_predicate_tells_a_saved_value_form() -> None:
    codes, values = torch.zeros(4, dtype=torch.uint8), torch.zeros(4)
    assert codecs.quantized(codes) and not codecs.quantized(values) and not codecs.quantized(None)
    assert codecs.BNB_SIGNED.holds(codes) and not codecs.BNB_SIGNED.holds(values)
    assert codecs.LowBit(4).holds(codes) and codecs.PLAIN.holds(values) and not codecs.PLAIN.holds(codes)
    assert codecs.PACKED_SYMMETRIC.holds(values) and not codecs.PACKED_SYMMETRIC.holds(torch.zeros(2, 2))
    entry = LAMB_STATE.entry("exp_avg")
    assert entry.holds({"exp_avg": codes}) and not entry.holds({"exp_avg": values}) and not entry.holds({})


def test_declared_keys_and_saved_dtypes() -> None:
    codes, values = torch.zeros(4, dtype=torch.uint8), torch.zeros(4)
    assert LAMB_STATE.keeps_saved_dtype("exp_avg", codes) and LAMB_STATE.keeps_saved_dtype("exp_avg_sq_absmax", values)
    assert not LAMB_STATE.keeps_saved_dtype("exp_avg", values)  # a 32-bit moment takes the parameter's dtype
    assert not LAMB_STATE.keeps_saved_dtype("step", values) and LAMB_STATE.parse("step") is None
    # Shampoo's key rule: [block<i>.]<name>[<k>][_absmax], nothing parsed by hand.
    parse = SHAMPOO_STATE.parse
    for key, want in [
        ("block0.exp_avg_sq", ("exp_avg_sq", None, False)),
        ("block0.exp_avg_absmax", ("exp_avg", None, True)),
        ("block3.exp_avg_eigen", ("exp_avg_eigen", None, False)),
        ("block1.root10", ("root", 10, False)),
        ("block12.basis1_absmax", ("basis", 1, True)),
        ("momentum_buffer_absmax", ("momentum_buffer", None, True)),
        ("step", ("step", None, False)),
    ]:
        got = parse(key)
        assert got is not None and (got[0].name, got[1], got[2]) == want, key
    assert parse("block0.unknown") is None and parse("block0.factor") is not None


@pytest.mark.parametrize(
    "cls",
    [
        dist_optim.DistributedLamb,
        dist_optim.DistributedCAME,
        dist_optim.DistributedMuon,
        dist_optim.DistributedKron,
        dist_optim.DistributedGaLore,
        dist_optim.DistributedShampoo,
    ],
)
@pytest.mark.filterwarnings("ignore:DistributedGaLore. no parameter group has a 'rank'")
def test_optim_bits_one_scope(cls: type) -> None:
    """Every optimizer with 8-bit states takes optim_bits and min_8bit_size in its constructor,
    shows them the same way and refuses a bad value naming it and the fix."""
    kwargs = {"lr": 1e-2}
    opt = cls([torch.nn.Parameter(torch.randn(4, 4))], optim_bits=8, min_8bit_size=16, **kwargs)
    assert (opt.optim_bits, opt.min_8bit_size) == (8, 16)
    assert codecs.EightBit.of(opt) == codecs.EightBit(8, 16) and codecs.EightBit.of(opt).keeps(16)
    with pytest.raises(ValueError, match=r"optim_bits must be 32 or 8 .*got 4; pass optim_bits=8"):
        cls([torch.nn.Parameter(torch.randn(4, 4))], optim_bits=4, **kwargs)


@pytest.mark.parametrize(
    "cls",
    [dist_optim.DistributedLamb, dist_optim.DistributedCAME, dist_optim.DistributedMuon, dist_optim.DistributedKron],
)
def test_optimizer_wide_optim_bits_refused_in_a_group(cls: type) -> None:
    with pytest.raises(ValueError, match="optim_bits is optimizer-wide: pass it to the constructor"):
        cls([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "optim_bits": 8}], lr=1e-2)


def test_shampoo_takes_optim_bits_per_group_through_the_same_check() -> None:
    p, q = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    opt = dist_optim.DistributedShampoo(
        [{"params": [p], "optim_bits": 8, "min_8bit_size": 0}, {"params": [q]}], lr=1e-2
    )
    assert [codecs.EightBit.of(g) for g in opt.param_groups] == [codecs.EightBit(8, 0), codecs.EightBit(32, 4096)]
    with pytest.raises(ValueError, match=r"optim_bits must be 32 or 8 .*got 16; pass optim_bits=8"):
        dist_optim.DistributedShampoo([{"params": [p], "optim_bits": 16}], lr=1e-2)


def test_check_8bit_options() -> None:
    assert codecs.check_8bit_options(8, 0, "x") == (8, 0)
    with pytest.raises(ValueError, match=r"optim_bits must be 32 or 8 \(x\), got True"):
        codecs.check_8bit_options(True, 0, "x")
    with pytest.raises(ValueError, match="min_8bit_size must be an integer >= 0, got -1"):
        codecs.check_8bit_options(8, -1, "x")
    with pytest.raises(ValueError, match="min_8bit_size is optimizer-wide"):
        codecs.refuse_group_8bit_options({"min_8bit_size": 3}, "X")


def _declared_specs() -> list[tuple[type, dict[str, object], codecs.StateSpec]]:
    from dist_optim.galore.state import STATE as GALORE_STATE
    from dist_optim.muon.optimizer import STATE as MUON_STATE

    return [
        (dist_optim.DistributedLamb, {}, LAMB_STATE),
        (dist_optim.DistributedMuon, {}, MUON_STATE),
        (dist_optim.DistributedShampoo, {"max_preconditioner_dim": 4, "preconditioner_bits": 4}, SHAMPOO_STATE),
        (dist_optim.DistributedGaLore, {}, GALORE_STATE),
    ]


@pytest.mark.parametrize("cls, kwargs, spec", _declared_specs(), ids=lambda x: getattr(x, "__name__", ""))
def test_declarations_cover_what_the_optimizers_store(
    cls: type, kwargs: dict[str, object], spec: codecs.StateSpec
) -> None:
    """After 8-bit steps every stored code and absmax is one the optimizer declared (the loader keeps
    exactly those in their saved dtype)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 8)), torch.nn.Parameter(torch.randn(8))]
    groups: list[dict[str, object]] = [{"params": [params[0]]}, {"params": [params[1]]}]
    if cls is dist_optim.DistributedMuon:
        groups[1]["use_muon"] = False
    if cls is dist_optim.DistributedGaLore:
        groups[0]["rank"] = 2
    opt = cls(groups, lr=1e-2, optim_bits=8, min_8bit_size=0, **kwargs)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    seen = 0
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert spec.encoded(key, value) == (codecs.quantized(value) or key.endswith(codecs.ABSMAX)), key
                seen += codecs.quantized(value)
    assert seen
