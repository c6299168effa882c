"""``shm``: same host, separate processes: double-buffered shared-memory buckets, loopback sockets.

Data goes through two POSIX shared-memory segments (files in ``/dev/shm``) of ``bucket_bytes``
each; control messages and acknowledgements go through one loopback TCP connection per receiver.
Per bucket ``k`` the sender waits until every receiver has acknowledged bucket ``k - 2`` (the last
one in the same segment), copies bucket ``k`` into segment ``k % 2`` and announces it with its
header (:func:`~trellis.checkpoint.base.encode_header`); each receiver copies its tensors out and
acknowledges. So the sender fills one segment while the receivers read the other.

The segment files are unlinked as soon as every receiver has mapped them (the memory lives on
while mapped), so nothing is left behind even if a process is killed later; before that, at
``finalize``, on errors and at interpreter exit.

Wire format: every message is ``struct "!BBQQI"`` = (kind, segment, sequence number, payload
bytes, header bytes) followed by the header; kinds are data, end of step and abort (the header
then holds the reason). An acknowledgement is the 8-byte sequence number. Sequence numbers run on
across steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import os
import secrets
import socket
import struct
import tempfile
import time
import weakref
from collections.abc import AsyncGenerator
from typing import Any

import torch

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
_MESSAGE = struct.Struct("!BBQQI")  # kind, segment, sequence, payload bytes, header bytes
_ACK = struct.Struct("!Q")
_HELLO = struct.Struct("!16sI")  # token, receiver rank
_SEGMENTS = 2
_ACCEPT_POLL_S = 0.2  # the sender's accept loop wakes this often to notice finalize()


class ShmCheckpointEngine(CheckpointEngine):
    """Streams weights to receivers on the same host through double-buffered shared memory.

    Topology: trainer rank 0 sends to every rollout rank (any number); other trainer ranks only
    iterate. The sender needs ``2 * bucket_bytes`` of ``/dev/shm``; each receiver maps the same
    segments. Received tensors are on the CPU.

    Args:
        host: loopback address the sender listens on (the receivers connect to it).
        shm_dir: where the segment files go (default ``/dev/shm``, else the temp dir).
        **kwargs: :class:`~trellis.checkpoint.base.CheckpointEngine` arguments (bucket size,
            ``dtype``, ``timeout_s``).
    """

    name = "shm"

    def __init__(self, *, host: str = "127.0.0.1", shm_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.host = host
        self.shm_dir = shm_dir
        self.role: str | None = None
        self._paths: list[str] = []
        self._maps: list[mmap.mmap] = []
        self._buffers: list[torch.Tensor] = []
        self._token = b""
        self._listener: socket.socket | None = None
        self._peers: list[socket.socket] = []  # sender: one per receiver rank; receiver: the sender
        self._acked: list[int] = []
        self._seq = 0
        self._broken: str | None = None
        self._closed = False
        self._unlinker: weakref.finalize | None = None

    # ---------------------------------------------------------------- set-up

    def prepare(self) -> dict[str, Any]:
        """Create the two segments and the listening socket; return how to reach them."""
        if self._paths:
            raise self.error("prepare() was called twice on one engine.")
        directory = self.shm_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self._token = secrets.token_bytes(16)
        stem = os.path.join(directory, f"trellis-wsync-{os.getpid()}-{self._token[:6].hex()}")
        paths: list[str] = []
        self._paths = paths
        self._unlinker = weakref.finalize(self, _unlink_all, paths)  # also runs at interpreter exit
        try:
            for i in range(_SEGMENTS):
                path = f"{stem}-{i}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                paths.append(path)
                try:
                    _allocate(fd, self.bucket_bytes)
                    self._maps.append(mmap.mmap(fd, self.bucket_bytes))
                finally:
                    os.close(fd)
            self._buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
            self._listener = socket.create_server((self.host, 0))
        except OSError as exc:
            self.finalize()
            raise self.error(
                f"cannot set up {_SEGMENTS} x {self.bucket_bytes} bytes of shared memory in {directory!r} "
                f"and a socket on {self.host!r}: {exc}. Lower "
                "rollout.checkpoint_engine.update_weights_bucket_megabytes or make /dev/shm larger."
            ) from exc
        return {
            "host": self.host,
            "port": self._listener.getsockname()[1],
            "segments": list(paths),
            "bucket_bytes": self.bucket_bytes,
            "token": self._token.hex(),
        }

    @classmethod
    def build_topology(
        cls, trainer_world_size: int, rollout_world_size: int, metadata: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        if trainer_world_size < 1 or rollout_world_size < 1:
            raise ValueError(
                f"shm checkpoint engine: needs at least one trainer and one rollout rank, got "
                f"trainer_world_size={trainer_world_size}, rollout_world_size={rollout_world_size}."
            )
        connect = {key: metadata[key] for key in ("host", "port", "segments", "bucket_bytes", "token")}
        trainer = [{"role": "sender", "num_receivers": rollout_world_size}]
        trainer += [{"role": "idle"} for _ in range(trainer_world_size - 1)]
        rollout = [{"role": "receiver", "rank": rank, **connect} for rank in range(rollout_world_size)]
        return trainer, rollout

    def init_process_group(
        self,
        *,
        role: str,
        num_receivers: int | None = None,
        rank: int | None = None,
        host: str | None = None,
        port: int | None = None,
        segments: list[str] | None = None,
        bucket_bytes: int | None = None,
        token: str | None = None,
    ) -> None:
        """Sender: wait for ``num_receivers`` receivers. Receiver: map ``segments``, connect to the sender."""
        if self.role is not None:
            raise self.error(f"init_process_group was already called (as {self.role!r}).")
        self.check_known_role(self.name, role)
        if role == "sender" and self._listener is None:
            raise self.error("the sender must call prepare() before init_process_group().")
        if role == "receiver" and None in (rank, host, port, segments, bucket_bytes, token):
            raise self.error("a receiver needs rank, host, port, segments, bucket_bytes and token.")
        try:
            if role == "sender":
                self._accept(int(num_receivers or 0))
            elif role == "receiver":
                assert rank is not None and port is not None and segments is not None  # checked above
                assert bucket_bytes is not None
                self._connect(int(rank), str(host), int(port), list(segments), int(bucket_bytes), str(token))
        except WeightSyncError as exc:
            self.finalize()
            self._broken = f"init_process_group failed: {exc}"
            raise
        self.role = role

    def _accept(self, num_receivers: int) -> None:
        if num_receivers < 1:
            raise self.error(f"the sender needs num_receivers >= 1, got {num_receivers}.")
        assert self._listener is not None
        peers: dict[int, socket.socket] = {}
        deadline = time.monotonic() + self.timeout_s
        self._listener.settimeout(_ACCEPT_POLL_S)
        try:
            while len(peers) < num_receivers:
                if self._closed:
                    raise self.error("finalized while waiting for receivers.")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(num_receivers)) - set(peers))
                    raise self.error(
                        f"only {len(peers)} of {num_receivers} receivers connected within "
                        f"{self.timeout_s:g} s (missing ranks {missing})."
                    )
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    token, rank = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
                except (OSError, ConnectionError):
                    conn.close()
                    continue
                if token != self._token or not 0 <= rank < num_receivers or rank in peers:
                    conn.close()  # a stray connection, or a second receiver with one rank
                    continue
                conn.settimeout(self.timeout_s)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peers[rank] = conn
        except BaseException:
            for conn in peers.values():
                conn.close()
            raise
        self._peers = [peers[rank] for rank in range(num_receivers)]
        self._acked = [-1] * num_receivers
        self._listener.close()
        self._listener = None
        self._unlink()  # every receiver has mapped the segments: their names are no longer needed

    def _connect(
        self, rank: int, host: str, port: int, segments: list[str], bucket_bytes: int, token: str
    ) -> None:
        self.bucket_bytes = bucket_bytes  # the sender's buckets, whatever this end was built with
        try:
            for path in segments:
                fd = os.open(path, os.O_RDWR)
                try:
                    size = os.fstat(fd).st_size
                    if size != bucket_bytes:
                        raise self.error(f"segment {path!r} holds {size} bytes, not {bucket_bytes}.")
                    self._maps.append(mmap.mmap(fd, bucket_bytes))
                finally:
                    os.close(fd)
            self._buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
            conn = socket.create_connection((host, port), timeout=self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._peers = [conn]
            conn.sendall(_HELLO.pack(bytes.fromhex(token), rank))
        except OSError as exc:
            raise self.error(
                f"receiver {rank} cannot reach the sender's segments or {host}:{port}: {exc}"
            ) from exc

    # ---------------------------------------------------------------- sending

    async def send_weights(self, named_tensors: NamedTensors) -> None:
        if self.role == "idle":
            consume(named_tensors)
            return
        self._check("sender")
        try:
            # a worker thread copies one bucket into shared memory while the iterator produces the next
            await send_pipelined(
                named_tensors, self.bucket_bytes, self.dtype, self._send_bucket, self._send_end
            )
        except BaseException as exc:
            await asyncio.to_thread(
                self._abort, f"{type(exc).__name__}: {exc}"
            )  # a receiver may share this loop
            raise

    def _send_bucket(self, bucket: Any) -> None:
        seq = self._seq
        index = seq % _SEGMENTS
        self._wait_acks(seq - _SEGMENTS)  # everyone is done with this segment's previous bucket
        payload = fill_bucket(bucket, self._buffers[index])
        header = encode_header(bucket)
        self._send_all(_MESSAGE.pack(KIND_DATA, index, seq, payload, len(header)) + header)
        self._seq = seq + 1

    def _send_end(self) -> None:
        seq = self._seq
        self._send_all(_MESSAGE.pack(KIND_END, 0, seq, 0, 0))
        self._seq = seq + 1
        self._wait_acks(seq)

    def _send_all(self, message: bytes) -> None:
        for rank, conn in enumerate(self._peers):
            try:
                conn.sendall(message)
            except OSError as exc:
                raise self.error(f"receiver {rank} is gone ({exc}).") from exc

    def _wait_acks(self, upto: int) -> None:
        for rank, conn in enumerate(self._peers):
            while self._acked[rank] < upto:
                try:
                    (ack,) = _ACK.unpack(_recv_exact(conn, _ACK.size))
                except TimeoutError:
                    raise self.error(
                        f"receiver {rank} acknowledged nothing for {self.timeout_s:g} s "
                        f"(last: bucket {self._acked[rank]}, waiting for {upto})."
                    ) from None
                except OSError as exc:
                    raise self.error(f"receiver {rank} is gone ({exc}).") from exc
                if ack != self._acked[rank] + 1:
                    raise self.error(
                        f"receiver {rank} acknowledged bucket {ack}, expected {self._acked[rank] + 1}."
                    )
                self._acked[rank] = ack

    def _abort(self, reason: str) -> None:
        """Tell the receivers (best effort), then drop the connections: they fail fast, never hang."""
        if self._broken is None:
            self._broken = reason
        if self.role == "sender":
            note = reason.encode("utf-8", "replace")[:4096]
            message = _MESSAGE.pack(KIND_ABORT, 0, self._seq, 0, len(note)) + note
            for conn in self._peers:
                with contextlib.suppress(OSError):
                    conn.settimeout(1.0)
                    conn.sendall(message)
        _close_sockets(self._peers)

    # ---------------------------------------------------------------- receiving

    async def receive_weights(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        self._check("receiver")
        reader = BucketReader("cpu")
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
            if not finished:  # an error, or the consumer stopped early: the sender must not wait on us
                self._abort("the receiver stopped before the end of the step")

    def _receive_bucket(self, reader: BucketReader) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        conn = self._peers[0]
        try:
            kind, index, seq, payload, header_bytes = _MESSAGE.unpack(_recv_exact(conn, _MESSAGE.size))
            header = _recv_exact(conn, header_bytes) if header_bytes else b""
        except TimeoutError:
            raise self.error(f"the sender sent nothing for {self.timeout_s:g} s.") from None
        except OSError as exc:
            raise self.error(f"the sender is gone ({exc}).") from exc
        if kind == KIND_ABORT:
            raise self.error(f"the sender aborted the step: {header.decode('utf-8', 'replace')}")
        if seq != self._seq:
            raise self.error(f"got bucket {seq}, expected {self._seq}.")
        self._seq += 1
        try:
            if kind == KIND_END:
                reader.finish()
                tensors = []
            elif kind == KIND_DATA and index < _SEGMENTS and payload <= self.bucket_bytes:
                tensors = reader.read(decode_header(header), self._buffers[index])
            else:
                raise ValueError(f"message kind {kind}, segment {index}, {payload} bytes")
        except ValueError as exc:
            raise self.error(f"bucket {seq} is malformed: {exc}.") from exc
        try:
            conn.sendall(_ACK.pack(seq))
        except OSError as exc:
            raise self.error(f"the sender is gone ({exc}).") from exc
        return kind, tensors

    # ---------------------------------------------------------------- teardown

    def _check(self, role: str) -> None:
        if self._broken is not None:
            raise self.error(
                f"unusable after an earlier error ({self._broken}); finalize it and build a new engine."
            )
        self.check_role(self.role, role, bool(self._peers))

    def _unlink(self) -> None:
        if self._unlinker is not None:
            self._unlinker()  # runs _unlink_all once

    def finalize(self) -> None:
        self._closed = True
        if self._broken is None:
            self._broken = "finalized"
        _close_sockets(self._peers)
        self._peers = []
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._buffers = []  # the tensor views must go before their maps can close
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: the GC closes it
                m.close()
        self._maps = []
        self._unlink()


def _allocate(fd: int, size: int) -> None:
    """Size the file and reserve its memory now, so a full /dev/shm is an error here, not a SIGBUS later."""
    os.ftruncate(fd, size)
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _close_sockets(sockets: list[socket.socket]) -> None:
    for conn in sockets:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
        conn.close()


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes; ``ConnectionError`` when the peer closes first, ``TimeoutError`` on timeout."""
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the connection was closed")
        got += n
    return bytes(data)
