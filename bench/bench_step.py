"""Optimizer step time and state memory, as ratios to torch AdamW (foreach) measured in the same run.

Single process (default)::

    python bench/bench_step.py                     # Llama-like set: 2 layers H=1024 I=2752 + 8192x1024 embedding
    python bench/bench_step.py --only lamb --repeats 20

Each optimizer gets its own copy of the parameters and fixed random gradients; steps are timed
round-robin (one step of each optimizer in turn, ``--repeats`` rounds after ``--warmup``) so that
load from elsewhere on the machine hits every row alike, and the median is reported. Ratios, not
seconds, are what docs/benchmarks.md quotes.

Distributed (``--dist [lamb adafactor came galore shampoo]``) launches 4 CPU processes, boosts a
small Llama with HybridParallelPlugin tp=2 x dp=2 (``--zero-stage``, ``--precision``; ZeRO-1 bf16
by default) and times the optimizer step, counts its collectives and the bytes they carry
(received), for ours (swapped in from the ordinary optimizer) and for ColossalAI's own
distributed class; a peer that fails on the layout is reported as such. Shampoo (ours, passed
directly; ColossalAI has none) runs twice: gradient pieces sent to the block owners (the
default) and full gradients gathered on every rank; so do Muon and Kron (``kron``: kron_torch's
Kron swapped for ours; momentum pieces to the owners, or every full momentum gathered). With
``--bucket-bytes N`` those three run with that step-memory budget instead, once as they are (the
next bucket's exchange in flight while one computes, :func:`dist_optim.sharding.owners.pipelined`) and once
with the same buckets in sequence: the overlap's effect on the step.

``--split shampoo|kron|muon`` measures the per-rank preconditioner work (CPU seconds) and bytes at
dp=4 against dp=1 (``--layers`` sets the depth of the parameter set); for Shampoo also at tp=2 x
dp=2 (matrices split by rows over TP), with blocks split over the TP x DP grid and, for
comparison, over each TP rank's dp pair only.

GaLore rows report the amortised step too: the first step computes every projector (the SVDs a
refresh does), so ``(first + (gap - 1) x median) / gap``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

ROOT = __file__.rsplit("/bench/", 1)[0]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def llama_like(hidden: int = 1024, inter: int = 2752, layers: int = 2, vocab: int = 8192) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    shapes.append((hidden,))
    return shapes


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer state, also inside containers and objects
    (galore_torch keeps its projector in a GaLoreProjector object), each storage counted once."""
    seen: set[int] = set()

    def count(v: Any, depth: int = 0) -> int:
        if isinstance(v, torch.Tensor):
            key = v.untyped_storage().data_ptr()
            if key in seen:
                return 0
            seen.add(key)
            return v.numel() * v.element_size()
        if depth > 3:
            return 0
        if isinstance(v, dict):
            return sum(count(x, depth + 1) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(count(x, depth + 1) for x in v)
        if hasattr(v, "__dict__") and not isinstance(v, type):
            return sum(count(x, depth + 1) for x in vars(v).values())
        return 0

    return sum(count(state) for state in opt.state.values())


def fixed_params(shapes: list[tuple[int, ...]], device: str = "cpu") -> Callable[[], list[torch.nn.Parameter]]:
    """A maker of parameter sets of ``shapes`` (random * 0.02) with fixed gradients (random *
    1e-3), the same values from seed 0 on every call: one copy per optimizer timed, on ``device``."""
    gen = torch.Generator().manual_seed(0)
    base = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(device) for s in shapes]

    def make() -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return params

    return make


def device_sync(device: str) -> Callable[[], None]:
    """What a step's timing calls before and after it: a CUDA step returns before its kernels
    finish, so there time runs from an idle device to an idle device; elsewhere nothing."""
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def run_bench(
    shapes: list[tuple[int, ...]], selected: list[Any], warmup: int, repeats: int, device: str = "cpu"
) -> list[dict[str, Any]]:
    make_params = fixed_params(shapes, device)
    sync = device_sync(device)
    runs = []
    for row in selected:
        params = make_params()
        try:
            opt = row.factory(params)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            print(f"  skipped {row.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        runs.append((row, opt, []))
    firsts: dict[int, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(warmup + repeats):
            for k, (_row, opt, times) in enumerate(runs):
                gc.collect()
                sync()
                t0 = time.perf_counter()
                opt.step()
                sync()
                dt = time.perf_counter() - t0
                if i == 0:
                    firsts[k] = dt
                if i >= warmup:
                    times.append(dt)
    base_time = statistics.median(runs[0][2])
    base_bytes = state_bytes(runs[0][1])
    out = []
    for k, (row, opt, times) in enumerate(runs):
        median = statistics.median(times)
        amortised = None
        if row.refresh_every:
            amortised = (firsts[k] + (row.refresh_every - 1) * median) / row.refresh_every / base_time
        out.append(
            dict(
                name=row.name,
                group=row.group,
                ms=1e3 * median,
                mean_ratio=statistics.mean(times) / statistics.mean(runs[0][2]),
                ratio=median / base_time,
                amortised_ratio=amortised,
                state_ratio=state_bytes(opt) / base_bytes if base_bytes else float("nan"),
            )
        )
    return out


def print_table(results: list[dict[str, Any]], shapes: list[tuple[int, ...]], device: str = "cpu") -> None:
    n = sum(torch.Size(s).numel() for s in shapes)
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    print(f"\nStep time and optimizer state vs torch AdamW (foreach), {n / 1e6:.1f}M params, {where}")
    print(
        "| optimizer | group | median step (ms) | median / AdamW | mean / AdamW | amortised / AdamW "
        "| state bytes / AdamW |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        amortised = "" if r["amortised_ratio"] is None else f"{r['amortised_ratio']:.2f}x"
        print(
            f"| {r['name']} | {r['group']} | {r['ms']:.1f} | {r['ratio']:.2f}x | {r['mean_ratio']:.2f}x "
            f"| {amortised} | {r['state_ratio']:.3f} |"
        )


# ---- distributed ------------------------------------------------------------------------------
def _cls(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _instrument(
    inner: Any,
    times: list[float],
    counts: list[tuple[int, int]],
    calls: dict[str, int],
    real: dict[str, Callable[..., Any]],
    counting: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """Time the inner optimizer's step alone (ZeRO's gradient sync is the same for every optimizer)
    and count the collectives it issues and the bytes they carry (all-reduced, or received by an
    all-gather / broadcast)."""
    import torch.distributed as dist

    orig = inner.step

    def step(*a: Any, **k: Any) -> Any:
        for name, fn in real.items():
            setattr(dist, name, counting(fn))
        calls["n"] = 0
        calls["bytes"] = 0
        dist.barrier()
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            times.append(time.perf_counter() - t0)
            counts.append((calls["n"], calls["bytes"]))
            for name, fn in real.items():
                setattr(dist, name, fn)

    inner.step = step


#: --dist families: the ordinary optimizer a user passes (swapped for ours by dist_optim.plugins) and
#: ColossalAI's own distributed class (run on ColossalAI's plugin), with the same options.
DIST_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "lamb": ("colossalai.nn.optimizer.Lamb", "colossalai.nn.optimizer.DistributedLamb", dict(lr=1e-3)),
    "adafactor": (
        "transformers.optimization.Adafactor",
        "colossalai.nn.optimizer.DistributedAdaFactor",
        # The defaults (relative step, parameter scaling): ColossalAI's class fails on an explicit lr.
        dict(lr=None),
    ),
    "came": ("came_pytorch.CAME", "colossalai.nn.optimizer.DistributedCAME", dict(lr=2e-4)),
    # galore_torch-style groups are built by _dist_params below (rank 64 on the 256-wide model).
    "galore": ("galore_torch.GaLoreAdamW", "colossalai.nn.optimizer.DistGaloreAwamW", dict(lr=1e-3)),
    # No ordinary counterpart and none in ColossalAI: ours, passed directly, moving gradient pieces
    # to the block owners and, for comparison, gathering full gradients on every rank.
    "shampoo": (
        "dist_optim.DistributedShampoo",
        None,
        dict(lr=1e-3, precondition_frequency=10),  # + Adam grafting (_dist_options)
    ),
    # Ours, passed directly (the pinned torch has no torch.optim.Muon) with the usual split
    # (_dist_params): pieces of C to the matrices' owners and back, and for comparison every full
    # C gathered on every rank, which iterates on every matrix.
    "muon": ("dist_optim.DistributedMuon", None, dict(lr=2e-3, weight_decay=1e-2)),
    "muon-bf16": (
        "dist_optim.DistributedMuon",
        None,
        dict(lr=2e-3, weight_decay=1e-2, communication_dtype=torch.bfloat16),
    ),
    # Per-head Muon (muon_param_groups(per_head=True)): q, k and v by heads, whole in each TP slice.
    "muon-per-head": ("dist_optim.DistributedMuon", None, dict(lr=2e-3, weight_decay=1e-2)),
    # Muon with QK-clip: the logits measured in every forward, max-reduced over the data-parallel
    # ranks at the step, clipped heads scaled where their rows are (a bound the tiny model exceeds).
    "muon-qk-clip": ("dist_optim.DistributedMuon", None, dict(lr=2e-3, weight_decay=1e-2, qk_clip_tau=0.05)),
    # NorMuon: Muon's exchanges; each owner normalizes its matrices' rows.
    "normuon": ("dist_optim.DistributedNorMuon", None, dict(lr=2e-3, weight_decay=1e-2)),
    # kron_torch's Kron (swapped for ours): pieces of the momenta to the parameters' owners and the
    # directions' pieces back, and for comparison every full momentum gathered and every full
    # direction shared. ColossalAI has no Kron.
    "kron": ("kron_torch.Kron", None, dict(lr=3e-3, weight_decay=1e-2)),
}


def _dist_params(fam: str, model: torch.nn.Module) -> Any:
    if "muon" in fam:
        from dist_optim import muon_param_groups

        return muon_param_groups(model, per_head=fam == "muon-per-head")
    if fam != "galore":
        return model.parameters()
    from dist_optim import galore_param_groups

    return galore_param_groups(model, rank=64, update_proj_gap=200, scale=0.25)


def _dist_options(fam: str, options: dict[str, Any]) -> dict[str, Any]:
    if fam != "shampoo":
        return options
    import dist_optim

    return dict(options, grafting_config=dist_optim.AdamGraftingConfig(beta2=0.999, epsilon=1e-8))


@contextlib.contextmanager
def _buckets_in_sequence() -> Iterator[None]:
    """The owner optimizers' buckets one after another (each bucket's exchange waited for before the
    next is issued), instead of :func:`dist_optim.sharding.owners.pipelined`'s next exchange in flight while
    one computes: the same collectives and results, no overlap (``--dist --bucket-bytes``)."""
    from dist_optim.kron import optimizer as kron
    from dist_optim.muon import optimizer as muon
    from dist_optim.shampoo import optimizer as shampoo

    def sequential(buckets: Any, start: Callable[[Any], Any], finish: Callable[[Any], None]) -> None:
        for bucket in buckets:
            finish(start(bucket))

    saved = [(module, module.pipelined) for module in (kron, muon, shampoo)]
    for module, _ in saved:
        module.pipelined = sequential  # type: ignore[assignment]
    try:
        yield
    finally:
        for module, fn in saved:
            module.pipelined = fn  # type: ignore[assignment]


def _dist_worker(
    steps: int, families: list[str], zero_stage: int, precision: str, bucket_bytes: int | None = None
) -> dict[str, Any]:
    import torch.distributed as dist

    from dist_optim.plugins.cpu import install, quiet_colossal

    install()
    from colossalai.booster import Booster

    from dist_optim import comm, plugins
    from dist_optim.testing import tiny_llama

    out: dict[str, Any] = {}
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "all_to_all_single")
    real = {name: getattr(dist, name) for name in names}
    calls = {"n": 0, "bytes": 0}

    def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            calls["n"] += 1
            first = a[0] if a else next(iter(k.values()))
            for t in first if isinstance(first, (list, tuple)) else [first]:
                calls["bytes"] += t.numel() * t.element_size()
            return fn(*a, **k)

        return wrapped

    runs = []
    for fam in families:
        ordinary, theirs, options = DIST_FAMILIES[fam]
        if theirs is None:  # Shampoo, Muon: ours, two ways of moving gradients and directions
            ways = ((True, "pieces to block owners"), (False, "full gradients gathered"))
            if "muon" in fam:
                variant = {"muon-per-head": ", per head", "muon-qk-clip": ", QK-clip"}.get(fam, "")
                dtype = ("bf16" if fam.endswith("bf16") else "fp32") + variant
                ways = ((True, f"pieces to matrix owners, {dtype}"), (False, f"every C gathered, {dtype}"))
            if fam == "kron":
                ways = ((True, "pieces to owners"), (False, "every momentum and direction gathered"))
            if bucket_bytes is not None:  # the same buckets with and without the next one in flight
                options = dict(options, bucket_bytes=bucket_bytes)
                # In the order A B B A: the first run of a process measured up to 2x slower than the
                # same run second (warm-up), whichever way ran first.
                a, b = f"{ways[0][1]}, buckets of {bucket_bytes} B", "the same buckets, no overlap"
                ways = ((True, a), (None, b), (None, f"{b}, again"), (True, f"{a}, again"))
            for route, how in ways:
                label = f"dist_optim {ordinary.rsplit('.', 1)[1]} ({how})"
                runs.append((fam, label, plugins.HybridParallelPlugin, ordinary, options, route))
            continue
        runs.append(
            (
                fam,
                f"dist_optim (swapped from {ordinary.rsplit('.', 1)[1]})",
                plugins.HybridParallelPlugin,
                ordinary,
                options,
                True,
            )
        )
        runs.append(
            (
                fam,
                f"colossalai {theirs.rsplit('.', 1)[1]}",
                _cls("colossalai.booster.plugin.HybridParallelPlugin"),
                theirs,
                options,
                True,
            )
        )
    from dist_optim.sharding.runtime import OwnerRuntime

    for fam, label, plugin_cls, make, options, route in runs:
        OwnerRuntime.route_pieces = route is not False
        with quiet_colossal(), _buckets_in_sequence() if route is None else contextlib.nullcontext():
            torch.manual_seed(0)
            model = tiny_llama(hidden=256, inter=688, layers=2, vocab=1024)
            plugin = plugin_cls(
                tp_size=2, pp_size=1, zero_stage=zero_stage, precision=precision, overlap_communication=False
            )
            booster = Booster(plugin=plugin)
            try:
                opt = _cls(make)(_dist_params(fam, model), **_dist_options(fam, options))
                model, wrapper, *_ = booster.boost(model, opt)
                inner = wrapper.optim
                times: list[float] = []
                counts: list[tuple[int, int]] = []
                _instrument(inner, times, counts, calls, real, counting)
                x = torch.randint(0, 1024, (2, 32))
                for _ in range(steps + 2):
                    loss = model(input_ids=x, labels=x).loss
                    booster.backward(loss, wrapper)
                    wrapper.step()
                    wrapper.zero_grad()
            except Exception as exc:  # noqa: BLE001 - a peer that crashes on this layout is reported
                out[label] = dict(family=fam, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                continue
            finally:
                OwnerRuntime.route_pieces = True
            out[label] = dict(
                family=fam,
                ms=1e3 * statistics.median(times[2:]),
                collectives=statistics.median(c for c, _ in counts[2:]),
                kib=statistics.median(b for _, b in counts[2:]) / 1024,
                first_kib=counts[0][1] / 1024,
            )
    comm.reset_counts()
    return out


def run_dist(steps: int, families: list[str], zero_stage: int, precision: str, bucket_bytes: int | None = None) -> None:
    from dist_optim.testing import DistPool

    pool = DistPool(4)
    try:
        res = pool.run(_dist_worker, steps, families, zero_stage, precision, bucket_bytes)
    finally:
        pool.close()
    print(
        f"\nBoosted optimizer step at tp=2 x dp=2 (HybridParallelPlugin, ZeRO-{zero_stage}, {precision}), "
        "4 CPU processes"
    )
    print(
        "| optimizer | step (ms, slowest rank) | vs colossalai | collectives per step | KiB per step (rank 0) "
        "| KiB at the first step (GaLore: projector refresh) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for fam in families:
        labels = [k for k in res[0] if res[0][k]["family"] == fam]
        failed = {k: next((r[k]["error"] for r in res if "error" in r[k]), None) for k in labels}
        slowest = {k: max(r[k]["ms"] for r in res) for k in labels if failed[k] is None}
        base = next((slowest[k] for k in labels if k.startswith("colossalai") and k in slowest), None)
        for k in labels:
            if failed[k] is not None:
                print(f"| {k} | fails: {failed[k]} | | | | |")
                continue
            vs = f"{slowest[k] / base:.2f}x" if base else "n/a"
            r0 = res[0][k]
            print(
                f"| {k} | {slowest[k]:.1f} | {vs} | {r0['collectives']:.0f} | {r0['kib']:,.0f} "
                f"| {r0['first_kib']:,.0f} |"
            )


# ---- split preconditioner work ---------------------------------------------------------------
def _split_optimizer(name: str, params: list[torch.Tensor], pf: int) -> Any:
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
#: roots and directions of a batch of blocks (Shampoo) or one parameter (Kron), the iteration of one matrix
#: (Muon); --split times it where the optimizer's module calls it.
_OWNER_WORK = {
    "shampoo": ("dist_optim.shampoo.work", "block_directions"),
    "kron": ("dist_optim.kron.optimizer", "owner_direction"),
    "muon": ("dist_optim.muon.optimizer", "newton_schulz"),
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


def run_split(name: str, steps: int, pf: int, layers: int) -> None:
    from dist_optim.testing import DistPool

    shapes = llama_like(512, 1376, layers, 4096)
    pool = DistPool(4)
    try:
        res = pool.run(_split_worker, name, shapes, steps, pf)
    finally:
        pool.close()
    dp1, dp4 = (max(r[k] for r in res) for k in ("dp1", "dp4"))
    w1, w4 = (max(r[k] for r in res) for k in ("dp1_work", "dp4_work"))
    setting = f", precondition_frequency={pf}" if name == "shampoo" else ""
    work, held = ("Newton-Schulz", "momentum") if name == "muon" else ("preconditioner", "preconditioner")
    print(f"\n{name} {work} work split over 4 data-parallel ranks ({layers} layers, {steps} steps{setting})")
    print(
        f"| | {work} CPU s (busiest rank) | whole step CPU s (busiest rank) "
        f"| {held} bytes per rank (max) | collectives per step |"
    )
    print("|---|---:|---:|---:|---:|")
    print(f"| dp=1 (each rank alone) | {w1:.2f} | {dp1:.2f} | {max(r['dp1_bytes'] for r in res):,} | 0 |")
    print(
        f"| dp=4 (work split) | {w4:.2f} ({w4 / w1:.2f}x) | {dp4:.2f} ({dp4 / dp1:.2f}x) "
        f"| {max(r['dp4_bytes'] for r in res):,} | {res[0]['dp4_collectives']:.0f} |"
    )
    for label, title in (("tp2dp2", "tp=2 x dp=2, split over the TP x DP grid"),):
        if label not in res[0]:
            continue
        w, whole = (max(r[k] for r in res) for k in (label + "_work", label))
        print(
            f"| {title} | {w:.2f} ({w / w1:.2f}x) | {whole:.2f} ({whole / dp1:.2f}x) "
            f"| {max(r[label + '_bytes'] for r in res):,} | {res[0][label + '_collectives']:.0f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="groups to run (baseline always runs)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--small", action="store_true", help="a 4x smaller parameter set (quick check)")
    ap.add_argument("--device", default="cpu", help="where the single-process rows run (cpu, cuda)")
    ap.add_argument(
        "--dist",
        nargs="*",
        choices=sorted(DIST_FAMILIES),
        help="distributed boosted-step benchmark on 4 processes for these families (none named: all)",
    )
    ap.add_argument("--zero-stage", type=int, default=1, help="ZeRO stage for --dist")
    ap.add_argument(
        "--bucket-bytes",
        type=int,
        default=None,
        help="--dist shampoo/muon/kron: this step-memory budget, each also run with its buckets in sequence",
    )
    ap.add_argument("--precision", default="bf16", help="precision for --dist (fp32, bf16, fp16)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--split",
        choices=("shampoo", "kron", "muon"),
        help="per-rank preconditioner work at dp=4 vs dp=1 for this optimizer (4 processes)",
    )
    ap.add_argument("--pf", type=int, default=10, help="precondition_frequency for --split")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the --split parameter set")
    args = ap.parse_args()
    if args.dist is not None:
        run_dist(args.steps, args.dist or sorted(DIST_FAMILIES), args.zero_stage, args.precision, args.bucket_bytes)
        return
    if args.split:
        run_split(args.split, args.steps, args.pf, args.layers)
        return
    from bench.rows import rows

    shapes = llama_like(512, 1376, 2, 4096) if args.small else llama_like()
    selected = [r for r in rows() if r.group == "baseline" or not args.only or r.group in args.only]
    available = []
    for r in selected:
        if r.requires and importlib.util.find_spec(r.requires) is None:
            print(f"  skipped {r.name}: {r.requires} not installed", file=sys.stderr)
            continue
        available.append(r)
    print_table(run_bench(shapes, available, args.warmup, args.repeats, args.device), shapes, args.device)


if __name__ == "__main__":
    main()
