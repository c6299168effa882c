"""trellis.replay: the built-in replay pools, through the contract and one by one."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from typing import Any, ClassVar

import pytest
import torch

from trellis.replay import (
    FifoReplayPool,
    PrioritizedReplayPool,
    ReplayPool,
    ReplayPoolError,
    UniformReplayPool,
    load_pool,
)
from trellis.testing import ReplayPoolContract
from trellis.testing.replay import groups_equal, make_group

torch.set_num_threads(1)


def ids_of(groups):
    return [i for g in groups for i in g.non_tensor_batch["sample_id"].tolist()]


class TestFifoPool(ReplayPoolContract):
    pool_name = "fifo"
    pool_class = FifoReplayPool


class TestUniformPool(ReplayPoolContract):
    pool_name = "uniform"
    pool_class = UniformReplayPool


class TestPrioritizedPool(ReplayPoolContract):
    pool_name = "prioritized"
    pool_class = PrioritizedReplayPool
    pool_kwargs: ClassVar[dict[str, Any]] = {"priority_key": "score"}


# ---------------------------------------------------------------- order


def test_fifo_returns_oldest_first():
    pool = FifoReplayPool(capacity=10)
    pool.add([make_group([i], version=0) for i in range(6)])
    assert ids_of(pool.sample(2)) == [0, 1]
    pool.add(make_group([6], version=0))
    assert ids_of(pool.sample(10)) == [2, 3, 4, 5, 6]


def test_uniform_is_reproducible_with_a_seed():
    def draws(seed):
        pool = UniformReplayPool(capacity=50, seed=seed)
        pool.add([make_group([i], version=0) for i in range(50)])
        return [ids_of(pool.sample(5)) for _ in range(4)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)
    assert sorted(i for d in draws(3) for i in d) != list(range(20))  # not just the oldest


def test_prioritized_returns_highest_first_ties_by_age():
    pool = PrioritizedReplayPool(capacity=10, priority_key="score")
    for i, score in enumerate([0.5, 2.0, 1.0, 2.0, -1.0]):
        pool.add(make_group([i], version=0, score=score))
    assert ids_of(pool.sample(3)) == [1, 3, 2]
    assert ids_of(pool.sample(3)) == [0, 4]


def test_prioritized_reads_a_tensor_key_as_its_mean_per_group():
    pool = PrioritizedReplayPool(capacity=10, priority_key="responses")
    pool.add([make_group([f"{i}"], version=0) for i in range(4)])
    expected = sorted(
        range(4), key=lambda i: -make_group([f"{i}"], 0).batch["responses"].float().mean().item()
    )
    assert ids_of(pool.sample(4)) == [f"{i}" for i in expected]


# ---------------------------------------------------------------- eviction


def test_eviction_stalest_versus_oldest():
    versions = [3, 1, 2]
    oldest, stalest = FifoReplayPool(3, eviction="oldest"), FifoReplayPool(3, eviction="stalest")
    for pool in (oldest, stalest):
        pool.add([make_group([i], version=v) for i, v in enumerate(versions)])
    assert ids_of(oldest.add(make_group([3], version=4))) == [0]
    assert ids_of(stalest.add(make_group([3], version=4))) == [1]
    # ties by age: two groups at the lowest version, the older goes first
    tied = FifoReplayPool(2, eviction="stalest")
    tied.add([make_group(["x"], 1), make_group(["y"], 1)])
    assert ids_of(tied.add(make_group(["z"], 2))) == ["x"]


# ---------------------------------------------------------------- bad arguments, named


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FifoReplayPool(0), r"capacity must be an int >= 1, got 0"),
        (lambda: FifoReplayPool(True), r"capacity must be an int >= 1, got True"),
        (
            lambda: FifoReplayPool(4, eviction="newest"),
            r"Unknown eviction 'newest'; choose one of oldest, stalest",
        ),
        (lambda: PrioritizedReplayPool(4), r"needs priority_key.*got None"),
        (lambda: UniformReplayPool(4, seed="1"), r"seed must be an int, got '1'"),
    ],
)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ReplayPoolError, match=message):
        make()


def test_bad_groups_are_named():
    from trellis.data.protocol import DataProto

    pool = PrioritizedReplayPool(4, priority_key="advantage")
    with pytest.raises(ReplayPoolError, match=r"Group 0 has no priority: 'advantage'"):
        pool.add(make_group(["a"], 0))
    fifo = FifoReplayPool(4)
    no_ids = DataProto.from_dict({"x": torch.zeros(2)}, meta_info={"weight_version": 0})
    with pytest.raises(ReplayPoolError, match=r"Group 1 has no sample ids: non-tensor key 'sample_id'"):
        fifo.add([make_group(["a"], 0), no_ids])
    no_version = make_group(["b"], 0)
    del no_version.meta_info["weight_version"]
    with pytest.raises(ReplayPoolError, match=r"Group 0 needs meta_info\['weight_version'\].*got None"):
        fifo.add(no_version)
    with pytest.raises(ReplayPoolError, match=r"repeats a sample id"):
        fifo.add(make_group(["c", "c"], 0))
    with pytest.raises(ReplayPoolError, match=r"not a DataProto"):
        fifo.add([{"sample_id": ["d"]}])
    with pytest.raises(ReplayPoolError, match=r"sample\(n\) takes an int >= 0, got -1"):
        fifo.sample(-1)
    with pytest.raises(ReplayPoolError, match=r"max_staleness must be an int >= 0, got -1"):
        fifo.drop_stale(3, -1)
    assert len(fifo) == 0  # nothing of a refused add went in


def test_a_value_torch_load_cannot_read_is_refused_at_save(tmp_path):
    pool = FifoReplayPool(4)
    group = make_group(["a"], 0)
    group.meta_info["odd"] = object()
    pool.add(group)
    with pytest.raises(ReplayPoolError, match=r"torch.load\(weights_only=True\) cannot read back"):
        pool.save(tmp_path / "pool")


# ---------------------------------------------------------------- on disk


def test_load_refuses_another_version_kind_or_a_missing_file(tmp_path):
    pool = UniformReplayPool(4, seed=2)
    pool.add(make_group(["a"], 0))
    pool.save(tmp_path / "p")
    manifest = tmp_path / "p" / "manifest.json"
    data = json.loads(manifest.read_text())
    with pytest.raises(ReplayPoolError, match=r"holds a 'uniform' pool, not a 'fifo' one"):
        FifoReplayPool.load(tmp_path / "p")
    assert isinstance(ReplayPool.load(tmp_path / "p"), UniformReplayPool)
    manifest.write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(
        ReplayPoolError, match=r"manifest.json has replay pool format version 99; this Trellis reads"
    ):
        load_pool(tmp_path / "p")
    manifest.write_text("{not json")
    with pytest.raises(ReplayPoolError, match=r"manifest.json cannot be read"):
        load_pool(tmp_path / "p")
    manifest.write_text(json.dumps(data))
    (tmp_path / "p" / next(iter(data["files"]))).unlink()
    with pytest.raises(ReplayPoolError, match=r"groups-.*\.pt is missing"):
        load_pool(tmp_path / "p")
    with pytest.raises(ReplayPoolError, match=r"manifest.json is missing"):
        load_pool(tmp_path / "nothing")


@pytest.mark.parametrize("fail_at", ["data write", "manifest rename"])
def test_an_interrupted_save_leaves_the_previous_one_intact(tmp_path, monkeypatch, fail_at):
    pool = FifoReplayPool(8)
    pool.add([make_group([i], 0) for i in range(3)])
    pool.save(tmp_path / "p")
    before = sorted(os.listdir(tmp_path / "p"))
    pool.add(make_group([3], 1))
    if fail_at == "data write":
        monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    else:
        real = os.replace

        def replace(src, dst):
            if str(dst).endswith("manifest.json"):
                raise OSError("killed")
            return real(src, dst)

        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        pool.save(tmp_path / "p")
    monkeypatch.undo()
    loaded = load_pool(tmp_path / "p")
    assert loaded.sample_ids() == [0, 1, 2] and loaded.state["adds"] == 3
    # the next save goes through and cleans up what the failed one left
    pool.save(tmp_path / "p")
    assert load_pool(tmp_path / "p").sample_ids() == [0, 1, 2, 3]
    assert len(os.listdir(tmp_path / "p")) == len(before) == 2


def test_groups_keep_their_tensors_columns_and_meta_across_save(tmp_path):
    pool = FifoReplayPool(4)
    group = make_group(["a", "b"], 5, score=1.5)
    group.meta_info["extra"] = {"temperature": 0.7, "tags": ["x", None]}
    pool.add(group)
    pool.save(tmp_path / "p")
    (back,) = load_pool(tmp_path / "p").sample(1)
    assert groups_equal(back, group) and back.non_tensor_batch["sample_id"].dtype == object


# ---------------------------------------------------------------- kill safety


@pytest.mark.parametrize("kind", ["fifo", "uniform", "prioritized"])
def test_random_add_sample_save_load_cycles_lose_and_repeat_nothing(tmp_path, kind):
    """Like a run killed at random moments: every id added is sampled once, evicted, dropped, or
    still in the pool, whichever save the run restarts from."""
    from trellis.registries import replay_pools

    rng = random.Random(kind)
    kwargs = {"priority_key": "score"} if kind == "prioritized" else {}
    pool = replay_pools.get(kind)(capacity=12, eviction=rng.choice(["oldest", "stalest"]), seed=5, **kwargs)
    added: list = []
    out: list = []
    # What was consumed up to the last save: a restart rolls back to it (the trainer's checkpoint
    # holds the pool and the consumer's progress together).
    saved: tuple[list, list] = ([], [])
    for step in range(80):
        groups = [make_group([f"{step}.{j}.{r}" for r in range(rng.randint(1, 2))], step // 4, rng.random())
                  for j in range(rng.randint(0, 3))]  # fmt: skip
        added += ids_of(groups)
        out += ids_of(pool.add(groups))
        out += ids_of(pool.sample(rng.randint(0, 3)))
        if rng.random() < 0.2:
            out += ids_of(pool.drop_stale(step // 4, 3))
        if rng.random() < 0.3:
            pool.save(tmp_path / "pool")
            saved = (list(added), list(out))
        if rng.random() < 0.15 and (tmp_path / "pool").exists():  # killed: resume from the last save
            pool = load_pool(tmp_path / "pool")
            added, out = list(saved[0]), list(saved[1])
    counts = Counter(out + pool.sample_ids())
    assert sorted(counts) == sorted(added) and set(counts.values()) == {1}
