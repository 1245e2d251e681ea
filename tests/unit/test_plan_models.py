"""Issue 28 item 5: bad models and layouts refused in one line, naming the value and what is
accepted, by the planner and the recipe alike (``dist_optim.plan.models``), before ColossalAI
asserts on rank 0 or transformers defaults a missing field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dist_optim.plan import Layout, PlanError, make_plan
from dist_optim.plan.models import check_model_layout, load_config, read_config

TINY = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


def _write(tmp_path: Path, text: str) -> str:
    (tmp_path / "config.json").write_text(text)
    return str(tmp_path)


def test_a_good_config_reads_from_its_directory_or_file(tmp_path: Path) -> None:
    directory = _write(tmp_path, json.dumps(TINY))
    for model in (directory, str(tmp_path / "config.json")):
        config = read_config(model)
        assert (config.hidden_size, config.num_key_value_heads) == (64, 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"model_type": "llama", "hidden_size": 64,', r"config\.json is not valid JSON \(.*line 1.*\); fix or"),
        ("[1, 2]", r"holds a JSON list, not an object of config fields"),
        (json.dumps({**TINY, "model_type": "gpt2"}), r"model_type 'gpt2' in .*config\.json; supported: llama"),
        (json.dumps({k: v for k, v in TINY.items() if k != "model_type"}), r"model_type None .*; supported: llama"),
        (
            json.dumps({k: v for k, v in TINY.items() if k != "hidden_size"}),
            r"lacks a positive integer hidden_size \(every llama config gives them\)",
        ),
        (json.dumps({**TINY, "num_hidden_layers": 0, "vocab_size": "x"}), r"lacks .* num_hidden_layers, vocab_size"),
    ],
)
def test_a_bad_config_json_is_one_line_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    model = _write(tmp_path, text)
    with pytest.raises(PlanError, match=f"^--model {model!r}: .*{message}") as info:
        load_config(model)
    assert "\n" not in str(info.value)


def test_a_missing_model_names_the_presets(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"no config\.json there; give one of llama-7b, llama-13b, llama-70b, a model"):
        load_config(str(tmp_path / "nothing"))


@pytest.mark.parametrize(
    ("model", "tp", "accepted"),
    [("llama-70b", 16, "1, 2, 4, 8"), ("llama-70b", 3, "1, 2, 4, 8"), ("llama-7b", 64, "1, 2, 4, 8, 16, 32")],
)
def test_tp_must_divide_the_heads(model: str, tp: int, accepted: str) -> None:
    config = load_config(model)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    with pytest.raises(PlanError, match=rf"^--tp {tp}: must divide the model's {heads} attention heads and {kv} key/"):
        check_model_layout(config, tp)
    with pytest.raises(PlanError, match=rf"choose --tp among {accepted}$"):
        make_plan(model, Layout("hybrid", tp=tp, dp=1), "adamw")
    for ok in map(int, accepted.split(", ")):
        check_model_layout(config, ok)


STAGES = r"^--pp 3: more pipeline stages than the model's 2 layers; choose --pp at most 2$"


def test_heads_after_sequence_parallelism_and_stages_after_layers(tmp_path: Path) -> None:
    config: Any = read_config(_write(tmp_path, json.dumps(TINY)))
    check_model_layout(config, tp=1, sp=2, sp_mode="all_to_all")  # 2 and 1 heads per rank
    with pytest.raises(PlanError, match=r"^--sp 4: .*choose --sp among 1, 2$"):
        check_model_layout(config, tp=1, sp=4, sp_mode="all_to_all")
    with pytest.raises(PlanError, match=r"^--tp 2: must divide the model's 2 attention heads and 1 key/value"):
        check_model_layout(config, tp=2, sp=2, sp_mode="all_to_all")
    check_model_layout(config, pp=2)
    with pytest.raises(PlanError, match=STAGES):
        check_model_layout(config, pp=3)


def test_the_sweep_skips_tp_sizes_the_heads_refuse() -> None:
    from dist_optim.plan.__main__ import _fits_heads

    config = load_config("llama-70b")
    assert [tp for tp in (1, 2, 4, 8, 16) if _fits_heads(config, tp)] == [1, 2, 4, 8]


# ---- the recipe refuses the same input, and plans its default optimizer -----------------------
def _recipe(argv: list[str]) -> None:
    from recipes.train_llama import main

    main(argv + ["--dry-run"])


def test_recipe_refuses_bad_models_layouts_and_data(tmp_path: Path) -> None:
    bad = _write(tmp_path, '{"model_type": "llama",')
    with pytest.raises(SystemExit, match=rf"^--model {bad!r}: .*is not valid JSON"):
        _recipe(["--model", bad])
    with pytest.raises(SystemExit, match=r"^--tp 3: must divide the model's 4 attention heads .*among 1, 2, 4$"):
        _recipe(["--model", "tiny", "--tp", "3", "--world-size", "3"])
    with pytest.raises(SystemExit, match=r"^--pp 3: more pipeline stages than the model's 2 layers"):
        _recipe(["--model", "tiny", "--pp", "3", "--world-size", "3"])
    with pytest.raises(SystemExit, match=r"^--data '.*missing\.txt': no such file or directory$"):
        _recipe(["--model", "tiny", "--data", str(tmp_path / "missing.txt")])


def test_recipe_dry_run_plans_the_default_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    from recipes.train_llama import planner_name

    assert planner_name("colossalai.nn.optimizer.Lamb") == "lamb"
    assert planner_name("torch.optim.AdamW") == "adamw"
    assert planner_name("came_pytorch.CAME") == "came"
    assert planner_name("torch.optim.SGD") is None
    _recipe(["--model", "tiny", "--zero", "1", "--world-size", "2"])
    out = capsys.readouterr().out
    assert "planned as 'lamb', the optimizer the booster swaps colossalai.nn.optimizer.Lamb for" in out
    assert "hybrid tp=1 x dp=2 x ZeRO-1 (2 ranks, bf16), optimizer lamb" in out and "optimizer state" in out
