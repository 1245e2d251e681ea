"""What a step reports: throughput, model FLOPs utilisation, each rank's peak memory, the
loss over data-parallel ranks, QK-clip's largest logit, and the CSV / TensorBoard sinks."""

from __future__ import annotations

import argparse
import csv
import math
import os
from typing import Any

import torch
import torch.distributed as dist

from recipes.env import current_device, is_main

# Dense bf16/fp16 tensor-core peaks (TFLOPS, no sparsity) from NVIDIA's data sheets, matched in
# order against torch.cuda.get_device_name(): specific names before the families that contain them.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def device_peak_tflops(precision: str, override: float | None) -> float | None:
    """The device's peak for ``precision``, None where unknown (fp32, CPUs, devices not in the table)."""
    if override is not None:
        return override
    if precision == "fp32" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def flops_per_token(config: Any, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per non-embedding-lookup parameter (forward + backward matmuls)
    plus the attention scores, 12 * layers * hidden * seq_len (Chowdhery et al. 2022, PaLM,
    appendix B), the usual MFU convention: recomputation is not counted. A Mixtral's token passes
    through ``num_experts_per_tok`` of its ``num_local_experts`` experts (3 matrices each): the
    others' parameters do no work for it and are not counted. A tied embedding (Qwen2's option) is
    one parameter that is also the output head's matmul: counted."""
    embed = 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * config.hidden_size
    experts = int(getattr(config, "num_local_experts", 0) or 0)
    idle = experts - int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0
    inactive = config.num_hidden_layers * idle * 3 * config.hidden_size * config.intermediate_size
    return 6.0 * (num_params - embed - inactive) + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def peak_memory_bytes() -> int:
    """This process's peak: allocated device memory on GPUs, resident set size on CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def gather_peak_memory() -> list[float]:
    """Every rank's peak memory in GiB (on every rank)."""
    mine = torch.tensor([peak_memory_bytes() / 2**30], dtype=torch.float64, device=current_device())
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(t) for t in out]


CSV_FIELDS = ["step", "loss", "lr", "seconds", "tokens_per_s", "mfu", "peak_mem_gib", "peak_mem_gib_per_rank"]
CSV_FIELDS += ["eval_loss"]


class MetricsLog:
    """The CSV and TensorBoard sinks (rank 0)."""

    def __init__(self, args: argparse.Namespace, start: int) -> None:
        self.file = self.writer = self.board = None
        if not is_main():
            return
        if args.log_csv:
            os.makedirs(os.path.dirname(os.path.abspath(args.log_csv)), exist_ok=True)
            fresh = not (args.resume and os.path.exists(args.log_csv))
            self.file = open(args.log_csv, "w" if fresh else "a", newline="")  # noqa: SIM115 - closed in close()
            self.writer = csv.DictWriter(self.file, CSV_FIELDS)
            if fresh:
                self.writer.writeheader()
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(args.tensorboard, purge_step=start + 1 if args.resume else None)

    def write(self, entry: dict[str, Any]) -> None:
        if self.writer is not None:
            row = {
                "step": entry["step"],
                "loss": f"{entry['loss']:.6f}",
                "lr": f"{entry['lr']:.6g}",
                "seconds": f"{entry['seconds']:.4f}",
                "tokens_per_s": f"{entry['tokens_per_s']:.1f}",
                "mfu": "" if entry["mfu"] is None else f"{entry['mfu']:.4f}",
                "peak_mem_gib": f"{max(entry['peak_mem_gib']):.3f}",
                "peak_mem_gib_per_rank": " ".join(f"{m:.3f}" for m in entry["peak_mem_gib"]),
                "eval_loss": "" if entry.get("eval_loss") is None else f"{entry['eval_loss']:.6f}",
            }
            self.writer.writerow(row)
            self.file.flush()  # a log that can be followed while the run goes on
        if self.board is not None:
            step = entry["step"]
            for key in ("loss", "lr", "seconds", "tokens_per_s"):
                self.board.add_scalar(f"train/{key}", entry[key], step)
            if entry["mfu"] is not None:
                self.board.add_scalar("train/mfu", entry["mfu"], step)
            for rank, mem in enumerate(entry["peak_mem_gib"]):
                self.board.add_scalar(f"memory/peak_gib_rank{rank}", mem, step)
            if entry.get("eval_loss") is not None:
                self.board.add_scalar("eval/loss", entry["eval_loss"], step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()


def clip_metrics(optimizer: Any) -> dict[str, float]:
    """With QK-clip on (``--optimizer-args '{"qk_clip_tau": ...}'``), ``max_attention_logit``: the
    largest attention logit of the step over every head of the model (each rank holds its heads and
    layers), on every rank; else nothing."""
    inner = getattr(optimizer, "optim", optimizer)
    if getattr(inner, "qk_clip_tau", None) is None:
        return {}
    found = [m.values.max() for m in inner.last_max_logits.values()]
    value = torch.stack(found).max().float() if found else torch.tensor(-math.inf)
    value = value.reshape(1).to(current_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return {"max_attention_logit": float(value)}


def global_loss(loss: torch.Tensor | None, plugin: Any) -> float:
    """The mean loss over data-parallel ranks (on the last pipeline stage), on every rank."""
    value = torch.zeros(2, dtype=torch.float64)
    if loss is not None:
        value[0] = float(loss.detach().float())
        value[1] = 1.0
    value = value.to(current_device())  # NCCL reduces device tensors only
    dist.all_reduce(value)
    return float(value[0] / value[1].clamp_min(1))
