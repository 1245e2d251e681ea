"""DistributedGaLore against galore_torch (32-bit), bitsandbytes' 8-bit GaLore AdamW, a tiny Llama,
conversions, bad input, and its distributed behaviour (exactness on shapes where ColossalAI
crashes, collectives per step, bytes gathered only at projector refreshes)."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch

import dist_optim
from dist_optim import comm
from dist_optim.galore import DistributedGaLore, galore_param_groups, matrix_pieces
from dist_optim.layout import ParamLayout, TPSplit, ZeroShard

RTOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """bitsandbytes' CPU block-wise (de)quantisation runs on the OpenMP pool it shares with torch;
    on an oversubscribed machine that pool is ~50x slower than one thread for these tiny tensors."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SHAPES = [(12, 8), (6, 10), (8, 8), (5,)]
STEPS = 6
NONE_STEP = 3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _groups(params: list[torch.Tensor], proj_type: str, rank: int = 3, gap: int = 2) -> list[dict[str, Any]]:
    return [
        {"params": params[:3], "rank": rank, "update_proj_gap": gap, "scale": 0.5, "proj_type": proj_type},
        {"params": params[3:], "weight_decay": 0.0},
    ]


def _grads(step: int, shapes: list[tuple[int, ...]], scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) * scale for s in shapes]


def _train(opt: torch.optim.Optimizer, params: list[torch.Tensor], shapes: list[tuple[int, ...]], steps: int) -> None:
    for step in range(steps):
        for i, (p, g) in enumerate(zip(params, _grads(step, shapes))):
            p.grad = None if (i == 0 and step == NONE_STEP) else g.clone()
        opt.step()


# ---- unbound, 32-bit: galore_torch.GaLoreAdamW -----------------------------------------------
@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right", "full"])
@pytest.mark.parametrize("correct_bias", [True, False])
def test_matches_galore_torch(proj_type: str, correct_bias: bool) -> None:
    from galore_torch import GaLoreAdamW

    init = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(SHAPES)]
    ref_params = [p.clone() for p in init]
    our_params = [p.clone() for p in init]
    hyper = dict(lr=1e-2, weight_decay=0.1, correct_bias=correct_bias)
    ref = GaLoreAdamW(_groups(ref_params, proj_type), no_deprecation_warning=True, **hyper)
    ours = DistributedGaLore(_groups(our_params, proj_type), **hyper)
    _train(ref, ref_params, SHAPES, STEPS)
    _train(ours, our_params, SHAPES, STEPS)

    for p, q in zip(our_params, ref_params):
        assert _rel(p, q) <= RTOL
    for i, (p, q) in enumerate(zip(our_params, ref_params)):
        s, r = ours.state[p], ref.state[q]
        assert int(s["step"]) == r["step"] == (STEPS - 1 if i == 0 else STEPS)
        if i < 3:
            assert _rel(s["low_rank_exp_avg"], r["exp_avg"]) <= RTOL
            assert _rel(s["low_rank_exp_avg_sq"], r["exp_avg_sq"]) <= RTOL
            ortho = r["projector"].ortho_matrix
            if proj_type == "full":
                assert _rel(s["proj_left"], ortho[0]) <= RTOL and _rel(s["proj_right"], ortho[1]) <= RTOL
            else:
                ours_proj = s.get("proj_left", s.get("proj_right"))
                assert _rel(ours_proj, ortho) <= RTOL
        else:
            assert _rel(s["exp_avg"], r["exp_avg"]) <= RTOL
            assert _rel(s["exp_avg_sq"], r["exp_avg_sq"]) <= RTOL


@pytest.mark.parametrize("style", ["hf", "bnb"])
@pytest.mark.parametrize("correct_bias", [True, False])
def test_plain_params_match_their_adamw(style: str, correct_bias: bool) -> None:
    """Plain params (the fused-kernel path, and the per-op path when uncorrected) against the
    AdamW each style follows: transformers' (through galore_torch.GaLoreAdamW) for "hf", torch's
    for "bnb"; weight decay on, and a param whose grad is None at one step so the params of a
    group hold different step counts. eps is large so that where it enters counts."""
    from galore_torch import GaLoreAdamW

    if style == "bnb" and not correct_bias:
        pytest.skip("bitsandbytes always bias-corrects")
    shapes = [(9, 7), (33,), (4, 5)]
    init = [torch.randn(s, generator=torch.Generator().manual_seed(20 + i)) for i, s in enumerate(shapes)]
    ref_params = [p.clone() for p in init]
    our_params = [p.clone() for p in init]
    if style == "hf":
        ref: torch.optim.Optimizer = GaLoreAdamW(
            ref_params, lr=1e-2, eps=0.1, weight_decay=0.1, correct_bias=correct_bias, no_deprecation_warning=True
        )
    else:
        ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, eps=0.1, foreach=False)
    with pytest.warns(UserWarning, match="no parameter group has a 'rank'"):
        ours = DistributedGaLore(
            our_params, lr=1e-2, eps=0.1, weight_decay=0.1, correct_bias=correct_bias, adam_style=style
        )
    _train(ref, ref_params, shapes, STEPS)
    _train(ours, our_params, shapes, STEPS)
    for i, (p, q) in enumerate(zip(our_params, ref_params)):
        assert _rel(p, q) <= RTOL
        s, r = ours.state[p], ref.state[q]
        assert int(s["step"]) == int(r["step"]) == (STEPS - 1 if i == 0 else STEPS)
        assert _rel(s["exp_avg"], r["exp_avg"]) <= RTOL
        assert _rel(s["exp_avg_sq"], r["exp_avg_sq"]) <= RTOL


def test_projector_refreshes_on_schedule() -> None:
    """>= 2 refreshes within the run: the projector changes exactly at steps 0, gap, 2*gap."""
    p = torch.randn(10, 6)
    opt = DistributedGaLore([{"params": [p], "rank": 2, "update_proj_gap": 2, "scale": 1.0}], lr=1e-2)
    seen = []
    for _ in range(5):
        p.grad = torch.randn(10, 6)
        opt.step()
        seen.append(opt.state[p]["proj_right"].clone())
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert changed == [False, True, False, True]
    assert opt.comm_stats["refresh_steps"] == 3


@pytest.mark.parametrize("shape", [(10, 6), (6, 10), (8, 8)])
def test_projectors_do_not_keep_the_svd_alive(shape: tuple[int, int]) -> None:
    """A stored projector owns exactly its own memory: a slice of U (m x k) or Vh (k x n) kept as a
    view holds the whole factor (on a GPU, Vh's row-major slice is contiguous and stays a view; on
    the CPU, U's column-major slice does)."""
    p = torch.randn(*shape)
    opt = DistributedGaLore([{"params": [p], "rank": 2, "proj_type": "full", "scale": 1.0}], lr=1e-2)
    p.grad = torch.randn(*shape)
    opt.step()
    for key in ("proj_left", "proj_right"):
        t = opt.state[p][key]
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (key, t.shape)


def test_convert_galore_torch_trains_identically() -> None:
    from galore_torch import GaLoreAdamW

    init = [torch.randn(s, generator=torch.Generator().manual_seed(7 + i)) for i, s in enumerate(SHAPES)]
    a = [p.clone() for p in init]
    b = [p.clone() for p in init]
    hyper = dict(lr=2e-2, eps=1e-7, betas=(0.8, 0.95), weight_decay=0.05, correct_bias=False)
    ref = GaLoreAdamW(_groups(a, "std"), no_deprecation_warning=True, **hyper)
    conv = dist_optim.convert(GaLoreAdamW(_groups(b, "std"), no_deprecation_warning=True, **hyper))
    assert isinstance(conv, DistributedGaLore) and conv.adam_style == "hf" and conv.optim_bits == 32
    assert conv.param_groups[0]["rank"] == 3 and conv.param_groups[0]["correct_bias"] is False
    _train(ref, a, SHAPES, STEPS)
    _train(conv, b, SHAPES, STEPS)
    for p, q in zip(a, b):
        assert _rel(q, p) <= RTOL


def test_convert_refuses_stepped_and_unknown_options() -> None:
    from galore_torch import GaLoreAdamW, GaLoreAdamW8bit

    p = torch.randn(6, 4)
    ref = GaLoreAdamW(_groups([p], "std", rank=2), no_deprecation_warning=True)
    p.grad = torch.randn(6, 4)
    ref.step()
    with pytest.raises(ValueError, match="already stepped"):
        dist_optim.convert(ref)
    opt = GaLoreAdamW8bit(_groups([torch.randn(6, 4)], "std", rank=2))
    opt.param_groups[0]["alpha"] = 0.5  # bitsandbytes' AdEMAMix option
    with pytest.raises(ValueError, match="alpha"):
        dist_optim.convert(opt)


# ---- 8-bit -----------------------------------------------------------------------------------
def _assert_bnb_close(p1: torch.Tensor, p2: torch.Tensor, states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """bitsandbytes' own tolerances for 8-bit blockwise Adam against a reference
    (tests/test_optim.py::test_optimizer8bit, fp32): dequantised states isclose(atol=3e-3,
    rtol=1e-3) but for < 20 elements; params: mean abs err < 1.2e-4, mean rel err < 1.2e-3, and
    isclose(atol=1e-5, rtol=1e-3) but for <= 5 elements."""
    for s1, s2 in states:
        assert (~torch.isclose(s1, s2, atol=3e-3, rtol=1e-3)).sum().item() < 20
    err = (p1 - p2).abs()
    assert err.mean() < 1.2e-4
    assert (err / (p1.abs() + 1e-9)).mean() < 1.2e-3
    assert (~torch.isclose(p1, p2, atol=1e-5, rtol=1e-3)).sum().item() <= 5


def _lockstep(ref: Any, ours: Any, a: list, b: list, shapes: list, steps: int = 12) -> Any:
    """Step both optimizers on the same gradients; after each step yield every (ref, our) param."""
    for step in range(steps):
        for x, y, g in zip(a, b, _grads(step, shapes, 0.01)):
            x.grad, y.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
        yield from zip(a, b)


def _dequantized_pairs(ours: dict, ref: dict, prefix: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ours, bitsandbytes') dequantised first and second moments: our ``{prefix}exp_avg[_sq]``
    codes and absmax, bitsandbytes' ``state1/2``, ``absmax1/2``, ``qmap1/2``."""
    import bitsandbytes.functional as bnbf

    pairs = []
    for i, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
        theirs = bnbf.dequantize_blockwise(
            ref[f"state{i}"], absmax=ref[f"absmax{i}"], code=ref[f"qmap{i}"], blocksize=256
        )
        mine = bnbf.dequantize_blockwise(
            ours[prefix + name].reshape(-1),
            absmax=ours[f"{prefix}{name}_absmax"],
            code=bnbf.create_dynamic_map(signed=name == "exp_avg"),
            blocksize=256,
        )
        pairs.append((mine.view(theirs.shape), theirs))
    return pairs


def test_8bit_matches_bitsandbytes_galore(monkeypatch: pytest.MonkeyPatch) -> None:
    """galore_torch.GaLoreAdamW8bit runs bitsandbytes' 8-bit blockwise Adam (its CPU kernel here)
    on the projected gradients; ours quantises the low-rank moments with bitsandbytes'
    quantize_blockwise and the same dynamic maps."""
    from galore_torch import GaLoreAdamW8bit

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # galore_torch calls it
    shapes = [(64, 48), (40, 96)]
    init = [torch.randn(s, generator=torch.Generator().manual_seed(3 + i)) * 0.1 for i, s in enumerate(shapes)]
    a = [p.clone() for p in init]
    b = [p.clone() for p in init]

    def groups(ps: list[torch.Tensor]) -> list[dict[str, Any]]:
        return [{"params": ps, "rank": 8, "update_proj_gap": 4, "scale": 0.25, "proj_type": "std"}]

    ref = GaLoreAdamW8bit(groups(a), lr=1e-3, weight_decay=1e-2, min_8bit_size=0)
    ours = DistributedGaLore(
        groups(b), lr=1e-3, eps=1e-8, weight_decay=1e-2, optim_bits=8, min_8bit_size=0, adam_style="bnb"
    )
    for x, y in _lockstep(ref, ours, a, b, shapes):
        r, s = ref.state[x], ours.state[y]
        assert s["low_rank_exp_avg"].dtype == torch.uint8
        _assert_bnb_close(y, x, _dequantized_pairs(s, r, "low_rank_"))


def test_8bit_plain_params_match_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameters outside GaLore groups: bitsandbytes' 8-bit blockwise Adam (through
    galore_torch.GaLoreAdamW8bit, which is bitsandbytes' AdamW8bit for them), including a tensor
    whose size is not a multiple of the 256-element block and one below min_8bit_size."""
    from galore_torch import GaLoreAdamW8bit

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    shapes = [(64, 48), (30, 50), (700,), (40,)]
    init = [torch.randn(s, generator=torch.Generator().manual_seed(7 + i)) * 0.1 for i, s in enumerate(shapes)]
    a = [p.clone() for p in init]
    b = [p.clone() for p in init]
    ref = GaLoreAdamW8bit([{"params": a}], lr=1e-3, weight_decay=1e-2, min_8bit_size=100)
    ours = DistributedGaLore(
        [{"params": b}], lr=1e-3, eps=1e-8, weight_decay=1e-2, optim_bits=8, min_8bit_size=100, adam_style="bnb"
    )
    for x, y in _lockstep(ref, ours, a, b, shapes):
        r, s = ref.state[x], ours.state[y]
        if x.numel() < 100:
            assert s["exp_avg"].dtype == torch.float32 and r["state1"].dtype == torch.float32
            states = [(s["exp_avg"], r["state1"]), (s["exp_avg_sq"], r["state2"])]
        else:
            assert s["exp_avg"].dtype == torch.uint8
            states = [(o.view(x.shape), t.view(x.shape)) for o, t in _dequantized_pairs(s, r, "")]
        _assert_bnb_close(y, x, states)


def test_8bit_moments_are_a_quarter_of_32bit() -> None:
    """Codes (1 byte) plus one fp32 absmax per 256 values instead of fp32 moments, for GaLore and
    plain parameters alike (projectors left out: the next test counts them)."""
    shapes = [(512, 256), (256, 512), (300, 7), (256,)]

    def state_bytes(bits: int) -> int:
        params = [torch.zeros(s, requires_grad=True) for s in shapes]
        groups = [{"params": params[:2], "rank": 16}, {"params": params[2:]}]
        opt = DistributedGaLore(groups, lr=1e-3, optim_bits=bits, min_8bit_size=0)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        return sum(
            v.numel() * v.element_size()
            for st in opt.state.values()
            for k, v in st.items()
            if not k.startswith("proj") and k != "step"
        )

    assert state_bytes(8) <= (1 + 4 / 256) / 4 * state_bytes(32) + 64  # + rounding up to whole blocks


def test_8bit_state_is_under_30_percent_of_32bit_galore() -> None:
    """All optimizer state, projectors included, on the benchmark's Llama-like set scaled down 4x
    (hidden 256, intermediate 688, vocabulary 2048, 2 layers; rank 32 = hidden / 8 as rank 128 at
    hidden 1024): the 8-bit moments are a quarter, the projectors are stored in fp16."""
    from bench.bench_step import llama_like

    shapes = llama_like(hidden=256, inter=688, layers=2, vocab=2048)

    def state_bytes(**kw: Any) -> tuple[int, int]:
        params = [torch.zeros(s, requires_grad=True) for s in shapes]
        mats = [p for p in params[1:] if p.dim() == 2]
        groups = [{"params": [p for p in params if all(p is not m for m in mats)]}, {"params": mats, "rank": 32}]
        opt = DistributedGaLore(groups, lr=1e-3, **kw)
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        opt.step()
        sizes = [(k, v.numel() * v.element_size()) for st in opt.state.values() for k, v in st.items()]
        return sum(n for _, n in sizes), sum(n for k, n in sizes if k.startswith("proj"))

    total32, proj32 = state_bytes()
    total8, proj8 = state_bytes(optim_bits=8)
    assert proj8 * 2 == proj32
    assert total8 <= 0.30 * total32, total8 / total32
    fp32_projectors, _ = state_bytes(optim_bits=8, projector_dtype=torch.float32)
    assert fp32_projectors == total8 + proj32 // 2


def test_projector_dtype_option() -> None:
    """Defaults (fp16 storage in 8-bit mode, the gradient's dtype otherwise), an explicit choice,
    multiplication in the gradient's dtype, and a clear error for a non-float dtype."""
    for bits, chosen, expected in (
        (32, None, torch.float32),
        (8, None, torch.float16),
        (8, torch.float32, torch.float32),
    ):
        p = torch.zeros(16, 8, requires_grad=True)
        opt = DistributedGaLore(
            [{"params": [p], "rank": 2}], lr=1e-3, optim_bits=bits, min_8bit_size=0, projector_dtype=chosen
        )
        p.grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        opt.step()
        assert opt.state[p]["proj_right"].dtype == expected
        assert p.dtype == torch.float32 and torch.isfinite(p).all()
    with pytest.raises(TypeError, match="projector_dtype must be None or one of"):
        DistributedGaLore([{"params": [torch.zeros(4, 4, requires_grad=True)], "rank": 2}], projector_dtype=torch.int8)


@pytest.mark.parametrize("optim_bits", [32, 8])
def test_state_dict_round_trip(optim_bits: int) -> None:
    """A reloaded optimizer continues exactly; 8-bit codes stay uint8, absmax stays fp32."""
    shapes = [(12, 8), (6,)]

    def make(params: list[torch.Tensor]) -> DistributedGaLore:
        groups = [{"params": params[:1], "rank": 3, "update_proj_gap": 3}, {"params": params[1:]}]
        return DistributedGaLore(groups, lr=1e-2, optim_bits=optim_bits, min_8bit_size=0)

    init = [torch.randn(s, generator=torch.Generator().manual_seed(5)).bfloat16() for s in shapes]
    a = [p.clone() for p in init]
    b = [p.clone() for p in init]
    opt_a = make(a)
    opt_b = make(b)
    for step in range(4):
        for x, y, g in zip(a, b, _grads(step, shapes)):
            x.grad, y.grad = g.bfloat16(), g.bfloat16()
        opt_a.step()
        opt_b.step()
        if step == 1:
            saved = opt_b.state_dict()
            opt_b = make(b)
            opt_b.load_state_dict(saved)
            st = opt_b.state[b[0]]
            if optim_bits == 8:
                assert st["low_rank_exp_avg"].dtype == torch.uint8
                assert st["low_rank_exp_avg_absmax"].dtype == torch.float32
            assert st["proj_right"].dtype == (torch.float16 if optim_bits == 8 else torch.bfloat16)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _run_bits(
    bits: list[int], split: int | None, restart: bool = False, through_full_state: bool = False
) -> list[torch.Tensor]:
    """Six steps of GaLore and plain parameters, the optimizer rebuilt at step ``split`` with
    ``bits[1]`` (``bits[0]`` before) from the old one's state_dict (or full_state; ``restart``:
    from nothing)."""
    params = [torch.randn(s, generator=torch.Generator().manual_seed(7)) for s in SHAPES]

    def make(optim_bits: int) -> DistributedGaLore:
        return DistributedGaLore(_groups(params, "std"), lr=1e-2, optim_bits=optim_bits, min_8bit_size=0)

    opt = make(bits[0])
    for step in range(STEPS):
        if step == split:
            new = make(bits[1])
            if through_full_state:
                new.load_full_state(copy.deepcopy(opt.full_state()))
            elif not restart:
                new.load_state_dict(copy.deepcopy(opt.state_dict()))
                if bits[0] == 8:
                    assert new.state[params[0]]["low_rank_exp_avg"].dtype == torch.uint8
                    assert new.state[params[3]]["exp_avg_sq_absmax"].dtype == torch.float32
            opt = new
        for i, (p, g) in enumerate(zip(params, _grads(step, SHAPES))):
            p.grad = None if (i == 0 and step == NONE_STEP) else g
        opt.step()
    return [p.detach().clone() for p in params]


def test_a_state_saved_with_the_other_optim_bits_is_carried_over() -> None:
    """32-bit moments (low-rank and plain) loaded by an 8-bit optimizer are quantised at its next
    step (their values, not zeros); 8-bit ones loaded by a 32-bit optimizer are dequantised. Either
    way the run stays within the quantisation's reach of the all-32-bit run, and far from a restart."""
    plain = _run_bits([32, 32], None)
    restarted = _run_bits([32, 32], 3, restart=True)
    for bits in ([32, 8], [8, 32]):
        mixed = _run_bits(bits, 3)
        for a, b, r in zip(mixed, plain, restarted):
            assert float((a - b).abs().max()) < 0.1 * float((r - b).abs().max()), bits


@pytest.mark.parametrize("bits", [[32, 8], [8, 32]], ids=["32to8", "8to32"])
def test_the_other_optim_bits_through_full_state_as_through_state_dict(bits: list[int]) -> None:
    """load_full_state carries moments of the other width over as load_state_dict does, bit for bit
    (the full low-rank moments are converted before they are cut)."""
    for a, b in zip(_run_bits(bits, 3, through_full_state=True), _run_bits(bits, 3)):
        assert torch.equal(a, b)


def test_convert_galore_torch_8bit_reads_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from galore_torch import GaLoreAdamW8bit

    opt = GaLoreAdamW8bit(_groups([torch.randn(6, 4), torch.randn(3)], "std", rank=2), min_8bit_size=128)
    conv = dist_optim.convert(opt)
    assert (conv.optim_bits, conv.min_8bit_size, conv.adam_style) == (8, 128, "bnb")
    assert conv.param_groups[0]["eps"] == 1e-8 and conv.param_groups[0]["weight_decay"] == 1e-2


def _fake_colossal_galore(args: dict[str, Any]) -> torch.optim.Optimizer:
    """ColossalAI 0.5.0's GaLoreAdamW8bit cannot be constructed on bitsandbytes 0.50 (it passes
    the removed percentile_clipping/block_wise keywords): build one as it would be on an older
    bitsandbytes, with the attributes the conversion reads."""
    galore = pytest.importorskip("colossalai.nn.optimizer.galore")
    from bitsandbytes.optim.optimizer import MockArgs

    cls = galore.GaLoreAdamW8bit
    opt = cls.__new__(cls)
    groups = [{"params": [torch.randn(8, 6)], "rank": 2}, {"params": [torch.randn(6)]}]
    torch.optim.Optimizer.__init__(opt, groups, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2))
    for g in opt.param_groups:
        if "rank" in g:
            g.update(update_proj_gap=200, proj_type="std", scale=0.25)
    opt.args = MockArgs(args)
    opt.is_paged = False
    return opt


def test_convert_colossal_galore_8bit_and_its_args() -> None:
    good = dict(
        optim_bits=8, min_8bit_size=64, percentile_clipping=100, block_wise=True, max_unorm=0.0, skip_zeros=False
    )
    conv = dist_optim.convert(_fake_colossal_galore(good))
    assert (conv.optim_bits, conv.min_8bit_size, conv.adam_style) == (8, 64, "bnb")
    assert conv.param_groups[0]["scale"] == 0.25
    with pytest.raises(ValueError, match="percentile_clipping=5"):
        dist_optim.convert(_fake_colossal_galore(dict(good, percentile_clipping=5)))
    # What ColossalAI's cast_to_distributed does: NewCls(optim.param_groups, args=optim.args).
    src = _fake_colossal_galore(good)
    ours = DistributedGaLore(src.param_groups, args=src.args)
    assert (ours.optim_bits, ours.min_8bit_size, ours.adam_style) == (8, 64, "bnb")


def _tiny_llama_loss(optim_bits: int, steps: int = 50) -> float:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        intermediate_size=128,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    groups = galore_param_groups(model, rank=16, update_proj_gap=10, scale=1.0, weight_decay=0.0)
    # lr 2e-3: at 5e-3 this run is chaotic (final losses 8% apart across seeds, and a rounding-level
    # change of the arithmetic moves one by 3%), so a 2% criterion would measure noise.
    opt = DistributedGaLore(groups, lr=2e-3, optim_bits=optim_bits, min_8bit_size=0)
    gen = torch.Generator().manual_seed(1)
    # Learnable data: each sequence repeats a random 4-token pattern.
    base = torch.randint(0, 256, (64, 4), generator=gen)
    data = base.repeat(1, 4)
    for step in range(steps):
        batch = data[(step * 8) % 64 : (step * 8) % 64 + 8]
        out = model(input_ids=batch, labels=batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    with torch.no_grad():
        return float(model(input_ids=data, labels=data).loss)


def test_8bit_tiny_llama_within_2_percent_of_32bit() -> None:
    loss32 = _tiny_llama_loss(32)
    loss8 = _tiny_llama_loss(8)
    assert loss32 < 3.5  # it learned something (log(256) = 5.55)
    assert abs(loss8 - loss32) / loss32 < 0.02, (loss8, loss32)


def test_galore_param_groups_selects_attention_and_mlp() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64, intermediate_size=48
    )
    model = transformers.LlamaForCausalLM(config)
    groups = galore_param_groups(model, rank=4, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    galore = [names[id(p)] for p in groups[0]["params"]]
    assert len(galore) == 2 * 7 and all(("self_attn" in n or "mlp" in n) for n in galore)
    assert groups[0]["rank"] == 4 and groups[0]["weight_decay"] == 0.1
    others = [names[id(p)] for g in groups[1:] for p in g["params"]]
    assert "model.embed_tokens.weight" in others and "lm_head.weight" in others
    assert all(g["weight_decay"] == 0.0 for g in groups[2:] for _ in g["params"])


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_input() -> None:
    with pytest.raises(ValueError, match="2-D"):
        DistributedGaLore([{"params": [torch.randn(3, 4, 5)], "rank": 2}])
    with pytest.raises(ValueError, match="proj_type"):
        DistributedGaLore([{"params": [torch.randn(4, 5)], "rank": 2, "proj_type": "diagonal"}])
    with pytest.raises(ValueError, match="rank"):
        DistributedGaLore([{"params": [torch.randn(4, 5)], "rank": 0}])
    with pytest.raises(ValueError, match="optim_bits"):
        DistributedGaLore([torch.randn(4)], optim_bits=4)
    # rank > min(dims): found at the first step unbound, at bind on the full shape.
    p = torch.randn(4, 5)
    opt = DistributedGaLore([{"params": [p], "rank": 5}])
    p.grad = torch.randn(4, 5)
    with pytest.raises(ValueError, match=r"rank=5 exceeds min\(4, 5\)"):
        opt.step()
    local = torch.randn(4, 3)  # a TP slice of a 4 x 6 matrix: rank 4 fits the full shape
    opt = DistributedGaLore([{"params": [local], "rank": 4}])
    opt.bind({local: ParamLayout((4, 6), TPSplit(1, 2, 0))})
    with pytest.raises(ValueError, match=r"rank=5 exceeds min\(4, 6\)"):
        opt = DistributedGaLore([{"params": [local], "rank": 5}])
        opt.bind({local: ParamLayout((4, 6), TPSplit(1, 2, 0))})
    vec = torch.randn(6)
    opt = DistributedGaLore([{"params": [vec], "rank": 1}])
    vec.grad = torch.randn(6)
    with pytest.raises(ValueError, match="2-D matrices only"):
        opt.step()
    with pytest.warns(UserWarning, match="no parameter group has a 'rank'"):
        DistributedGaLore([torch.randn(3)])


def test_add_param_group_and_load_state_dict_validate_as_init() -> None:
    """validate_group is the one check of a group: add_param_group and load_state_dict refuse what
    __init__ refuses (the optimizer left as it was), optimizer-wide options named in a group must
    agree with the optimizer's and are not kept in the group."""
    opt = DistributedGaLore([{"params": [torch.randn(4, 5)], "rank": 2}], optim_bits=8)
    bad_groups = [
        ({"rank": 0}, "rank must be a positive int"),
        ({"rank": 2, "update_proj_gap": 0}, "update_proj_gap"),
        ({"rank": 2, "scale": float("nan")}, "scale"),
        ({"rank": 2, "proj_type": "diagonal"}, "proj_type"),
        ({"lr": -1.0}, "lr"),
        ({"optim_bits": 32}, "optim_bits is optimizer-wide"),
        ({"rank": 2, "adam_style": "bnb"}, "adam_style is optimizer-wide"),
    ]
    for extra, match in bad_groups:
        with pytest.raises(ValueError, match=match):
            opt.add_param_group({"params": [torch.randn(4, 5)], **extra})
        assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [torch.randn(4, 5)], "rank": 2, "optim_bits": 8, "is_paged": False})
    assert "optim_bits" not in opt.param_groups[-1] and "is_paged" not in opt.param_groups[-1]
    saved = opt.state_dict()
    saved["param_groups"][0]["update_proj_gap"] = 0
    with pytest.raises(ValueError, match="update_proj_gap"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["update_proj_gap"] == 200


def test_failed_svd_keeps_previous_projector(monkeypatch: pytest.MonkeyPatch) -> None:
    p = torch.randn(6, 4)
    opt = DistributedGaLore([{"params": [p], "rank": 2, "update_proj_gap": 1}])
    p.grad = torch.randn(6, 4)
    opt.step()
    before = opt.state[p]["proj_right"].clone()

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "svd", fail)
    p.grad = torch.randn(6, 4)
    with pytest.warns(UserWarning, match="SVD failed"):
        opt.step()
    assert torch.equal(opt.state[p]["proj_right"], before)


def test_paged_on_cpu_warns() -> None:
    p = torch.randn(4, 5)
    opt = DistributedGaLore([{"params": [p], "rank": 2}], is_paged=True)
    p.grad = torch.randn(4, 5)
    with pytest.warns(UserWarning, match="is_paged=True needs CUDA"):
        opt.step()


@pytest.mark.parametrize("optim_bits", [32, 8])
def test_paged_states_allocation_and_prefetch(monkeypatch: pytest.MonkeyPatch, optim_bits: int) -> None:
    """The paged path without a GPU: bitsandbytes' paged allocator and prefetch are replaced by
    recording fakes and paging is declared available on the CPU. Moments of >= 1e5 elements (GaLore
    and plain) come from the paged allocator and are prefetched before every update, smaller ones
    are ordinary tensors, and the run is identical to the unpaged one."""
    import bitsandbytes.functional as bnbf

    from dist_optim.states import bnb

    allocated: list[torch.Tensor] = []
    prefetched: list[int] = []

    def fake_get_paged(*shape: int, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        t.is_paged = True  # what bitsandbytes marks its paged tensors with
        allocated.append(t)
        return t

    monkeypatch.setattr(bnb, "paging_supported", lambda device: True)
    monkeypatch.setattr(bnbf, "get_paged", fake_get_paged)
    monkeypatch.setattr(bnbf, "prefetch_tensor", lambda t, to_cpu=False: prefetched.append(t.data_ptr()))
    shapes = [(512, 256), (400, 300), (64, 48), (700,)]  # big GaLore, big plain, small GaLore, small plain

    def run(paged: bool) -> tuple[list[torch.Tensor], DistributedGaLore]:
        params = [torch.randn(s, generator=torch.Generator().manual_seed(i)) * 0.1 for i, s in enumerate(shapes)]
        groups = [
            {"params": [params[0]], "rank": 256},
            {"params": [params[2]], "rank": 8},
            {"params": [params[1], params[3]]},
        ]
        opt = DistributedGaLore(groups, lr=1e-3, optim_bits=optim_bits, min_8bit_size=0, is_paged=paged)
        for step in range(3):
            for p, g in zip(params, _grads(step, shapes, 0.01)):
                p.grad = g
            opt.step()
        return params, opt

    ref_params, _ = run(False)
    assert not allocated
    params, opt = run(True)
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    paged_keys = {
        (i, k) for i, p in enumerate(params) for k, v in opt.state[p].items() if getattr(v, "is_paged", False)
    }
    # GaLore (512, 256) at rank 256: low-rank moments of 512 x 256 = 131k elements; plain (400, 300).
    low = "low_rank_exp_avg"
    assert paged_keys == {(0, low), (0, low + "_sq"), (1, "exp_avg"), (1, "exp_avg_sq")}
    assert len(allocated) == 4
    assert set(prefetched) == {t.data_ptr() for t in allocated} and len(prefetched) == 4 * 3


def test_matrix_pieces_cover_chunks() -> None:
    """The rectangles of the ZeRO chunks of a TP slice hold the right values and tile the slice
    exactly once (chunks that cut rows, padding, chunks of padding only)."""
    full = torch.arange(7 * 6).view(7, 6)
    for tp, tp_dim in ((1, None), (2, 1), (3, 1), (7, 0)):
        for tp_rank in range(tp):
            tps = TPSplit(tp_dim, tp, tp_rank) if tp_dim is not None else None
            for dp in (1, 3, 4, 16):
                seen = torch.zeros(7, 6, dtype=torch.long)
                local_numel = 7 * 6 // tp
                for r in range(dp):
                    zs = ZeroShard(dp, r, (-local_numel) % dp) if dp > 1 else None
                    layout = ParamLayout((7, 6), tps, zs)
                    chunk = layout.take_local(full).reshape(-1)
                    for pc in matrix_pieces(layout):
                        off = pc.offset or 0
                        vals = chunk[off : off + pc.rows * pc.cols].view(pc.rows, pc.cols)
                        rows, cols = slice(pc.row0, pc.row0 + pc.rows), slice(pc.col0, pc.col0 + pc.cols)
                        assert torch.equal(vals, full[rows, cols])
                        seen[rows, cols] += 1
                expected = torch.zeros(7, 6, dtype=torch.long)
                expected[ParamLayout((7, 6), tps).tp_slices()] = 1
                assert torch.equal(seen, expected), (tp, tp_rank, dp)


# ---- distributed: shapes where ColossalAI crashes, collectives, bytes -------------------------
# (full shape, TP split dim): GQA-like k/v (fewer rows than columns: std projects the TP-split
# rows), o_proj/down_proj split on the last dim (right projection over the split columns for
# o), an odd replicated matrix whose ZeRO chunks are padded and cut rows.
DIST_SHAPES: list[tuple[tuple[int, int], int | None]] = [
    ((16, 16), 0),  # q
    ((8, 16), 0),  # k (GQA)
    ((8, 16), 0),  # v (GQA)
    ((16, 16), 1),  # o
    ((24, 16), 0),  # up
    ((16, 24), 1),  # down
    ((5, 7), None),  # odd, replicated
]
DIST_LAYOUTS = [(2, 1, 0), (2, 2, 0), (1, 4, 1), (2, 2, 1), (4, 1, 0)]


def _local_piece(
    i: int, g: torch.Tensor, *, dims: list[Any], tp: int, tp_rank: int, dp: int, dp_rank: int, is_zero: bool
) -> torch.Tensor:
    from tests.helpers.parity import tp_slice, zero_chunk

    piece = tp_slice(g, dims[i], tp, tp_rank)
    return zero_chunk(piece, dp, dp_rank).clone() if is_zero else piece.clone()


def _dist_worker(copies: int, proj_type: str, optim_bits: int) -> dict[str, Any]:
    import torch.distributed as dist

    from dist_optim.testing import grid_groups
    from tests.helpers.parity import tp_slice, zero_chunk

    specs = DIST_SHAPES * copies
    shapes = [s for s, _ in specs]

    def full_init() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(11)
        return [torch.randn(s, generator=gen) * 0.5 for s in shapes]

    def make(params: list[torch.Tensor]) -> DistributedGaLore:
        return DistributedGaLore(
            [{"params": params, "rank": 4, "update_proj_gap": 2, "scale": 0.5, "proj_type": proj_type}],
            lr=1e-2,
            weight_decay=1e-2,
            optim_bits=optim_bits,
            min_8bit_size=0,
        )

    def run(opt: DistributedGaLore, params: list[torch.Tensor], local: Any, record: list[Any] | None) -> None:
        for step in range(STEPS):
            for i, (p, g) in enumerate(zip(params, _grads(step, shapes, 0.1 * (step + 1)))):
                p.grad = None if (i == 1 and step == NONE_STEP) else local(i, g)
            before = (dict(comm.COUNTS), dict(opt.comm_stats))
            opt.step()
            if record is not None:
                kinds = ("all_gather", "all_reduce", "all_to_all", "broadcast")
                counts = {k: comm.COUNTS[k] - before[0].get(k, 0) for k in kinds}
                stats = {k: opt.comm_stats[k] - before[1].get(k, 0) for k in opt.comm_stats}
                record.append((counts, stats))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_params = full_init()
        ref = make(ref_params)
        run(ref, ref_params, lambda i, g: g.clone(), None)

    failures: list[str] = []
    per_layout: dict[str, Any] = {}
    for tp, dp, zero in DIST_LAYOUTS:
        tp_group, dp_group = grid_groups(tp, dp)
        tp_rank, dp_rank = dist.get_rank(tp_group), dist.get_rank(dp_group)
        is_zero = zero > 0 and dp > 1
        dims = [d if tp > 1 else None for _, d in specs]
        params, layouts = [], {}
        for full, (shape, _), dim in zip(full_init(), specs, dims):
            piece = tp_slice(full, dim, tp, tp_rank)
            tps = TPSplit(dim, tp, tp_rank, tp_group) if dim is not None else None
            zs = ZeroShard(dp, dp_rank, (-piece.numel()) % dp, dp_group) if is_zero else None
            p = zero_chunk(piece, dp, dp_rank).clone() if is_zero else piece.clone()
            params.append(p)
            layouts[p] = ParamLayout(shape, tps, zs)
        opt = make(params)
        opt.bind(layouts, dp_group=dp_group)

        local = functools.partial(
            _local_piece, dims=dims, tp=tp, tp_rank=tp_rank, dp=dp, dp_rank=dp_rank, is_zero=is_zero
        )
        record: list[Any] = []
        run(opt, params, local, record)
        label = f"[tp={tp} dp={dp} zero={zero}]"
        fulls = comm.gather_full([(layouts[p], p) for p in params])
        failures += _differences(label, fulls, ref_params, opt.full_state(), ref.full_state(), optim_bits)
        per_layout[label] = record
    return {"failures": failures, "record": per_layout}


def _differences(
    label: str,
    params: list[torch.Tensor],
    ref_params: list[torch.Tensor],
    states: list[dict[str, Any]],
    ref_states: list[dict[str, Any]],
    optim_bits: int,
) -> list[str]:
    """What differs between a distributed run's full parameters and states and the reference's."""
    out = [
        f"{label} param {i}: {_rel(a, b):.3g}" for i, (a, b) in enumerate(zip(params, ref_params)) if _rel(a, b) > RTOL
    ]
    for i, (s, r) in enumerate(zip(states, ref_states)):
        for key in r:
            a, b = s[key], r[key]
            if isinstance(b, torch.Tensor) and b.dtype == torch.uint8:
                # 8-bit codes: identical but for values that sit on a code boundary.
                if (a != b).float().mean() > 0.01:
                    out.append(f"{label} state {i}.{key}: codes differ")
            elif isinstance(b, torch.Tensor) and _rel(a, b) > (RTOL if optim_bits == 32 else 1e-3):
                out.append(f"{label} state {i}.{key}: {_rel(a, b):.3g}")
    return out


@pytest.mark.parametrize(("proj_type", "optim_bits"), [("std", 32), ("reverse_std", 32), ("std", 8)])
def test_distributed_exact_on_crash_shapes(pool4: Any, proj_type: str, optim_bits: int) -> None:
    results = pool4.run(_dist_worker, 1, proj_type, optim_bits)
    failures = sorted({f for r in results for f in r["failures"]})
    assert not failures, "\n".join(failures)


def test_collectives_constant_and_routed_only_at_refresh(pool4: Any) -> None:
    one = pool4.run(_dist_worker, 1, "std", 32)
    two = pool4.run(_dist_worker, 2, "std", 32)
    for r1, r2 in zip(one, two):
        assert not r1["failures"] and not r2["failures"]
        for label, record in r1["record"].items():
            record2 = r2["record"][label]
            for step, ((counts, stats), (counts2, _)) in enumerate(zip(record, record2)):
                # Twice the parameters, the same collectives (one bucket: the default budget).
                assert counts == counts2, (label, step, counts, counts2)
                # The NaN/Inf check's flag is the one all-reduce, but between refreshes where the
                # owner grid is the whole job (tp x dp = 4 processes): there it rides on the
                # projectors' all-gather. The projectors' partitions are one all-gather over the
                # owner grid; the low-rank sums one reduce-scatter (all-to-all) over the ZeRO x TP
                # grid as one stage (partition.py) and one over the ZeRO group for the matrices TP
                # replicates; the normalised steps one all-gather over the grid; a refresh adds two
                # all-to-alls over the owner grid (pieces to the SVD owners, each rank's partition
                # of the projectors back).
                refresh = stats.get("refresh_steps", 0)
                tp, dp = (int(label.split(f"{k}=")[1].split()[0]) for k in ("tp", "dp"))
                carried = not refresh and tp * dp == 4
                assert counts["all_reduce"] == (0 if carried else 1), (label, step, counts)
                assert counts["broadcast"] == 0, (label, step, counts)
                assert counts["all_to_all"] <= 2 + 2 * refresh, (label, step, counts)
                assert counts["all_gather"] <= 2, (label, step, counts)
                # The gradients are routed, never gathered whole (their pieces tile the matrices).
                assert stats.get("gather_bytes", 0) == 0, (label, step)
                if stats.get("refresh_steps", 0) == 0:
                    assert stats.get("route_bytes", 0) == 0 and stats.get("scatter_bytes", 0) == 0, (label, step)
            refreshes = [step for step, (_, stats) in enumerate(record) if stats.get("refresh_steps")]
            # steps 0, 2, 4 for all; param 1 skipped step 3, so it refreshes again at step 5.
            assert refreshes == [0, 2, 4, 5], (label, refreshes)


#: Budgets of the bucket test: one bucket, a few matrices per bucket, less than any one matrix.
BUDGETS: list[int | None] = [None, 1200, 1]


def _bucket_worker(copies: int, optim_bits: int, budgets: list[int | None]) -> dict[str, Any]:
    """The crash shapes (``copies`` times) on tp=2 x ZeRO-2 and ZeRO-4, stepped under each of
    ``budgets``: each budget's local params, full state and, per step, the collectives this rank
    issued (counted at torch.distributed, by function name)."""
    import torch.distributed as dist

    from dist_optim.testing import grid_groups
    from tests.helpers.collectives import counting_collectives
    from tests.helpers.parity import tp_slice, zero_chunk

    specs = DIST_SHAPES * copies
    shapes = [s for s, _ in specs]
    out: dict[str, Any] = {}
    for tp, dp in ((2, 2), (1, 4)):
        tp_group, dp_group = grid_groups(tp, dp)
        tp_rank, dp_rank = dist.get_rank(tp_group), dist.get_rank(dp_group)
        dims = [d if tp > 1 else None for _, d in specs]
        for budget in budgets:
            gen = torch.Generator().manual_seed(11)
            params, layouts = [], {}
            for shape, dim in zip(shapes, dims):
                piece = tp_slice(torch.randn(shape, generator=gen) * 0.5, dim, tp, tp_rank)
                tps = TPSplit(dim, tp, tp_rank, tp_group) if dim is not None else None
                p = zero_chunk(piece, dp, dp_rank).clone()
                params.append(p)
                layouts[p] = ParamLayout(shape, tps, ZeroShard(dp, dp_rank, (-piece.numel()) % dp, dp_group))
            opt = DistributedGaLore(
                [{"params": params, "rank": 4, "update_proj_gap": 2, "scale": 0.5, "proj_type": "std"}],
                lr=1e-2,
                weight_decay=1e-2,
                optim_bits=optim_bits,
                min_8bit_size=0,
                bucket_bytes=budget,
            )
            opt.bind(layouts, dp_group=dp_group)
            local = functools.partial(
                _local_piece, dims=dims, tp=tp, tp_rank=tp_rank, dp=dp, dp_rank=dp_rank, is_zero=True
            )
            counts = []
            for step in range(STEPS):
                for i, (p, g) in enumerate(zip(params, _grads(step, shapes, 0.1 * (step + 1)))):
                    # Every copy of matrix 1 skips a step: copies differ in nothing.
                    p.grad = None if (i % len(DIST_SHAPES) == 1 and step == NONE_STEP) else local(i, g)
                with counting_collectives() as seen:
                    opt.step()
                counts.append(dict(seen.counts))
            out[f"tp={tp} dp={dp} bucket_bytes={budget}"] = dict(
                params=[p.clone() for p in params], state=opt.full_state(), counts=counts
            )
    return out


@pytest.mark.parametrize("optim_bits", [32, 8])
def test_bucket_bytes_changes_collectives_not_bits(pool4: Any, optim_bits: int) -> None:
    """Every budget (one bucket, a few matrices, less than one matrix) gives the same params and
    state, bit for bit (torch.equal), on every rank; the collectives of a step grow with the number of
    buckets only: twice the matrices in one bucket issue the same collectives, and one bucket per
    matrix issues one bucket's collectives per matrix on top of the step's own (the NaN/Inf flag)."""
    one = pool4.run(_bucket_worker, 1, optim_bits, BUDGETS)
    # twice the matrices: only the collectives of one bucket and of one bucket per matrix are compared
    two = pool4.run(_bucket_worker, 2, optim_bits, [None, 1])
    for r1, r2 in zip(one, two):
        for tp_dp in ("tp=2 dp=2", "tp=1 dp=4"):
            ref = r1[f"{tp_dp} bucket_bytes=None"]
            for budget in BUDGETS[1:]:
                got = r1[f"{tp_dp} bucket_bytes={budget}"]
                for a, b in zip(got["params"], ref["params"]):
                    assert torch.equal(a, b), (tp_dp, budget)
                for sa, sb in zip(got["state"], ref["state"]):
                    assert sa.keys() == sb.keys()
                    for key in sb:
                        assert torch.equal(sa[key], sb[key]), (tp_dp, budget, key)
            one_bucket, two_one_bucket = ref["counts"], r2[f"{tp_dp} bucket_bytes=None"]["counts"]
            assert one_bucket == two_one_bucket, (tp_dp, one_bucket, two_one_bucket)
            per_matrix, per_matrix2 = r1[f"{tp_dp} bucket_bytes=1"]["counts"], r2[f"{tp_dp} bucket_bytes=1"]["counts"]
            for step, (c1, c2) in enumerate(zip(per_matrix, per_matrix2)):
                # Planning the SVD routes (every rank's holdings, one all_gather_object per work
                # group) happens once, at the first refresh, whatever the budget.
                assert c1.get("all_gather_object", 0) == c2.get("all_gather_object", 0) == (step == 0)
                for kind in (set(c1) | set(c2)) - {"all_gather_object"}:
                    # f(n buckets) = flag + n x (one bucket's): doubling n adds f(n) - flag.
                    flag = 1 if kind == "all_reduce" else 0
                    assert c2.get(kind, 0) - flag == 2 * (c1.get(kind, 0) - flag), (tp_dp, step, kind, c1, c2)
                assert sum(c1.values()) > sum(one_bucket[step].values()), (tp_dp, step)


def test_bad_bucket_bytes_refused() -> None:
    p = torch.nn.Parameter(torch.zeros(8, 8))
    for bad in (0, -1, 1.5, "256MiB", True):
        with pytest.raises(ValueError, match="bucket_bytes"):
            DistributedGaLore([{"params": [p], "rank": 2}], bucket_bytes=bad)
    assert DistributedGaLore([{"params": [p], "rank": 2}], bucket_bytes=None).bucket_bytes is None


#: The crash shapes and two matrices whose low-rank moments span 4 blocks of 256 values (rank 4), so
#: that every one of 4 ranks keeps whole 8-bit blocks of them.
PARTITION_SHAPES = DIST_SHAPES + [((256, 64), 0), ((64, 256), 1)]


def _partition_worker(optim_bits: int) -> dict[str, Any]:
    """PARTITION_SHAPES on tp=2 x ZeRO-2 and ZeRO-4 and on one device, 3 steps (a refresh, a step, a
    refresh): per layout, the numel of every state entry this rank keeps of every GaLore matrix, what
    of its entries is not its partition of the assembled full state (torch.equal), and the full state
    against the single-device one."""
    import torch.distributed as dist

    from dist_optim.sharding.partition import partition_span
    from dist_optim.testing import grid_groups
    from tests.helpers.parity import tp_slice, zero_chunk

    shapes = [s for s, _ in PARTITION_SHAPES]

    def make(params: list[torch.Tensor]) -> DistributedGaLore:
        group = {"params": params, "rank": 4, "update_proj_gap": 2, "scale": 0.5, "proj_type": "std"}
        return DistributedGaLore([group], lr=1e-2, optim_bits=optim_bits, min_8bit_size=0)

    def init() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(11)
        return [torch.randn(s, generator=gen) * 0.5 for s in shapes]

    ref_params = init()
    ref = make(ref_params)
    for step in range(3):
        for p, g in zip(ref_params, _grads(step, shapes, 0.1)):
            p.grad = g
        ref.step()
    out: dict[str, Any] = {"single": [{k: v.numel() for k, v in st.items()} for st in ref.full_state()]}
    for tp, dp in ((2, 2), (1, 4)):
        tp_group, dp_group = grid_groups(tp, dp)
        tp_rank, dp_rank = dist.get_rank(tp_group), dist.get_rank(dp_group)
        dims = [d if tp > 1 else None for _, d in PARTITION_SHAPES]
        params, layouts = [], {}
        for full, shape, dim in zip(init(), shapes, dims):
            piece = tp_slice(full, dim, tp, tp_rank)
            tps = TPSplit(dim, tp, tp_rank, tp_group) if dim is not None else None
            p = zero_chunk(piece, dp, dp_rank).clone()
            params.append(p)
            layouts[p] = ParamLayout(shape, tps, ZeroShard(dp, dp_rank, (-piece.numel()) % dp, dp_group))
        opt = make(params)
        opt.bind(layouts, dp_group=dp_group)
        local = functools.partial(_local_piece, dims=dims, tp=tp, tp_rank=tp_rank, dp=dp, dp_rank=dp_rank, is_zero=True)
        for step in range(3):
            for i, (p, g) in enumerate(zip(params, _grads(step, shapes, 0.1))):
                p.grad = local(i, g)
            opt.step()
        full_states = opt.full_state()
        label = f"tp={tp} dp={dp}"
        numels, not_parts = [], []
        for i, (p, full) in enumerate(zip(params, full_states)):
            numels.append({k: v.numel() for k, v in opt.state[p].items() if k != "step"})
            for key, (_, groups, align) in opt.state_partitions(p).items():
                lo, hi = partition_span(full[key].numel(), groups, align)
                if not torch.equal(opt.state[p][key].reshape(-1), full[key].reshape(-1)[lo:hi]):
                    not_parts.append(f"{label} param {i} {key}")
        fulls = comm.gather_full([(layouts[p], p) for p in params])
        failures = _differences(label, fulls, ref_params, full_states, ref.full_state(), optim_bits)
        out[label] = dict(numels=numels, not_parts=not_parts, failures=failures)
    return out


@pytest.mark.parametrize("optim_bits", [32, 8])
def test_state_is_a_partition_over_the_ranks(pool4: Any, optim_bits: int) -> None:
    """Each of the 4 ranks that share a matrix (tp=2 x ZeRO-2, ZeRO-4) keeps a 1/4 partition of its
    projectors and low-rank moments (8-bit: codes and absmax): the numel of every entry summed over
    the ranks is the single-device numel, each rank's entry is its partition of the full state the
    optimizer assembles, and that full state is the single-device one (parameters too). The
    matrix TP replicates (5 x 7) is partitioned over its ZeRO group and its TP replicas alike."""
    results = pool4.run(_partition_worker, optim_bits)
    single = results[0]["single"]
    for label in ("tp=2 dp=2", "tp=1 dp=4"):
        for rank, r in enumerate(results):
            assert not r[label]["not_parts"], (rank, r[label]["not_parts"])
            assert not r[label]["failures"], (rank, r[label]["failures"])
        for i, ref in enumerate(single):
            for key, numel in ref.items():
                if key == "step":
                    continue
                kept = [r[label]["numels"][i][key] for r in results]
                assert sum(kept) == numel, (label, i, key, kept, numel)
                # A quarter each, up to ZeRO's rounding (whole 256-value blocks in 8-bit).
                block = 256 if optim_bits == 8 and key.startswith("low_rank_exp_avg") and "absmax" not in key else 1
                assert max(kept) <= -(-numel // (4 * block)) * block, (label, i, key, kept)
