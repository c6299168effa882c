"""Weight sync end to end: engines across real processes, and WeightSyncManager in one process.

Process tests spawn one sender and one or two receivers (multiprocessing ``spawn``) through
:func:`trellis.testing.checkpoint.run_weight_transfer`, which reaps every process even on failure.
"""

from __future__ import annotations

import asyncio
import glob
import time

import pytest
import torch

from trellis.checkpoint import WeightSyncManager
from trellis.checkpoint.distributed import GlooCheckpointEngine
from trellis.checkpoint.shm import ShmCheckpointEngine
from trellis.config.schema import CheckpointEngineConfig
from trellis.errors import UnknownComponentError, WeightSyncError
from trellis.testing.checkpoint import (
    RecordingReplica,
    assert_bit_identical,
    contract_state_dict,
    run_weight_transfer,
)

STATE = contract_state_dict(0)
LARGEST = max(t.numel() * t.element_size() for t in STATE.values())  # 7680 bytes
TOTAL = sum(t.numel() * t.element_size() for t in STATE.values())
BUCKETS = {"smaller than one tensor": LARGEST // 3 + 7, "equal": LARGEST, "larger than the model": 2 * TOTAL}
ENGINE_TIMEOUT_S = 20.0  # peers die in these tests: failures must come from the death, not this


def _leftover_segments() -> set[str]:
    return set(glob.glob("/dev/shm/trellis-wsync-*"))


# ---------------------------------------------------------------- across processes


def test_one_sender_two_receivers_across_processes_bit_identical():
    """gloo and shm, three bucket sizes each, two steps per engine; then the manager's halves.

    One set of spawned processes (1 sender, 2 receivers) serves every case: spawning is the slow part.
    """
    before = _leftover_segments()
    cases = [
        {"engine": engine, "bucket_bytes": size, "timeout_s": ENGINE_TIMEOUT_S}
        for engine in ("gloo", "shm")
        for size in BUCKETS.values()
    ]
    halves = {"engine": "shm", "via_manager": True, "bucket_bytes": LARGEST // 2, "dtype": "bfloat16"}
    cases.append({**halves, "timeout_s": ENGINE_TIMEOUT_S})
    report = run_weight_transfer("shm", cases, receivers=2, steps=2, peers="processes").check()
    assert len(report.received) == len(cases)
    for case, options in enumerate(cases[:-1]):
        for receiver in range(2):
            for step in range(2):
                try:
                    assert_bit_identical(contract_state_dict(step), report.received[case][receiver][step])
                except AssertionError as exc:
                    raise AssertionError(f"case {options}, receiver {receiver}, step {step}: {exc}") from None

    # the manager's halves: WeightSyncManager.send in the sender, .receive into a replica
    sent = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in STATE.items()}
    nbytes = {n: t.numel() * t.element_size() for n, t in sent.items()}
    for receiver in range(2):
        for step in range(2):
            assert_bit_identical(
                contract_state_dict(step), report.received[-1][receiver][step], dtype=torch.bfloat16
            )
        events, calls = report.events[-1][receiver][0], report.calls[-1][receiver][0]
        assert events == ["wake_up"] + ["update_weights"] * len(calls) + ["resume"]
        assert len(calls) >= 3, calls  # bucket by bucket, never the whole model in one call
        for call in calls[:-1]:
            assert sum(nbytes[n] for n in call) >= halves["bucket_bytes"]
            assert sum(nbytes[n] for n in call[:-1]) < halves["bucket_bytes"]  # closed once full
    assert _leftover_segments() <= before


@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_a_sender_that_dies_fails_every_receiver_fast(engine):
    before = _leftover_segments()
    start = time.monotonic()
    report = run_weight_transfer(
        engine,
        [{"bucket_bytes": 512, "timeout_s": ENGINE_TIMEOUT_S}],
        receivers=2,
        peers=["process", "thread", "thread"],
        die=("sender", 5),
    )
    elapsed = time.monotonic() - start
    assert report.errors["sender"][0] == "exit 17"
    for receiver in range(2):
        kind, message, _ = report.errors[f"receiver {receiver}"]
        assert kind == "WeightSyncError", (kind, message)
        assert message.startswith(f"{engine} checkpoint engine: "), message
    assert elapsed < ENGINE_TIMEOUT_S, f"the receivers noticed only after {elapsed:.1f} s"
    assert _leftover_segments() <= before


@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_a_receiver_that_dies_fails_the_sender_fast(engine):
    start = time.monotonic()
    report = run_weight_transfer(
        engine,
        [{"bucket_bytes": 512, "timeout_s": ENGINE_TIMEOUT_S}],
        receivers=1,
        peers=["thread", "process"],
        die=("receiver", 3),
    )
    elapsed = time.monotonic() - start
    assert report.errors["receiver 0"][0] == "exit 17"
    kind, message, _ = report.errors["sender"]
    assert kind == "WeightSyncError", (kind, message)
    assert message.startswith(f"{engine} checkpoint engine: "), message
    assert elapsed < ENGINE_TIMEOUT_S, f"the sender noticed only after {elapsed:.1f} s"


# ---------------------------------------------------------------- WeightSyncManager, one process


ENGINES = ["naive", "shm", "gloo"]


def _manager(engine: str, **kwargs) -> WeightSyncManager:
    return WeightSyncManager(engine, **{"bucket_bytes": 2000, "timeout_s": ENGINE_TIMEOUT_S, **kwargs})


@pytest.mark.parametrize("engine", ENGINES)
def test_sync_feeds_every_replica_bucket_by_bucket_and_reuses_the_engines(engine):
    replicas = [RecordingReplica(), RecordingReplica()]
    with _manager(engine) as manager:

        async def steps():
            stats = [
                await manager.sync(iter(contract_state_dict(step).items()), replicas) for step in range(2)
            ]
            return stats, manager._local

        stats, pair = asyncio.run(steps())
        assert pair is not None and manager._local is pair  # set up once, kept across steps
    assert manager._local is None
    assert stats[0].tensors == len(STATE) and stats[0].bytes == TOTAL
    for replica in replicas:
        assert replica.events[0] == "wake_up" and replica.events[-1] == "resume"
        per_step = len(replica.calls) // 2
        assert per_step > 3
        assert_bit_identical(STATE, [p for call in replica.calls[:per_step] for p in call])
        assert_bit_identical(contract_state_dict(1), [p for call in replica.calls[per_step:] for p in call])


@pytest.mark.parametrize("engine", ENGINES)
def test_sync_casts_to_dtype(engine):
    replica = RecordingReplica()
    with _manager(engine, dtype=torch.bfloat16) as manager:
        asyncio.run(manager.sync(iter(STATE.items()), replica))
    assert_bit_identical(STATE, replica.loaded, dtype=torch.bfloat16)


class _FailingReplica(RecordingReplica):
    def __init__(self, fail_in: str) -> None:
        super().__init__()
        self.fail_in = fail_in

    async def wake_up(self) -> None:
        if self.fail_in == "wake_up":
            raise RuntimeError("cannot wake up")
        await super().wake_up()

    async def update_weights(self, named_tensors) -> None:
        await super().update_weights(named_tensors)
        if self.fail_in == "update_weights" and len(self.calls) == 2:
            raise KeyError("model.unknown.weight")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fail_in", ["wake_up", "update_weights"])
def test_sync_raises_the_replica_error_at_once_and_recovers(engine, fail_in):
    expected = RuntimeError if fail_in == "wake_up" else KeyError
    with _manager(engine) as manager:
        start = time.monotonic()
        with pytest.raises(expected):
            asyncio.run(manager.sync(iter(STATE.items()), [_FailingReplica(fail_in)]))
        assert time.monotonic() - start < ENGINE_TIMEOUT_S / 2, "waited for a timeout instead of failing fast"
        assert manager._local is None  # torn down
        replica = RecordingReplica()
        asyncio.run(manager.sync(iter(STATE.items()), [replica]))
    assert_bit_identical(STATE, replica.loaded)


@pytest.mark.parametrize("engine", ENGINES)
def test_sync_raises_the_iterator_error(engine):
    def broken():
        yield from list(STATE.items())[:5]
        raise RuntimeError("all-gather failed")

    with _manager(engine) as manager:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="all-gather failed"):
            asyncio.run(manager.sync(broken(), [RecordingReplica()]))
        assert time.monotonic() - start < ENGINE_TIMEOUT_S / 2
        replica = RecordingReplica()
        asyncio.run(manager.sync(iter(STATE.items()), [replica]))
    assert_bit_identical(STATE, replica.loaded)


class _Engine:
    """A receiving engine that logs each tensor as the receiver reads it (and can fail after some)."""

    def __init__(self, log: list[str], fail_after: int | None = None) -> None:
        self.log, self.fail_after = log, fail_after

    async def receive_weights(self):
        for i, (name, tensor) in enumerate(STATE.items()):
            if i == self.fail_after:
                raise WeightSyncError("the sender is gone")
            self.log.append(f"read {name}")
            yield name, tensor


class _HeldReplica(RecordingReplica):
    """A replica whose hold waits for ``release`` (rows in flight finishing), logging each hook."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log, self.release, self.weight_version = log, asyncio.Event(), 3

    async def begin_weight_update(self) -> None:
        self.log.append("begin")
        await self.release.wait()
        self.log.append("held")

    async def end_weight_update(self, version) -> None:
        self.log.append(f"end {version}")

    async def update_weights(self, named_tensors) -> None:
        self.log.append("load")
        await super().update_weights(named_tensors)


@pytest.mark.parametrize("staged", [False, True])
def test_a_staged_receive_reads_every_bucket_before_the_hold_and_loads_after_it(staged):
    log: list[str] = []
    replica = _HeldReplica(log)

    async def main():
        task = asyncio.ensure_future(
            _manager("naive").receive(_Engine(log), [replica], version=4, staged=staged)
        )
        for _ in range(50):  # the hold waits (rows in flight): let the receive run as far as it can
            await asyncio.sleep(0)
        during = list(log)
        replica.release.set()
        return during, await task

    during, stats = asyncio.run(main())
    reads = [f"read {name}" for name in STATE]
    if staged:  # the sender is released while the hold still waits; nothing loads before it
        assert during == ["begin", *reads]
    else:
        assert during == ["begin"]  # the hold first: the sender would wait with it
    assert log[: len(during) + 1] == [*during, "held"] and log[-1] == "end 4"
    assert log.count("load") == len(replica.calls) > 3 and stats.tensors == len(STATE)
    assert_bit_identical(STATE, replica.loaded)


def test_a_staged_receive_that_fails_to_read_ends_the_waiting_hold_with_the_old_version():
    log: list[str] = []
    replica = _HeldReplica(log)
    with pytest.raises(WeightSyncError, match="the sender is gone"):
        asyncio.run(_manager("naive").receive(_Engine(log, fail_after=3), [replica], version=4, staged=True))
    # never held, nothing loaded, the version kept
    assert log == ["begin", *[f"read {name}" for name in list(STATE)[:3]], "end 3"]


def test_sync_loads_the_trainer_weights_into_an_hf_replica(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from trellis.config.schema import ModelConfig, RolloutConfig
    from trellis.rollout.hf import HFRolloutReplica

    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn(param.shape, generator=generator))

    async def main():
        replica = HFRolloutReplica(
            0, RolloutConfig(seed=0), ModelConfig(path=tiny_model_path, dtype="float32")
        )
        await replica.init("colocated")
        try:
            with WeightSyncManager(
                CheckpointEngineConfig(name="shm", update_weights_bucket_megabytes=1)
            ) as manager:
                stats = await manager.sync(trainer.state_dict().items(), [replica])
            return replica.model.state_dict(), stats
        finally:
            await replica.shutdown()

    loaded, stats = asyncio.run(main())
    expected = trainer.state_dict()
    assert stats.tensors == len(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_manager_from_config_and_overrides():
    config = CheckpointEngineConfig(name="shm", update_weights_bucket_megabytes=3)
    manager = WeightSyncManager(config)
    assert manager.engine_class is ShmCheckpointEngine and manager.engine_name == "shm"
    assert manager.bucket_bytes == 3 * 2**20 and manager.create_engine().bucket_bytes == 3 * 2**20
    assert WeightSyncManager(config, bucket_megabytes=1).bucket_bytes == 2**20
    assert WeightSyncManager().engine_name == "naive"
    assert WeightSyncManager(GlooCheckpointEngine).engine_name == "gloo"
    with pytest.raises(UnknownComponentError, match="shm"):
        WeightSyncManager("shmm")


def test_plan_gives_every_rank_its_kwargs():
    manager = WeightSyncManager("gloo", bucket_bytes=1024)
    engine, trainer, rollout = manager.plan(2, 3)
    try:
        assert [kw["role"] for kw in trainer] == ["sender", "idle"]
        assert [kw["rank"] for kw in rollout] == [1, 2, 3]
        assert {kw["world_size"] for kw in rollout} == {4}
    finally:
        engine.finalize()


def test_weight_sync_errors_are_trellis_errors():
    from trellis.errors import TrellisError

    assert issubclass(WeightSyncError, TrellisError) and issubclass(WeightSyncError, RuntimeError)
