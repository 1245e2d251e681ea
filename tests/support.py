"""The README's support table, generated from what the tests cover.

``python -m tests.support`` prints it; tests/test_support_table.py fails when the README's copy
differs, so the table can only claim what a test in this suite runs.
"""

from __future__ import annotations

# Booster layouts, in the order of the table's columns: (plugin, tp, pp, ZeRO stage, precision)
# and, for sequence parallelism, a sixth entry: the SP mode. "all_to_all" runs on its own sp=2
# axis, and ZeRO then shards over dp x sp (not over the dp group ColossalAI hands to
# setup_distributed); "split_gather" splits the sequence over the TP group.
COLUMNS: list[tuple] = [
    ("HybridParallelPlugin", 2, 1, 0, "fp32"),
    ("HybridParallelPlugin", 2, 1, 0, "bf16"),
    ("HybridParallelPlugin", 2, 1, 1, "bf16"),
    ("HybridParallelPlugin", 2, 1, 2, "bf16"),
    ("HybridParallelPlugin", 2, 1, 1, "fp16"),
    ("HybridParallelPlugin", 2, 2, 0, "fp32"),
    ("HybridParallelPlugin", 1, 2, 1, "bf16"),
    ("HybridParallelPlugin", 1, 1, 1, "bf16", "all_to_all"),
    ("HybridParallelPlugin", 2, 1, 1, "bf16", "split_gather"),
    # A tiny Mixtral, experts split over ep=2 and ZeRO-sharded over the MoE data-parallel group.
    ("MoeHybridParallelPlugin", 1, 1, 1, "bf16"),
    ("LowLevelZeroPlugin", 1, 1, 1, "bf16"),
    ("LowLevelZeroPlugin", 1, 1, 2, "fp32"),
    ("TorchDDPPlugin", 1, 1, 0, "fp32"),
]

OPTIMIZERS = ["LAMB", "Adafactor", "CAME", "GaLore", "Shampoo", "Kron", "Muon"]


def booster_coverage() -> dict[str, set[tuple]]:
    """Optimizer -> the booster layouts tests/test_booster.py trains it under."""
    from tests import test_booster

    cov: dict[str, set[tuple]] = {name: set() for name in OPTIMIZERS}
    for case in test_booster.CASES:
        name, col = case.values
        cov[name].add(col)
    return cov


def checkpoint_coverage() -> set[str]:
    from tests import test_checkpoint

    names = {"lamb": "LAMB", "adafactor": "Adafactor", "came": "CAME", "galore": "GaLore", "kron": "Kron"}
    names["shampoo"] = "Shampoo"
    names["muon"] = "Muon"
    return {names[k] for k in test_checkpoint.OPTIMIZERS}


def parity_coverage() -> set[str]:
    from tests.cases import PARITY_CASES

    names = {
        "DistributedLamb": "LAMB",
        "DistributedAdafactor": "Adafactor",
        "DistributedCAME": "CAME",
        "DistributedGaLore": "GaLore",
        "DistributedShampoo": "Shampoo",
        "DistributedKron": "Kron",
        "DistributedMuon": "Muon",
    }
    return {names[c.cls.__name__] for c in PARITY_CASES}


def _header(col: tuple) -> str:
    plugin, tp, pp, zero, precision, *sp = col
    short = {
        "HybridParallelPlugin": "Hybrid",
        "MoeHybridParallelPlugin": "MoeHybrid ep=2",
        "LowLevelZeroPlugin": "LowLevelZero",
        "TorchDDPPlugin": "TorchDDP",
    }
    parts = [short[plugin]]
    if plugin == "HybridParallelPlugin":
        parts.append(f"tp={tp}")
        if pp > 1:
            parts.append(f"pp={pp}")
        if sp:
            parts.append(f"sp={2 if sp[0] == 'all_to_all' else tp} {sp[0]}")
    if plugin != "TorchDDPPlugin":
        parts.append(f"ZeRO-{zero}")
    parts.append(precision)
    return " ".join(parts)


def markdown() -> str:
    cov = booster_coverage()
    ckpt = checkpoint_coverage()
    grid = parity_coverage()
    header = ["optimizer", "parity grid"] + [_header(c) for c in COLUMNS] + ["checkpoint resume / reshard"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for opt in OPTIMIZERS:
        cells = [opt, "✔" if opt in grid else "—"]
        cells += ["✔" if col in cov[opt] else "—" for col in COLUMNS]
        cells.append("✔" if opt in ckpt else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
