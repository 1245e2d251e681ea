"""Per-head Muon (``heads``): each of a matrix's row blocks orthogonalized on its own, as
torchtitan's Muon and Megatron-Core's split QKV do; whole heads in a TP slice never leave it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_optim import DistributedMuon, ParamLayout, TPSplit, muon_param_groups
from dist_optim.testing import tiny_llama
from tests.helpers.collectives import counting_collectives


@pytest.mark.parametrize(
    "shape,heads,adjust", [((12, 10), 3, None), ((24, 4), 2, None), ((16, 6), 4, "match_rms_adamw")]
)
def test_per_head_is_muon_on_each_head(shape: tuple[int, int], heads: int, adjust: str | None) -> None:
    """heads=h steps a matrix as plain Muon steps its h row blocks given as h parameters (each
    block's own lr adjustment: a tall 24 x 4 matrix in 2 heads scales by sqrt(3), not sqrt(6)):
    float64, 4 steps, one without a gradient, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(shape, dtype=torch.float64, generator=gen)
    whole = torch.nn.Parameter(full.clone())
    blocks = [torch.nn.Parameter(b.clone()) for b in full.chunk(heads)]
    kw: dict[str, Any] = dict(lr=0.02, weight_decay=0.01, adjust_lr_fn=adjust)
    per_head = DistributedMuon([{"params": [whole], "heads": heads}], **kw)
    plain = DistributedMuon([{"params": blocks}], **kw)
    for step in range(4):
        g = None if step == 2 else torch.randn(shape, dtype=torch.float64, generator=gen)
        whole.grad = g
        for b, part in zip(blocks, g.chunk(heads) if g is not None else [None] * heads):
            b.grad = None if part is None else part.clone()
        per_head.step()
        plain.step()
    assert torch.equal(whole.detach(), torch.cat([b.detach() for b in blocks]))
    assert not torch.equal(whole.detach(), full), "the step moved nothing"
    momentum = per_head.state[whole]["momentum_buffer"]
    assert torch.equal(momentum, torch.cat([plain.state[b]["momentum_buffer"] for b in blocks]))


def tp_step(heads: int | None) -> dict[str, Any]:
    """A q_proj-like 8 x 6 matrix split by rows over 2 TP ranks: the collectives of a step at
    torch.distributed, and the full result."""
    from dist_optim.testing import grid_groups

    group, _ = grid_groups(2, 1)
    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(3)
    full, grad = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    param = torch.nn.Parameter(full.chunk(2)[rank].clone())
    opt = DistributedMuon([{"params": [param], "heads": heads}], lr=0.05)
    opt.bind({param: ParamLayout((8, 6), TPSplit(0, 2, rank, group))}, tp_group=group)
    param.grad = grad.chunk(2)[rank].clone()
    opt.step()  # the first step plans and routes (object collectives): counted from the second
    param.grad = grad.chunk(2)[rank].clone()
    with counting_collectives() as seen:
        opt.step()
    out = [torch.empty_like(param.detach()) for _ in range(2)]
    dist.all_gather(out, param.detach(), group=group)
    return dict(counts=dict(seen.counts), full=torch.cat(out))


def test_whole_heads_never_leave_their_tp_slice(pool2) -> None:
    """4 heads over tp=2: each rank orthogonalizes its 2 heads from its slice; the step's only
    collective is the NaN/Inf check's all-reduce. Without heads the matrix goes to its owner and
    back (all-to-alls). The per-head result is the single-device per-head one."""
    per_head = pool2.run(tp_step, 4)
    whole = pool2.run(tp_step, None)
    for rank in range(2):
        assert per_head[rank]["counts"] == {"all_reduce": 1}, per_head[rank]["counts"]
        assert whole[rank]["counts"].get("all_to_all_single", 0) >= 1, whole[rank]["counts"]
    gen = torch.Generator().manual_seed(3)
    full, grad = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    ref = torch.nn.Parameter(full.clone())
    opt = DistributedMuon([{"params": [ref], "heads": 4}], lr=0.05)
    for _ in range(2):
        ref.grad = grad.clone()
        opt.step()
    assert torch.allclose(per_head[0]["full"], ref.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(per_head[0]["full"], per_head[1]["full"])


def test_muon_param_groups_per_head() -> None:
    """From a Hugging Face config: q_proj by its attention heads, k_proj and v_proj by the key/value
    heads, each in a Muon group of its own with the other options; the rest as without."""
    model = tiny_llama()
    config = model.config
    groups = muon_param_groups(model, per_head=True, lr=0.01)
    by_heads = {g.get("heads"): g for g in groups if g["use_muon"]}
    q_heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    assert set(by_heads) == {None, q_heads, kv_heads} or (q_heads == kv_heads and set(by_heads) == {None, q_heads})
    assert all(n.endswith("q_proj.weight") for n in by_heads[q_heads]["param_names"] if "q_proj" in n)
    named = {n: g.get("heads") for g in groups for n in g["param_names"]}
    for n, h in named.items():
        if n.endswith("q_proj.weight"):
            assert h == q_heads, n
        elif n.endswith(("k_proj.weight", "v_proj.weight")):
            assert h == kv_heads, n
        else:
            assert h is None, n
    assert all(g["lr"] == 0.01 for g in groups if g["use_muon"])
    plain = muon_param_groups(model, lr=0.01)
    assert sorted(named) == sorted(n for g in plain for n in g["param_names"])
    DistributedMuon(groups).step()  # the groups are valid as given (no gradients: nothing moves)


def test_bad_heads_are_refused() -> None:
    w = torch.nn.Parameter(torch.randn(6, 4))
    for bad in (0, -2, True, 2.5):
        with pytest.raises(ValueError, match=f"heads must be None or a positive integer .*got {bad!r}"):
            DistributedMuon([{"params": [w], "heads": bad}])
    opt = DistributedMuon([{"params": [w], "heads": 4}])
    w.grad = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"heads=4 for .* of shape \(6, 4\), whose 6 rows: give its group a heads"):
        opt.step()
    cube = torch.nn.Parameter(torch.randn(2, 4, 3))
    cube.grad = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match=r"is a stack of matrices \(stacked=True\)"):
        DistributedMuon([{"params": [cube], "heads": 2}], stacked=True).step()
    with pytest.raises(ValueError, match="no config.num_attention_heads"):
        muon_param_groups(torch.nn.Linear(3, 3), per_head=True)
