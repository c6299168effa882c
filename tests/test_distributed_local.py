"""Single controller, in-process: dispatch modes, padding, meshes, futures, colocated roles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed_workers import Doubler, MeshWorker, Ref

from trellis.data.protocol import DataProto
from trellis.distributed import (
    ClassWithInitArgs,
    DataProtoFuture,
    Dispatch,
    LocalWorkerGroup,
    Worker,
    create_colocated_worker_cls,
    register,
    register_dispatch_mode,
)
from trellis.distributed.dispatch import get_dispatch_mode


def proto(n: int) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float32)}, non_tensors={"tag": [f"s{i}" for i in range(n)]}
    )


@pytest.fixture
def group():
    return LocalWorkerGroup(ClassWithInitArgs(Doubler, scale=3), world_size=3)


def test_one_to_all_all_to_all_and_dp_compute(group):
    assert group.whoami("hi") == [("hi", 0, 3), ("hi", 1, 3), ("hi", 2, 3)]
    assert group.add([1, 2, 3], 10) == [11, 13, 15]  # a per-worker list is split, a scalar repeated
    assert group.add(1, 10) == [11, 12, 13]
    assert group.square([1, 2, 3]) == [1, 4, 9]
    with pytest.raises(
        ValueError, match=r"DP_COMPUTE needs every argument as a list with one item per worker \(3\)"
    ):
        group.square([1, 2])


@pytest.mark.parametrize("rows", [3, 6, 7, 8, 1])
def test_dp_compute_proto_pads_and_strips(group, rows):
    out = group.double(proto(rows))
    assert len(out) == rows
    assert out.batch["y"].tolist() == [3.0 * i for i in range(rows)]
    assert out.non_tensor_batch["tag"].tolist() == [f"s{i}" for i in range(rows)]
    per_rank = -(-rows // 3)
    assert out.batch["rank"].tolist() == [float(i // per_rank) for i in range(rows)]
    assert group.seen_sizes() == [[per_rank]] * 3  # every worker got an equal (padded) chunk


def test_metric_mode_returns_one_output_per_worker(group):
    assert group.metrics(proto(6)) == [{"rows": 2.0, "rank": float(r)} for r in range(3)]


def test_rank_zero_execution(group):
    assert group.only_rank_zero() == 100


def test_non_blocking_future_feeds_the_next_call(group):
    future = group.double_async(proto(6))
    assert isinstance(future, DataProtoFuture)
    out = group.plus_one(future)  # each worker resolves its own chunk
    assert out.batch["x"].tolist() == [3.0 * i + 1 for i in range(6)]
    assert future.get().batch["y"].tolist() == [3.0 * i for i in range(6)]


def test_non_blocking_future_with_padding_is_resolved_correctly(group):
    future = group.double_async(proto(7))
    assert len(future.get()) == 7
    with pytest.raises(ValueError, match="cannot be split evenly over 3 workers"):
        group.plus_one(future)


def test_mesh_dispatch_sends_each_dp_rank_its_chunk_and_collects_one_per_rank():
    group = LocalWorkerGroup(ClassWithInitArgs(MeshWorker), world_size=4)
    assert group.dispatch_info("train") == [0, 0, 1, 1]
    assert group.collect_info("train") == [True, False, True, False]
    out = group.run(proto(5))  # dp size 2: padded to 6, chunks of 3, padding stripped
    assert out.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out.batch["worker"].tolist() == [0.0, 0.0, 0.0, 2.0, 2.0]


def test_registering_a_mesh_twice_is_an_error():
    class Twice(Worker):
        def __init__(self):
            self._register_dispatch_collect_info("m", 0, True)
            self._register_dispatch_collect_info("m", 0, True)

    with pytest.raises(ValueError, match="Mesh 'm' is already registered on worker 0"):
        LocalWorkerGroup(ClassWithInitArgs(Twice))


def test_unregistered_mesh_and_missing_collector_are_reported():
    class NoCollector(Worker):
        def __init__(self):
            self._register_dispatch_collect_info("m", 0, False)

    with pytest.raises(ValueError, match=r"no worker collects data-parallel rank\(s\) \[0\]"):
        LocalWorkerGroup(ClassWithInitArgs(NoCollector), world_size=2).dispatch_info("m")
    with pytest.raises(ValueError, match="has not registered mesh 'train'"):
        LocalWorkerGroup(ClassWithInitArgs(Doubler)).dispatch_info("train")


def test_custom_dispatch_mode():
    def dispatch_reversed(group, values):
        return (list(reversed(values)),), {}

    def collect_sum(group, outputs):
        return sum(outputs)

    register_dispatch_mode("REVERSED_SUM_TEST", dispatch_reversed, collect_sum)
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode("REVERSED_SUM_TEST", dispatch_reversed, collect_sum)

    class Custom(Worker):
        @register(dispatch_mode="REVERSED_SUM_TEST")
        def weigh(self, value):
            return value * (self.rank + 1)

    group = LocalWorkerGroup(ClassWithInitArgs(Custom), world_size=2)
    assert group.weigh([10, 20]) == 20 * 1 + 10 * 2


def test_unknown_modes_fail_where_declared():
    with pytest.raises(ValueError, match=r"Unknown dispatch mode 'NOPE'; known: .*DP_COMPUTE_PROTO"):
        register(dispatch_mode="NOPE")
    with pytest.raises(ValueError, match="Unknown execute mode 'SOME'"):
        register(execute_mode="SOME")
    with pytest.raises(ValueError, match="needs 'dispatch_fn' and 'collect_fn'"):
        get_dispatch_mode({"dispatch_fn": print})


def test_colocated_roles_share_workers_and_spawn_one_group_each():
    combined = create_colocated_worker_cls(
        {"actor": ClassWithInitArgs(Doubler, scale=2), "ref": ClassWithInitArgs(Ref, offset=100)}
    )
    group = LocalWorkerGroup(combined, world_size=2)
    groups = group.spawn({"actor", "ref"})
    assert set(groups) == {"actor", "ref"}
    actor, ref = groups["actor"], groups["ref"]
    assert actor.double(proto(4)).batch["y"].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert ref.shift(proto(4)).batch["y"].tolist() == [100.0, 101.0, 102.0, 103.0]
    assert not hasattr(ref, "double") and not hasattr(actor, "shift")
    assert actor.whoami("a") == [("a", 0, 2), ("a", 1, 2)]  # roles keep their worker's rank
    assert group.workers[0].roles["actor"].seen == [2]  # the same objects serve both views
    with pytest.raises(
        ValueError, match=r"Unknown role 'critic'; this colocated class holds \['actor', 'ref'\]"
    ):
        group.spawn({"critic"})
    with pytest.raises(ValueError, match="is not one"):
        LocalWorkerGroup(ClassWithInitArgs(Doubler)).spawn({"actor"})


def test_bad_worker_classes_and_sizes():
    with pytest.raises(TypeError, match=r"must subclass trellis\.distributed\.Worker"):
        ClassWithInitArgs(dict)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        LocalWorkerGroup(ClassWithInitArgs(Doubler), world_size=0)

    class Clash(Worker):
        @register()
        def spawn(self):  # would shadow the group's own method
            return 1

    with pytest.raises(ValueError, match="clashes with the worker group's own attribute"):
        LocalWorkerGroup(ClassWithInitArgs(Clash))


def test_unequal_dataproto_arguments_are_rejected(group):
    class Two(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def both(self, a, b):
            return a

    two = LocalWorkerGroup(ClassWithInitArgs(Two), world_size=2)
    with pytest.raises(ValueError, match="same number of rows"):
        two.both(proto(3), proto(4))
    out = two.both(proto(4), proto(4))
    assert np.array_equal(out.non_tensor_batch["tag"], proto(4).non_tensor_batch["tag"])
