"""The planner's recorder remembers meta kernels' outputs by their arguments' metadata
(dist_optim.plan.meta_kernels): what it makes from memory is what the kernel makes, views are never
remembered, and every input an output's layout follows is part of what is remembered."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_optim.plan import Layout, make_plan, meta_kernels
from dist_optim.plan.torch_internals import meta_strides_as
from dist_optim.plan.traffic import LiveBytes
from tests.helpers.check import without_seconds


def _meta(out: Any) -> list[Any]:
    """Everything the recorder and its callers can see of an operator's outputs."""
    outs = out if isinstance(out, (tuple, list)) else [out]
    return [
        None
        if t is None
        else (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().nbytes())
        for t in outs
    ]


def _m(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


#: Out-of-place operators whose meta kernels torch runs in Python, on broadcast, strided and
#: padded arguments; each builds its arguments afresh (names say what they exercise).
CASES: dict[str, Callable[[], Any]] = {
    "div_broadcast": lambda: torch.div(_m(64, 32), _m(64, 1)),
    "mul_scalar_bf16": lambda: _m(8, 16, dtype=torch.bfloat16) * 0.5,
    "mean_keepdim": lambda: _m(4, 64, 32).mean(dim=-2, keepdim=True),
    "sum_permuted": lambda: _m(4, 8, 16).permute(2, 0, 1).sum(dim=1),
    "pad": lambda: torch.nn.functional.pad(_m(100), (3, 5)),
    "index_select": lambda: _m(50, 8).index_select(0, torch.empty(7, dtype=torch.long, device="meta")),
    "clone_transposed": lambda: _m(64, 32).t().clone(),
    "rsqrt_expanded": lambda: _m(1, 32).expand(16, 32).rsqrt(),
    "to_bf16": lambda: _m(3, 5).t().to(torch.bfloat16),
    "layer_norm_tuple": lambda: torch.ops.aten.native_layer_norm(_m(4, 8, 16), [16], _m(16), _m(16), 1e-5),
    "vector_norm": lambda: torch.linalg.vector_norm(_m(30, 20, dtype=torch.bfloat16), dtype=torch.float32),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_remembered_output_is_the_kernels_own(name: str) -> None:
    want = _meta(CASES[name]())  # the kernel itself: no recorder
    with LiveBytes():
        before = meta_kernels.COUNTS["remembered"]
        first = _meta(CASES[name]())
        second = _meta(CASES[name]())
        remembered = meta_kernels.COUNTS["remembered"] - before
    assert first == want and second == want
    assert remembered >= 1  # the second call's operator came from the memo


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x.view(32, 64),
        lambda x: x[1:],
        lambda x: x.reshape(-1),
        lambda x: x.t(),
        lambda x: x.unsqueeze(0),
    ],
)
def test_views_are_never_remembered(view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A view shares its argument's storage at every call (a fresh tensor would count as memory)."""
    with LiveBytes() as live:
        x = _m(64, 32)
        for _ in range(2):
            live.reset_peak()
            out = view(x)
            assert out.untyped_storage()._cdata == x.untyped_storage()._cdata
            assert live.peak == live.live


def test_what_a_layout_follows_besides_shapes_is_remembered_apart() -> None:
    """The same shapes with other strides, under another default dtype, or with meta kernels
    shaped as on another device give the outputs the kernel gives there, not the first ones."""
    with LiveBytes():
        assert torch.empty(32, 64, device="meta").t().clone().stride() == (1, 64)
        assert torch.empty(64, 32, device="meta").clone().stride() == (32, 1)
        ints = torch.empty(5, dtype=torch.int64, device="meta")
        assert torch.div(ints, ints).dtype == torch.float32
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            assert torch.div(ints, ints).dtype == torch.float64
        finally:
            torch.set_default_dtype(previous)
        strides = {}
        for device in ("cpu", "cuda", "cpu", "cuda"):
            with meta_strides_as(device):
                vh = torch.linalg.svd(_m(6, 4), full_matrices=False)[2]
                strides.setdefault(device, set()).add(vh.stride())
    assert len(strides["cpu"]) == len(strides["cuda"]) == 1 and strides["cpu"] != strides["cuda"]


CONFIG = {
    "model_type": "llama",
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 200,
    "max_position_embeddings": 64,
}


@pytest.mark.parametrize("optimizer", ["came", "adafactor", "lamb"])
def test_plans_with_the_memo_equal_plans_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    layout = Layout("hybrid", tp=2, dp=2, zero=1)
    before = meta_kernels.COUNTS["remembered"]
    remembered = without_seconds(make_plan(str(path), layout, optimizer, steps=2).to_json())
    assert meta_kernels.COUNTS["remembered"] > before  # the comparison below compares something
    monkeypatch.setattr(meta_kernels, "_functional", lambda func: False)  # every kernel runs
    assert without_seconds(make_plan(str(path), layout, optimizer, steps=2).to_json()) == remembered
