"""Bad models and layouts refused in one line, naming the value and what is
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
SUPPORTED = "supported: llama, mistral, qwen2, mixtral"


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
        (json.dumps({**TINY, "model_type": "gpt2"}), rf"model_type 'gpt2' in .*config\.json; {SUPPORTED}$"),
        (json.dumps({k: v for k, v in TINY.items() if k != "model_type"}), rf"model_type None .*; {SUPPORTED}$"),
        (
            json.dumps({**TINY, "model_type": "qwen3"}),
            rf"model_type 'qwen3' in .*config\.json: ColossalAI 0\.5\.0 has no ShardFormer policy for Qwen3 "
            rf"\(qwen3\); {SUPPORTED}$",
        ),
        ('{"model_type": "mistral", "hidden_size": 64, }', r"config\.json is not valid JSON \(.*\); fix or"),
        (
            json.dumps({**TINY, "model_type": "mixtral"}),
            r"lacks a positive integer num_local_experts, num_experts_per_tok \(every mixtral config gives them\)",
        ),
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
    from recipes.train import main

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
    from recipes.dry_run import planner_name

    assert planner_name("colossalai.nn.optimizer.Lamb") == "lamb"
    assert planner_name("torch.optim.AdamW") == "adamw"
    assert planner_name("came_pytorch.CAME") == "came"
    assert planner_name("torch.optim.SGD") is None
    _recipe(["--model", "tiny", "--zero", "1", "--world-size", "2"])
    out = capsys.readouterr().out
    assert "planned as 'lamb', the optimizer the booster swaps colossalai.nn.optimizer.Lamb for" in out
    assert "hybrid tp=1 x dp=2 x ZeRO-1 (2 ranks, bf16), optimizer lamb" in out and "optimizer state" in out


# ---- the other model types: Mistral, Qwen2 (qkv bias, tied embeddings), Mixtral ---------------------
#: model_type -> the options of its tiny config beyond TINY's sizes.
OTHER_TYPES: dict[str, dict[str, Any]] = {
    "mistral": dict(sliding_window=None),
    "qwen2": dict(tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def test_each_supported_type_has_a_shardformer_policy_and_qwen3_has_none() -> None:
    """SUPPORTED_TYPES and NO_POLICY against the installed ColossalAI's policy table, by the
    causal-LM class path the table is keyed by."""
    from colossalai.shardformer.policies.auto_policy import _POLICY_LIST

    from dist_optim.plan.models import NO_POLICY, SUPPORTED_TYPES

    def has_policy(kind: str) -> bool:
        return any(
            key.startswith(f"transformers.models.{kind}.") and key.endswith("ForCausalLM") for key in _POLICY_LIST
        )

    assert [k for k in SUPPORTED_TYPES if not has_policy(k)] == []
    assert [k for k in NO_POLICY if has_policy(k)] == []


@pytest.mark.parametrize("kind", sorted(OTHER_TYPES))
def test_the_planner_accepts_each_supported_type(tmp_path: Path, kind: str) -> None:
    import transformers

    model = _write(tmp_path, json.dumps({**TINY, "model_type": kind, **OTHER_TYPES[kind]}))
    config = load_config(model)
    assert config.model_type == kind
    plan = make_plan(model, Layout("hybrid", tp=2, dp=2, zero=1), "adamw", steps=2)
    # The meta model is the type's own class (a Llama would count no q/k/v biases, no experts).
    real = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))(config)
    numel = sum(p.numel() for p in real.parameters())
    assert plan.single_device_state == pytest.approx(8 * numel, abs=8 * 64)  # AdamW: 2 fp32 moments (+ steps)
    assert plan.busiest.working_params > 0 and plan.busiest.optimizer_state > 0


@pytest.mark.parametrize("value", ["1", None])
def test_a_clusters_init_barrier_setting_does_not_reach_the_fake_world(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    """TORCH_DIST_INIT_BARRIER=1 makes torch end init_process_group and new_group with a store
    barrier, which the fake backend's store cannot do; the planner plans as without it (pipeline
    stages: ColossalAI's mesh makes groups too) and leaves the variable as it found it."""
    import os

    if value is None:
        monkeypatch.delenv("TORCH_DIST_INIT_BARRIER", raising=False)
    else:
        monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", value)
    plan = make_plan(_write(tmp_path, json.dumps(TINY)), Layout("hybrid", tp=2, pp=2, dp=2, zero=1), "adamw", steps=2)
    assert plan.busiest.optimizer_state > 0
    assert os.environ.get("TORCH_DIST_INIT_BARRIER") == value


def test_a_tied_qwen2_is_planned_with_the_parameters_the_optimizer_gets(tmp_path: Path) -> None:
    """A tied embedding is one parameter in ``model.parameters()``, what the optimizer is given:
    the planner counts it once, whole (single device) and over tp=2 (ShardFormer keeps the tie)."""
    from transformers import Qwen2ForCausalLM

    config = load_config(_write(tmp_path, json.dumps({**TINY, "model_type": "qwen2", "tie_word_embeddings": True})))
    real = Qwen2ForCausalLM(config)
    assert (
        real.lm_head.weight is real.model.embed_tokens.weight and real.model.layers[0].self_attn.q_proj.bias is not None
    )
    numel = sum(p.numel() for p in real.parameters())
    whole = make_plan(config, Layout("hybrid", precision="fp32"), "adamw", steps=2)
    assert whole.busiest.working_params == 4 * numel
    assert whole.single_device_state == 8 * numel + 4 * len(list(real.parameters()))  # moments + a step each
    split = make_plan(config, Layout("hybrid", tp=2, precision="fp32"), "adamw", steps=2)
    # tp=2: matrices and q/k/v biases halved, the embedding padded to a multiple of 64 x tp rows.
    hidden, vocab, padded = 64, 256, 256
    vectors = sum(p.numel() for n, p in real.named_parameters() if p.dim() == 1 and "norm" in n)
    assert split.busiest.working_params == 4 * (
        (numel - vectors - vocab * hidden) // 2 + vectors + padded * hidden // 2
    )


def test_bad_ep_is_refused_in_one_line(tmp_path: Path) -> None:
    """--ep: a dense model has no experts; ep must divide the MoE model's experts and the
    data-parallel ranks (MoeHybridParallelPlugin splits them into ep x MoE dp); the plugin runs it
    with ZeRO-1 only; not simulated with --pp or --sp. Each one line naming the value and what is
    accepted, from the planner's functions and from its command line."""
    from transformers import MixtralConfig

    from dist_optim.plan.__main__ import main

    with pytest.raises(PlanError, match=r"^--ep 2: a llama model has no experts; .*\(mixtral\); plan with --ep 1$"):
        make_plan("llama-7b", Layout("hybrid", dp=2, ep=2, zero=1), "adamw")
    mixtral = MixtralConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, num_local_experts=4)
    with pytest.raises(PlanError, match=r"^--ep 3: must divide the model's 4 experts; choose --ep among 1, 2, 4$"):
        check_model_layout(mixtral, ep=3)
    check_model_layout(mixtral, tp=2, ep=4)
    for kwargs, message in (
        (dict(dp=4, ep=3, zero=1), r"^--ep 3: must divide the 4 data-parallel ranks .* choose --ep among 1, 2, 4, "),
        (dict(dp=2, ep=2), r"^--ep 2 with --zero 0: MoeHybridParallelPlugin runs expert parallelism with ZeRO-1 only"),
        (dict(dp=2, ep=2, zero=2), r"^--ep 2 with --zero 2: .*plan --zero 1$"),
        (dict(dp=2, ep=2, zero=1, pp=2), r"^--ep 2 with --pp 2: expert parallelism is simulated without pipeline"),
        (dict(plugin="zero", dp=2, ep=2, zero=1), r"^--ep 2 needs --plugin hybrid"),
    ):
        with pytest.raises(PlanError, match=message):
            Layout(**kwargs)  # type: ignore[arg-type]
    path = tmp_path / "config.json"
    mixtral.to_json_file(path)
    with pytest.raises(SystemExit) as info:
        main(["--model", str(path), "--dp", "4", "--ep", "8", "--zero", "1"])
    assert str(info.value).startswith("dist_optim.plan: --ep 8: must divide the 4 data-parallel ranks")
    with pytest.raises(SystemExit, match=r"^dist_optim.plan: --ep 8: must divide the model's 4 experts; .*1, 2, 4$"):
        main(["--model", str(path), "--dp", "8", "--ep", "8", "--zero", "1"])


def test_ep_groups_are_moe_hybrid_parallel_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation's expert-parallel, MoE data-parallel and data-parallel groups of every rank of
    tp=2 x dp=4 (ep=2) are those ColossalAI's MoeHybridParallelPlugin makes for that rank (its own
    mesh, built on the fake backend for each rank in turn)."""
    import torch.distributed as dist
    from colossalai.booster.plugin import MoeHybridParallelPlugin
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dist_optim.plan.world import SimWorld

    layout = Layout("hybrid", tp=2, dp=4, ep=2, zero=1)
    for rank in range(layout.world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
        try:
            plugin = MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=2, zero_stage=1, precision="bf16")
            theirs = [
                tuple(dist.get_process_group_ranks(g))
                for g in (plugin.tp_group, plugin.ep_group, plugin.moe_dp_group, plugin.dp_group)
            ]
            del plugin
        finally:
            dist.destroy_process_group()
        world = SimWorld(layout, rank)
        ours = [world.tp_ranks(rank), world.ep_ranks(rank), world.moe_dp_ranks(rank), world.dp_ranks(rank)]
        assert ours == theirs, f"rank {rank}: (tp, ep, moe dp, dp) groups"


def test_the_command_line_says_a_bad_type_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dist_optim.plan.__main__ import main

    model = _write(tmp_path, json.dumps({**TINY, "model_type": "qwen3"}))
    with pytest.raises(SystemExit) as info:
        main(["--model", model])
    assert str(info.value).startswith("dist_optim.plan: --model ") and "no ShardFormer policy for Qwen3" in str(
        info.value
    )
    assert "\n" not in str(info.value)


def test_a_tied_plain_head_model_is_not_vocabulary_padded(tmp_path: Path) -> None:
    """ColossalAI 0.5.0's Qwen2 and Mixtral policies shard the head as a plain column-parallel
    linear: tied to a padded embedding, its padded rows would enter the loss. The planner (as the
    recipe's plugin) shards such a model without padding, and a --tp not dividing its vocabulary
    is refused; an untied one, or a Llama, keeps the plugin's padding to 64 x tp."""
    from dist_optim.plan.models import vocab_multiple

    fields = {**TINY, "model_type": "qwen2", "vocab_size": 300}
    tied = load_config(_write(tmp_path, json.dumps({**fields, "tie_word_embeddings": True})))
    untied = read_config(_write(tmp_path, json.dumps({**fields, "tie_word_embeddings": False})))
    assert (vocab_multiple(tied), vocab_multiple(untied), vocab_multiple(load_config("llama-7b"))) == (1, 64, 64)
    plan = make_plan(tied, Layout("hybrid", tp=2, precision="fp32"), "adamw", steps=2)
    embedding = 300 * 64 // 2  # padded to 384 rows it would be 384 * 64 // 2
    # a layer: q, o 64 x 64, k, v 32 x 64, their biases and the MLP halved; 2 norms of 64 whole
    layer = (2 * 64 * 64 + 2 * 32 * 64 + 64 + 2 * 32 + 3 * 64 * 128) // 2 + 2 * 64
    assert plan.busiest.working_params == 4 * (embedding + 2 * layer + 64)
    odd = read_config(_write(tmp_path, json.dumps({**fields, "vocab_size": 301, "tie_word_embeddings": True})))
    with pytest.raises(
        PlanError, match=r"^--tp 2: must divide the 301-token vocabulary of this qwen2 model .*among 1$"
    ):
        check_model_layout(odd, tp=2)
    untied_odd = read_config(_write(tmp_path, json.dumps({**fields, "vocab_size": 301})))
    check_model_layout(untied_odd, tp=2)  # padded by the plugin, and no tie to break


def test_the_single_device_state_is_simulated_once_per_model_and_optimizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ideal does not depend on the layout: plans of one model and optimizer under several
    layouts (a sweep) simulate it once, and another optimizer or other options simulate their own."""
    from dist_optim.plan import simulate

    calls: list[str] = []
    real = simulate.simulate_single_device

    def counting(config: Any, optimizer: str, args: Any, device: str = "cuda") -> tuple[int, str]:
        calls.append(optimizer)
        return real(config, optimizer, args, device)

    monkeypatch.setattr(simulate, "simulate_single_device", counting)
    monkeypatch.setattr(simulate, "_IDEALS", {})
    config = load_config(_write(tmp_path, json.dumps({**TINY, "model_type": "llama"})))
    plans = [
        make_plan(config, layout, "lamb", steps=2)
        for layout in (Layout("hybrid", tp=2, dp=2), Layout("zero", zero=2, dp=4))
    ]
    assert calls == ["lamb"] and plans[0].single_device_state == plans[1].single_device_state > 0
    make_plan(config, Layout("hybrid", tp=2, dp=2), "lamb", {"weight_decay": 0.1}, steps=2)
    make_plan(config, Layout("hybrid", tp=2, dp=2), "came", steps=2)
    assert calls == ["lamb", "lamb", "came"]
