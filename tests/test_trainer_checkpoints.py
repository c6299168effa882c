"""The trainer's checkpoints: each worker saves and loads its own shard, no tensor of the training
state passes through the driver, a crashed run resumes bit-identically (policy and critic), the
checkpoint exports, and a checkpoint of a Trellis before parts still resumes.

The Ray variant (two FSDP workers, SIGKILLed and resumed) is ``tests/test_checkpoint_kill_ray.py``.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from trainer_checkpoint_run import DriverGuard, install_guard

import trellis
from trellis.checkpoint import CheckpointManager, export_to_hf
from trellis.checkpoint.training import MANIFEST, load_rank_file
from trellis.distributed.worker import registered_methods
from trellis.errors import CheckpointError
from trellis.hooks import get_plugin_manager, hookimpl
from trellis.recipes.presets import preset_overrides
from trellis.trainer.workers import ActorRolloutRefWorker, CriticWorker

STEPS = 3
PPO = [
    "algorithm.adv_estimator=gae",  # a critic, in a worker group of its own
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",  # a KL coefficient that moves: the driver's state
    f"trainer.total_training_steps={STEPS}",
    "trainer.save_freq=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.trackers=[jsonl]",
]
PARTS = ("actor", "critic", "trainer")


def run(run_dir, *overrides):
    return trellis.train(
        overrides=[*preset_overrides("tiny"), f"trainer.run_dir={run_dir}", *PPO, *overrides]
    )


def shards(ckpt) -> dict:
    return {part: load_rank_file(ckpt, 0, part=part) for part in PARTS}


def assert_identical(a, b, where: str = "") -> None:
    """``a`` and ``b`` equal to the last bit: nested dicts, lists and tuples, tensors of the same dtype
    and shape, everything else by ``==``; ``where`` names the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """An uninterrupted PPO run (policy and critic) checkpointing every step."""
    torch.set_num_threads(1)
    return run(tmp_path_factory.mktemp("whole") / "run", "trainer.resume_mode=disable")


def test_the_state_dict_round_trip_through_the_driver_is_gone():
    for cls in (ActorRolloutRefWorker, CriticWorker):
        methods = registered_methods(cls)
        assert "state_dict" not in methods and "load_state_dict" not in methods, cls
        assert {"save_checkpoint", "load_checkpoint"} <= set(methods), cls


def test_workers_save_their_own_shards_and_no_tensor_reaches_the_driver(whole, tmp_path, monkeypatch):
    """A run crashes after step 2's checkpoint and resumes. Every worker call during saves and the
    resume goes through DriverGuard (which fails on a tensor in any argument or result): the driver
    only sends the root, the step and the path, and gets back each shard's file, size and digest.
    The resumed run ends bit-identical to the uninterrupted one: every worker's engine state and RNG
    state, the driver's step, loader position, KL coefficient and RNG state."""
    install_guard(monkeypatch.setattr)
    monkeypatch.setattr(DriverGuard, "calls", [])

    class Crash:
        @hookimpl
        def trellis_step_end(self, step, metrics):
            if step == STEPS:
                raise RuntimeError(f"crash after step {STEPS}, before its checkpoint")

    crash = Crash()
    get_plugin_manager().register(crash)
    try:
        with pytest.raises(RuntimeError, match="crash after step 3"):
            run(tmp_path / "cut")
    finally:
        get_plugin_manager().unregister(crash)
    resumed = run(tmp_path / "cut")
    assert resumed.steps == STEPS and len(resumed.history) == 1

    saves = [(group, method) for stage, group, method, _ in DriverGuard.calls if stage == "save"]
    assert saves == [("actor_wg", "save_checkpoint"), ("critic_wg", "save_checkpoint")] * STEPS
    resume = [(group, method) for stage, group, method, _ in DriverGuard.calls if stage == "resume"]
    assert resume == [
        ("actor_wg", "load_checkpoint"),
        ("actor_wg", "sync_rollout_weights"),
        ("critic_wg", "load_checkpoint"),
    ]
    # what came back from the last save is the manifest's entry of each worker's shard
    ckpt = tmp_path / "cut" / "checkpoints" / f"global_step_{STEPS}"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    returned = [result for stage, _, _, result in DriverGuard.calls if stage == "save"][-2:]
    assert returned == [
        [{"file": "actor/rank_0.pt", **manifest["files"]["actor/rank_0.pt"]}],
        [{"file": "critic/rank_0.pt", **manifest["files"]["critic/rank_0.pt"]}],
    ]
    assert all(re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) for [entry] in returned)

    assert manifest["parts"] == {"actor": 1, "critic": 1, "trainer": 1} and manifest["version"] == 2
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert [f for f in files if not f.startswith("hf/")] == [
        "actor/rank_0.pt",
        "critic/rank_0.pt",
        MANIFEST,
        "trainer/rank_0.pt",
    ]
    mine, theirs = shards(resumed.last_checkpoint), shards(whole.last_checkpoint)
    assert mine["trainer"]["trainer"]["step"] == STEPS and mine["actor"]["actor"]["global_step"] == STEPS
    assert mine["trainer"]["trainer"]["kl_coef"] != 0.001  # the adaptive controller moved it
    assert set(mine["actor"]) == {"actor", "rng"} and set(mine["critic"]) == {"critic", "rng"}
    assert_identical(mine, theirs)


def test_a_trainer_checkpoint_exports(whole, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = whole.last_checkpoint
    export_to_hf(ckpt, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    trained = load_rank_file(ckpt, 0, part="actor")["actor"]["model"]
    state = model.state_dict()
    assert state.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    export_to_hf(ckpt, tmp_path / "critic", role="critic")
    with pytest.raises(
        CheckpointError, match=r"holds no 'ref' model; it holds the parts \['actor', 'critic', 'trainer'\]"
    ):
        export_to_hf(ckpt, tmp_path / "ref", role="ref")


def test_a_checkpoint_of_trellis_before_parts_resumes(whole, tmp_path):
    """The layout before parts: one rank_0.pt holding actor, critic and trainer states (the driver's
    RNG inside the trainer's), manifest version 1. A run resumes from it and ends as the whole run."""
    before = shards(f"{whole.run_dir}/checkpoints/global_step_{STEPS - 1}")
    states = {"actor": before["actor"]["actor"], "critic": before["critic"]["critic"], **before["trainer"]}
    old = CheckpointManager(tmp_path / "old").save(STEPS - 1, states)
    assert json.loads((tmp_path / "old" / f"global_step_{STEPS - 1}" / MANIFEST).read_text())["version"] == 1
    resumed = run(tmp_path / "new", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={old}")
    assert resumed.steps == STEPS and len(resumed.history) == 1
    assert_identical(shards(resumed.last_checkpoint), shards(whole.last_checkpoint))


class Engine:
    """What a worker's checkpoint methods use of an engine: state_dict and load_state_dict."""

    def __init__(self, seed: int):
        self.state = {"model": {"w": torch.randn(4, generator=torch.Generator().manual_seed(seed))}}
        self.loaded = None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


def test_a_worker_writes_and_reads_its_own_shard_and_rng(tmp_path):
    """The worker methods themselves, on stand-in workers: each writes its role's shard with its RNG
    state and returns only the entry; each reads its own shard back, restoring its RNG state."""
    import random
    from types import SimpleNamespace

    import numpy as np

    config = SimpleNamespace(trainer=SimpleNamespace(device="cpu"))
    actor = SimpleNamespace(actor=Engine(1), rank=1, world_size=2, config=config)  # no process group here
    critic = SimpleNamespace(critic=Engine(2), rank=0, world_size=1, config=config)
    manager = CheckpointManager(tmp_path, parts={"actor": 2, "critic": 1})
    manager.begin(5)
    random.seed(3)
    entry = ActorRolloutRefWorker.save_checkpoint(actor, str(tmp_path), 5)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    CriticWorker.save_checkpoint(critic, str(tmp_path), 5)
    manager.save_shard(5, "actor", 0, {"actor": Engine(0).state_dict()})
    path = manager.publish(5, {"actor": 2, "critic": 1})
    manifest = json.loads((tmp_path / "global_step_5" / MANIFEST).read_text())
    assert entry == {"file": "actor/rank_1.pt", **manifest["files"]["actor/rank_1.pt"]}

    random.seed(99)
    ActorRolloutRefWorker.load_checkpoint(actor, path)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
    assert torch.equal(actor.actor.loaded["model"]["w"], actor.actor.state["model"]["w"])
    CriticWorker.load_checkpoint(critic, path)
    assert torch.equal(critic.critic.loaded["model"]["w"], critic.critic.state["model"]["w"])
    # a checkpoint from before parts, of a run without a critic, resumed by a run with one
    old = CheckpointManager(tmp_path / "old").save(1, {"actor": Engine(0).state_dict(), "trainer": {}})
    with pytest.raises(
        CheckpointError, match=r"rank 0's shard holds no 'critic' state \(it holds \['actor', 'trainer'\]\)"
    ):
        CriticWorker.load_checkpoint(critic, old)
