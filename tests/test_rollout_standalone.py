"""Standalone replicas (``rollout.mode=standalone``): replicas in Ray actors of their own, weights sent
by the trainer's ranks through the checkpoint engine, the replica manager and agent workers."""

from __future__ import annotations

import os
import shutil
import textwrap

import numpy as np
import pytest
import torch

from trellis.config import load_config
from trellis.data.protocol import DataProto
from trellis.errors import RolloutReplicaError
from trellis.recipes.presets import preset_overrides
from trellis.rollout.sampling import SamplingParams
from trellis.trainer.ppo import Trainer

ray = pytest.importorskip("ray")

QUICK = [
    "trainer.trackers=[jsonl]",
    "trainer.resume_mode=disable",
    "trainer.total_training_steps=3",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _config(tmp_path, *overrides):
    return load_config(
        overrides=[*preset_overrides("tiny"), *QUICK, f"trainer.run_dir={tmp_path / 'run'}", *overrides]
    )


class _Recording(Trainer):
    """Records, at every weight sync, the replicas' processes (from their health check)."""

    def sync_weights(self):
        metrics = super().sync_weights()
        if self.replicas is not None:
            self.seen_pids = [*getattr(self, "seen_pids", []), self.replicas.health()]
        return metrics


def _train(tmp_path, name, *overrides):
    config = load_config(
        overrides=[*preset_overrides("tiny"), *QUICK, f"trainer.run_dir={tmp_path / name}", *overrides]
    )
    trainer = _Recording(config)
    result = trainer.fit()
    shutil.rmtree(tmp_path / name, ignore_errors=True)
    return trainer, result


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """The reference: the tiny preset with the replica in the training process (its own weight copy)."""
    return _train(tmp_path_factory.mktemp("colocated"), "colocated", "rollout.mode=colocated")[1]


@pytest.mark.distributed  # a replica actor against an in-process run (~20 s)
def test_standalone_replica_trains_like_colocated_through_shm(tmp_path, ray_cluster, colocated):
    trainer, result = _train(
        tmp_path, "standalone", "rollout.mode=standalone", "rollout.checkpoint_engine.name=shm"
    )
    assert result.steps == 3
    # fp32, same seed: the replica in its own process generates exactly what the in-process one does
    assert [m["reward/mean"] for m in result.history] == [m["reward/mean"] for m in colocated.history]
    # one sync after start, then one per step, each to a replica in another process
    assert len(trainer.seen_pids) == 4
    assert all(set(pids) == {0} and pids[0] != os.getpid() for pids in trainer.seen_pids)
    weights = sum(p.numel() * p.element_size() for p in _tiny_model_params(trainer))
    for metrics in result.history:
        assert metrics["weight_sync/megabytes"] == pytest.approx(weights / 1e6)
        assert metrics["weight_sync/mb_per_s"] > 0
        assert "timing/rollout_sleep" not in metrics  # own devices: nothing to give back to training
    assert trainer.replicas is None  # shut down with the run


def _tiny_model_params(trainer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trainer.config.model.path, dtype=torch.float32)
    return list(model.state_dict().values())


@pytest.mark.distributed  # six Ray actors (~40 s)
def test_two_fsdp_workers_two_replicas_two_agent_workers_over_gloo(tmp_path, ray_cluster, colocated):
    trainer, result = _train(
        tmp_path,
        "standalone_ray",
        "rollout.mode=standalone",
        "rollout.n_devices_per_node=2",
        "rollout.agent.num_workers=2",
        "rollout.checkpoint_engine.name=gloo",
        "trainer.executor=ray",
        "trainer.n_devices_per_node=2",
        "actor.engine=fsdp",
    )
    assert [m["reward/mean"] for m in result.history] == pytest.approx(
        [m["reward/mean"] for m in colocated.history], abs=1e-6
    )
    pids = trainer.seen_pids[-1]
    assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2 and os.getpid() not in pids.values()


# ------------------------------------------------------------------ the replica manager


@pytest.fixture(scope="module")
def standalone(ray_cluster, tmp_path_factory):
    from trellis.rollout.manager import ReplicaManager

    config = _config(
        tmp_path_factory.mktemp("manager"), "rollout.mode=standalone", "rollout.n_devices_per_node=2"
    )
    manager = ReplicaManager.start_standalone(config)
    yield config, manager
    manager.shutdown()


def _generate(replica, prompt=(5, 6, 7)):
    from trellis.utils.coroutines import run_coroutine

    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    return run_coroutine(replica.generate(list(prompt), params, "req-1"))


def test_manager_starts_routes_sleeps_and_wakes_replicas(standalone):
    _, manager = standalone
    pids = manager.health()
    assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2 and os.getpid() not in pids.values()
    assert [r.pid for r in manager.replicas] == [pids[0], pids[1]]
    # least-loaded first, then sticky for the same sample
    first, second = manager.route("a"), manager.route("b")
    assert (first.replica_rank, second.replica_rank) == (0, 1) and manager.route("a") is first
    manager.router.release("a")
    manager.router.release("b")
    out = _generate(manager.replicas[1])
    assert 1 <= len(out.token_ids) <= 4
    manager.sleep_all()
    assert [r.asleep for r in manager.replicas] == [True, True]
    with pytest.raises(RuntimeError, match="asleep"):
        _generate(manager.replicas[0])
    manager.wake_up_all()
    assert [r.asleep for r in manager.replicas] == [False, False]
    assert _generate(manager.replicas[1]).token_ids == out.token_ids  # same seed, same weights
    with pytest.raises(TypeError, match="pass the trainer's send"):
        manager.update_weights([("x", torch.zeros(1))])
    with pytest.raises(RolloutReplicaError, match="connect_weight_sync first"):
        manager.update_weights(lambda: None)
    with pytest.raises(RolloutReplicaError, match="started by its ReplicaManager"):
        _run(manager.replicas[0].init())


def _run(coro):
    from trellis.utils.coroutines import run_coroutine

    return run_coroutine(coro)


def test_replica_processes_join_the_core_ledger(standalone, tmp_path):
    from types import SimpleNamespace

    from trellis.device.core_share import CoreShare
    from trellis.rollout.manager import ReplicaManager
    from trellis.rollout.remote import ReplicaActor

    _, manager = standalone
    ledger = CoreShare.create([1, 1, 1], directory=str(tmp_path))
    try:
        assert ledger.others_busy() == [True, True]  # not attached yet: nothing lent
        assert manager.share_cores(ledger.path) == [True, True]  # slots 1 and 2: replicas 0 and 1
        assert ledger.others_busy() == [False, False]
        assert ledger.threads() == 3
        assert 1 <= len(_generate(manager.replicas[0]).token_ids) <= 4
        assert ledger.others_busy() == [False, False]  # idle again once served
        # a replica without share_cores (a plugin's), or one that declines, keeps its slot busy
        for replica in (SimpleNamespace(), SimpleNamespace(share_cores=lambda share: False)):
            actor = ReplicaActor.__new__(ReplicaActor)
            actor.replica, actor._core_share = replica, None
            slot = CoreShare.create([1, 1], directory=str(tmp_path))
            try:
                assert _run(actor.share_cores(slot.path, 1)) is False
                assert slot.others_busy() == [True]
            finally:
                slot.close()
    finally:
        ledger.close()
    local = ReplicaManager([SimpleNamespace(replica_rank=0)])
    with pytest.raises(RolloutReplicaError, match="share_cores: these replicas run in this process"):
        local.share_cores(ledger.path)


def test_manager_sends_weights_through_the_engine_and_names_a_dead_replica(ray_cluster, tmp_path):
    from trellis.checkpoint.sync import WeightSyncManager
    from trellis.rollout.manager import ReplicaManager

    config = _config(
        tmp_path,
        "rollout.mode=standalone",
        "rollout.n_devices_per_node=2",
        "rollout.checkpoint_engine.name=shm",
    )
    manager = ReplicaManager.start_standalone(config)
    try:
        before = _generate(manager.replicas[0]).token_ids
        sync = WeightSyncManager(config.rollout.checkpoint_engine)
        engine, trainer_kwargs, rollout_kwargs = sync.plan(1, manager.world_size)
        manager.connect_weight_sync(rollout_kwargs, lambda: engine.init_process_group(**trainer_kwargs[0]))
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
        with torch.no_grad():
            model.lm_head.weight.mul_(-3.0)  # a different policy: different tokens for the same seed
        named = list(model.state_dict().items())
        stats = manager.update_weights(lambda: _run(sync.send(engine, iter(named))))
        assert stats.tensors == len(named)
        assert stats.bytes == sum(t.numel() * t.element_size() for _, t in named)
        after = [_generate(r).token_ids for r in manager.replicas]
        assert after[0] == after[1] and after[0] != before  # both replicas serve the new weights

        def send(pairs):  # the trainer's half, reporting as the policy workers' send does
            def call():
                sent = _run(sync.send(engine, iter(pairs)))
                return [{"tensors": float(sent.tensors), "bytes": float(sent.bytes), "seconds": sent.seconds}]

            return call

        # not waited for: the call returns once the replicas have read the weights; a failure to load
        # them surfaces at the next wait
        bad = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in named]
        stats = manager.update_weights(send(bad), version=5, wait=False)
        assert stats.tensors == len(named) and len(manager._loading) == 2
        with pytest.raises(
            RolloutReplicaError,
            match=r"rollout replica 0 \(pid \d+\) failed during receive_weights: ValueError: update_weights: "
            r"'model.norm.weight' has shape \(64,\), got \(63,\)",
        ):
            manager.wait_for_weights()
        assert manager._loading == []
        original = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).state_dict()
        manager.update_weights(send(list(original.items())), version=6, wait=False)
        manager.wait_for_weights()
        assert [_generate(r).token_ids for r in manager.replicas] == [before, before]
        assert ray.get([r.actor.weight_version.remote() for r in manager.replicas]) == [6, 6]
        engine.finalize()

        ray.kill(manager.replicas[1].actor)
        dead = manager.replicas[1]
        _wait_exited(dead.pid)  # ray.kill only asks: a ping sent at once may still be answered
        with pytest.raises(RolloutReplicaError, match=rf"rollout replica 1 \(pid {dead.pid}\) is dead"):
            manager.health(timeout_s=20)
        with pytest.raises(RolloutReplicaError, match=r"rollout replica 1 .* is dead .* during generate"):
            _generate(dead)
    finally:
        manager.shutdown()


def _wait_exited(pid, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs {timeout:g} s after ray.kill")


def test_in_process_manager_streams_weights_and_sleeps(tmp_path):
    from trellis.registries import rollout_replicas
    from trellis.rollout.manager import ReplicaManager
    from trellis.utils.tokenizer import hf_tokenizer

    config = _config(tmp_path)
    replica = rollout_replicas.get("hf")(0, config.rollout, config.model)
    _run(replica.init("colocated", tokenizer=hf_tokenizer(config.model.path)))
    manager = ReplicaManager([replica], checkpoint_engine=config.rollout.checkpoint_engine)
    named = [(n, torch.full_like(t, 0.5)) for n, t in replica.model.state_dict().items()]
    stats = manager.update_weights(iter(named))
    assert stats.tensors == len(named)
    assert all(torch.equal(t, torch.full_like(t, 0.5)) for t in replica.model.state_dict().values())
    manager.sleep_all()
    assert replica.asleep
    manager.wake_up_all()
    assert not replica.asleep
    assert manager.health() == {0: os.getpid()}
    with pytest.raises(TypeError, match=r"pass the \(name, tensor\) pairs"):
        manager.update_weights(lambda: None)
    with pytest.raises(RolloutReplicaError, match="only replicas in processes of their own"):
        manager.connect_weight_sync([{}], lambda: None)
    manager.shutdown()


# ------------------------------------------------------------------ agent workers

SLOW_LOOP = textwrap.dedent(
    """
    import os
    import time

    from trellis.rollout.agent_loop import AgentLoop, AgentLoopOutput


    class BlockingToolLoop(AgentLoop):
        '''Calls a synchronous tool between two turns; on rows marked slow the tool blocks for 2 s.'''

        async def run(self, sampling_params, **sample):
            prompt = self.prompt_ids(sample)
            first = await self.server.generate(prompt, sampling_params)
            blocked = (0.0, 0.0)
            if sample["extra_info"]["slow"]:
                start = time.time()
                time.sleep(2.0)  # a tool that blocks its event loop (a synchronous HTTP call, a subprocess)
                blocked = (start, time.time())
            ids = prompt + list(first.token_ids)
            second = await self.server.generate(ids, sampling_params)
            response = list(first.token_ids) + list(second.token_ids)
            return AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=response,
                response_mask=[1] * len(response),
                num_turns=3,
                extra={"pid": os.getpid(), "done_at": time.time(), "blocked": blocked},
            )
    """
)


def _prompts(n, slow_rows):
    rng = np.random.default_rng(0)
    ids = [rng.integers(5, 200, size=3 + i % 4).tolist() for i in range(n)]
    return DataProto.from_dict(
        non_tensors={
            "raw_prompt_ids": np.array([*ids, None], dtype=object)[:-1],
            "extra_info": np.array([{"slow": i in slow_rows} for i in range(n)], dtype=object),
            "__row__": np.arange(n),
        }
    )


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_blocking_tool_stalls_only_its_own_agent_worker(tmp_path, standalone, num_workers):
    from trellis.rollout.manager import AgentWorkerPool
    from trellis.utils.tokenizer import hf_tokenizer

    loop_file = tmp_path / "blocking_loop.py"
    loop_file.write_text(SLOW_LOOP)
    config, manager = standalone
    config.rollout.agent.default_agent_loop = f"{loop_file}:BlockingToolLoop"
    config.rollout.agent.num_workers = num_workers
    pool = AgentWorkerPool(config, manager, hf_tokenizer(config.model.path))
    try:
        out = pool.generate_sequences(_prompts(8, slow_rows={0}))
    finally:
        pool.shutdown()
    pids, done = out.non_tensor_batch["pid"], out.non_tensor_batch["done_at"].astype(float)
    assert out.tensors["responses"].shape[0] == 8
    assert list(out.non_tensor_batch["__row__"]) == list(range(8))  # rows in order after the join
    if num_workers == 1:  # one event loop: the blocked tool held back every sample not yet done
        start, end = out.non_tensor_batch["blocked"][0]
        assert set(pids) == {os.getpid()}
        assert end - start >= 2.0
        assert not ((done > start) & (done < end)).any()  # nothing finished while the loop was blocked
        assert (done[1:] > end).any()  # (a continuous replica may finish short rows before it)
    else:  # rows 0-3 in one worker, 4-7 in the other, which never waited for the blocked tool
        assert len(set(pids[:4])) == 1 and len(set(pids[4:])) == 1 and pids[0] != pids[4]
        assert os.getpid() not in set(pids)
        assert done[4:].max() < done[0] - 1.0


def test_standalone_settings_are_checked(tmp_path):
    from trellis.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.agent\.num_workers' needs rollout\.mode=standalone"):
        _config(tmp_path, "rollout.agent.num_workers=2")
    with pytest.raises(ConfigError, match=r"rollout\.n_devices_per_node' places standalone replicas only"):
        _config(tmp_path, "rollout.n_devices_per_node=2")
    with pytest.raises(ConfigError, match=r"rollout\.nnodes' places standalone replicas only"):
        _config(tmp_path, "rollout.nnodes=2")
    with pytest.raises(ConfigError, match=r"multiple of rollout\.tensor_parallel_size \(2\)"):
        standalone = ["rollout.mode=standalone", "rollout.n_devices_per_node=3"]
        _config(tmp_path, *standalone, "rollout.tensor_parallel_size=2")


def test_standalone_replicas_are_placed_per_node_with_their_tensor_parallel_devices(tmp_path):
    from trellis.rollout.manager import replica_pool

    config = _config(
        tmp_path,
        "rollout.mode=standalone",
        "rollout.nnodes=2",
        "rollout.n_devices_per_node=4",
        "rollout.tensor_parallel_size=2",
    )
    pool = replica_pool(config)
    assert pool.process_on_nodes == [2, 2] and pool.bundle() == {"CPU": 1}  # on the CPU: processes
    config.trainer.device = "cuda"
    pool = replica_pool(config)  # (no placement group is made until the replicas start)
    assert pool.process_on_nodes == [2, 2] and pool.bundle() == {"CPU": 1, "GPU": 2}
    assert replica_pool(config).name_prefix != pool.name_prefix  # two runs may share a cluster
