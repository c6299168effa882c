"""``gloo`` and ``nccl``: torch.distributed broadcast from trainer rank 0 to every rollout rank.

The engines build a process group of their own, never touching the default one (training may be
using it): the sender hosts a ``TCPStore`` (opened by :meth:`prepare` on a free port), every end
joins a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` made directly from that store under a
prefix unique to the group. Group rank 0 is the sender, rollout rank ``i`` is group rank ``i + 1``.

Per bucket (packed with :func:`~trellis.checkpoint.base.iter_buckets`) the sender broadcasts a
control tensor ``int64 (3,)`` = (kind, header bytes, payload bytes), then the header
(:func:`~trellis.checkpoint.base.encode_header` as ``uint8``), then the payload. It has two
bucket buffers: it packs the next bucket while the previous payload is still on the wire. A
control tensor of kind "end" closes the step; kind "abort" is followed by the reason.

The two engines share every line but the backend and the buffers' device (CPU for ``gloo``,
the current CUDA device for ``nccl``). Backend-specific engines for other hardware (``hccl``)
come from plugins and may subclass :class:`BroadcastCheckpointEngine` the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import secrets
from collections.abc import AsyncGenerator
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from trellis.checkpoint.base import (
    BucketReader,
    CheckpointEngine,
    NamedTensors,
    consume,
    decode_header,
    encode_header,
    fill_bucket,
    send_pipelined,
)
from trellis.errors import WeightSyncError

KIND_DATA, KIND_END, KIND_ABORT = 1, 2, 3
_ABORT_TIMEOUT_S = 5.0  # how long a sender tries to tell the receivers it gives up


class BroadcastCheckpointEngine(CheckpointEngine):
    """Broadcasts buckets from the sender to every receiver over a dedicated process group.

    Subclasses set ``backend`` and implement :meth:`new_backend` and :meth:`buffer_device`.

    Args:
        host: address the sender's ``TCPStore`` listens on; receivers connect to it. The default
            loopback address serves one host; give a reachable address for several hosts.
        **kwargs: :class:`~trellis.checkpoint.base.CheckpointEngine` arguments (bucket size,
            ``dtype``, ``timeout_s``).
    """

    backend: ClassVar[str]

    def __init__(self, *, host: str = "127.0.0.1", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.host = host
        self.role: str | None = None
        self.device = torch.device("cpu")
        self._store: Any = None
        self._group: Any = None
        self._buffers: list[torch.Tensor] = []
        self._inflight: Any = None  # the sender's payload broadcast still on the wire
        self._seq = 0
        self._broken: str | None = None

    # ---------------------------------------------------------------- backend specifics

    def new_backend(self, store: Any, rank: int, world_size: int) -> Any:
        """A ``torch.distributed`` backend object (e.g. ``ProcessGroupGloo``) joined through ``store``."""
        raise NotImplementedError

    def buffer_device(self) -> torch.device:
        """Where buckets (and received tensors) live for this backend."""
        raise NotImplementedError

    def _timedelta(self, seconds: float | None = None) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s if seconds is None else seconds)

    def _device_context(self) -> Any:
        # Worker threads start on device 0: put them on this engine's device.
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    # ---------------------------------------------------------------- set-up

    def prepare(self) -> dict[str, Any]:
        """Open the group's ``TCPStore`` on ``host`` (a free port); return how to join the group."""
        if self._store is not None:
            raise self.error("prepare() was called twice on one engine.")
        reason = self.unavailable_reason()
        if reason is not None:
            raise self.error(reason)
        try:
            self._store = dist.TCPStore(self.host, 0, None, True, self._timedelta(), wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise self.error(f"cannot open a TCPStore on {self.host!r}: {exc}") from exc
        return {
            "host": self.host,
            "port": int(self._store.port),
            "group": secrets.token_hex(8),
            "bucket_bytes": self.bucket_bytes,
        }

    @classmethod
    def build_topology(
        cls, trainer_world_size: int, rollout_world_size: int, metadata: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        if trainer_world_size < 1 or rollout_world_size < 1:
            raise ValueError(
                f"{cls.name} checkpoint engine: needs at least one trainer and one rollout rank, got "
                f"trainer_world_size={trainer_world_size}, rollout_world_size={rollout_world_size}."
            )
        group = {
            "world_size": rollout_world_size + 1,
            "host": metadata["host"],
            "port": metadata["port"],
            "group": metadata["group"],
            "bucket_bytes": metadata["bucket_bytes"],
        }
        trainer = [{"role": "sender", "rank": 0, **group}]
        trainer += [{"role": "idle"} for _ in range(trainer_world_size - 1)]
        rollout = [{"role": "receiver", "rank": i + 1, **group} for i in range(rollout_world_size)]
        return trainer, rollout

    def init_process_group(
        self,
        *,
        role: str,
        rank: int | None = None,
        world_size: int | None = None,
        host: str | None = None,
        port: int | None = None,
        group: str | None = None,
        bucket_bytes: int | None = None,
    ) -> None:
        """Join the group as ``role`` (``sender`` = rank 0, ``receiver``, or ``idle``: no group at all).

        A receiver takes the sender's ``bucket_bytes``, whatever it was built with.
        """
        if self.role is not None:
            raise self.error(f"init_process_group was already called (as {self.role!r}).")
        self.check_known_role(self.name, role)
        if role == "idle":
            self.role = role
            return
        if None in (rank, world_size, host, port, group):
            raise self.error(f"a {role} needs rank, world_size, host, port and group.")
        assert rank is not None and world_size is not None and port is not None  # checked just above
        if role == "sender" and (self._store is None or rank != 0):
            raise self.error("the sender is group rank 0 and must call prepare() first.")
        reason = self.unavailable_reason()
        if reason is not None:
            raise self.error(reason)
        try:
            if role == "receiver":
                self._store = dist.TCPStore(str(host), int(port), None, False, self._timedelta())
            prefixed = dist.PrefixStore(f"trellis-wsync/{group}/", self._store)
            self.device = self.buffer_device()
            with self._device_context():
                self._group = self.new_backend(prefixed, int(rank), int(world_size))
        except (RuntimeError, OSError, ValueError) as exc:
            self.finalize()
            self._broken = f"init_process_group failed: {exc}"
            raise self.error(
                f"rank {rank} of {world_size} could not join the group at {host}:{port}: {exc}"
            ) from exc
        self.role = role
        if bucket_bytes is not None:
            self.bucket_bytes = int(bucket_bytes)
        count = 2 if role == "sender" else 1
        self._buffers = [
            torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(count)
        ]

    # ---------------------------------------------------------------- collectives

    def _broadcast(self, tensor: torch.Tensor, timeout_s: float | None = None) -> Any:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = self._timedelta(timeout_s)
        return self._group.broadcast([tensor], options)

    def _wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        try:
            work.wait(self._timedelta(timeout_s))
        except RuntimeError as exc:
            raise self.error(
                f"broadcast of {what} failed (a peer died, or {self.timeout_s:g} s passed): {exc}"
            ) from exc

    def _control(self, kind: int, header: int, payload: int) -> None:
        control = torch.tensor([kind, header, payload], dtype=torch.int64, device=self.device)
        self._wait(self._broadcast(control), "a control message")

    # ---------------------------------------------------------------- sending

    async def send_weights(self, named_tensors: NamedTensors) -> None:
        if self.role == "idle":
            consume(named_tensors)
            return
        self._check("sender")
        try:
            # a worker thread packs and broadcasts one bucket while the iterator produces the next
            await send_pipelined(
                named_tensors, self.bucket_bytes, self.dtype, self._send_bucket, self._send_end
            )
        except BaseException as exc:
            # Tell the receivers only when the wire is between buckets (the iterator failed);
            # after a transport error they will see the group fail. In a thread: a receiver may
            # share this event loop.
            reason = f"{type(exc).__name__}: {exc}"
            await asyncio.to_thread(self._abort, reason, notify=not isinstance(exc, WeightSyncError))
            raise

    def _send_bucket(self, bucket: Any) -> None:
        with self._device_context():
            buffer = self._buffers[self._seq % 2]
            payload = fill_bucket(bucket, buffer)  # the other buffer may still be on the wire
            header = encode_header(bucket)
            self._finish_inflight()
            self._control(KIND_DATA, len(header), payload)
            self._wait(self._broadcast(self._header_tensor(header)), "a bucket header")
            if payload:
                self._inflight = self._broadcast(buffer[:payload])
            self._seq += 1

    def _send_end(self) -> None:
        with self._device_context():
            self._finish_inflight()
            self._control(KIND_END, 0, 0)

    def _finish_inflight(self) -> None:
        if self._inflight is not None:
            work, self._inflight = self._inflight, None
            self._wait(work, f"bucket {self._seq - 1}")

    def _header_tensor(self, header: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)

    def _abort(self, reason: str, *, notify: bool) -> None:
        if self._broken is None:
            self._broken = reason
        if notify and self.role == "sender" and self._group is not None:
            note = reason.encode("utf-8", "replace")[:4096] or b"?"
            with contextlib.suppress(WeightSyncError, RuntimeError), self._device_context():
                self._finish_inflight()
                self._control(KIND_ABORT, len(note), 0)
                work = self._broadcast(self._header_tensor(note), _ABORT_TIMEOUT_S)
                self._wait(work, "the reason", _ABORT_TIMEOUT_S)
        self._teardown()

    # ---------------------------------------------------------------- receiving

    async def receive_weights(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        self._check("receiver")
        reader = BucketReader(self.device)
        finished = False
        try:
            while True:
                kind, tensors = await asyncio.to_thread(self._receive_bucket, reader)
                if kind == KIND_END:
                    finished = True
                    return
                for item in tensors:
                    yield item
        finally:
            if not finished:  # an error, or the consumer stopped early: drop out so the sender fails fast
                self._abort("the receiver stopped before the end of the step", notify=False)

    def _receive_bucket(self, reader: BucketReader) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        with self._device_context():
            control = torch.zeros(3, dtype=torch.int64, device=self.device)
            self._wait(self._broadcast(control), "a control message")
            kind, header_bytes, payload = (int(v) for v in control.tolist())
            header = b""
            if kind in (KIND_DATA, KIND_ABORT) and 0 < header_bytes < 2**31:
                received = torch.empty(header_bytes, dtype=torch.uint8, device=self.device)
                self._wait(self._broadcast(received), "a bucket header")
                header = received.cpu().numpy().tobytes()
            if kind == KIND_ABORT:
                raise self.error(f"the sender aborted the step: {header.decode('utf-8', 'replace')}")
            if kind == KIND_END:
                try:
                    reader.finish()
                except ValueError as exc:
                    raise self.error(f"the step ended early: {exc}.") from exc
                return kind, []
            buffer = self._buffers[0]
            if kind != KIND_DATA or not header or not 0 <= payload <= buffer.numel():
                raise self.error(
                    f"malformed control message (kind {kind}, header {header_bytes}, payload {payload})."
                )
            if payload:
                self._wait(self._broadcast(buffer[:payload]), f"bucket {self._seq}")
            try:
                tensors = reader.read(decode_header(header), buffer)
            except ValueError as exc:
                raise self.error(f"bucket {self._seq} is malformed: {exc}.") from exc
            self._seq += 1
            return kind, tensors

    # ---------------------------------------------------------------- teardown

    def _check(self, role: str) -> None:
        if self._broken is not None:
            raise self.error(
                f"unusable after an earlier error ({self._broken}); finalize it and build a new engine."
            )
        self.check_role(self.role, role, self._group is not None)

    def _teardown(self) -> None:
        group, self._group = self._group, None
        self._inflight = None
        if group is not None:
            for method in ("abort", "shutdown"):
                stop = getattr(group, method, None)
                if stop is not None:
                    with contextlib.suppress(Exception):
                        stop()
                    break

    def finalize(self) -> None:
        if self._broken is None:
            self._broken = "finalized"
        self._teardown()
        self._buffers = []
        self._store = None


class GlooCheckpointEngine(BroadcastCheckpointEngine):
    """Broadcasts weights over a dedicated gloo group, CPU to CPU, within a host or across hosts.

    Topology: trainer rank 0 sends to every rollout rank; other trainer ranks only iterate.
    Received tensors are on the CPU. See :class:`BroadcastCheckpointEngine` for the arguments.
    """

    name = "gloo"
    backend = "gloo"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not (dist.is_available() and dist.is_gloo_available()):
            return "this torch build has no gloo backend (torch.distributed.is_gloo_available() is False)."
        return None

    def buffer_device(self) -> torch.device:
        return torch.device("cpu")

    def new_backend(self, store: Any, rank: int, world_size: int) -> Any:
        if _is_loopback(self.host):
            # Pin gloo to the loopback interface: the default one (the hostname's address) may be
            # unreachable in containers.
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs name it Options
            options._timeout = self._timedelta()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            return dist.ProcessGroupGloo(store, rank, world_size, options)
        return dist.ProcessGroupGloo(store, rank, world_size, timeout=self._timedelta())


class NcclCheckpointEngine(BroadcastCheckpointEngine):
    """Broadcasts weights over a dedicated NCCL group, GPU to GPU.

    Buckets and received tensors live on the current CUDA device of each end (set it before
    ``init_process_group``). Topology as for ``gloo``. See :class:`BroadcastCheckpointEngine`.
    """

    name = "nccl"
    backend = "nccl"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not (dist.is_available() and dist.is_nccl_available()):
            return "this torch build has no NCCL backend (torch.distributed.is_nccl_available() is False)."
        if not torch.cuda.is_available():
            return "no CUDA device is available (torch.cuda.is_available() is False)."
        return None

    def buffer_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def new_backend(self, store: Any, rank: int, world_size: int) -> Any:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = self._timedelta()
        return dist.ProcessGroupNCCL(store, rank, world_size, options)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
