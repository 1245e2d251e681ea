"""ColossalAI's own reports of its optimizers failing under ZeRO's CPU offload, through the swap.

* hpcaitech/ColossalAI#6399: ``GaLoreAdamW8bit`` (ColossalAI's, with ``get_galore_param_groups``)
  with ``LowLevelZeroPlugin(precision="fp32", cpu_offload=True)``: "All input tensors need to be
  on the same GPU" (built as on the bitsandbytes it was written for: :func:`_colossal_galore_8bit`).
* hpcaitech/ColossalAI#6400: ColossalAI's ``Lamb`` with ``LowLevelZeroPlugin(initial_scale=2**20,
  cpu_offload=True)`` (fp16): "No backend type associated with device type cpu".

Each report's script (its MLP on random features, scaled down to the suite's size; 4 ranks, 4
steps) runs with dist_optim's drop-in LowLevelZeroPlugin: the optimizer must be swapped for ours,
ZeRO must hold the masters in host memory, every collective of ours must be staged through the
group's (simulated, tests/conftest.py) accelerator, and the weights must be those of the same
script without offload, element-wise (``OFFLOAD_RTOL``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

#: Offloaded against not offloaded, per element: ``|a - b| <= OFFLOAD_RTOL * max|b|``. Both runs do
#: the same arithmetic on the same CPU: measured 0 (bit-identical) on every parameter.
OFFLOAD_RTOL = 1e-6

#: Steps per report's run: #6399's all reach the optimizer; #6400's loss scale starts at 2**20, which
#: overflows fp16 until ColossalAI's scaler has halved it enough (each overflow skips the step).
STEPS = {"6399": 4, "6400": 20}
#: Steps each run must have taken after the skipped ones (#6400: 15 of 20 measured).
MIN_TAKEN = {"6399": 4, "6400": 10}


class _MLP(torch.nn.Module):
    """The reports' model: features -> hidden -> classes, with a LayerNorm (input 1024 there)."""

    def __init__(self, features: int = 64, hidden: int = 48, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(features, hidden)
        self.LayerNorm = torch.nn.LayerNorm(hidden)
        self.fc2 = torch.nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.LayerNorm(self.fc1(x))))


def _colossal_galore_8bit(cls: Any, groups: list[dict], lr: float, min_8bit_size: int) -> Any:
    """ColossalAI 0.5.0's GaLoreAdamW8bit as its constructor would build it on the bitsandbytes it
    was written for: on bitsandbytes 0.50 the constructor passes keywords that bitsandbytes removed
    (``percentile_clipping``, ``block_wise``), so it cannot run; the swap reads only its groups and args."""
    from bitsandbytes.optim.optimizer import MockArgs

    opt = cls.__new__(cls)
    torch.optim.Optimizer.__init__(opt, groups, dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2))
    for group in opt.param_groups:
        if "rank" in group:
            group.setdefault("update_proj_gap", 200)
            group.setdefault("proj_type", "std")
            group.setdefault("scale", 0.25)
    args = dict(optim_bits=8, min_8bit_size=min_8bit_size, percentile_clipping=100, block_wise=True)
    opt.args = MockArgs(dict(args, max_unorm=0.0, skip_zeros=False))
    opt.is_paged = False
    return opt


def report_run(report: str, offload: bool) -> dict[str, Any]:
    """One report's script on this rank: what the optimizer became, the run's facts, its weights."""
    from colossalai.booster import Booster

    from dist_optim import plugins
    from dist_optim.comm import rules
    from dist_optim.plugins.cpu import install, quiet_colossal

    install()
    torch.manual_seed(0)
    model = _MLP()
    if report == "6399":
        from colossalai.nn.optimizer import GaLoreAdamW8bit
        from colossalai.nn.optimizer.galore import get_galore_param_groups

        groups = get_galore_param_groups(model, weight_decay=0.01, rank=8, update_proj_gap=2, scale=0.25)
        optimizer: Any = _colossal_galore_8bit(GaLoreAdamW8bit, groups, lr=1e-3, min_8bit_size=256)
        plugin = plugins.LowLevelZeroPlugin(precision="fp32", cpu_offload=offload, overlap_communication=False)
    else:
        from colossalai.nn.optimizer.lamb import Lamb

        optimizer = Lamb(model.parameters(), lr=1e-3)
        plugin = plugins.LowLevelZeroPlugin(initial_scale=2**20, cpu_offload=offload, overlap_communication=False)
    with quiet_colossal():
        booster = Booster(plugin=plugin)
        model, optimizer, criterion, *_ = booster.boost(model, optimizer, torch.nn.CrossEntropyLoss())
    rules.reset_staged()
    inner, taken = optimizer.optim, [0]
    inner_step = inner.step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        taken[0] += 1
        return inner_step(*args, **kwargs)

    inner.step = counted_step
    losses = []
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    for _ in range(STEPS[report]):
        x, y = torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        if report == "6400":
            x = x.half()
        loss = criterion(model(x).float(), y)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return dict(
        swapped_to=type(optimizer.optim).__name__,
        cpu_offload=bool(getattr(optimizer, "_cpu_offload", False)),
        master_devices=sorted({p.device.type for g in optimizer.optim.param_groups for p in g["params"]}),
        staged=sum(rules.STAGED.values()),
        steps_taken=taken[0],
        losses=losses,
        weights={n: p.detach().float().clone() for n, p in model.unwrap().named_parameters()},
    )


@pytest.mark.parametrize("report,expected", [("6399", "DistributedGaLore"), ("6400", "DistributedLamb")])
def test_report_trains_with_offload(report: str, expected: str, pool4) -> None:
    offloaded = pool4.run(report_run, report, True)
    plain = pool4.run(report_run, report, False)
    for rank, (a, b) in enumerate(zip(offloaded, plain)):
        assert a["swapped_to"] == expected, a["swapped_to"]
        assert a["cpu_offload"] and a["master_devices"] == ["cpu"], (a["cpu_offload"], a["master_devices"])
        print(f"rank {rank}: {a['steps_taken']} of {STEPS[report]} steps reached the optimizer")
        assert a["steps_taken"] >= MIN_TAKEN[report], f"rank {rank}: the optimizer stepped {a['steps_taken']} times"
        assert a["staged"] > 0, f"rank {rank}: no collective staged through the group's device"
        assert all(torch.isfinite(torch.tensor(a["losses"]))), a["losses"]
        for name, w in a["weights"].items():
            ref = b["weights"][name]
            err = (w - ref).abs().max().item()
            assert err <= OFFLOAD_RTOL * ref.abs().max().item(), f"rank {rank} {name}: offload moved it by {err}"
        moved = [n for n, w in a["weights"].items() if not torch.equal(w, offloaded[0]["weights"][n])]
        assert not moved, f"rank {rank}: weights differ from rank 0's: {moved}"
