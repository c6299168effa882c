"""The checkpoint-engine protocol: how fresh weights travel from the trainer to the rollout replicas.

After each update the trainer streams its weights to every rollout replica. A checkpoint engine
(registry ``trellis.checkpoint_engines``) is one transport for that stream; one engine instance
is one end of it. The lifecycle, set up once and then reused every step::

    sender = cls(bucket_megabytes=512, dtype=torch.bfloat16)      # trainer rank 0
    metadata = sender.prepare()                                     # on the sender only
    trainer_kwargs, rollout_kwargs = cls.build_topology(trainer_world_size, rollout_world_size, metadata)
    # every end, concurrently (the calls rendezvous):
    sender.init_process_group(**trainer_kwargs[0])                  # trainer rank r: trainer_kwargs[r]
    receiver.init_process_group(**rollout_kwargs[i])                # rollout rank i, receiver = cls(...)
    # each step, concurrently:
    await sender.send_weights(engine.iter_full_params())            # every trainer rank
    async for name, tensor in receiver.receive_weights(): ...       # every rollout rank
    # at the end:
    sender.finalize(); receiver.finalize()

Trainer ranks other than 0 take part only by iterating: their ``send_weights`` consumes the
iterator (FSDP gathers each tensor collectively, so every rank must) and sends nothing.

Weights travel in *buckets*: flat byte buffers of ``bucket_bytes`` holding several tensors back
to back (see :func:`iter_buckets`); a tensor larger than a bucket is split across buckets and
reassembled by the receiver (:class:`BucketReader`), so neither side ever holds a second copy of
the whole model: at most two buckets and one tensor. Floating tensors are cast to ``dtype`` on the
sender, before packing. Received tensors stay valid after the next bucket arrives.

Every wait on a peer is bounded by ``timeout_s``, a receiver's wait for the step to begin included
(start receiving when the sender starts sending); a dead peer, a timeout or a garbled bucket raises
:class:`~trellis.errors.WeightSyncError` naming the engine and the cause. After such an error the
engine is unusable: finalize it and build a new one.
"""

from __future__ import annotations

import abc
import json
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from trellis.errors import WeightSyncError

DEFAULT_TIMEOUT_S = 300.0
"""Seconds any engine waits on a peer (a connection, a bucket, an acknowledgement) before giving up."""

ALIGNMENT = 64
"""Byte alignment of each tensor's first byte inside a bucket (cache lines; any dtype's alignment)."""

NamedTensors = Iterable[tuple[str, torch.Tensor]]
"""``(Hugging Face name, tensor)`` pairs, e.g. from ``TrainingEngine.iter_full_params``."""


class CheckpointEngine(abc.ABC):
    """Base class of weight-sync transports (registry ``trellis.checkpoint_engines``).

    Built as ``cls(bucket_megabytes=..., dtype=..., timeout_s=..., **options)``; see the module
    docstring for the lifecycle. Subclasses implement :meth:`build_topology`,
    :meth:`init_process_group`, :meth:`send_weights` and :meth:`receive_weights`, and usually
    :meth:`prepare` and :meth:`finalize`.

    Args:
        bucket_megabytes: bucket size in MiB (``rollout.checkpoint_engine.update_weights_bucket_megabytes``).
        bucket_bytes: bucket size in bytes; overrides ``bucket_megabytes`` (tests use tiny buckets).
        dtype: cast floating tensors to this dtype (a ``torch.dtype`` or its name, e.g.
            ``"bfloat16"``) before sending; None sends them as they are. Other tensors are never cast.
        timeout_s: seconds to wait on a peer before raising :class:`WeightSyncError`.

    Raises:
        ValueError: a bucket size below one byte, a non-positive timeout or an unknown dtype name.
    """

    name: ClassVar[str] = "checkpoint"
    """The registry name, used in error messages."""

    def __init__(
        self,
        *,
        bucket_megabytes: float = 512,
        bucket_bytes: int | None = None,
        dtype: torch.dtype | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        size = int(bucket_bytes) if bucket_bytes is not None else int(float(bucket_megabytes) * 2**20)
        if size < 1:
            raise ValueError(
                f"{self.name} checkpoint engine: the bucket size must be at least 1 byte, got {size} "
                f"(bucket_megabytes={bucket_megabytes!r}, bucket_bytes={bucket_bytes!r})."
            )
        if not timeout_s > 0:
            raise ValueError(f"{self.name} checkpoint engine: timeout_s must be > 0, got {timeout_s!r}.")
        self.bucket_bytes = size
        self.dtype = resolve_dtype(dtype)
        self.timeout_s = float(timeout_s)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this engine cannot run on this machine (e.g. no CUDA for ``nccl``); None if it can."""
        return None

    def prepare(self) -> dict[str, Any]:
        """Allocate the sender's resources; return what peers need to connect to it.

        Called once, on the sending engine (trainer rank 0), before :meth:`build_topology`. The
        result must be picklable for engines whose peers live in other processes.
        """
        return {}

    @classmethod
    @abc.abstractmethod
    def build_topology(
        cls, trainer_world_size: int, rollout_world_size: int, metadata: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The :meth:`init_process_group` keyword arguments of every trainer and rollout rank.

        Args:
            trainer_world_size: number of trainer ranks (all iterate the weights; rank 0 sends).
            rollout_world_size: number of rollout ranks that receive.
            metadata: what the sender's :meth:`prepare` returned.

        Returns:
            ``(trainer_kwargs, rollout_kwargs)``: lists of ``trainer_world_size`` and
            ``rollout_world_size`` dicts, indexed by rank.

        Raises:
            ValueError: a world size this engine cannot serve.
        """

    @abc.abstractmethod
    def init_process_group(self, *args: Any, **kwargs: Any) -> None:
        """Connect this end to its peers, with the kwargs :meth:`build_topology` gave its rank.

        Each engine declares the keyword arguments its own ``build_topology`` hands out; this
        signature accepts any, so that an override may name them.

        Blocks until the peers it needs have connected (at most ``timeout_s``); all ends must call
        it concurrently. Raises :class:`WeightSyncError` when they do not meet in time.
        """

    @abc.abstractmethod
    async def send_weights(self, named_tensors: NamedTensors) -> None:
        """Stream every ``(name, tensor)`` to the receivers, in order; return once all have it.

        On trainer ranks other than 0, consume the iterator without sending. Raises
        :class:`WeightSyncError` when a receiver vanishes or stops acknowledging; an exception of
        the iterator itself is re-raised after the receivers are told to stop.
        """

    @abc.abstractmethod
    async def receive_weights(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield the sender's ``(name, tensor)`` pairs of one step, in send order.

        Each tensor is whole, on the engine's device and valid for as long as the caller keeps
        it: never a view of a buffer the engine reuses (in-process engines may hand over the
        sender's own tensor). Raises :class:`WeightSyncError` when the sender
        vanishes, aborts or sends nothing for ``timeout_s``.
        """
        raise NotImplementedError
        yield  # an async generator, like the implementations

    def finalize(self) -> None:  # noqa: B027 - optional: engines without resources keep this one
        """Release connections and buffers. Idempotent; safe after a failed or partial set-up."""

    # ---------------------------------------------------------------- helpers for subclasses

    def error(self, cause: str) -> WeightSyncError:
        """A :class:`WeightSyncError` whose message names this engine, then ``cause``."""
        return WeightSyncError(f"{self.name} checkpoint engine: {cause}")

    def check_role(self, role: str | None, expected: str, ready: bool = True) -> None:
        """Raise :class:`WeightSyncError` unless this end was set up as ``expected`` (and is ``ready``)."""
        if role != expected or not ready:
            raise self.error(
                f"this end was set up as {role!r}, not {expected!r}; call init_process_group first."
            )

    @staticmethod
    def check_known_role(name: str, role: str) -> None:
        """``ValueError`` unless ``role`` is ``sender``, ``receiver`` or ``idle``."""
        if role not in ("sender", "receiver", "idle"):
            raise ValueError(
                f"{name} checkpoint engine: unknown role {role!r}; expected sender, receiver or idle."
            )


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a ``torch.dtype`` (``"bfloat16"``, ``"torch.float16"`` and ``torch.float32`` all work).

    Raises:
        ValueError: a name that is not a torch dtype.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; expected a torch dtype name such as 'bfloat16'.")
    return value


async def send_pipelined(
    named_tensors: NamedTensors,
    bucket_bytes: int,
    dtype: Any,
    send_bucket: Callable[[Any], None],
    send_end: Callable[[], None],
) -> None:
    """Stream ``named_tensors`` as buckets: ``send_bucket`` runs in a worker thread for one bucket while
    the caller's iterator (and the dtype cast) produces the next; ``send_end`` follows the last.

    On any failure the bucket in flight is let finish first (a thread cannot be cancelled), then the
    exception propagates for the engine to tear down.
    """
    import asyncio
    import contextlib

    inflight: asyncio.Future[None] | None = None
    try:
        for bucket in iter_buckets(named_tensors, bucket_bytes, dtype=dtype):
            if inflight is not None:
                await inflight
            inflight = asyncio.ensure_future(asyncio.to_thread(send_bucket, bucket))
        if inflight is not None:
            await inflight
            inflight = None
        await asyncio.to_thread(send_end)
    except BaseException:
        if inflight is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(inflight)
        raise


def consume(named_tensors: NamedTensors) -> None:
    """Iterate ``named_tensors`` to the end, dropping each tensor: what idle trainer ranks do."""
    for _ in named_tensors:
        pass


# ---------------------------------------------------------------- buckets (shared by the built-in engines)


@dataclass(frozen=True)
class Chunk:
    """Where bytes ``[start, start + nbytes)`` of one tensor (of ``total`` bytes) sit in a bucket.

    A tensor that fits in a bucket is one chunk with ``start == 0`` and ``nbytes == total``.
    """

    name: str
    dtype: str
    """The torch dtype's name, e.g. ``"bfloat16"``."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the chunk inside the bucket (a multiple of :data:`ALIGNMENT`)."""
    nbytes: int
    start: int
    total: int


Bucket = list[tuple[Chunk, torch.Tensor]]
"""One bucket's plan: each chunk with its source bytes (a flat ``uint8`` tensor of ``nbytes``)."""


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The bytes of ``tensor`` (cast to ``dtype`` if it is floating) as a flat ``uint8`` tensor.

    Copies only when it must: to cast, or to make a non-contiguous tensor contiguous.
    """
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def iter_buckets(
    named_tensors: NamedTensors, bucket_bytes: int, *, dtype: torch.dtype | None = None
) -> Iterator[Bucket]:
    """Plan buckets of at most ``bucket_bytes`` from ``named_tensors``, consumed lazily, in order.

    Tensors go back to back at :data:`ALIGNMENT`-aligned offsets. A tensor that does not fit in
    the rest of the current bucket starts a new one; a tensor larger than a whole bucket fills
    the rest of the current one and continues over as many buckets as it needs. Only the tensors
    of the bucket being planned are referenced. Copy a plan into a buffer with :func:`fill_bucket`.
    """
    bucket: Bucket = []
    used = 0
    for name, tensor in named_tensors:
        flat = tensor_bytes(tensor, dtype)
        meta = (name, str(_sent_dtype(tensor, dtype)).removeprefix("torch."), tuple(tensor.shape))
        total = flat.numel()
        start = 0
        while True:
            offset = _align(used) if bucket else 0
            room = bucket_bytes - offset
            remaining = total - start
            if remaining <= room:
                bucket.append((Chunk(*meta, offset, remaining, start, total), flat[start:]))
                used = offset + remaining
                break
            if bucket and (remaining <= bucket_bytes or room <= 0):
                yield bucket  # it fits a fresh bucket whole (or nothing fits here): don't split it
                bucket, used = [], 0
                continue
            bucket.append((Chunk(*meta, offset, room, start, total), flat[start : start + room]))
            start += room
            yield bucket
            bucket, used = [], 0
    if bucket:
        yield bucket


def _sent_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None and tensor.is_floating_point():
        return dtype
    return tensor.dtype


def fill_bucket(bucket: Bucket, buffer: torch.Tensor) -> int:
    """Copy a planned bucket into ``buffer`` (a flat ``uint8`` tensor); return the bytes used."""
    end = 0
    for chunk, source in bucket:
        if chunk.nbytes:
            buffer[chunk.offset : chunk.offset + chunk.nbytes].copy_(source)
        end = chunk.offset + chunk.nbytes
    return end


def encode_header(bucket: Bucket | list[Chunk]) -> bytes:
    """The chunks of a bucket as compact JSON bytes (what travels next to the bucket's bytes)."""
    chunks = [item[0] if isinstance(item, tuple) else item for item in bucket]
    rows = [[c.name, c.dtype, list(c.shape), c.offset, c.nbytes, c.start, c.total] for c in chunks]
    return json.dumps(rows, separators=(",", ":")).encode()


def decode_header(data: bytes | bytearray | memoryview) -> list[Chunk]:
    """The chunks encoded by :func:`encode_header`.

    Raises:
        ValueError: ``data`` is not such a header.
    """
    try:
        rows = json.loads(bytes(data))
        return [
            Chunk(str(n), str(d), tuple(int(s) for s in shape), int(o), int(b), int(st), int(t))
            for n, d, shape, o, b, st, t in rows
        ]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a bucket header ({exc}): {bytes(data)[:80]!r}") from exc


class BucketReader:
    """The receiving half of the bucket format: turns buckets back into whole tensors.

    ``read(chunks, buffer)`` copies each chunk out of ``buffer`` (which the caller may reuse
    right after) into freshly allocated tensors on ``device`` and returns the tensors completed
    by this bucket, in send order. A tensor split over several buckets is held, alone, until its
    last chunk arrives.

    Raises:
        ValueError: chunks that do not continue the tensor in progress, a dtype torch does not
            know, or a chunk outside the buffer.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._pending: tuple[str, torch.Tensor, torch.Tensor, int] | None = None  # name, out, bytes, filled

    def read(self, chunks: list[Chunk], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        done: list[tuple[str, torch.Tensor]] = []
        for chunk in chunks:
            if chunk.offset + chunk.nbytes > buffer.numel():
                raise ValueError(
                    f"chunk of {chunk.name!r} ends at byte {chunk.offset + chunk.nbytes}, past the "
                    f"{buffer.numel()}-byte bucket"
                )
            if chunk.start == 0:
                if self._pending is not None:
                    raise ValueError(f"{chunk.name!r} began before {self._pending[0]!r} was complete")
                out = torch.empty(chunk.shape, dtype=resolve_dtype(chunk.dtype), device=self.device)
                flat = out.reshape(-1).view(torch.uint8)
                if flat.numel() != chunk.total:
                    raise ValueError(
                        f"{chunk.name!r}: {chunk.total} bytes announced for {chunk.dtype}{list(chunk.shape)}"
                    )
                self._pending = (chunk.name, out, flat, 0)
            elif self._pending is None or self._pending[0] != chunk.name or self._pending[3] != chunk.start:
                raise ValueError(f"chunk of {chunk.name!r} at byte {chunk.start} arrived out of order")
            name, out, flat, _ = self._pending
            if chunk.nbytes:
                flat[chunk.start : chunk.start + chunk.nbytes].copy_(
                    buffer[chunk.offset : chunk.offset + chunk.nbytes]
                )
            filled = chunk.start + chunk.nbytes
            if filled == chunk.total:
                done.append((name, out))
                self._pending = None
            else:
                self._pending = (name, out, flat, filled)
        return done

    def finish(self) -> None:
        """Check that no tensor is left half received (call at the end of a step).

        Raises:
            ValueError: the stream ended inside a tensor.
        """
        if self._pending is not None:
            name, _, flat, filled = self._pending
            self._pending = None
            raise ValueError(f"the stream ended inside {name!r} ({filled} of {flat.numel()} bytes)")
