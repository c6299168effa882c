"""LoRA through peft (``model.lora``, :mod:`trellis.engine.lora`) on the tiny model.

Only the adapters (and the critic's head) train and take optimizer state; the base weights never
move; the training state holds the adapters alone and resumes bit-identically; weight sync sees the
merged weights under the base model's names, which give the engine's own log-probs in a plain model
and in the ``hf`` replica; the ``fsdp`` engine over two gloo processes matches ``single``; the
reference ignores the adapters; bad settings fail with the key and the fix; the tiny preset learns.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from _spawn import init_gloo, run_ranks
from test_engine_base import make_batch, policy_loss_fn, value_loss_fn

from trellis.config.base import ConfigValueError
from trellis.config.schema import ActorConfig, CriticConfig, LoraConfig, ModelConfig, OptimConfig, RefConfig
from trellis.engine.lora import adapter_state, is_adapter_entry, lora_settings, merged_weights
from trellis.engine.single import SingleEngine

ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The tiny Llama's linear layers: what ``all-linear`` adapts in each of its 2 blocks (not lm_head)."""

WORLD = 2


def setup_module() -> None:
    torch.set_num_threads(1)


def build(
    path, role="actor", *, rank=2, engine_cls=SingleEngine, lr=1e-2, mbs=4, packed=False, model=None, **lora
):
    """A float32 engine of ``role`` with adapters of ``rank`` (0: none) and ``lora``'s other settings;
    ``model``: more ``ModelConfig`` settings."""
    settings = {"dtype": "float32", "use_remove_padding": packed, **(model or {})}
    model_config = ModelConfig(path=path, lora=LoraConfig(rank=rank, **lora), **settings)
    if role == "ref":
        config = RefConfig(log_prob_micro_batch_size_per_device=mbs)
    else:
        section = CriticConfig if role == "critic" else ActorConfig
        config = section(ppo_micro_batch_size_per_device=mbs, optim=OptimConfig(lr=lr))
    return engine_cls(model_config, config, role=role, device="cpu")


def step(engine, seed=0, rows=None):
    """One update on ``make_batch(8, seed)`` (its ``rows``); returns the loss."""
    batch = make_batch(8, seed=seed)
    if rows is not None:
        batch = batch[rows]
    engine.zero_grad()
    loss_fn = value_loss_fn if engine.role == "critic" else policy_loss_fn("token-mean")
    loss = engine.forward_backward(batch, loss_fn)["loss"]
    assert engine.optimizer_step()["stepped"]
    return loss


def full(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.iter_full_params()}


def plain(path, role="actor"):
    """A non-LoRA engine of ``role`` (its model a plain Hugging Face model), for references."""
    return build(path, role, rank=0)


def optimizer_bytes(engine) -> int:
    return sum(v.numel() * v.element_size() for s in engine.optimizer.state.values() for v in s.values())


# ---------------------------------------------------------------- what trains


def test_only_the_adapters_train_and_their_optimizer_state_is_small(tiny_model_path):
    lora, full_ft = build(tiny_model_path), plain(tiny_model_path)
    trained = [name for name, p in lora.model.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * len(ADAPTED) * 2  # A and B of 7 layers in 2 blocks
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in trained), trained
    optimized = {id(p) for group in lora.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in lora.model.parameters() if p.requires_grad}
    step(lora), step(full_ft)
    assert 0 < optimizer_bytes(lora) < 0.05 * optimizer_bytes(full_ft)


def test_the_base_weights_stay_and_the_adapters_move(tiny_model_path):
    engine = build(tiny_model_path)
    before = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    assert all(before[n].abs().sum() == 0 for n in before if ".lora_B." in n)  # B starts at 0
    step(engine, seed=0), step(engine, seed=1)
    after = engine.model.state_dict()
    for name, tensor in before.items():
        moved = not torch.equal(after[name], tensor)
        assert moved == is_adapter_entry(name), name


def test_merged_weights_give_the_engines_log_probs(tiny_model_path):
    engine, reference = build(tiny_model_path, alpha=5.0), plain(tiny_model_path)
    base = full(reference)
    initial = full(engine)
    assert {n: t.shape for n, t in initial.items()} == {n: t.shape for n, t in base.items()}
    assert all(torch.equal(initial[n], base[n]) for n in base)  # B = 0: the base model exactly
    step(engine)
    merged = full(engine)
    assert list(merged) == list(initial)
    assert sum(not torch.equal(merged[n], base[n]) for n in base) == 2 * len(ADAPTED)

    # W + (alpha / rank) B A, from the engine's own matrices (alpha 5, rank 2: scale 2.5)
    layer = "model.layers.1.mlp.down_proj"
    params = dict(engine.model.named_parameters())
    a, b = (params[f"base_model.model.{layer}.lora_{m}.default.weight"] for m in "AB")
    torch.testing.assert_close(merged[f"{layer}.weight"], base[f"{layer}.weight"] + 2.5 * b @ a)

    reference.model.load_state_dict(merged)  # a plain Hugging Face model with the merged weights
    batch = make_batch(8, seed=3)
    mine, theirs = engine.forward(batch)["log_probs"], reference.forward(batch)["log_probs"]
    torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=0)
    assert not torch.allclose(plain(tiny_model_path).forward(batch)["log_probs"], mine, atol=1e-3)

    half = {n: t for n, t in engine.iter_full_params(dtype=torch.bfloat16)}
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, merged[n].bfloat16()) for n, t in half.items())


def test_merged_weights_stream_without_materialising_the_model(tiny_model_path):
    """A layer's merged weight comes out as soon as its A and B came by, not at the end."""
    engine = build(tiny_model_path)
    step(engine)
    seen: list[str] = []

    def recorded():
        for name, tensor in engine.model.state_dict().items():
            seen.append(name)
            yield name, tensor

    stream = merged_weights(recorded(), engine.lora)
    for name, _ in stream:
        if name == "model.layers.0.self_attn.q_proj.weight":
            break
    assert seen[-1] == "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    with pytest.raises(ValueError, match=r"ended before layer 'model.layers.0.mlp.up_proj' was complete"):
        state = engine.model.state_dict()
        list(merged_weights([(n, t) for n, t in state.items() if "up_proj.lora_B" not in n], engine.lora))


def test_conv1d_layers_merge_transposed(tmp_path):
    """GPT-2 keeps its weights as (d_in, d_out) (``Conv1D``): the merged update is (B A)ᵀ there."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=400, n_positions=64, n_embd=32, n_layer=1, n_head=2, n_inner=48)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    engine, reference = build(str(tmp_path / "gpt2"), rank=4), plain(str(tmp_path / "gpt2"))
    assert engine.lora["fan_in_fan_out"] and reference.lora is None
    step(engine)
    merged = full(engine)
    assert {n: t.shape for n, t in merged.items()} == {n: t.shape for n, t in full(reference).items()}
    reference.model.load_state_dict(merged)
    batch = make_batch(8, seed=3)
    torch.testing.assert_close(
        reference.forward(batch)["log_probs"], engine.forward(batch)["log_probs"], atol=1e-5, rtol=0
    )


def test_checkpointing_and_bfloat16_work_with_the_adapters(tiny_model_path):
    def lora_grads(engine):
        engine.forward_backward(make_batch(8), policy_loss_fn("token-mean"))
        return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}

    plain_grads = lora_grads(build(tiny_model_path))
    checkpointed = lora_grads(build(tiny_model_path, model={"gradient_checkpointing": True}))
    assert checkpointed.keys() == plain_grads.keys() and len(plain_grads) == 2 * len(ADAPTED) * 2
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=0, msg=name)
    half = build(tiny_model_path, model={"dtype": "bfloat16"}, packed=True)
    batch = make_batch(8)
    torch.testing.assert_close(
        half.forward(batch)["log_probs"],
        build(tiny_model_path).forward(batch)["log_probs"],
        atol=5e-2,
        rtol=0,
    )
    assert torch.isfinite(torch.tensor(step(half)))


# ---------------------------------------------------------------- state


def test_the_state_holds_only_the_adapters_and_resumes_bit_identically(tiny_model_path, tmp_path):
    engine = build(tiny_model_path)
    step(engine, seed=0)
    state = engine.state_dict()
    assert sorted(state["model"]) == sorted(n for n in engine.model.state_dict() if is_adapter_entry(n))
    assert len(state["model"]) == 2 * len(ADAPTED) * 2
    adapters = adapter_state(engine.model.state_dict())
    assert all(state["model"][n].data_ptr() == t.data_ptr() for n, t in adapters.items())  # no copies
    torch.save(state, tmp_path / "engine.pt")

    resumed = build(tiny_model_path)
    resumed.load_state_dict(torch.load(tmp_path / "engine.pt", weights_only=True))
    batch = make_batch(8, seed=5)
    assert torch.equal(resumed.forward(batch)["log_probs"], engine.forward(batch)["log_probs"])
    assert step(resumed, seed=1) == step(engine, seed=1)
    for (name, a), (_, b) in zip(engine.iter_full_params(), resumed.iter_full_params(), strict=True):
        assert torch.equal(a, b), name

    with pytest.raises(ValueError, match=r"saved by an engine without model.lora"):
        resumed.load_state_dict(plain(tiny_model_path).state_dict())
    with pytest.raises(
        ValueError, match=r"do not fit this model's \(model.lora\): missing \[.*q_proj.lora_A"
    ):
        build(tiny_model_path, target_modules=["q_proj", "v_proj"]).load_state_dict(
            build(tiny_model_path, target_modules=["k_proj"]).state_dict()
        )


def test_the_critic_trains_its_head_and_adapters(tiny_model_path):
    critic, reference = build(tiny_model_path, "critic", packed=True), plain(tiny_model_path, "critic")
    trained = [name for name, p in critic.model.named_parameters() if p.requires_grad]
    head = [
        "base_model.model.score.modules_to_save.default.weight",
        "base_model.model.score.modules_to_save.default.bias",
    ]
    assert [n for n in trained if "lora_" not in n] == head
    assert sorted(critic.state_dict()["model"]) == sorted([*head, *(n for n in trained if "lora_" in n)])
    initial = full(critic)
    assert initial.keys() == full(reference).keys()  # score.weight and score.bias, once
    assert all(torch.equal(initial[n], t) for n, t in full(reference).items())  # the same seeded head

    step(critic)
    merged = full(critic)
    assert not torch.equal(merged["score.weight"], initial["score.weight"])
    assert torch.equal(merged["score.weight"], dict(critic.model.named_parameters())[head[0]])
    reference.model.load_state_dict(merged)
    batch = make_batch(8, seed=3)
    torch.testing.assert_close(
        reference.forward(batch)["values"], critic.forward(batch)["values"], atol=1e-5, rtol=0
    )


def test_the_reference_ignores_lora(tiny_model_path):
    from transformers import AutoModelForCausalLM

    assert lora_settings(ModelConfig(path=tiny_model_path, lora=LoraConfig(rank=8)), "ref") is None
    ref = build(tiny_model_path, "ref", rank=8)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    assert ref.lora is None and type(ref.model).__name__ == "LlamaForCausalLM"
    state = ref.state_dict()["model"]
    assert state.keys() == base.keys() and all(torch.equal(state[n], base[n]) for n in base)


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        ({"rank": -1}, r"'model.lora.rank' must be a whole number >= 0; got -1.*Use 0 to train every weight"),
        ({"rank": True}, r"'model.lora.rank' must be a whole number >= 0; got True"),
        (
            {"rank": 8, "alpha": 0},
            r"'model.lora.alpha' must be a number > 0; got 0.*alpha = 2 \* rank \(16\)",
        ),
        ({"rank": 8, "dropout": 1.0}, r"'model.lora.dropout' must be a probability in \[0, 1\); got 1.0"),
        ({"rank": 8, "target_modules": "q_proj"}, r"'model.lora.target_modules' must be a list.*\[q_proj\]"),
        ({"rank": 8, "target_modules": []}, r"'model.lora.target_modules' must be a non-empty list"),
        ({"rank": 8, "target_modules": ["all-linear", "q_proj"]}, r"\[all-linear\] alone"),
        ({"rank": 8, "alpah": 16}, r"'model.lora.alpah' is not a key of model.lora.*check its spelling"),
    ],
)
def test_bad_settings_name_the_key_and_the_fix(lora, match):
    with pytest.raises(ConfigValueError, match=match):
        lora_settings({"path": "unused", "lora": lora}, "actor")


def test_bad_target_modules_name_the_models_layers(tiny_model_path):
    with pytest.raises(
        ConfigValueError,
        match=r"'model.lora.target_modules' must name modules of the model.*"
        r"Its linear layers are \['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj'",
    ):
        build(tiny_model_path, target_modules=["qkv_proj"])
    with pytest.raises(ConfigValueError, match=r"must name linear or embedding layers \(Target module Llama"):
        build(tiny_model_path, target_modules=["input_layernorm"])
    with pytest.raises(
        ConfigValueError, match=r"must not name 'model.embed_tokens'.*ties its input embedding"
    ):
        build(tiny_model_path, target_modules=["embed_tokens"])
    with pytest.raises(ConfigValueError, match=r"'rank' must be >= 0; got -1"):
        LoraConfig(rank=-1)  # the schema checks a config built from YAML too


def test_settings_defaults_and_target_modules(tiny_model_path):
    assert lora_settings(ModelConfig(path=tiny_model_path), "actor") is None  # rank 0: off
    assert lora_settings({"lora": {"rank": 4}}, "critic") == {
        "rank": 4, "alpha": 16.0, "dropout": 0.0, "target_modules": ["all-linear"]
    }  # fmt: skip
    engine = build(tiny_model_path, target_modules=["q_proj", "v_proj"])
    adapted = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in engine.state_dict()["model"]})
    assert adapted == ["q_proj", "v_proj"]
    assert len(engine.state_dict()["model"]) == 2 * 2 * 2
    step(engine)
    merged, base = full(engine), full(plain(tiny_model_path))
    changed = sorted(n for n in base if not torch.equal(merged[n], base[n]))
    assert changed == [f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in ("q_proj", "v_proj")]


def test_dropout_reaches_the_adapters(tiny_model_path):
    engine = build(tiny_model_path, dropout=0.25)
    drops = [m.lora_dropout["default"] for m in engine.model.modules() if hasattr(m, "lora_dropout")]
    assert len(drops) == 2 * len(ADAPTED) and all(d.p == 0.25 for d in drops)
    batch = make_batch(8)
    assert torch.equal(engine.forward(batch)["log_probs"], engine.forward(batch)["log_probs"])  # eval: off


# ---------------------------------------------------------------- rollout replicas


def test_the_hf_replica_generates_with_the_merged_adapters(tiny_model_path):
    from transformers import AutoTokenizer

    from trellis.config.schema import RolloutConfig
    from trellis.rollout import SamplingParams
    from trellis.rollout.hf import HFRolloutReplica

    engine = build(tiny_model_path, lr=5e-2)
    step(engine, seed=0), step(engine, seed=1)
    prompt = AutoTokenizer.from_pretrained(tiny_model_path)("What is 12 + 7?")["input_ids"]

    async def generate(update):
        replica = HFRolloutReplica(
            0, RolloutConfig(seed=0), ModelConfig(path=tiny_model_path, dtype="float32")
        )
        await replica.init("colocated")
        try:
            if update:
                await replica.update_weights(engine.iter_full_params())
            return await replica.generate(
                prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=True), "r"
            )
        finally:
            await replica.shutdown()

    def engine_log_probs(out):
        ids = torch.tensor([prompt + out.token_ids])
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, len(prompt) :]}
        return engine.forward(batch)["log_probs"][0]

    synced, stale = asyncio.run(generate(True)), asyncio.run(generate(False))
    torch.testing.assert_close(torch.tensor(synced.log_probs), engine_log_probs(synced), atol=1e-5, rtol=0)
    assert (torch.tensor(stale.log_probs) - engine_log_probs(stale)).abs().max() > 1e-3  # the base model's


def test_the_trainer_syncs_the_adapters_into_a_colocated_hf_replica(tmp_path):
    """The replica's log-probs equal the trainer's after every update (ppl ratio 1 to 1e-4)."""
    from trellis.testing.rollout import check_grpo_run

    overrides = ["rollout.mode=colocated", "model.lora.rank=8", "actor.optim.lr=5e-2"]
    result = check_grpo_run("hf", str(tmp_path / "run"), steps=2, overrides=overrides)
    assert all(m["timing/weight_sync"] > 0 for m in result.history)


def test_the_tiny_preset_learns_with_lora(tmp_path):
    """``trellis train --preset tiny model.lora.rank=8 model.lora.alpha=32 actor.optim.lr=1e-2``: greedy
    validation goes from no digits to only digits, as with full fine-tuning at lr 2e-3."""
    from trellis.checkpoint.training import load_rank_file
    from trellis.cli import main

    run_dir = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "model.lora.rank=8", "model.lora.alpha=32", "actor.optim.lr=1e-2"]
    argv += [f"trainer.run_dir={run_dir}", "trainer.trackers=[jsonl]", "trainer.resume_mode=disable"]
    assert main([*argv, "trainer.save_freq=12"]) == 0
    import json

    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    val = [row["val/reward/mean"] for row in rows if "val/reward/mean" in row]
    assert len(val) == 3 and val[0] < 0.2 and val[-1] > 0.9, val
    rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
    assert len(rewards) == 12 and max(rewards[-4:]) > max(rewards[:4]), rewards
    saved = load_rank_file(run_dir / "checkpoints" / "global_step_12", 0, part="actor")["actor"]["model"]
    assert saved and all(is_adapter_entry(name) for name in saved)


# ---------------------------------------------------------------- fsdp over gloo


def _worker(rank: int, port: int, path: str, out_dir: str) -> None:
    """One fsdp rank: 2 LoRA steps on its half of each batch; its losses, merged weights and checkpoint."""
    import torch.distributed as dist

    from trellis.checkpoint import CheckpointManager
    from trellis.engine.fsdp import FSDPEngine

    with init_gloo(rank, port, WORLD, timeout_s=90):
        engine = build(path, engine_cls=FSDPEngine, mbs=2, packed=True)
        rows = list(range(4 * rank, 4 * rank + 4))
        losses = [step(engine, seed=seed, rows=rows) for seed in (0, 1)]
        merged = full(engine)
        manager = CheckpointManager(out_dir, rank=rank, world_size=WORLD, barrier=dist.barrier)
        manager.save(2, {"actor": engine.state_dict()}, hf_files=path)
        if rank == 0:
            torch.save({"losses": losses, "merged": merged}, Path(out_dir) / "result.pt")


@pytest.fixture(scope="module")
def fsdp_run(tiny_model_path, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("lora_fsdp"))
    run_ranks("test_lora", WORLD, tiny_model_path, out_dir)
    return out_dir, torch.load(Path(out_dir) / "result.pt", weights_only=True)


def test_fsdp_with_lora_matches_single(fsdp_run, tiny_model_path):
    _, result = fsdp_run
    single = build(tiny_model_path, mbs=2, packed=True)
    losses = [step(single, seed=seed) for seed in (0, 1)]
    assert result["losses"] == pytest.approx(losses, abs=1e-5)
    expected = full(single)
    assert list(result["merged"]) == list(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(result["merged"][name], tensor, atol=1e-5, rtol=0, msg=name)


def test_export_of_an_fsdp_lora_checkpoint_is_the_merged_model(fsdp_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from trellis.checkpoint import export_to_hf

    out_dir, result = fsdp_run
    ckpt = f"{out_dir}/global_step_2"
    shards = [torch.load(Path(ckpt) / f"rank_{rank}.pt", weights_only=True) for rank in range(WORLD)]
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert [s["states"]["actor"]["model"][a].shape[0] for s in shards] == [1, 1]  # rank 2, sharded
    export_to_hf(ckpt, tmp_path / "hf")
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    assert state.keys() == result["merged"].keys()
    for name, tensor in result["merged"].items():
        torch.testing.assert_close(state[name], tensor, atol=1e-6, rtol=0, msg=name)
