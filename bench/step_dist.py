"""``bench/bench_step.py --dist``: the boosted optimizer step at tp=2 x dp=2 on 4 CPU processes,
ours against ColossalAI's distributed classes, with its collectives and bytes (the module docstring
of bench_step.py says what runs). Apart from bench_step.py, whose single-process mode and
``--split`` fill a module of their own."""

from __future__ import annotations

import contextlib
import importlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench.record import Column, col


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
DIST_FAMILIES: dict[str, tuple[str, str | None, dict[str, Any]]] = {
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
    one computes: the same collectives and results, no overlap (``--dist --bucket-bytes``). Patched
    where the owners' runtime calls it, which every owner optimizer's step goes through."""
    from dist_optim.sharding import runtime

    def sequential(buckets: Any, start: Callable[[Any], Any], finish: Callable[[Any], None]) -> None:
        for bucket in buckets:
            finish(start(bucket))

    saved = runtime.pipelined
    runtime.pipelined = sequential  # type: ignore[assignment]
    try:
        yield
    finally:
        runtime.pipelined = saved  # type: ignore[assignment]


def _dist_worker(
    steps: int, families: list[str], zero_stage: int, precision: str, bucket_bytes: int | None = None
) -> dict[str, Any]:
    import torch.distributed as dist

    from dist_optim.plugins.cpu import install, quiet_colossal

    install()
    from colossalai.booster import Booster

    from dist_optim import comm, plugins  # type: ignore[attr-defined]
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
            ways: tuple[tuple[bool | None, str], ...] = (
                (True, "pieces to block owners"),
                (False, "full gradients gathered"),
            )
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


#: The ``--dist`` table's columns (``dist_step``, ``dist_shampoo_routes``): the step of the slowest
#: rank, its ratio to ColossalAI's class of the same family, and rank 0's collectives and bytes.
DIST_COLUMNS: list[Column] = [
    col("optimizer", "optimizer"),
    col("step_ms", "step (ms, slowest rank)", 1),
    col("vs_colossalai", "vs ColossalAI", 2, suffix="x"),
    col("collectives", "collectives per step", 0),
    col("kib", "KiB per step (rank 0)", 0, thousands=True),
    col("kib_first", "KiB at the first step", 0, thousands=True),
]
#: With ``--bucket-bytes`` (``dist_overlap``): per family, the A B B A runs' steps with the next
#: bucket's exchange in flight and in sequence.
OVERLAP_COLUMNS: list[Column] = [
    col("optimizer", "optimizer"),
    col("collectives", "collectives per step", 0),
    col("overlapped_ms", "overlapped (ms)", 1),
    col("sequence_ms", "in sequence (ms)", 1),
    col("ratio", "overlapped / in sequence", 2, suffix="x"),
]


def dist_rows(res: list[dict[str, Any]], families: list[str]) -> list[dict[str, Any]]:
    """One row per run of :func:`_dist_worker` in :data:`DIST_COLUMNS` (a failed one: its error)."""
    rows: list[dict[str, Any]] = []
    for fam in families:
        labels = [k for k in res[0] if res[0][k]["family"] == fam]
        failed = {k: next((r[k]["error"] for r in res if "error" in r[k]), None) for k in labels}
        slowest = {k: max(r[k]["ms"] for r in res) for k in labels if failed[k] is None}
        base = next((slowest[k] for k in labels if k.startswith("colossalai") and k in slowest), None)
        for k in labels:
            if failed[k] is not None:
                rows.append(dict(optimizer=k, step_ms=f"fails: {failed[k]}"))
                continue
            r0 = res[0][k]
            rows.append(
                dict(
                    optimizer=k,
                    step_ms=slowest[k],
                    vs_colossalai=slowest[k] / base if base else None,
                    collectives=r0["collectives"],
                    kib=r0["kib"],
                    kib_first=r0["first_kib"],
                )
            )
    return rows


def overlap_rows(res: list[dict[str, Any]], families: list[str]) -> list[dict[str, Any]]:
    """Per owner family of a ``--bucket-bytes`` run, its overlapped and in-sequence steps
    (:data:`OVERLAP_COLUMNS`; the in-sequence runs are those labelled "no overlap")."""
    rows = []
    for fam in families:
        if DIST_FAMILIES[fam][1] is not None:
            continue
        labels = [k for k in res[0] if res[0][k]["family"] == fam and "error" not in res[0][k]]
        ms = {k: max(r[k]["ms"] for r in res if "ms" in r[k]) for k in labels}
        sequence = [ms[k] for k in labels if "no overlap" in k]
        overlapped = [ms[k] for k in labels if "no overlap" not in k and "buckets of" in k]
        if not sequence or not overlapped:
            continue
        rows.append(
            dict(
                optimizer=DIST_FAMILIES[fam][0].rsplit(".", 1)[1] + ("" if fam in ("shampoo", "kron") else f" ({fam})"),
                collectives=res[0][labels[0]]["collectives"],
                overlapped_ms=overlapped,
                sequence_ms=sequence,
                ratio=statistics.median(overlapped) / statistics.median(sequence),
            )
        )
    return rows


def run_dist(
    steps: int, families: list[str], zero_stage: int, precision: str, bucket_bytes: int | None = None
) -> list[dict[str, Any]]:
    """Print the boosted steps' table and return :func:`_dist_worker`'s results of every rank."""
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
    for r in dist_rows(res, families):
        if isinstance(r["step_ms"], str):
            print(f"| {r['optimizer']} | {r['step_ms']} | | | | |")
            continue
        vs = "n/a" if r["vs_colossalai"] is None else f"{r['vs_colossalai']:.2f}x"
        print(
            f"| {r['optimizer']} | {r['step_ms']:.1f} | {vs} | {r['collectives']:.0f} | {r['kib']:,.0f} "
            f"| {r['kib_first']:,.0f} |"
        )
    return res
