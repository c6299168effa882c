"""Where the trainer puts its roles: the actor (+ rollout, ref) and the critic share one Ray actor per
device by default (``create_colocated_worker_cls`` + ``spawn``), or the critic gets a resource pool of its
own (``critic.placement=separate``); either way a run reproduces the one-process run. The policy's
data-parallel methods are dispatched by each worker's dp-rank registration on its role's mesh."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from trellis.config import load_config
from trellis.data.protocol import DataProto
from trellis.distributed import (
    ClassWithInitArgs,
    Dispatch,
    LocalWorkerGroup,
    Worker,
    create_colocated_worker_cls,
    make_nd_compute_metric_dispatch_fn,
    register,
)
from trellis.distributed.worker import registered_methods
from trellis.recipes.presets import preset_overrides
from trellis.trainer import Trainer
from trellis.trainer.workers import ActorRolloutRefWorker, CriticWorker

STEPS = 2
PPO = [
    "trainer.trackers=[jsonl]",
    "trainer.resume_mode=disable",
    "algorithm.adv_estimator=gae",
    f"trainer.total_training_steps={STEPS}",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]
RAY = ["trainer.executor=ray", "trainer.n_devices_per_node=2", "actor.engine=fsdp", "critic.engine=fsdp"]
COMPARED = ("reward/mean", "values/mean", "critic/loss", "actor/grad_norm")
"""Per-step metrics every placement must reproduce (the critic's values at step 2 come from its update)."""


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The one-process run every Ray placement is compared with (the colocated class there too)."""
    torch.set_num_threads(1)
    return _run(tmp_path_factory.mktemp("local"), "local", *PPO)


def _run(tmp_path, name, *overrides, probe=None):
    """A run of the tiny preset; ``probe(trainer)`` is called once its workers are built."""

    class Probed(Trainer):
        def _build_workers(self):
            super()._build_workers()
            if probe is not None:
                probe(self)

    config = load_config(None, [*preset_overrides("tiny"), f"trainer.run_dir={tmp_path / name}", *overrides])
    result = Probed(config).fit()
    shutil.rmtree(tmp_path / name, ignore_errors=True)
    assert result.steps == config.trainer.total_training_steps
    return result


def _placement(ray, seen):
    """A probe recording the trainer's Ray actors and, for each, the roles it holds and their processes."""

    def roles_in(worker):  # runs inside the actor (pickled by value: a local function)
        held = getattr(worker, "roles", None) or {"": worker}
        return sorted((type(obj).__name__, os.getpid(), obj.rank) for obj in held.values())

    def probe(trainer):
        actors = [actor for group in trainer.groups for actor in group.workers]
        seen["actors"] = len(actors)
        seen["roles"] = ray.get([actor.__ray_call__.remote(roles_in) for actor in actors])
        seen["shared"] = trainer.critic_wg.workers is trainer.actor_wg.workers
        seen["meshes"] = (trainer.actor_wg.dispatch_info("actor"), trainer.critic_wg.dispatch_info("critic"))

    return probe


def _curve(result):
    return [m[key] for m in result.history for key in COMPARED]


@pytest.mark.distributed  # Ray actors against an in-process run (~30 s)
def test_actor_and_critic_share_one_ray_actor_per_device_and_match_the_local_run(
    tmp_path, ray_cluster, local_run
):
    seen = {}
    colocated = _run(tmp_path, "colocated", *PPO, *RAY, probe=_placement(ray_cluster, seen))
    assert seen["actors"] == 2 and seen["shared"]  # not one group (2 actors) per role
    for rank, held in enumerate(seen["roles"]):
        (actor, actor_pid, actor_rank), (critic, critic_pid, critic_rank) = held
        assert (actor, critic) == ("ActorRolloutRefWorker", "CriticWorker")
        assert actor_pid == critic_pid != os.getpid() and actor_rank == critic_rank == rank
    assert len({held[0][1] for held in seen["roles"]}) == 2  # two processes
    assert seen["meshes"] == ([0, 1], [0, 1])  # each role registered its dp rank on its own mesh
    # FSDP actor and critic engines in one process, sharing its process group: the same run as locally
    assert all(m["critic/vf_loss"] > 0 and m["critic/grad_norm"] > 0 for m in colocated.history)
    assert _curve(colocated) == pytest.approx(_curve(local_run), abs=1e-5)


@pytest.mark.distributed  # two pools of Ray actors (~40 s)
def test_critic_on_a_separate_pool_starts_its_own_actors_and_trains_the_same(
    tmp_path, ray_cluster, local_run
):
    seen = {}
    overrides = [*PPO, *RAY, "critic.placement=separate", "trainer.total_training_steps=1"]  # kept short
    separate = _run(tmp_path, "separate", *overrides, probe=_placement(ray_cluster, seen))
    assert seen["actors"] == 4 and not seen["shared"]
    held = [roles for per_actor in seen["roles"] for roles in per_actor]
    assert sorted((name, rank) for name, _, rank in held) == [
        ("ActorRolloutRefWorker", 0), ("ActorRolloutRefWorker", 1), ("CriticWorker", 0), ("CriticWorker", 1),
    ]  # fmt: skip
    assert len({pid for _, pid, _ in held}) == 4  # every role in a process of its own
    assert _curve(separate) == pytest.approx(_curve(local_run)[: len(COMPARED)], abs=1e-5)


# ---------------------------------------------------------------- mesh dispatch


def _mode(cls, method):
    return registered_methods(cls)[method].dispatch_mode


class _Permuted(ActorRolloutRefWorker):
    """A policy worker whose dp rank on every mesh is its rank reversed (as a real layout may order them);
    ``rows`` is dispatched exactly as ``compute_log_prob`` is."""

    def _register_dispatch_collect_info(self, mesh_name, dp_rank, is_collect):
        super()._register_dispatch_collect_info(mesh_name, self.world_size - 1 - dp_rank, is_collect)

    @register(dispatch_mode=_mode(ActorRolloutRefWorker, "compute_log_prob"))
    def rows(self, data):
        x = data.batch["x"]
        return DataProto.from_dict(tensors={"x": x, "worker": torch.full_like(x, float(self.rank))})


def _rows(n):
    return DataProto.from_dict(tensors={"x": torch.arange(n, dtype=torch.float32)})


def test_log_probs_are_dispatched_by_the_registered_dp_rank_of_the_actor_mesh():
    group = LocalWorkerGroup(ClassWithInitArgs(_Permuted, SimpleNamespace()), world_size=3)
    assert group.dispatch_info("actor") == [2, 1, 0] and group.collect_info("actor") == [True] * 3
    out = group.rows(_rows(7))  # 3 dp ranks: padded to 9, chunks of 3, padding stripped
    assert out.batch["x"].tolist() == [float(i) for i in range(7)]  # the rows come back in their order
    # dp rank 0 (worker 2) got rows 0-2, dp rank 1 (worker 1) rows 3-5, dp rank 2 (worker 0) row 6
    assert out.batch["worker"].tolist() == [2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0]


def test_a_colocated_worker_registers_each_role_on_its_own_mesh():
    config = SimpleNamespace()
    combined = create_colocated_worker_cls(
        {
            "actor_rollout": ClassWithInitArgs(_Permuted, config),
            "critic": ClassWithInitArgs(CriticWorker, config),
        }
    )
    roles = LocalWorkerGroup(combined, world_size=2).spawn(["actor_rollout", "critic"])
    assert roles["actor_rollout"].dispatch_info("actor") == [1, 0]  # asked of the actor role
    assert roles["critic"].dispatch_info("critic") == [0, 1]  # asked of the critic role
    with pytest.raises(ValueError, match="has not registered mesh 'critic'"):
        roles["actor_rollout"].dispatch_info("critic")


def test_the_data_parallel_methods_of_both_workers_are_dispatched_over_their_role_mesh():
    modes = {
        name: spec.dispatch_mode
        for cls in (ActorRolloutRefWorker, CriticWorker)
        for name, spec in registered_methods(cls).items()
    }
    meshes = {
        "compute_log_prob": "actor",
        "compute_ref_log_prob": "actor",
        "compute_scores": "actor",
        "update_actor": "actor",
        "compute_values": "critic",
        "update_critic": "critic",
    }
    assert {name: modes[name].get("mesh_name") for name in meshes} == meshes
    # updates return metric dicts: kept one per dp rank, not concatenated
    assert [modes[name].get("concat", True) for name in meshes] == [True, True, True, False, True, False]


class _Metrics(Worker):
    """A (dp=2, sp=2) layout: workers 2k and 2k+1 share dp rank k; the even one is collected."""

    def __init__(self):
        self._register_dispatch_collect_info("m", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=make_nd_compute_metric_dispatch_fn("m"))
    def update(self, data):
        return {"rows": float(len(data)), "rank": float(self.rank)}

    @register(dispatch_mode=make_nd_compute_metric_dispatch_fn("m"), blocking=False)
    def update_later(self, data):
        return self.update(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def plain(self, data):
        return {"rows": float(len(data))}


def test_metric_dicts_are_collected_one_per_dp_rank_and_padding_drops_none():
    group = LocalWorkerGroup(ClassWithInitArgs(_Metrics), world_size=4)
    expected = [{"rows": 3.0, "rank": 0.0}, {"rows": 3.0, "rank": 2.0}]  # 5 rows padded to 6, 3 per dp rank
    assert group.update(_rows(5)) == expected
    assert group.update_later(_rows(5)) == expected  # locally a "future" is the value itself
    # padding is rows of the batch, not workers: all four dicts come back (5 rows padded to 8)
    assert group.plain(_rows(5)) == [{"rows": 2.0}] * 4
