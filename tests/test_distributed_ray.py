"""Single controller on Ray actors: the same results as in-process, futures between stages, colocated
roles in one process, torch.distributed rendezvous from the group's environment, resource errors."""

from __future__ import annotations

import os

import pytest
import torch
from distributed_workers import Doubler, Gloo, Ref

from trellis.data.protocol import DataProto
from trellis.distributed import (
    ClassWithInitArgs,
    DataProtoFuture,
    LocalWorkerGroup,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    create_colocated_worker_cls,
)

ray = pytest.importorskip("ray")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ray_cluster():
    saved = {
        k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")
    }
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, saved["PYTHONPATH"]) if p)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray process on 127.0.0.1
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    try:
        yield
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def proto(n: int) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float32)}, non_tensors={"tag": [f"s{i}" for i in range(n)]}
    )


def test_ray_group_matches_the_local_group(ray_cluster):
    local = LocalWorkerGroup(ClassWithInitArgs(Doubler, scale=3), world_size=2)
    remote = RayWorkerGroup(RayResourcePool([2]), ClassWithInitArgs(Doubler, scale=3))
    try:
        assert remote.world_size == 2
        assert remote.whoami("t") == local.whoami("t") == [("t", 0, 2), ("t", 1, 2)]
        assert remote.add([1, 2], 5) == local.add([1, 2], 5)
        assert remote.square([3, 4]) == local.square([3, 4]) == [9, 16]
        for rows in (4, 5):  # 5: padded to 6 and stripped
            a, b = remote.double(proto(rows)), local.double(proto(rows))
            assert torch.equal(a.batch["y"], b.batch["y"]) and torch.equal(a.batch["rank"], b.batch["rank"])
            assert a.non_tensor_batch["tag"].tolist() == b.non_tensor_batch["tag"].tolist()
        assert remote.metrics(proto(4)) == local.metrics(proto(4))
        assert remote.only_rank_zero() == local.only_rank_zero() == 100
        assert len(set(remote.pid())) == 2 and os.getpid() not in remote.pid()  # two real processes

        # a non-blocking stage's output feeds the next stage as object refs, resolved by the workers
        future = remote.double_async(proto(4))
        assert isinstance(future, DataProtoFuture)
        assert all(isinstance(f, ray.ObjectRef) for f in future.futures)
        assert remote.plus_one(future).batch["x"].tolist() == [1.0, 4.0, 7.0, 10.0]
    finally:
        remote.shutdown()


@pytest.mark.distributed  # a Ray actor hosting three roles (~15 s)
def test_colocated_roles_run_in_the_same_actor(ray_cluster):
    combined = create_colocated_worker_cls(
        {"actor": ClassWithInitArgs(Doubler, scale=2), "ref": ClassWithInitArgs(Ref, offset=10)}
    )
    group = RayWorkerGroup(RayResourcePool([2]), combined)
    try:
        roles = group.spawn({"actor", "ref"})
        assert roles["actor"].pid() == roles["ref"].pid()  # both roles live in each worker process
        assert roles["actor"].double(proto(4)).batch["y"].tolist() == [0.0, 2.0, 4.0, 6.0]
        assert roles["ref"].shift(proto(4)).batch["y"].tolist() == [10.0, 11.0, 12.0, 13.0]
    finally:
        group.shutdown()


@pytest.mark.distributed  # two Ray workers in a gloo group (~15 s)
def test_workers_rendezvous_for_torch_distributed(ray_cluster):
    group = RayWorkerGroup(RayResourcePool([2]), ClassWithInitArgs(Gloo))
    try:
        assert group.init_dist() == [group.master_address[0]] * 2
        assert group.all_reduce(2.0) == [6.0, 6.0]  # 2*1 + 2*2 on both ranks
    finally:
        group.shutdown()


def test_resource_errors_name_what_was_asked(ray_cluster):
    manager = ResourcePoolManager({"pool": [1]}, {"actor": "pool"})
    assert manager.get_resource_pool("actor").world_size == 1
    with pytest.raises(KeyError, match=r"No resource pool for role 'critic'; roles: \['actor'\]"):
        manager.get_resource_pool("critic")
    with pytest.raises(ValueError, match=r"undefined pools \['gpu_pool'\]"):
        ResourcePoolManager({"pool": [1]}, {"actor": "gpu_pool"})
    too_big = RayResourcePool([64], ready_timeout_s=1)
    with pytest.raises(RuntimeError, match=r"Ray could not place \[64\] workers with \{'CPU': 1\} each"):
        too_big.get_placement_groups()
