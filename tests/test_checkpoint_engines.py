"""The checkpoint engines: the bucket format, each built-in engine against the contract, and errors.

The contract's round trips run each peer in a thread of this process (real sockets, real shared
memory, real gloo groups); tests/test_checkpoint_sync.py runs them across processes.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from trellis.checkpoint.base import (
    ALIGNMENT,
    BucketReader,
    CheckpointEngine,
    decode_header,
    encode_header,
    fill_bucket,
    iter_buckets,
    resolve_dtype,
)
from trellis.checkpoint.distributed import GlooCheckpointEngine, NcclCheckpointEngine
from trellis.checkpoint.naive import NaiveCheckpointEngine
from trellis.checkpoint.shm import ShmCheckpointEngine
from trellis.errors import WeightSyncError
from trellis.testing import CheckpointEngineContract
from trellis.testing.checkpoint import assert_bit_identical, contract_state_dict

# ---------------------------------------------------------------- the contract, per engine


class _BuiltinContract(CheckpointEngineContract):
    def test_resolves_in_fresh_process(self) -> None:
        pytest.skip("checked for every built-in at once by test_builtin_engines_resolve_in_a_fresh_process")


def test_builtin_engines_resolve_in_a_fresh_process(python):
    names = ("naive", "shm", "gloo", "nccl")
    done = python(
        "from trellis.registries import checkpoint_engines as r\n"
        f"for n in {names!r}: print(r.get(n).__module__ + ':' + r.get(n).__qualname__)"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "trellis.checkpoint.naive:NaiveCheckpointEngine",
        "trellis.checkpoint.shm:ShmCheckpointEngine",
        "trellis.checkpoint.distributed:GlooCheckpointEngine",
        "trellis.checkpoint.distributed:NcclCheckpointEngine",
    ]


class TestNaiveEngine(_BuiltinContract):
    engine_name = "naive"
    engine_class = NaiveCheckpointEngine
    receivers = 1
    topology_cases = ((1, 1), (3, 1))
    cross_process = False


class TestShmEngine(_BuiltinContract):
    engine_name = "shm"
    engine_class = ShmCheckpointEngine


class TestGlooEngine(_BuiltinContract):
    engine_name = "gloo"
    engine_class = GlooCheckpointEngine


class TestNcclEngine(_BuiltinContract):
    engine_name = "nccl"
    engine_class = NcclCheckpointEngine
    device = "cuda"
    receivers = 1

    def skip_reason(self) -> str | None:
        reason = super().skip_reason()
        if reason is None and torch.cuda.device_count() < self.receivers + 1:
            reason = (
                f"needs {self.receivers + 1} CUDA devices (one per peer), found {torch.cuda.device_count()}"
            )
        return reason

    def peer_devices(self, count: int) -> list[str]:
        return [f"cuda:{i}" for i in range(count)]


def test_nccl_says_why_it_cannot_run_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert (
        "CUDA" in NcclCheckpointEngine.unavailable_reason()
        or "NCCL" in NcclCheckpointEngine.unavailable_reason()
    )
    with pytest.raises(WeightSyncError, match=r"^nccl checkpoint engine: "):
        NcclCheckpointEngine().prepare()


# ---------------------------------------------------------------- the bucket format


def _round_trip_buckets(state: dict[str, torch.Tensor], bucket_bytes: int, dtype=None):
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8)
    reader = BucketReader()
    received, sizes = [], []
    for bucket in iter_buckets(iter(state.items()), bucket_bytes, dtype=dtype):
        buffer.fill_(0xAB)  # the reader must not depend on what the buffer held before
        used = fill_bucket(bucket, buffer)
        sizes.append(used)
        chunks = decode_header(encode_header(bucket))
        assert chunks == [chunk for chunk, _ in bucket]
        received += reader.read(chunks, buffer)
    reader.finish()
    return received, sizes


@pytest.mark.parametrize("bucket_bytes", [1, 7, 100, 2567, 7680, 10**6])
def test_buckets_round_trip_bit_exact(bucket_bytes):
    state = contract_state_dict(0)
    received, sizes = _round_trip_buckets(state, bucket_bytes)
    assert_bit_identical(state, received)
    assert all(0 <= size <= bucket_bytes for size in sizes)
    assert all(t.is_contiguous() for _, t in received)


def test_buckets_pack_tensors_back_to_back_aligned():
    state = {
        "a": torch.ones(3),
        "b": torch.ones(5, dtype=torch.float64),
        "c": torch.ones(2, dtype=torch.int8),
    }
    (bucket,) = list(iter_buckets(iter(state.items()), 1000))
    assert [(c.name, c.offset, c.nbytes, c.start, c.total) for c, _ in bucket] == [
        ("a", 0, 12, 0, 12),
        ("b", ALIGNMENT, 40, 0, 40),
        ("c", 2 * ALIGNMENT, 2, 0, 2),
    ]


def test_a_tensor_that_fits_a_fresh_bucket_is_not_split():
    state = {"a": torch.ones(10), "b": torch.ones(20)}  # 40 + 80 bytes; buckets of 100
    buckets = list(iter_buckets(iter(state.items()), 100))
    assert [[(c.name, c.start, c.nbytes) for c, _ in b] for b in buckets] == [[("a", 0, 40)], [("b", 0, 80)]]


def test_a_tensor_larger_than_a_bucket_is_split_and_fills_the_current_one():
    state = {"a": torch.ones(4), "b": torch.arange(60, dtype=torch.float32)}  # 16 + 240 bytes
    buckets = list(iter_buckets(iter(state.items()), 100))
    layout = [[(c.name, c.offset, c.start, c.nbytes) for c, _ in b] for b in buckets]
    assert layout == [
        [("a", 0, 0, 16), ("b", 64, 0, 36)],
        [("b", 0, 36, 100)],
        [("b", 0, 136, 100)],
        [("b", 0, 236, 4)],
    ]


def test_dtype_conversion_casts_only_floating_tensors():
    state = contract_state_dict(1)
    received, _ = _round_trip_buckets(state, 2000, dtype=torch.bfloat16)
    assert_bit_identical(state, received, dtype=torch.bfloat16)
    dtypes = dict((name, t.dtype) for name, t in received)
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16
    assert dtypes["model.rotary_emb.inv_freq"] == torch.bfloat16
    assert dtypes["model.token_type_ids"] == torch.int64
    assert dtypes["model.layers.0.mask"] == torch.bool


def test_received_tensors_outlive_the_buffer():
    state = {"a": torch.arange(8, dtype=torch.float32), "b": torch.arange(8, 16, dtype=torch.float32)}
    buffer = torch.empty(64, dtype=torch.uint8)
    reader = BucketReader()
    received = []
    for bucket in iter_buckets(iter(state.items()), 32):
        fill_bucket(bucket, buffer)
        received += reader.read([c for c, _ in bucket], buffer)
    buffer.zero_()
    assert torch.equal(received[0][1], state["a"]) and torch.equal(received[1][1], state["b"])


def test_iter_buckets_is_lazy():
    pulled = []

    def source():
        for i in range(6):
            pulled.append(i)
            yield f"t{i}", torch.ones(25)  # 100 bytes each: one bucket apiece

    buckets = iter_buckets(source(), 100)
    next(buckets)
    assert pulled == [0, 1]  # the second tensor showed the first bucket was full


def test_reader_rejects_out_of_order_chunks():
    state = {"a": torch.arange(60, dtype=torch.float32)}
    buckets = list(iter_buckets(iter(state.items()), 100))
    buffer = torch.empty(100, dtype=torch.uint8)
    reader = BucketReader()
    with pytest.raises(ValueError, match="out of order"):
        reader.read([c for c, _ in buckets[1]], buffer)
    reader = BucketReader()
    reader.read([c for c, _ in buckets[0]], buffer)
    with pytest.raises(ValueError, match=r"ended inside 'a' \(100 of 240 bytes\)"):
        reader.finish()


def test_decode_header_rejects_garbage():
    with pytest.raises(ValueError, match="not a bucket header"):
        decode_header(b"\x00garbage")


def test_resolve_dtype():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype(torch.float32) is torch.float32
    assert resolve_dtype(None) is None
    with pytest.raises(ValueError, match="Unknown dtype 'bfloat17'"):
        resolve_dtype("bfloat17")


# ---------------------------------------------------------------- construction and misuse


def test_bucket_size_from_megabytes_or_bytes():
    assert ShmCheckpointEngine(bucket_megabytes=2).bucket_bytes == 2 * 2**20
    assert ShmCheckpointEngine(bucket_megabytes=2, bucket_bytes=100).bucket_bytes == 100
    with pytest.raises(ValueError, match="at least 1 byte, got 0"):
        GlooCheckpointEngine(bucket_bytes=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        NaiveCheckpointEngine(timeout_s=0)


@pytest.mark.parametrize("cls", [NaiveCheckpointEngine, ShmCheckpointEngine, GlooCheckpointEngine])
def test_sending_before_init_process_group_names_the_engine(cls):
    engine = cls()
    with pytest.raises(WeightSyncError, match=f"^{cls.name} checkpoint engine: .*init_process_group"):
        asyncio.run(engine.send_weights(iter([])))
    engine.finalize()


@pytest.mark.parametrize("cls", [NaiveCheckpointEngine, ShmCheckpointEngine, GlooCheckpointEngine])
def test_unknown_role_is_rejected(cls):
    with pytest.raises(ValueError, match="unknown role 'middle'; expected sender, receiver or idle"):
        cls().init_process_group(role="middle")


def test_naive_topology_has_one_receiver():
    with pytest.raises(ValueError, match="one receiver"):
        NaiveCheckpointEngine.build_topology(1, 2, NaiveCheckpointEngine().prepare())


def test_builtin_engines_are_checkpoint_engines():
    for cls in (NaiveCheckpointEngine, ShmCheckpointEngine, GlooCheckpointEngine, NcclCheckpointEngine):
        assert issubclass(cls, CheckpointEngine)


def test_shm_segments_are_unlinked_once_receivers_attach_and_at_finalize(tmp_path):
    import threading

    sender = ShmCheckpointEngine(bucket_bytes=4096, timeout_s=10, shm_dir=str(tmp_path))
    metadata = sender.prepare()
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in metadata["segments"])
    trainer, rollout = ShmCheckpointEngine.build_topology(1, 1, metadata)
    receiver = ShmCheckpointEngine(timeout_s=10)
    thread = threading.Thread(target=receiver.init_process_group, kwargs=rollout[0])
    thread.start()
    sender.init_process_group(**trainer[0])
    thread.join()
    assert os.listdir(tmp_path) == []  # mapped by everyone: the names are gone, the memory is not
    state = contract_state_dict(0)

    async def step():
        received = []

        async def take():
            async for item in receiver.receive_weights():
                received.append(item)

        await asyncio.gather(sender.send_weights(iter(state.items())), take())
        return received

    assert_bit_identical(state, asyncio.run(step()))
    receiver.finalize()
    sender.finalize()

    unused = ShmCheckpointEngine(bucket_bytes=4096, shm_dir=str(tmp_path))
    unused.prepare()
    assert len(os.listdir(tmp_path)) == 2
    unused.finalize()
    assert os.listdir(tmp_path) == []


def test_shm_reports_a_full_shm_dir(tmp_path):
    engine = ShmCheckpointEngine(bucket_bytes=4096, shm_dir=str(tmp_path / "missing"))
    with pytest.raises(WeightSyncError, match=r"^shm checkpoint engine: cannot set up 2 x 4096 bytes"):
        engine.prepare()
    engine.finalize()


@pytest.mark.parametrize("cls", [ShmCheckpointEngine, GlooCheckpointEngine])
def test_receivers_take_the_senders_bucket_size(cls):
    import threading

    sender = cls(bucket_bytes=3000, timeout_s=10)
    receiver = cls(bucket_bytes=100, timeout_s=10)  # ignored: the sender's buckets decide
    trainer, rollout = cls.build_topology(1, 1, sender.prepare())
    thread = threading.Thread(target=receiver.init_process_group, kwargs=rollout[0])
    thread.start()
    sender.init_process_group(**trainer[0])
    thread.join()
    state = contract_state_dict(0)

    async def step():
        async def take():
            return [item async for item in receiver.receive_weights()]

        return (await asyncio.gather(sender.send_weights(iter(state.items())), take()))[1]

    try:
        assert receiver.bucket_bytes == 3000
        assert_bit_identical(state, asyncio.run(step()))
    finally:
        receiver.finalize()
        sender.finalize()


def test_a_failed_init_leaves_the_engine_unusable_with_the_reason(tmp_path):
    receiver = ShmCheckpointEngine(timeout_s=5)
    kwargs = {"host": "127.0.0.1", "port": 9, "bucket_bytes": 64, "token": "00" * 16}
    with pytest.raises(WeightSyncError, match="receiver 0 cannot reach the sender's segments"):
        receiver.init_process_group(role="receiver", rank=0, segments=[str(tmp_path / "gone")], **kwargs)

    async def drain():
        async for _ in receiver.receive_weights():
            pass

    with pytest.raises(WeightSyncError, match=r"unusable after an earlier error \(init_process_group failed"):
        asyncio.run(drain())
