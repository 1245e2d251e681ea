"""The planner at scale: Llama-2-70B on 1024 ranks (tp=8 x dp=128 x ZeRO-1, bf16).

    python bench/plan_scale.py                        # muon (owner routes over 1024 ranks)
    python bench/plan_scale.py --optimizer shampoo    # any of dist_optim.plan's optimizers

Prints the wall time of ``make_plan`` (ShardFormer on the meta model, binding, owner assignment and
route planning over the 1024-rank grid, the simulated steps of rank 0 and of the busiest rank, the
single-device ideal) and the plan's headline figures. The goal: under 60 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", default="muon")
    ap.add_argument("--dp", type=int, default=128)
    a = ap.parse_args()
    from dist_optim.plan import GB, Layout, make_plan

    layout = Layout("hybrid", tp=8, zero=1, dp=a.dp, precision="bf16")
    t0 = time.perf_counter()
    plan = make_plan("llama-70b", layout, a.optimizer)
    seconds = time.perf_counter() - t0
    b = plan.busiest
    print(
        f"plan_scale: llama-70b {layout.describe()} {a.optimizer}: {seconds:.1f} s "
        f"(goal < 60 s); busiest rank {b.rank}: state {b.optimizer_state / GB:.2f} GB "
        f"(ideal {plan.ideal_state / GB:.2f}), transient {b.peak_transient / GB:.2f} GB, "
        f"steady {plan.steady['collectives']} collectives / {plan.steady['bytes_sent'] / GB:.3f} GB sent"
    )


if __name__ == "__main__":
    main()
