"""DistributedShampoo against Meta's ``distributed_shampoo`` (facebookresearch/optimizers), in one
process, on the Llama-like set of ``bench_step.py`` (blocks of 1024, no merging, Adam grafting,
epsilon 1e-12, betas (0.9, 0.999)): the issue's target settings.

Meta's package is not on PyPI. At the mid-2024 commit b91f46b (the API used here:
``distributed_shampoo.distributed_shampoo.DistributedShampoo(..., use_merge_dims=...)`` and
``distributed_shampoo.shampoo_types.AdamGraftingConfig``; the package's ``__init__.py`` exports
nothing) its ``setup.py`` installs neither ``distributed_shampoo/utils`` (no ``__init__.py``) nor
the top-level ``matrix_functions.py`` and ``optimizer_modules.py`` that the package imports, so
``pip install git+...`` yields a package that fails to import. Put the checkout on the path
instead::

    git clone https://github.com/facebookresearch/optimizers.git /tmp/optimizers
    git -C /tmp/optimizers checkout b91f46b
    PYTHONPATH=/tmp/optimizers .venv/bin/python bench/shampoo_vs_meta.py [--repeats 7] [--pf10-steps 30]

(or ``pip install -e /tmp/optimizers --config-settings editable_mode=compat``, which puts the
checkout on the path the same way).

The figures in docs/benchmarks.md were measured against that version's single-process code, rebuilt file by
file from the repository (this machine reaches PyPI only), without its distributed wrappers.

Every optimizer works on its own copy of the parameters with fixed gradients; steps are timed
round-robin (one step of each optimizer in turn), the first round dropped, medians kept:

* "before start": ``start_preconditioning_step = precondition_frequency = 10000``: factor statistics
  and Adam grafting only (the median step of a precondition_frequency=10 run with Meta's default
  start is such a step until step 10).
* "preconditioned": roots computed once in a warm-up step, then steps between refreshes. Meta's
  requires start >= frequency, so it is built with start = frequency = 1, stepped once, and its
  groups' ``precondition_frequency`` is then raised to 10**9 (read by every ``step()``).
* "pf=10 run": fresh optimizers with precondition_frequency=10 and the default start (10),
  ``--pf10-steps`` steps each, round-robin; median and mean (with the refreshes at steps 10, 20, ...).
  Its refresh steps are also shown alone ("root refresh in the pf=10 run": an ``eigh`` per factor,
  timed in turn; the warm-up steps above include setting up the state and run one after the other).
* "products only": the multiply-adds that the same math cannot avoid, on the same blocks and with
  nothing else (no grafting, no update, no checks): every factor's statistics by our fastest
  triangle update (:func:`dist_optim.kernels.structured.gram_update_`), and, preconditioned, ``R_0^T M R_1``
  by two ``mm`` into reused outputs. Its ratio to Meta's step is the lowest ratio any implementation
  of this math reaches with torch's BLAS on this machine; "ours / products only" is what we spend
  beyond it.
* ``--host-blocks N`` (alone, or with ``--device``): the host time per block, the cost that does not
  shrink with the block: N parameters of 16 x 16 (one block each, whose products are negligible),
  preconditioned steps (start = frequency = 1, then no refresh), round-robin, the median step
  divided by N. On a GPU this is the part of a step that kernels cannot hide (the bench set has 73
  blocks); with ``--device cuda`` it is timed there (each step synchronised).
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import dist_optim  # noqa: E402  (ours)
from bench.bench_step import fixed_params, llama_like  # noqa: E402
from bench.record import Column, col, present, write_table  # noqa: E402
from bench.warm_refresh import WarmTally  # noqa: E402
from dist_optim.kernels import structured  # noqa: E402
from dist_optim.shampoo import apply_each_dim, kept_triangle, plan_blocks  # noqa: E402

try:  # from its modules: the package's __init__.py exports nothing at b91f46b
    from distributed_shampoo.distributed_shampoo import DistributedShampoo as MetaShampoo
    from distributed_shampoo.shampoo_types import AdamGraftingConfig as MetaAdamGraftingConfig
except ImportError as exc:  # not on PyPI
    raise SystemExit(
        f"bench/shampoo_vs_meta.py needs Meta's distributed_shampoo ({exc}): git clone "
        "https://github.com/facebookresearch/optimizers.git /tmp/optimizers && git -C /tmp/optimizers "
        "checkout b91f46b, then run with PYTHONPATH=/tmp/optimizers"
    ) from exc

#: Meta's side of the comparison, recorded with every table this bench writes.
META = {"meta_commit": "b91f46b"}

logging.getLogger("distributed_shampoo").setLevel(logging.ERROR)  # Meta's start=-1 warning


def _finite(opt: Any) -> bool | str:
    if not isinstance(opt, torch.optim.Optimizer):
        return ""
    return all(bool(torch.isfinite(p).all()) for g in opt.param_groups for p in g["params"])


class SameProducts:
    """The products a Shampoo step with blocks of ``block`` cannot avoid, alone (see the module
    docstring), made by our own functions on our own blocking: ``step()`` updates each block's
    factors from a fixed gradient block and, with ``preconditioned``, multiplies a fixed moment
    block by fixed roots on both sides."""

    def __init__(self, shapes: list[tuple[int, ...]], block: int, preconditioned: bool, beta2: float) -> None:
        gen = torch.Generator().manual_seed(1)
        self.beta2 = beta2
        self.items: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]] = []
        for shape in shapes:
            for blk in plan_blocks(shape, block)[1]:
                g = torch.randn(blk.shape, generator=gen) * 1e-3
                factors = [torch.zeros(n, n) for n in blk.shape]
                roots = [torch.eye(n) + 1e-3 * torch.randn(n, n, generator=gen) for n in blk.shape]
                out = torch.empty(blk.shape) if preconditioned else None
                self.items.append((g, factors, roots, out))
        self.tmp = torch.empty(block * block)

    def step(self) -> None:
        b2 = self.beta2
        for g, factors, roots, out in self.items:
            order = g.dim()
            for k, factor in enumerate(factors):
                gk = g.movedim(k, 0).reshape(g.shape[k], -1)
                structured.gram_update_(kept_triangle(factor, order, k), gk, b2, 1 - b2)
            if out is not None:
                tmp = self.tmp[: g.numel()].view(g.shape)
                apply_each_dim(g, roots, transpose=False, out=out, tmp=tmp)


def _clock() -> float:
    """``time.perf_counter()`` after the GPU's queued work (if any) has finished."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed_round(opts: dict[str, Any], times: dict[str, list[float]] | None) -> None:
    """One step of each optimizer in turn (round-robin, as bench_step.py / shampoo_vs_commit.py),
    each step's seconds appended to ``times`` under its name (None: untimed)."""
    for name, opt in opts.items():
        t0 = _clock()
        opt.step()
        if times is not None:
            times[name].append(_clock() - t0)


def host_per_block(blocks: int, repeats: int, device: str = "cpu") -> dict[str, float]:
    """``--host-blocks``: seconds per block of a preconditioned step on ``blocks`` 16 x 16
    parameters on ``device``, ours and Meta's (median over ``repeats`` round-robin steps)."""
    make = fixed_params([(16, 16)] * blocks, device)
    kw: dict[str, Any] = dict(
        lr=1e-3,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        precondition_frequency=1,
        start_preconditioning_step=1,
        use_decoupled_weight_decay=True,
    )
    opts: dict[str, torch.optim.Optimizer] = {
        "ours": dist_optim.DistributedShampoo(
            make(), grafting_config=dist_optim.AdamGraftingConfig(beta2=0.999, epsilon=1e-8), **kw
        ),
        "Meta": MetaShampoo(
            make(), grafting_config=MetaAdamGraftingConfig(beta2=0.999, epsilon=1e-8), use_merge_dims=False, **kw
        ),
    }
    for opt in opts.values():
        for _ in range(3):
            opt.step()
        for group in opt.param_groups:
            group["precondition_frequency"] = 10**9  # no further refresh (read by every step)
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(repeats):
        _timed_round(opts, times)
    return {k: statistics.median(t) / blocks for k, t in times.items()}


def _print_host(blocks: int, device: str) -> dict[str, Any]:
    per = host_per_block(blocks, 30, device)
    print(f"{blocks} blocks of 16 x 16 on {device}, {torch.get_num_threads()} threads, preconditioned steps:")
    for name, sec in per.items():
        print(f"  {name:5s} {1e6 * sec:6.0f} us per block")
    print(f"  ours / Meta's: {per['ours'] / per['Meta']:.2f}x")
    ratio = per["ours"] / per["Meta"]
    return dict(device=device, blocks=blocks, ours_us=1e6 * per["ours"], meta_us=1e6 * per["Meta"], ratio=ratio)


def _pf10_run(
    pf10: dict[str, Any], steps: int, drift: float, times: dict[str, list[float]], finite: dict[str, bool | str]
) -> None:
    """Steps of the pf=10 optimizers in turn, timed into ``times``; the refresh steps (10, 20, ...:
    root refreshes timed in turn, without state setup) also under their own rows. With ``drift``,
    before each round every optimizer's gradients are set to ``g0 + drift * z_t`` with ``g0`` the
    fixed gradients and ``z_t`` fresh noise of the same scale, the same for all (outside the timing):
    the factors' eigenvectors then move between refreshes, as in training."""
    for k in pf10:
        times[k] = []
    gen = torch.Generator().manual_seed(5)
    first = next(iter(pf10.values()))
    base = [p.grad.clone() for g in first.param_groups for p in g["params"]]
    for _ in range(steps):
        if drift:
            grads = [b + drift * b.std() * torch.randn(b.shape, generator=gen).to(b.device) for b in base]
            for opt in pf10.values():
                for p, g in zip((p for group in opt.param_groups for p in group["params"]), grads):
                    p.grad.copy_(g)
        _timed_round(pf10, times)
    finite.update({k: _finite(o) for k, o in pf10.items()})
    for name in pf10:
        who = name.removesuffix(", pf=10 run")
        refreshes = times[name][9::10]
        if refreshes:
            times[f"{who}, root refresh in the pf=10 run"] = refreshes


def root_errors(opt: dist_optim.DistributedShampoo, steps: int) -> list[float]:
    """Per factor, ``||R - R64||_F / ||R64||_F`` with ``R64`` the root of the same factor by
    float64 ``eigh`` (the package docstring's formula), for an optimizer whose last step refreshed
    its roots."""
    group = opt.param_groups[0]
    b2, eps = group["betas"][1], group["epsilon"]
    scale = 1.0 / (1 - b2**steps)
    out = []
    for state in opt.state_dict()["state"].values():  # state_dict() mirrors the kept triangles
        for key, factor in state.items():
            if ".factor" not in key:
                continue
            block = key.split(".")[0] + ".factor"
            order = sum(1 for k in state if k.startswith(block))
            a = factor.double() * scale
            a.diagonal().add_(eps)
            lam, vec = torch.linalg.eigh(a)
            lam = lam + (eps - lam.min()).clamp(min=0)
            exact = (vec * lam.pow(-1.0 / (2 * order))) @ vec.T
            root = state[key.replace("factor", "root")].double()
            out.append(float(torch.linalg.matrix_norm(root - exact) / torch.linalg.matrix_norm(exact)))
    return out


#: The columns of the table ``--write NAME`` writes (``shampoo_vs_meta_gpu``): one row per timed
#: step kind, ratios to AdamW and to Meta's step of the same kind in the same run.
COLUMNS: list[Column] = [
    col("step", "step"),
    col("median_ms", "median (ms)", 1),
    col("mean_ms", "mean (ms)", 1),
    col("median_vs_adamw", "median / AdamW", 2),
    col("vs_meta_median", "/ Meta (median)", 2),
    col("vs_meta_mean", "/ Meta (mean)", 2),
    col("vs_products", "ours / products only", 2),
]
#: ``--host-blocks N --write NAME`` (``shampoo_host_blocks``): microseconds per block.
HOST_COLUMNS: list[Column] = [
    col("device", "device"),
    col("blocks", "blocks", 0),
    col("ours_us", "ours (us per block)", 0),
    col("meta_us", "Meta's (us per block)", 0),
    col("ratio", "ours / Meta's", 2),
]


def step_rows(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Per timed step kind, the rows of :data:`COLUMNS` (milliseconds and ratios)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.mean(v) for k, v in times.items()}
    adamw = med["torch AdamW (foreach)"]
    rows = []
    for name in times:
        row: dict[str, Any] = dict(
            step=name, median_ms=1e3 * med[name], mean_ms=1e3 * mean[name], median_vs_adamw=med[name] / adamw
        )
        kind, _, mode = name.partition(", ")
        if kind in ("ours", "ours warm", "products only"):
            other = f"Meta, {mode}"
            row.update(vs_meta_median=med[name] / med[other], vs_meta_mean=mean[name] / mean[other])
            floor = f"products only, {mode}"
            if kind == "ours" and floor in med:
                row["vs_products"] = med[name] / med[floor]
        rows.append(row)
    return rows


def _print_table(
    times: dict[str, list[float]],
    finite: dict[str, bool | str],
    shapes: list[tuple[int, ...]],
    repeats: int,
    pf10_steps: int,
    warm_meta: float,
    warm_ours: float,
) -> list[dict[str, Any]]:
    n = sum(torch.Size(s).numel() for s in shapes)
    print(
        f"\n{n / 1e6:.1f}M params, {torch.get_num_threads()} threads, {repeats} repeats, "
        f"pf=10 run {pf10_steps} steps; "
        f"first-refresh warm-up step: Meta {warm_meta:.2f} s, ours {warm_ours:.2f} s"
    )
    print(
        "| step | median (ms) | mean (ms) | median / AdamW | / Meta (median) | / Meta (mean) "
        "| ours / products only | finite |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    rows = step_rows(times)
    for r in rows:
        ratios = [f"{r[k]:.2f}x" if k in r else "" for k in ("vs_meta_median", "vs_meta_mean", "vs_products")]
        print(
            f"| {r['step']} | {r['median_ms']:.1f} | {r['mean_ms']:.1f} | {r['median_vs_adamw']:.2f}x "
            f"| {' | '.join(ratios)} | {finite.get(r['step'], '')} |"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--pf10-steps", type=int, default=30)
    ap.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="pf=10 run: fresh gradient noise each step, this times the fixed gradients' scale (0: fixed)",
    )
    ap.add_argument("--device", default="cpu", help="where the parameters live (cuda: GPU timings, synchronised)")
    ap.add_argument("--refresh-tolerance", type=float, default=0.01, help="the warm row's refresh_tolerance")
    ap.add_argument(
        "--pf10-only",
        action="store_true",
        help="skip the before-start, preconditioned and products-only rows (AdamW still timed): the pf=10 run "
        "and its refreshes alone, in about half the time",
    )
    ap.add_argument(
        "--host-blocks",
        type=int,
        default=0,
        help="only the host time per block: this many 16 x 16 parameters, preconditioned steps (30 rounds)",
    )
    ap.add_argument(
        "--write",
        metavar="NAME",
        help="also write the rows as bench/results/NAME.json (the data of the docs' table NAME); off by default",
    )
    args = ap.parse_args(argv)
    write = functools.partial(write_table, script=__file__, argv=argv, device=args.device, extra=META)
    if args.host_blocks:
        row = _print_host(args.host_blocks, args.device)
        if args.write:
            write(args.write, HOST_COLUMNS, [row], ["Preconditioned steps, 30 rounds, the median step per block."])
        return

    shapes = llama_like()
    on_cpu = fixed_params(shapes)

    def params() -> list[torch.nn.Parameter]:
        out = []
        for p in on_cpu():
            q = torch.nn.Parameter(p.detach().to(args.device))
            q.grad = p.grad.to(args.device)
            out.append(q)
        return out

    def shampoo(cls: Any, grafting: Any, start: int | None, freq: int, **extra: Any) -> torch.optim.Optimizer:
        return cls(
            params(),
            lr=1e-3,
            betas=(0.9, 0.999),
            epsilon=1e-12,
            max_preconditioner_dim=1024,
            precondition_frequency=freq,
            start_preconditioning_step=start,
            use_decoupled_weight_decay=True,
            grafting_config=grafting(beta2=0.999, epsilon=1e-8),
            **extra,
        )

    def ours(start: int | None, freq: int) -> torch.optim.Optimizer:
        return shampoo(dist_optim.DistributedShampoo, dist_optim.AdamGraftingConfig, start, freq)

    def metas(start: int, freq: int) -> torch.optim.Optimizer:
        return shampoo(MetaShampoo, MetaAdamGraftingConfig, start, freq, use_merge_dims=False)

    # ---- before start / preconditioned, round-robin with AdamW ----
    runs: dict[str, Any] = {"torch AdamW (foreach)": torch.optim.AdamW(params(), foreach=True)}
    warm_meta = warm_ours = float("nan")
    if not args.pf10_only:
        runs["Meta, before start"] = metas(10_000, 10_000)
        pre = metas(1, 1)
        t0 = _clock()
        pre.step()  # step == start: the first root refresh
        warm_meta = _clock() - t0
        for group in pre.param_groups:
            group["precondition_frequency"] = 10**9  # no further refresh; read by step() each call
        runs["Meta, preconditioned"] = pre
        runs["ours, before start"] = ours(10_000, 10_000)
        pre = ours(1, 10_000)
        t0 = _clock()
        pre.step()  # the first root refresh
        warm_ours = _clock() - t0
        runs["ours, preconditioned"] = pre
        del pre
    if args.device == "cpu" and not args.pf10_only:  # the products-only floor is a CPU measurement
        runs["products only, before start"] = SameProducts(shapes, 1024, False, 0.999)
        runs["products only, preconditioned"] = SameProducts(shapes, 1024, True, 0.999)

    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.repeats + 1):
        _timed_round(runs, times if i else None)  # the first round untimed
    finite = {k: _finite(o) for k, o in runs.items()}
    del runs
    gc.collect()

    # ---- pf=10 run: fresh optimizers, default start, Meta and ours (eigh, warm) round-robin ----
    pf10 = {"Meta, pf=10 run": metas(-1, 10), "ours, pf=10 run": ours(None, 10)}
    warm_kwargs = dict(root_inverse="warm", refresh_tolerance=args.refresh_tolerance)
    pf10["ours warm, pf=10 run"] = shampoo(
        dist_optim.DistributedShampoo, dist_optim.AdamGraftingConfig, None, 10, **warm_kwargs
    )
    with WarmTally() as tally:
        _pf10_run(pf10, args.pf10_steps, args.drift, times, finite)
    gc.collect()

    rows = _print_table(times, finite, shapes, args.repeats, args.pf10_steps, warm_meta, warm_ours)
    notes = [
        f"Warm refreshes (tolerance {args.refresh_tolerance}, gradient drift {args.drift}): "
        f"{tally.kept} factors kept their eigenvectors, {tally.refined} took QR steps, "
        f"{tally.recomputed} were recomputed by eigh."
    ]
    print("\n" + notes[0])
    if args.pf10_steps % 10 == 0:  # the last step refreshed every root
        for name in ("ours, pf=10 run", "ours warm, pf=10 run"):
            errs = sorted(root_errors(pf10[name], args.pf10_steps))
            notes.append(
                f"{name}: roots against float64 eigh of the same factors, relative Frobenius error: "
                f"median {statistics.median(errs):.2e}, max {errs[-1]:.2e} ({len(errs)} factors)."
            )
            print(notes[-1])
    if args.write:
        write(args.write, *present(COLUMNS, rows), notes)


if __name__ == "__main__":
    main()
