"""The async trainer's rollout stream (``trellis.trainer.streaming``) against a scripted generator: the
staleness gate, drops and regeneration, replay, metrics, errors and the checkpoint state."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from trellis.data.protocol import DataProto
from trellis.registries import replay_pools
from trellis.replay import UniformReplayPool
from trellis.trainer.streaming import RolloutStream, RolloutStreamError

N = 2  # responses per prompt


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


class Loader:
    """Endless batches of ``size`` prompts whose ``index`` counts up; resumable."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = int(state["position"])

    def batches(self):
        while True:
            start = self.position * self.size
            self.position += 1
            index = np.arange(start, start + self.size, dtype=np.int64)
            yield DataProto.from_dict(non_tensors={"index": index}, meta_info={})


class Replica:
    """A scripted generator: records every call, serves ``version``, holds groups listed in ``held``
    until released, and fails for the dataset indices in ``fail``."""

    def __init__(self) -> None:
        self.version = 0
        self.calls: list[int] = []  # dataset index of each group generated, in order
        self.held: dict[int, threading.Event] = {}
        self.fail: set[int] = set()
        self.tokens_version: dict[int, list[int]] = {}  # index -> per-token versions to return

    async def generate(self, prompts: DataProto) -> DataProto:
        index = int(prompts.non_tensor_batch["index"][0])
        self.calls.append(index)
        version = self.version
        gate = self.held.get(index)
        if gate is not None:
            while not gate.is_set():
                await asyncio.sleep(0.005)
        if index in self.fail:
            raise RuntimeError(f"replica lost its mind on {index}")
        versions = self.tokens_version.get(index, [version, version])
        rows = len(prompts)
        return DataProto.from_dict(
            tensors={
                "responses": torch.full((rows, 2), index),
                "rollout_weight_versions": torch.tensor([versions] * rows),
            },
            non_tensors={k: v.copy() for k, v in prompts.non_tensor_batch.items()},
            meta_info={"metrics": {"agent/num_turns/mean": 2.0}},
        )


def make_stream(replica, batch_size=2, *, staleness=1, policy="drop", replay=0, capacity=None, version=0):
    loader = Loader(batch_size)
    pool = replay_pools.get("fifo")(capacity or (staleness + 2) * batch_size, eviction="stalest")
    memory = UniformReplayPool(16, eviction="stalest") if replay else None
    stream = RolloutStream(
        replica.generate,
        loader.batches(),
        loader,
        group_size=N,
        batch_size=batch_size,
        max_staleness=staleness,
        stale_policy=policy,
        pool=pool,
        memory=memory,
        replay_count=replay,
        version=version,
    )
    return stream, loader


def settle(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the stream")
        time.sleep(0.005)
    time.sleep(0.05)  # and nothing more happens meanwhile


def indices(groups):
    return [int(g.non_tensor_batch["index"][0]) for g in groups]


def ids(groups):
    return [sid for g in groups for sid in g.non_tensor_batch["sample_id"]]


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_the_gate_runs_at_most_max_staleness_versions_ahead(staleness):
    replica = Replica()
    stream, _ = make_stream(replica, staleness=staleness)
    stream.start()
    try:
        settle(lambda: len(replica.calls) >= (staleness + 1) * 2)
        assert replica.calls == list(range((staleness + 1) * 2))  # (s + 1) steps' groups, no more
        groups, metrics = stream.take(1)
        assert indices(groups) == [0, 1]
        assert ids(groups) == ["0:0", "0:1", "1:0", "1:1"]
        assert [g.non_tensor_batch["uid"][0] for g in groups] == ["1-0", "1-1"]  # as sync labels them
        assert metrics["async/staleness/mean"] == 0.0 and metrics["async/staleness/hist_0"] == 1.0
        assert metrics["async/queue_depth"] == (staleness + 1) * 2
        assert metrics["agent/num_turns/mean"] == 2.0
        time.sleep(0.1)
        assert len(replica.calls) == (staleness + 1) * 2  # taken, but the weights are still version 0
        replica.version = 1
        stream.set_version(1)
        settle(lambda: len(replica.calls) >= (staleness + 2) * 2)
        assert len(replica.calls) == (staleness + 2) * 2
    finally:
        stream.stop()


def test_rows_carry_the_seed_labels_of_their_sync_step():
    seen = []
    replica = Replica()

    async def generate(prompts):
        seen.append((prompts.meta_info["global_steps"], prompts.non_tensor_batch["__row__"].tolist()))
        return await replica.generate(prompts)

    stream, _ = make_stream(replica, batch_size=3, staleness=1)
    stream.generate = generate
    stream.start()
    try:
        settle(lambda: len(seen) >= 6)
    finally:
        stream.stop()
    # group g is the (g % 3)-th prompt of step g // 3 + 1: rows numbered as in that step's batch
    assert sorted(seen) == [(1, [0, 1]), (1, [2, 3]), (1, [4, 5]), (2, [0, 1]), (2, [2, 3]), (2, [4, 5])]


def test_staleness_is_the_oldest_token_of_each_sample():
    replica = Replica()
    replica.tokens_version = {0: [0, 0], 1: [0, 1]}
    stream, _ = make_stream(replica, staleness=3)
    stream.start()
    try:
        _, metrics = stream.take(3)  # proximal version 2
    finally:
        stream.stop()
    assert metrics["async/staleness/max"] == 2.0
    assert metrics["async/staleness/mean"] == 2.0
    assert metrics["async/staleness/hist_2"] == 1.0 and metrics["async/staleness/hist_0"] == 0.0


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_a_group_staler_than_the_bound_is_dropped_or_regenerated(policy):
    replica = Replica()
    replica.held[0] = threading.Event()  # group 0 (version 0) arrives late
    stream, _ = make_stream(replica, batch_size=1, staleness=1, policy=policy)
    stream.start()
    try:
        trained = []
        for step in (1, 2):
            groups, metrics = stream.take(step)
            trained += indices(groups)
            replica.version = step
            stream.set_version(step)
        assert trained == [1, 2]  # fifo by arrival: group 0 is still generating
        replica.held[0].set()
        settle(lambda: len(stream.pool) >= 2)
        groups, metrics = stream.take(3)  # proximal 2: group 0 (version 0) lags 2 > 1
        trained += indices(groups)
        if policy == "drop":
            assert metrics["async/dropped_groups"] == 1.0 and metrics["async/dropped_groups_total"] == 1.0
            assert metrics["async/regenerated_groups"] == 0.0
            assert 0 not in trained
        else:
            assert metrics["async/regenerated_groups"] == 1.0 and metrics["async/dropped_groups"] == 0.0
            stream.set_version(3)
            replica.version = 3
            groups, _ = stream.take(4)
            trained += indices(groups)
            assert replica.calls.count(0) == 2  # generated again, first in line
            assert 0 in trained
        assert metrics["async/staleness/max"] <= 1.0
    finally:
        stream.stop()


def test_replay_draws_trained_groups_again():
    replica = Replica()
    stream, _ = make_stream(replica, batch_size=3, staleness=2, replay=1)
    stream.start()
    try:
        first, metrics = stream.take(1)
        assert len(first) == 2 and metrics["async/replayed_groups"] == 0.0  # nothing trained yet
        stream.set_version(1)
        second, metrics = stream.take(2)
    finally:
        stream.stop()
    assert len(second) == 3 and metrics["async/replayed_groups"] == 1.0
    assert indices(second)[:2] == [2, 3] and indices(second)[2] in indices(first)


def test_a_failed_group_is_raised_by_the_next_take_with_its_name():
    replica = Replica()
    replica.fail = {1}
    stream, _ = make_stream(replica, staleness=0)
    stream.start()
    try:
        expected = r"group 1 \(dataset index 1\).*replica lost its mind on 1"
        with pytest.raises(RolloutStreamError, match=expected):
            stream.take(1)
    finally:
        stream.stop()


def test_state_dict_resumes_with_no_sample_lost_and_none_trained_twice():
    replica = Replica()
    replica.held[3] = threading.Event()  # in flight at the save
    stream, _ = make_stream(replica, batch_size=2, staleness=2)
    stream.start()
    trained = []
    try:
        groups, _ = stream.take(1)
        trained += ids(groups)
        replica.version = 1
        stream.set_version(1)
        settle(lambda: len(stream.pool) >= 3)  # groups 2, 4, 5... buffered; 3 held
        state = stream.state_dict()
        groups, _ = stream.take(2)  # trained after the save: lost with the killed run
    finally:
        replica.held[3].set()
        stream.stop()
    state = _reloaded(state)  # as a checkpoint stores it
    replica = Replica()
    replica.version = 1  # the restarted replica serves the checkpoint's weights (version 1), so no group
    # it generates can fall past max_staleness before step 4 however the threads interleave (with version
    # 0, group 3 was dropped as stale whenever it finished after the groups buffered before it)
    resumed, _ = make_stream(replica, batch_size=2, staleness=2, version=1)
    resumed.load_state_dict(state)
    assert resumed.pool.sample_ids() and "3:0" not in resumed.pool.sample_ids()
    resumed.start()
    try:
        for step in (2, 3, 4):
            groups, _ = resumed.take(step)
            trained += ids(groups)
            replica.version = step
            resumed.set_version(step)
        final = resumed.state_dict()
    finally:
        resumed.stop()
    assert replica.calls[0] == 3  # the prompt in flight at the save is generated first
    assert len(trained) == len(set(trained)) == 4 * 2 * N  # none trained twice
    # what the final checkpoint holds (the live pool may gain groups between that save and the stop)
    held = set(_buffered(final)) | {f"{g}:{j}" for g in _pending(final) for j in range(N)}
    everything = {f"{g}:{j}" for g in range(final["next_group"]) for j in range(N)}
    assert set(trained) | held == everything and not set(trained) & held  # none lost


def _reloaded(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _buffered(state):
    from trellis.replay import ReplayPool

    return ReplayPool.from_state_dict(state["buffer"]).sample_ids()


def _pending(state):
    from trellis.replay import ReplayPool

    pool = ReplayPool.from_state_dict(state["pending"])
    return [int(v) for v in pool.sample_ids()]
