"""The activation peak of one pipeline stage under ColossalAI's interleaved schedule, replayed.

Under ``pp_style="interleaved"`` each of the ``P`` stages holds ``K`` chunks of the layers, and one
step runs ``M`` micro-batches through every chunk: ``M x K`` forwards and as many backwards per
stage, in the order of ColossalAI 0.5.0's ``InterleavedSchedule.run_forward_backward``
(colossalai/pipeline/schedule/interleaved_pp.py), replayed here step by step:

* warm-up: ``min(2 (P - stage - 1) + (K - 1) P, M K)`` forwards, each followed by the receive of
  the next forward's input; then the receive of the first backward's gradient;
* steady state: a forward, the receive of the next input, the backward of the oldest micro-batch
  of its chunk, the receive of the next gradient;
* cool-down: the remaining backwards, each followed by the receive of the next gradient.

The ``i``-th forward of a stage runs chunk ``(i mod PK) // P``, the ``i``-th backward the mirror
chunk ``K - 1 - (i mod PK) // P``. What each chunk's micro-batch allocates comes from the
simulation of that chunk (:class:`ChunkBytes`); the replay adds what the loop holds around it: the
other in-flight micro-batches' kept bytes, the received input of the next forward and the received
gradient of the next backward (each one hidden-states tensor, where the chunk has a neighbour),
the input gradient of the last backward (the loop's ``input_obj_grad``, alive until the next
backward returns) and the last backward's input and output (its ``_input_obj`` and
``_output_obj``, alive until the next backward pops its own).

Pure arithmetic on the simulated figures: no ColossalAI import; the order is checked against the
schedule's own methods in tests/unit/test_plan_schedules.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ChunkBytes", "Replay", "interleaved_order", "replay_interleaved"]


@dataclass(frozen=True)
class ChunkBytes:
    """One micro-batch through one model chunk of a stage, as simulated: the bytes its forward
    leaves alive for the backward (``kept``), the peak of its forward alone (``forward_peak``) and
    of its forward and backward (``peak``), the received tensors included."""

    kept: int
    forward_peak: int
    peak: int


@dataclass(frozen=True)
class Replay:
    """A stage's replayed schedule: its activation ``peak`` and the most chunk micro-batches it held
    at once (``in_flight``)."""

    peak: int
    in_flight: int


def interleaved_order(stages: int, stage: int, chunks: int, microbatches: int) -> list[tuple[str, int]]:
    """The compute steps of ``stage`` in one training step, in order: ``("F", chunk)`` or
    ``("B", chunk)``, with the receives between them as ``("recv_input", chunk)`` and
    ``("recv_grad", chunk)`` (the chunk the received tensor is for)."""
    total = microbatches * chunks
    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    remaining = total - warmup

    def chunk(i: int, forward: bool) -> int:
        c = (i % (stages * chunks)) // stages
        return c if forward else chunks - 1 - c

    out = [("recv_input", chunk(0, True))]
    for i in range(warmup):
        out.append(("F", chunk(i, True)))
        if not (i == warmup - 1 and remaining == 0):
            out.append(("recv_input", chunk(i + 1, True)))
    if remaining > 0:
        out.append(("recv_grad", chunk(0, False)))
    for i in range(remaining):
        f = i + warmup
        out.append(("F", chunk(f, True)))
        if i < remaining - 1:
            out.append(("recv_input", chunk(f + 1, True)))
        out.append(("B", chunk(i, False)))
        if not (i == remaining - 1 and warmup == 0):
            out.append(("recv_grad", chunk(i + 1, False)))
    if remaining == 0:
        out.append(("recv_grad", chunk(0, False)))
    for i in range(remaining, total):
        out.append(("B", chunk(i, False)))
        if i < total - 1:
            out.append(("recv_grad", chunk(i + 1, False)))
    return out


def replay_interleaved(
    stages: int, stage: int, chunk_bytes: Sequence[ChunkBytes], microbatches: int, hidden: int
) -> Replay:
    """The activation peak of ``stage`` of ``stages`` with ``chunk_bytes[c]`` for its chunk ``c``,
    ``microbatches`` per step, and ``hidden`` bytes per hidden-states tensor (what a stage sends or
    receives for one micro-batch)."""
    chunks = len(chunk_bytes)

    def has_prev(c: int) -> bool:  # receives its input, sends its input gradient back
        return not (stage == 0 and c == 0)

    def has_next(c: int) -> bool:  # sends its output, receives its output's gradient
        return not (stage == stages - 1 and c == chunks - 1)

    in_flight: list[int] = []
    pending_input = pending_grad = held_grad = leftover = 0
    peak = most = 0
    for what, c in interleaved_order(stages, stage, chunks, microbatches):
        held = sum(chunk_bytes[x].kept for x in in_flight)
        if what == "recv_input":
            pending_input = hidden if has_prev(c) else 0
        elif what == "recv_grad":
            pending_grad = hidden if has_next(c) else 0
        elif what == "F":  # its received input is inside its simulated figures
            peak = max(peak, held + pending_grad + held_grad + leftover + chunk_bytes[c].forward_peak)
            pending_input = 0
            in_flight.append(c)
            most = max(most, len(in_flight))
        else:  # the backward pops its micro-batch (the last one's input and output go) and runs
            in_flight.remove(c)
            held -= chunk_bytes[c].kept
            peak = max(peak, held + pending_input + held_grad + chunk_bytes[c].peak)
            pending_grad = 0
            held_grad = hidden if has_prev(c) else 0
            # the input's gradient is held_grad (the same tensor); the input and output themselves
            leftover = (hidden if has_prev(c) else 0) + (hidden if has_next(c) else 0)
    return Replay(peak, most)
