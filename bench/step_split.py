"""``bench/bench_step.py --split``: the per-rank preconditioner work (CPU seconds) and bytes of
Shampoo, Kron or Muon at dp=4 against dp=1 on 4 CPU processes, and for Shampoo at tp=2 x dp=2. Apart from
bench_step.py, whose single-process and ``--dist`` modes fill a module of their own."""

from __future__ import annotations

import importlib
import time
from typing import Any

import torch

from bench.record import Column, col


def _split_optimizer(name: str, params: list[Any], pf: int) -> Any:
    import dist_optim

    if name == "muon":
        from bench.rows import muon_groups

        return dist_optim.DistributedMuon(muon_groups(params), lr=2e-3, weight_decay=0.01)
    if name == "shampoo":
        return dist_optim.DistributedShampoo(
            params,
            lr=1e-3,
            precondition_frequency=pf,
            start_preconditioning_step=pf,
            grafting_config=dist_optim.AdamGraftingConfig(beta2=0.999, epsilon=1e-8),
        )
    return dist_optim.DistributedKron(params, lr=3e-4, seed=0)


def _preconditioner_bytes(opt: Any) -> int:
    if type(opt).__name__ == "DistributedMuon":  # no preconditioner: the momentum of its pieces
        return sum(st["momentum_buffer"].numel() * 4 for st in opt.state.values() if "momentum_buffer" in st)
    if hasattr(opt, "state_bytes"):
        return int(opt.state_bytes()["preconditioner"])
    return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k.startswith("Q_"))


#: The public function (module, name) that does an owner's work: the preconditioner's statistics,
#: roots and directions of a batch of blocks (Shampoo) or one parameter (Kron), the iteration of the
#: owner's matrices (Muon, in batches of one shape); --split times it where the optimizer's module calls it.
_OWNER_WORK = {
    "shampoo": ("dist_optim.shampoo.work", "block_directions"),
    "kron": ("dist_optim.kron.optimizer", "owner_direction"),
    "muon": ("dist_optim.muon.optimizer", "newton_schulz_many"),
}


def _split_worker(name: str, shapes: list[tuple[int, ...]], steps: int, pf: int) -> dict[str, Any]:
    """CPU seconds on this rank, working alone (dp=1) and sharing the preconditioner work with the 4
    data-parallel ranks (replicated params, as under DDP): of the owner's preconditioner work alone,
    and of the whole step (which adds sharing the directions and applying the full update)."""
    import torch.distributed as dist

    from dist_optim import comm
    from dist_optim.layout import ParamLayout, TPSplit, local_layout
    from dist_optim.testing import grid_groups

    torch.manual_seed(0)
    base = [torch.randn(s) * 0.02 for s in shapes]
    grads = [torch.randn(s) * 1e-3 for s in shapes]
    alone = dist.new_group([dist.get_rank()])
    tp_group, dp_group = grid_groups(2, 2)
    tp_rank = dist.get_rank(tp_group)

    def tp_piece(t: torch.Tensor) -> torch.Tensor:  # matrices split by rows over TP, vectors whole
        return t.chunk(2, dim=0)[tp_rank].clone() if t.dim() == 2 else t.clone()

    out: dict[str, Any] = {}
    labels = [("dp1", alone), ("dp4", dist.group.WORLD)]
    if name == "shampoo":
        labels += [("tp2dp2", dp_group)]
    for label, group in labels:
        tp = label.startswith("tp")
        params = [torch.nn.Parameter(tp_piece(b) if tp else b.clone()) for b in base]
        opt = _split_optimizer(name, params, pf)
        if tp:
            split = TPSplit(0, 2, tp_rank, tp_group)
            opt.bind(
                {
                    p: ParamLayout(tuple(b.shape), split, None) if b.dim() == 2 else local_layout(p)
                    for p, b in zip(params, base)
                },
                dp_group=group,
            )
        else:
            opt.bind({p: local_layout(p) for p in params}, dp_group=group)
        for p, g in zip(params, grads):
            p.grad = tp_piece(g) if tp else g.clone()
        opt.step()  # warm-up (Shampoo: first preconditioner refresh at step pf)
        work = [0.0]
        module = importlib.import_module(_OWNER_WORK[name][0])
        real = getattr(module, _OWNER_WORK[name][1])

        def timed(*a: Any, real: Any = real, work: list[float] = work, **k: Any) -> Any:
            t = time.process_time()
            try:
                return real(*a, **k)
            finally:
                work[0] += time.process_time() - t

        setattr(module, _OWNER_WORK[name][1], timed)
        comm.reset_counts()
        dist.barrier()
        t0 = time.process_time()
        try:
            for _ in range(steps):
                opt.step()
        finally:
            setattr(module, _OWNER_WORK[name][1], real)
        out[label] = time.process_time() - t0
        out[label + "_work"] = work[0]
        out[label + "_bytes"] = _preconditioner_bytes(opt)
        out[label + "_collectives"] = sum(comm.COUNTS.values()) / steps
    return out


#: The columns of the ``split`` table (``--split NAME --write split``): each row's figures as
#: ratios to the same optimizer on each rank alone (dp=1).
SPLIT_COLUMNS: list[Column] = [
    col("optimizer", "optimizer, layers"),
    col("precond_cpu", "preconditioner CPU, busiest rank, dp=4 / dp=1", 2, suffix="x"),
    col("step_cpu", "whole step CPU, dp=4 / dp=1", 2, suffix="x"),
    col("precond_bytes", "preconditioner bytes per rank, dp=4 / dp=1", 2, suffix="x"),
    col("collectives", "collectives per step", 0),
]


def run_split(name: str, steps: int, pf: int, layers: int) -> list[dict[str, Any]]:
    """Print the split's table and return its rows in :data:`SPLIT_COLUMNS` (dp=4, and for
    Shampoo tp=2 x dp=2, against dp=1)."""
    from bench.bench_step import llama_like
    from dist_optim.testing import DistPool

    shapes = llama_like(512, 1376, layers, 4096)
    pool = DistPool(4)
    try:
        res = pool.run(_split_worker, name, shapes, steps, pf)
    finally:
        pool.close()
    dp1, w1 = (max(r[k] for r in res) for k in ("dp1", "dp1_work"))
    b1 = max(r["dp1_bytes"] for r in res)
    setting = f", precondition_frequency={pf}" if name == "shampoo" else ""
    work, held = ("Newton-Schulz", "momentum") if name == "muon" else ("preconditioner", "preconditioner")
    print(f"\n{name} {work} work split over 4 data-parallel ranks ({layers} layers, {steps} steps{setting})")
    print(
        f"| | {work} CPU s (busiest rank) | whole step CPU s (busiest rank) "
        f"| {held} bytes per rank (max) | collectives per step |"
    )
    print("|---|---:|---:|---:|---:|")
    print(f"| dp=1 (each rank alone) | {w1:.2f} | {dp1:.2f} | {b1:,} | 0 |")
    title = {"shampoo": f"Shampoo (pf={pf})", "kron": "Kron", "muon": "Muon"}[name]
    title += f", {layers} layers" if layers != 1 else ", 1 layer"
    rows = []
    for label, shown, suffix in (
        ("dp4", "dp=4 (work split)", ""),
        ("tp2dp2", "tp=2 x dp=2, split over the TP x DP grid", ", tp=2 x dp=2"),
    ):
        if label not in res[0]:
            continue
        w, whole = (max(r[k] for r in res) for k in (label + "_work", label))
        held_bytes = max(r[label + "_bytes"] for r in res)
        collectives = res[0][label + "_collectives"]
        print(
            f"| {shown} | {w:.2f} ({w / w1:.2f}x) | {whole:.2f} ({whole / dp1:.2f}x) "
            f"| {held_bytes:,} | {collectives:.0f} |"
        )
        rows.append(
            dict(
                optimizer=title + suffix,
                precond_cpu=w / w1 if w1 else None,
                step_cpu=whole / dp1 if dp1 else None,
                precond_bytes=held_bytes / b1 if b1 else None,
                collectives=collectives,
            )
        )
    return rows
