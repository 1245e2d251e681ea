"""QK-clip (MuonClip, Kimi K2): the attention logits measured in the forward, and the clip after
Muon's step, against a float64 reference written from the report (logits recomputed from the
layers' inputs, not through the hooks under test); the clip on every kind of piece a rank holds."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

import dist_optim
from dist_optim import DistributedMuon, ParamLayout, TPSplit, ZeroShard, muon_param_groups, watch_attention_logits
from dist_optim.muon.qk_clip import HeadMaxima, clip_factors, scale_head_rows_
from dist_optim.testing import tiny_llama
from tests.helpers.check import assert_close
from tests.helpers.muon_reference import DEFAULTS, MuonReference

HEADS, HEAD_DIM, SEQ, BATCH = 4, 16, 16, 2


def llama64(kv_heads: int = 4, attn: str = "eager") -> Any:
    model = tiny_llama()
    if kv_heads != 4:  # a grouped-query twin, seeded alike
        import transformers

        config = copy.deepcopy(model.config)
        config.num_key_value_heads = kv_heads
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = attn
    return model.double()


def reference_maxima(model: Any, x: torch.Tensor, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each layer's per-head largest logit, from the layer's input (output_hidden_states): the
    projections, rotary embedding and scaled products written out, causal and key padding masked."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    training = model.training
    model.eval()  # no dropout in the tiny models; eval keeps a watched model's monitor out of it
    with torch.no_grad():
        hidden = model(input_ids=x, attention_mask=mask, output_hidden_states=True).hidden_states
    model.train(training)
    with torch.no_grad():
        out = []
        b, s = x.shape
        keep = torch.ones(s, s).tril().bool()[None, None]
        if mask is not None:
            keep = keep & mask.bool()[:, None, None, :]
        for i, layer in enumerate(model.model.layers):
            h = layer.input_layernorm(hidden[i])
            at = layer.self_attn
            q = at.q_proj(h).view(b, s, -1, HEAD_DIM).transpose(1, 2)
            k = at.k_proj(h).view(b, s, -1, HEAD_DIM).transpose(1, 2)
            cos, sin = model.model.rotary_emb(h, torch.arange(s)[None].expand(b, -1))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            logits = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
            out.append(logits.masked_fill(~keep, -math.inf).amax(dim=(0, 2, 3)))
        return out


@pytest.mark.parametrize("kv_heads,attn,padded", [(4, "eager", False), (2, "eager", True), (4, "sdpa", False)])
def test_measured_logits_are_the_attentions(kv_heads: int, attn: str, padded: bool) -> None:
    """Per head, the largest logit over two forwards (the maximum of both), float64, exactly the
    reference's; left padding masks its keys; eval-mode forwards do not count."""
    model = llama64(kv_heads, attn)
    opt = DistributedMuon(muon_param_groups(model), qk_clip_tau=1.0)
    monitor = watch_attention_logits(model, opt)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randint(0, 256, (BATCH, SEQ), generator=gen) for _ in range(2)]
    mask = None
    if padded:
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[0, :5] = 0
    model.eval()
    model(input_ids=torch.randint(0, 256, (BATCH, SEQ), generator=gen))  # not counted
    model.train()
    for x in xs:
        model(input_ids=x, attention_mask=mask)
    got = monitor.take()
    expected = [torch.maximum(a, b) for a, b in zip(*(reference_maxima(model, x, mask) for x in xs))]
    for i, want in enumerate(expected):
        measured = got[f"model.layers.{i}.self_attn"]
        assert measured.head_dim == HEAD_DIM and measured.group == 4 // kv_heads
        assert_close(measured.values, want, msg=f"layer {i}")
    assert all(bool((m.values == -math.inf).all()) for m in monitor.take().values()), "take() starts over"


def _reference_groups(model: Any, lr: float) -> list[dict[str, Any]]:
    return [
        {**DEFAULTS, "use_muon": True, **g, "lr": lr if g.get("use_muon", True) else 1e-3}
        for g in muon_param_groups(model, adamw_lr=1e-3)
    ]


@pytest.mark.parametrize("kv_heads,alpha", [(4, 0.5), (4, 0.3), (2, 0.5)])
def test_muon_clip_matches_the_report(kv_heads: int, alpha: float) -> None:
    """Five steps of Muon with QK-clip, one with q_proj of layer 0 without a gradient, against the
    float64 reference (Muon written out, logits from the layers' inputs, each clipped head's query
    rows times gamma^alpha and key rows times gamma^(1 - alpha), or with grouped key heads the query
    times gamma): every parameter and momentum at float64 precision. tau sits among the heads'
    maxima, so that some heads clip and some do not at every step."""
    lr, tau = 2e-2, 0.08
    model = llama64(kv_heads)
    ref = copy.deepcopy(model)
    opt = DistributedMuon(muon_param_groups(model, adamw_lr=1e-3), lr=lr, qk_clip_tau=tau, qk_clip_alpha=alpha)
    watch_attention_logits(model, opt)
    reference = MuonReference(_reference_groups(ref, lr))
    gen = torch.Generator().manual_seed(5)
    clipped = kept = 0
    for step in range(5):
        x = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
        maxima = reference_maxima(ref, x)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            m(input_ids=x, labels=x).loss.backward()
            if step == 2:
                m.model.layers[0].self_attn.q_proj.weight.grad = None
        opt.step()
        reference.step()
        with torch.no_grad():
            for layer, s in zip(ref.model.layers, maxima):
                assert float((s / tau - 1).abs().min()) > 1e-6, "a head at tau: the case is ill-posed"
                gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
                clipped += int((s > tau).sum())
                kept += int((s <= tau).sum())
                q_rows = gamma if kv_heads != HEADS else gamma**alpha
                layer.self_attn.q_proj.weight.mul_(q_rows.repeat_interleave(HEAD_DIM)[:, None])
                if kv_heads == HEADS:
                    layer.self_attn.k_proj.weight.mul_((gamma ** (1 - alpha)).repeat_interleave(HEAD_DIM)[:, None])
        for i, s in enumerate(maxima):
            assert_close(opt.last_max_logits[f"model.layers.{i}.self_attn"].values, s, msg=f"step {step} logits {i}")
    assert clipped and kept, f"clipped {clipped} heads and kept {kept}: the case must do both"
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.detach(), theirs[name].detach(), msg=name)
        if "momentum_buffer" in opt.state[p]:
            assert_close(
                opt.state[p]["momentum_buffer"], reference.state[id(theirs[name])]["momentum_buffer"], msg=name
            )


def test_clip_on_every_piece() -> None:
    """scale_head_rows_ on each rank's piece of a 2-head-per-slice q_proj (TP=2 by rows, ZeRO
    chunks with padding, flat ranges with empty ranks, a bias) equals scaling the full tensor."""
    gen = torch.Generator().manual_seed(0)
    heads, d, cols = 4, 3, 5
    full = torch.randn(heads * d, cols, dtype=torch.float64, generator=gen)
    factors = torch.tensor([0.5, 1.0, 0.25, 1.0], dtype=torch.float64)
    want = full * factors.repeat_interleave(d)[:, None]
    shape = tuple(full.shape)
    cases: list[tuple[str, list[ParamLayout]]] = [
        ("whole", [ParamLayout(shape)]),
        ("tp2", [ParamLayout(shape, TPSplit(0, 2, r)) for r in range(2)]),
        ("tp2-zero4", [ParamLayout(shape, TPSplit(0, 2, r), ZeroShard(4, z, 2)) for r in range(2) for z in range(4)]),
        ("zero3", [ParamLayout(shape, None, ZeroShard(3, z, 0)) for z in range(3)]),
        ("flat", [ParamLayout(shape, None, ZeroShard(4, z, 0, bounds=(0, 7, 7, 41, 60))) for z in range(4)]),
    ]
    for label, layouts in cases:
        out = torch.zeros_like(full)
        for layout in layouts:
            local = full[layout.tp_slices()].reshape(-1)
            start, stop = layout.chunk_range
            piece = torch.cat([local, local.new_zeros(max(0, stop - local.numel()))])[start:stop].clone()
            tp_heads = heads // (layout.tp.size if layout.tp else 1)
            offset = (layout.tp.rank * tp_heads) if layout.tp else 0
            scale_head_rows_(piece, layout, factors[offset : offset + tp_heads], d)
            view = out[layout.tp_slices()]
            flat = view.reshape(-1).clone()
            n = max(0, min(stop, flat.numel()) - start)
            flat[start : start + n] = piece[:n]
            view.copy_(flat.view_as(view))
            if stop > local.numel():
                assert bool((piece[n:] == 0).all()), f"{label}: padding touched"
        assert torch.equal(out, want), label
    bias = torch.randn(heads * d, dtype=torch.float64, generator=gen)
    layout = ParamLayout((heads * d,), None, ZeroShard(2, 1, 0))
    piece = bias[6:].clone()
    scale_head_rows_(piece, layout, factors, d)
    assert torch.equal(piece, (bias * factors.repeat_interleave(d))[6:])


def test_factors() -> None:
    """gamma = tau / S above tau, 1 at or below it (and for -inf: a head that saw nothing)."""
    s = torch.tensor([200.0, 100.0, 50.0, -math.inf], dtype=torch.float64)
    q, k = clip_factors(HeadMaxima(s, 8, 1), 100.0, 0.5)
    assert_close(q, torch.tensor([0.5**0.5, 1, 1, 1], dtype=torch.float64), msg="q")
    assert torch.equal(q, k)
    q, k = clip_factors(HeadMaxima(s, 8, 1), math.inf, 0.5)  # tau=inf: measure and log, never clip
    assert bool((q == 1).all()) and bool((k == 1).all())
    q, k = clip_factors(HeadMaxima(s, 8, 2), 100.0, 0.5)
    assert torch.equal(q, torch.tensor([0.5, 1, 1, 1], dtype=torch.float64)) and torch.equal(
        k, torch.ones(2, dtype=torch.float64)
    )


def test_skipped_step_forgets_its_logits() -> None:
    """A step skipped for a NaN gradient discards the logits of its forward; the next step clips by
    its own."""
    model = llama64()
    opt = DistributedMuon(muon_param_groups(model, adamw_lr=1e-3), lr=1e-2, qk_clip_tau=100.0, nonfinite="skip")
    monitor = watch_attention_logits(model, opt)
    x = torch.randint(0, 256, (BATCH, SEQ))
    model(input_ids=x, labels=x).loss.backward()
    model.model.layers[0].mlp.up_proj.weight.grad[0, 0] = float("nan")
    opt.step()
    assert opt.skipped_steps == 1 and all(bool((m.values == -math.inf).all()) for m in monitor.take().values())


def test_options_and_misuse_are_refused() -> None:
    model = llama64()
    groups = muon_param_groups(model)
    for bad in (0.0, -1.0, True, "100"):
        with pytest.raises(ValueError, match="qk_clip_tau"):
            DistributedMuon(groups, qk_clip_tau=bad)
    for bad_alpha in (-0.1, 1.5):
        with pytest.raises(ValueError, match="qk_clip_alpha"):
            DistributedMuon(groups, qk_clip_tau=100.0, qk_clip_alpha=bad_alpha)
    opt = DistributedMuon(groups, qk_clip_tau=100.0)
    x = torch.randint(0, 256, (BATCH, SEQ))
    model(input_ids=x, labels=x).loss.backward()
    with pytest.raises(RuntimeError, match="watch_attention_logits"):
        opt.step()
    with pytest.raises(ValueError, match="no attention module"):
        watch_attention_logits(torch.nn.Linear(2, 2), opt)
    assert dist_optim.watch_attention_logits is watch_attention_logits


@pytest.mark.parametrize("block", [1 << 25, 40])
def test_max_logits_masks_and_blocks(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    """max_logits against the full logit tensor: causal (keys up to the query's position, the
    cached keys before it included), a boolean mask, and row blocks of 40 logits; a future key with
    the largest logit of all is not counted."""
    from dist_optim.muon import qk_clip

    monkeypatch.setattr(qk_clip, "LOGIT_BLOCK", block)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(2, 2, 9, 8, dtype=torch.float64, generator=gen)
    k[:, :, -1] = q[:, ::2, 0] * 50  # the last key: huge for query 0, which must not see it
    full = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3
    causal = torch.ones(6, 9).tril(diagonal=3).bool()
    want = full.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))
    assert not torch.allclose(want, full.amax(dim=(0, 2, 3))), "the future key must matter"
    assert_close(qk_clip.max_logits(q, k, 0.3, None), want, msg="causal")
    allowed = torch.rand(2, 1, 6, 9, generator=gen) > 0.5
    want = full.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3))
    assert_close(qk_clip.max_logits(q, k, 0.3, allowed), want, msg="mask")


def test_colossal_masks_and_sequence_splits() -> None:
    """ShardFormer's mask forms: causal; padded causal from the valid tokens' flat indices (padded
    queries and keys attend nothing); a non-causal mask refused. Ring attention's zigzag split of
    the sequence is refused at boost, naming the mode and the fix."""
    from colossalai.shardformer.layer.attn import AttnMaskType, ColoAttention

    from dist_optim.plugins.qk_clip import colossal_mask, watch_boosted

    assert colossal_mask({"attention_mask_type": AttnMaskType.CAUSAL}, 2, 5, 5) is None
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kwargs = ColoAttention.prepare_attn_kwargs(
        (2, 1, 5, 5), torch.float32, torch.device("cpu"), q_padding_mask=padding, is_causal=True
    )
    got = colossal_mask(kwargs, 2, 5, 5)
    valid = padding.bool()
    want = torch.ones(5, 5).tril().bool()[None, None] & valid[:, None, None, :] & valid[:, None, :, None]
    assert got is not None and torch.equal(got.expand(2, 1, 5, 5), want)
    with pytest.raises(ValueError, match="causal"):
        colossal_mask({"attention_mask_type": AttnMaskType.PADDED}, 2, 5, 5)

    class Plugin:
        enable_sequence_parallelism = True
        sequence_parallelism_mode = "ring_attn"
        sp_group = None

    model = llama64()
    opt = DistributedMuon(muon_param_groups(model), qk_clip_tau=100.0)
    with pytest.raises(ValueError, match="sequence_parallelism_mode='ring_attn'.*'split_gather' or 'all_to_all'"):
        watch_boosted(Plugin(), model, opt)
    Plugin.sequence_parallelism_mode = "split_gather"
    watch_boosted(Plugin(), model, opt)
    assert opt.attention_logits is not None


def test_the_planner_counts_the_clips_all_reduce() -> None:
    """The planner steps a Muon with QK-clip as a rank would: one all-reduce more per step (each
    rank's heads of each layer, max-reduced over the data-parallel ranks), nothing else changed."""
    from dist_optim.plan import Layout, make_plan

    config = tiny_llama().config
    layout = Layout("hybrid", tp=2, dp=2, zero=1)
    plain = make_plan(config, layout, "muon", steps=2)
    clipped = make_plan(config, layout, "muon", {"qk_clip_tau": 100.0}, steps=2)
    assert clipped.steady["collectives"] == plain.steady["collectives"] + 1
    # 2 layers x 2 heads of this TP rank x fp32, sent by a 2-rank all-reduce
    assert 0 < clipped.steady["bytes_sent"] - plain.steady["bytes_sent"] <= 2 * 2 * 4 * 2
    assert clipped.busiest.optimizer_state == plain.busiest.optimizer_state


def test_queries_at_an_offset_meet_the_keys_before_them() -> None:
    """A sequence-parallel rank's queries start at its offset: max_logits with ``offset`` against
    the whole sequence's logits cut to those rows (causal, as all_to_all's ranks measure them)."""
    from dist_optim.muon.qk_clip import max_logits

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 2, 8, 4, dtype=torch.float64, generator=gen)
    full = (q @ k.transpose(-1, -2)).masked_fill(~torch.ones(8, 8).tril().bool(), -math.inf)
    halves = [max_logits(q[:, :, r * 4 : (r + 1) * 4], k, 1.0, None, offset=r * 4) for r in range(2)]
    assert_close(torch.maximum(*halves), full.amax(dim=(0, 2, 3)), msg="two ranks' halves")
    assert_close(halves[1], full[:, :, 4:].amax(dim=(0, 2, 3)), msg="the second half")


def test_the_planner_reduces_over_the_sequence_group_under_all_to_all() -> None:
    """Under all_to_all sequence parallelism the clip's maxima are max-reduced over the
    data-parallel group and then the sequence-parallel one: two all-reduces more than Muon's."""
    from dist_optim.plan import Layout, make_plan

    config = tiny_llama().config
    layout = Layout("hybrid", dp=2, sp=2, zero=1)
    plain = make_plan(config, layout, "muon", steps=2)
    clipped = make_plan(config, layout, "muon", {"qk_clip_tau": 100.0}, steps=2)
    assert clipped.steady["collectives"] == plain.steady["collectives"] + 2
