"""How close Muon's named coefficient schedules (``ns_coefficients="jordan"``, ``"newton_schulz"``,
``"polar_express"``; dist_optim.muon.coefficients) bring a momentum to its polar factor, run through
``dist_optim.kernels.newton_schulz.newton_schulz`` (the code Muon runs) in fp32 and bf16.

    python bench/ns_presets.py               # prints the table, writes bench/results/ns_presets.json
    python bench/ns_presets.py --steps 5 --shapes 256x704 512x512

Against the float64 polar factor ``U V^T`` of the same fp32 input, on its singular directions
with ``s / ||input||_F >= 1e-3`` (the interval the iteration sees after its normalization, which
Polar Express is built for; smaller singular values stay near 0 under every 5-step schedule):
``X`` there, ``U_d^T X V_d``, is the identity for the polar factor; the table gives its relative
Frobenius distance to the identity and its largest ``|s - 1|`` (diagonal). Inputs:
dist_optim.testing's stress momenta (rank 8; singular values log-spaced 1..1e-6; Gaussian), the
worst over the shapes. The JSON (``--write``, :func:`bench.record.write_table`) holds the command,
the commit, the machine and every figure;
docs/optimizers.md's table is this script's printed table.
"""

from __future__ import annotations

import argparse
import sys

import torch

ROOT = __file__.rsplit("/bench/", 1)[0]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.record import col, write_table  # noqa: E402
from dist_optim.kernels.newton_schulz import newton_schulz  # noqa: E402
from dist_optim.muon.coefficients import PRESETS  # noqa: E402
from dist_optim.testing import STRESS_KINDS, stress_momentum  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def distances(c: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius distance to the polar factor on the designed directions, largest
    ``|s - 1|`` there): the input's singular directions with ``s / ||c||_F >= 1e-3``, the interval
    the iteration sees after its normalization and Polar Express is built for."""
    c64, x64 = c.double(), x.double()
    u, s, vh = torch.linalg.svd(c64, full_matrices=False)
    designed = s >= 1e-3 * torch.linalg.norm(c64)
    u, v = u[:, designed], vh[designed].T
    inner = u.T @ x64 @ v  # X on the designed directions: the identity for the polar factor
    eye = torch.eye(inner.shape[0], dtype=torch.float64)
    frob = float(torch.linalg.norm(inner - eye) / torch.linalg.norm(eye))
    return frob, float((inner.diagonal() - 1).abs().max())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=["256x704", "512x512"])
    ap.add_argument("--write", metavar="NAME", default="ns_presets", help="bench/results/NAME.json ('': write nothing)")
    args = ap.parse_args(argv)
    rows = []
    for shape_text in args.shapes:
        shape = tuple(int(v) for v in shape_text.split("x"))
        for kind in STRESS_KINDS:
            c = stress_momentum(shape, kind)  # type: ignore[arg-type]
            for dtype_name, dtype in DTYPES.items():
                for name, make in PRESETS.items():
                    x = newton_schulz(c, list(make(args.steps)), 1e-7, dtype=dtype)
                    frob, gain = distances(c, x)
                    rows.append(dict(shape=shape_text, kind=kind, dtype=dtype_name, schedule=name, frobenius=frob,
                                     max_gain_error=gain))  # fmt: skip
    result = {"rows": rows}
    if args.write:
        columns = [col("shape", "shape"), col("kind", "input"), col("dtype", "dtype"), col("schedule", "schedule")]
        columns += [
            col("frobenius", "relative distance to the polar factor", 2, format="e"),
            col("max_gain_error", "max abs(s - 1)", 2, format="e"),
        ]
        write_table(args.write, columns, rows, script=__file__, argv=argv, extra={"steps": args.steps})
    print(table(result))


def table(result: dict) -> str:
    """The markdown table of a result: per schedule and dtype, the worst over shapes of each input kind."""
    names, kinds = list(PRESETS), list(STRESS_KINDS)
    head = "| schedule | dtype | " + " | ".join(f"{k}: distance, max abs(s - 1)" for k in kinds) + " |"
    lines = [head, "|---|---|" + "---:|" * len(kinds)]
    for name in names:
        for dtype in DTYPES:
            cells = []
            for kind in kinds:
                mine = [
                    r for r in result["rows"] if r["schedule"] == name and r["dtype"] == dtype and r["kind"] == kind
                ]
                cells.append(f"{max(r['frobenius'] for r in mine):.3g}, {max(r['max_gain_error'] for r in mine):.3g}")
            lines.append(f"| {name} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
