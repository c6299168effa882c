"""export_to_hf and ``trellis export``: a checkpoint of the ``single`` engine, and one saved by two
``fsdp`` ranks over gloo (uneven shards), become Hugging Face folders that give the trained
model's exact logits; shard merging as FSDP2 shards; clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _spawn import init_gloo, run_ranks

from trellis.checkpoint import CheckpointManager, export_to_hf
from trellis.checkpoint.export import merge_model_shards
from trellis.cli import main
from trellis.config.schema import ActorConfig, CriticConfig, ModelConfig, OptimConfig
from trellis.data.protocol import DataProto
from trellis.errors import CheckpointError

WORLD = 2


def batch(rows: int = 4, seed: int = 0) -> DataProto:
    ids = torch.randint(4, 300, (rows, 9), generator=torch.Generator().manual_seed(seed))
    data = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, 6:]}
    )
    data.batch["response_mask"] = torch.ones(rows, 3)
    return data


def train_step(engine, data: DataProto) -> None:
    """One optimizer step that moves every weight (a critic: towards values of 1)."""
    engine.zero_grad()
    if engine.role == "critic":
        engine.forward_backward(data, lambda out, micro, info: (((out["values"] - 1) ** 2).mean(), {}))
    else:
        engine.forward_backward(data, lambda out, micro, info: (-out["log_probs"].mean(), {}))
    engine.optimizer_step()


def build(engine_cls, path: str, role: str = "actor", **kwargs):
    section = CriticConfig if role == "critic" else ActorConfig
    return engine_cls(
        ModelConfig(path=path, dtype="float32"),
        section(ppo_micro_batch_size_per_device=2, optim=OptimConfig(lr=1e-2)),
        role=role,
        device="cpu",
        **kwargs,
    )


def outputs(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def single_checkpoint(tiny_model_path, tmp_path_factory):
    """A trained single engine (actor and critic) checkpointed with hf files; (folder, engines)."""
    from trellis.engine.single import SingleEngine

    actor, critic = build(SingleEngine, tiny_model_path), build(SingleEngine, tiny_model_path, "critic")
    train_step(actor, batch())
    train_step(critic, batch())
    manager = CheckpointManager(tmp_path_factory.mktemp("single"))
    states = {"actor": actor.state_dict(), "critic": critic.state_dict(), "trainer": {"step": 1}}
    return manager.save(1, states, hf_files=tiny_model_path), actor, critic


def test_export_single_gives_the_trained_logits(single_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, actor, _ = single_checkpoint
    out = tmp_path / "hf"
    assert export_to_hf(ckpt, out) == str(out)
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = batch().batch["input_ids"]
    assert torch.equal(outputs(model, ids), outputs(actor.model, ids))
    for name, tensor in actor.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert AutoTokenizer.from_pretrained(out).pad_token == "<|pad|>"


def test_export_critic(single_checkpoint, tmp_path):
    from transformers import AutoModelForTokenClassification

    ckpt, _, critic = single_checkpoint
    export_to_hf(ckpt, tmp_path / "critic", role="critic")
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32)
    ids = batch().batch["input_ids"]
    assert torch.equal(outputs(model, ids), outputs(critic.model, ids))


def test_export_of_a_lora_checkpoint_is_the_merged_model(tiny_model_path, tmp_path, capsys):
    """Adapters only in the checkpoint; the export is the whole merged model (actor and critic), under the
    base model's names, giving the engines' logits; the base weights come from the recorded model.path."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from trellis.config.schema import LoraConfig
    from trellis.engine.single import SingleEngine

    base = shutil.copytree(tiny_model_path, tmp_path / "base")  # the run's model.path
    engines = {}
    for role, section in (("actor", ActorConfig), ("critic", CriticConfig)):
        engines[role] = SingleEngine(
            ModelConfig(path=str(base), dtype="float32", lora=LoraConfig(rank=4, alpha=8.0)),
            section(ppo_micro_batch_size_per_device=2, optim=OptimConfig(lr=1e-2)),
            role=role,
            device="cpu",
        )
        train_step(engines[role], batch())
    states = {role: engine.state_dict() for role, engine in engines.items()}
    ckpt = CheckpointManager(tmp_path / "ckpt").save(1, states, hf_files=base)
    ids = batch().batch["input_ids"]
    for role, auto_class in (("actor", AutoModelForCausalLM), ("critic", AutoModelForTokenClassification)):
        export_to_hf(ckpt, tmp_path / role, role=role)
        model = auto_class.from_pretrained(tmp_path / role, dtype=torch.float32)
        merged = dict(engines[role].iter_full_params())
        assert model.state_dict().keys() == merged.keys()
        assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in merged.items())
        torch.testing.assert_close(outputs(model, ids), outputs(engines[role].model, ids), atol=1e-5, rtol=0)

    shutil.rmtree(base)  # the recorded base model is gone: pass it
    assert main(["export", ckpt, "--to", str(tmp_path / "again")]) == 2
    assert "does not load" in capsys.readouterr().err
    assert main(["export", ckpt, "--to", str(tmp_path / "given"), "--base-model", tiny_model_path]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "given", dtype=torch.float32)
    torch.testing.assert_close(outputs(model, ids), outputs(engines["actor"].model, ids), atol=1e-5, rtol=0)


def test_export_to_an_fsspec_url(single_checkpoint, tmp_path):
    import fsspec
    from transformers import AutoModelForCausalLM

    from trellis.utils.fs import copy

    ckpt, actor, _ = single_checkpoint
    url = "memory://exported-actor"
    try:
        export_to_hf(ckpt, url)
        local = copy(url, tmp_path / "copy")
        model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
        ids = batch().batch["input_ids"]
        assert torch.equal(outputs(model, ids), outputs(actor.model, ids))
    finally:
        fsspec.filesystem("memory").rm("/exported-actor", recursive=True)


# ---------------------------------------------------------------- fsdp over gloo


def _worker(rank: int, port: int, model_path: str, root: str) -> None:
    """One fsdp rank: a training step on its half of the batch, then a checkpoint and the full weights."""
    import torch.distributed as dist

    from trellis.engine.fsdp import FSDPEngine

    with init_gloo(rank, port, WORLD, timeout_s=90):
        engine = build(FSDPEngine, model_path)
        train_step(engine, batch(rows=4)[[2 * rank, 2 * rank + 1]])
        manager = CheckpointManager(root, rank=rank, world_size=WORLD, barrier=dist.barrier)
        manager.save(1, {"actor": engine.state_dict()}, hf_files=model_path)
        full = {name: tensor.clone() for name, tensor in engine.iter_full_params()}
        if rank == 0:
            torch.save(full, Path(root) / "full.pt")


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    """Two gloo ranks of the fsdp engine on a tiny model whose shapes split unevenly; (folder, weights)."""
    from trellis.recipes.tiny import save_tiny_model

    # odd sizes: the mlp's (129, 64) weights and the (401, 64) embedding split into unequal halves
    model_path = save_tiny_model(tmp_path_factory.mktemp("odd_model"), intermediate_size=129, vocab_size=401)
    root = str(tmp_path_factory.mktemp("fsdp_ckpt"))
    run_ranks("test_checkpoint_export", WORLD, model_path, root)
    return f"{root}/global_step_1", torch.load(Path(root) / "full.pt", weights_only=True)


def test_export_fsdp_merges_the_shards(fsdp_checkpoint, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt, full = fsdp_checkpoint
    shards = [torch.load(Path(ckpt) / f"rank_{rank}.pt", weights_only=True) for rank in range(WORLD)]
    gate = "model.layers.0.mlp.gate_proj.weight"
    assert [s["states"]["actor"]["model"][gate].shape[0] for s in shards] == [
        65,
        64,
    ]  # really sharded, unevenly
    assert [s["states"]["actor"]["engine"] for s in shards] == ["fsdp", "fsdp"]

    assert main([*("export", ckpt, "--to"), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in full.items():
        assert torch.equal(state[name], tensor), name
    reference = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(Path(ckpt) / "hf"), dtype=torch.float32
    )
    reference.load_state_dict(full)
    ids = batch().batch["input_ids"]
    assert torch.equal(outputs(model, ids), outputs(reference, ids))


# ---------------------------------------------------------------- merging, as FSDP2 shards


def fsdp_shards(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Rank r's local shard, as FSDP2 makes it: torch.chunk along dim 0, empty past the last chunk."""
    chunks = list(torch.chunk(tensor, world, dim=0))
    return chunks + [tensor.new_empty((0, *tensor.shape[1:]))] * (world - len(chunks))


def test_merge_reassembles_fsdp2_shards():
    gen = torch.Generator().manual_seed(0)
    full = {
        "embed": torch.randn(7, 4, generator=gen),  # chunks of 3, 3, 1
        "row": torch.randn(1, 5, generator=gen),  # one rank holds it all, the others nothing
        "norm": torch.randn(5, generator=gen),  # 2, 2, 1
        "small": torch.randn(2, 3, generator=gen),  # 1, 1 and an empty shard
    }
    buffer = torch.arange(6.0)  # not sharded: whole on every rank
    world = 3
    shards = [
        {name: fsdp_shards(value, world)[rank] for name, value in full.items()} for rank in range(world)
    ]
    for shard in shards:
        shard["buffer"] = buffer.clone()
    assert [tuple(s["row"].shape) for s in shards] == [(1, 5), (0, 5), (0, 5)]
    shapes = {name: value.shape for name, value in full.items()} | {"buffer": buffer.shape}
    merged = merge_model_shards(shards, shapes)
    for name, value in full.items():
        assert torch.equal(merged[name], value), name
    assert torch.equal(merged["buffer"], buffer)

    with pytest.raises(
        CheckpointError, match=r"the shards of 'embed' \(\[\(3, 4\), \(3, 4\)\]\) do not make"
    ):
        merge_model_shards([{"embed": torch.zeros(3, 4)}] * 2, {"embed": (7, 4)})
    with pytest.raises(
        CheckpointError, match=r"rank 1's model state .* missing \['embed'\], unexpected \['x'\]"
    ):
        merge_model_shards([{"embed": torch.zeros(7, 4)}, {"x": torch.zeros(1)}], {"embed": (7, 4)})


# ---------------------------------------------------------------- errors


def test_export_errors_name_the_path(single_checkpoint, tmp_path, capsys):
    ckpt, *_ = single_checkpoint
    not_a_checkpoint = tmp_path / "nothing"
    not_a_checkpoint.mkdir()
    assert main(["export", str(not_a_checkpoint), "--to", str(tmp_path / "a")]) == 2
    assert f"Checkpoint '{not_a_checkpoint}' is incomplete: it has no meta.json" in capsys.readouterr().err

    assert main(["export", str(tmp_path / "missing"), "--to", str(tmp_path / "a")]) == 2
    assert "missing' does not exist" in capsys.readouterr().err

    assert main(["export", ckpt, "--to", str(tmp_path / "b"), "--role", "ref"]) == 2
    assert f"Checkpoint '{ckpt}' (rank 0) holds no 'ref' model; it holds ['actor', 'critic']" in (
        capsys.readouterr().err
    )

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    assert main(["export", ckpt, "--to", str(occupied)]) == 2
    assert "the folder is not empty" in capsys.readouterr().err
    assert main(["export", ckpt, "--to", str(occupied), "--force"]) == 0
    assert (occupied / "model.safetensors").exists() and (occupied / "notes.txt").exists()


def test_export_without_hf_files_needs_a_base_model(tiny_model_path, tmp_path, capsys):
    from trellis.engine.single import SingleEngine

    engine = build(SingleEngine, tiny_model_path)
    ckpt = CheckpointManager(tmp_path / "ckpt").save(5, {"actor": engine.state_dict()})
    assert main(["export", ckpt, "--to", str(tmp_path / "hf")]) == 2
    assert f"Checkpoint '{ckpt}' has no hf/config.json" in capsys.readouterr().err
    assert main(["export", ckpt, "--to", str(tmp_path / "hf"), "--base-model", tiny_model_path]) == 0
    assert "Exported the actor model of" in capsys.readouterr().out
    assert (tmp_path / "hf" / "tokenizer.json").exists()
