"""The planner's Gemini chunks (dist_optim/plan/gemini.py) against ColossalAI's own GeminiDDP, in one
process on a ``fake`` process group of 4 ranks (its collectives move nothing, which neither the
chunk layout nor the gather schedule depends on): the ranges every parameter gets, and how many
times a forward and backward gather each chunk, with and without checkpointed layers, for chunk
searches that cut the tiny Llama's layers at different places. The real runs on 4 processes
(tests/distributed/test_plan.py) check the bytes; these check the replay on more layouts."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_optim.plan import Layout
from dist_optim.plan.gemini import gemini_chunks, parameter_events, replay_chunks
from dist_optim.plan.simulate import build_pieces
from dist_optim.plan.world import ChunkSearch, SimWorld
from dist_optim.testing import tiny_llama

WORLD = 4
SEARCHES = [
    dict(min_chunk_size_m=0.0, search_range_m=0, hidden_dim=64),  # the tests' (tests/helpers/booster.py)
    dict(min_chunk_size_m=0.0, search_range_m=0.02, hidden_dim=512),
    dict(min_chunk_size_m=0.0, search_range_m=0.05, hidden_dim=1000),
    dict(min_chunk_size_m=0.03, search_range_m=0, hidden_dim=64),
]


def _gemini_run(search: dict[str, Any], checkpointed: bool) -> tuple[list[tuple[str, Any]], list[int]]:
    """Rank 0's GeminiDDP of the tiny Llama: every parameter's layout (plugins/gemini.py reads it
    from the chunk) and each working chunk's all-gathers in the second of two training steps."""
    from colossalai.zero.gemini.chunk import chunk as chunk_module
    from colossalai.zero.gemini.gemini_ddp import GeminiDDP
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dist_optim.plugins.cpu import install, quiet_colossal
    from dist_optim.plugins.gemini import chunk_layout

    install()
    gathers: collections.Counter[int] = collections.Counter()
    real_gather = chunk_module.Chunk._Chunk__gather  # type: ignore[attr-defined]

    def gather(self: Any, async_op: bool = False) -> Any:
        if not self.is_gathered:
            gathers[self.count_id] += 1
        return real_gather(self, async_op)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    chunk_module.Chunk._Chunk__gather = gather  # type: ignore[attr-defined]
    try:
        with quiet_colossal():
            model = tiny_llama()
            if checkpointed:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            ddp = GeminiDDP(model, placement_policy="static", mixed_precision=torch.bfloat16, **search)
            x = torch.zeros((1, 8), dtype=torch.long)
            for _ in range(2):
                gathers.clear()
                ddp.backward(ddp(input_ids=x, labels=x).loss)
        layouts = [(n, chunk_layout(ddp.chunk_manager.get_chunk(p), p)) for n, p in ddp.module.named_parameters()]
        working = ddp.chunk_manager.chunk_groups[f"fp16_param_{WORLD}"]
        return layouts, [gathers[c.count_id] for c in working]
    finally:
        chunk_module.Chunk._Chunk__gather = real_gather  # type: ignore[attr-defined]
        dist.destroy_process_group()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_chunks_and_gathers_equal_gemini(search: dict[str, Any], checkpointed: bool) -> None:
    real_layouts, real_gathers = _gemini_run(search, checkpointed)
    config = tiny_llama().config
    layout = Layout("gemini", dp=WORLD, chunk_search=ChunkSearch(**search))
    with SimWorld(layout, 0) as world:
        model, pieces = build_pieces(config, layout, world)
        where = gemini_chunks(model, config, layout)
    planned = [(p.name, p.layout) for p in pieces]
    assert [n for n, _ in planned] == [n for n, _ in real_layouts]
    for (name, mine), (_, real) in zip(planned, real_layouts):
        bounds = (mine.zero.bounds if mine.zero else None, real.zero.bounds if real.zero else None)
        assert mine == real and bounds[0] == bounds[1], (name, mine, real)
    gathers, _ = replay_chunks(where, parameter_events(config, checkpointed))
    chunks = sorted({c.index for c, _, _ in where.values()})
    assert [gathers[i] for i in chunks] == real_gathers
    assert [c.gathers[checkpointed] for c in sorted({c for c, _, _ in where.values()}, key=lambda c: c.index)] == (
        real_gathers
    )
