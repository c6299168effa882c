"""``naive``: the same-process checkpoint engine; the receiver iterates the sender's iterator itself."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncGenerator
from typing import Any

import torch

from trellis.checkpoint.base import CheckpointEngine, NamedTensors, consume
from trellis.errors import WeightSyncError


class _Handoff:
    """The one-slot meeting point of a sender and a receiver in one process (any threads, any loops).

    The sender offers ``(iterator, done)``; the receiver takes it, iterates it and resolves ``done``.
    ``concurrent.futures.Future`` rather than asyncio primitives, because the two ends may run in
    different event loops or threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offer: concurrent.futures.Future[tuple[Any, concurrent.futures.Future[None]]] = (
            concurrent.futures.Future()
        )
        self.taken = 0  # tensors handed over so far: the sender's evidence of progress
        self._closed: BaseException | None = None

    def offer(self, iterator: Any) -> concurrent.futures.Future[None]:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._closed is not None:
                raise RuntimeError(str(self._closed))
            if self._offer.done():
                raise RuntimeError("a previous send_weights has not been received yet")
            self._offer.set_result((iterator, done))
        return done

    def pending(self) -> concurrent.futures.Future[tuple[Any, concurrent.futures.Future[None]]]:
        return self._offer

    def take(self) -> tuple[Any, concurrent.futures.Future[None]]:
        with self._lock:
            item = self._offer.result(timeout=0)
            self._offer = concurrent.futures.Future()
        return item

    def withdraw(self, done: concurrent.futures.Future[None]) -> None:
        """Take back an offer nobody took (the sender gave up), so the next one can be made."""
        with self._lock:
            if self._offer.done() and not self._offer.exception() and self._offer.result()[1] is done:
                self._offer = concurrent.futures.Future()

    def close(self, exc: BaseException) -> None:
        """Fail whoever waits on this channel (either end finalized), now and from now on."""
        with self._lock:
            if self._closed is None:
                self._closed = exc
            offer = self._offer
            if not offer.done():
                offer.set_exception(exc)  # wakes a receiver waiting for an offer
        if offer.exception() is None:
            _resolve(offer.result()[1], exc)  # wakes a sender whose offer nobody took


def _resolve(done: concurrent.futures.Future[None], exc: BaseException | None = None) -> None:
    if done.done():  # the sender gave up already
        return
    try:
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass


class NaiveCheckpointEngine(CheckpointEngine):
    """Hands the trainer's ``(name, tensor)`` iterator to a receiver in the same process.

    Nothing is copied or bucketed: the receiver iterates the sender's iterator (casting floating
    tensors to ``dtype``) and gets the trainer's own tensors, one at a time. ``send_weights``
    returns once the receiver has gone through all of them. The ends may run in one event loop or
    in different threads. This is the default engine of the ``hybrid`` mode, where each training
    worker serves its own replica.

    Topology: one receiver (``rollout_world_size == 1``); trainer ranks above 0 only iterate.
    ``prepare()`` returns a live channel object, so the metadata cannot cross processes.
    """

    name = "naive"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.role: str | None = None
        self._channel: _Handoff | None = None

    def prepare(self) -> dict[str, Any]:
        return {"channel": _Handoff()}

    @classmethod
    def build_topology(
        cls, trainer_world_size: int, rollout_world_size: int, metadata: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        if trainer_world_size < 1 or rollout_world_size != 1:
            raise ValueError(
                f"naive checkpoint engine: hands tensors over inside one process, to one receiver; got "
                f"trainer_world_size={trainer_world_size}, rollout_world_size={rollout_world_size}. Feed "
                "several in-process replicas through one receiver (WeightSyncManager does), or pick an "
                "engine that crosses processes (shm, gloo, nccl)."
            )
        channel = metadata["channel"]
        trainer = [{"role": "sender", "channel": channel}] + [{"role": "idle"}] * (trainer_world_size - 1)
        return trainer, [{"role": "receiver", "channel": channel}]

    def init_process_group(self, *, role: str, channel: _Handoff | None = None) -> None:
        """Join ``channel`` as ``role`` (``"sender"``, ``"receiver"`` or ``"idle"``)."""
        self.check_known_role(self.name, role)
        if role != "idle" and not isinstance(channel, _Handoff):
            raise ValueError(f"naive checkpoint engine: role {role!r} needs the channel from prepare().")
        self.role = role
        self._channel = channel

    def _check_role(self, role: str) -> _Handoff:
        self.check_role(self.role, role, self._channel is not None)
        assert self._channel is not None
        return self._channel

    async def send_weights(self, named_tensors: NamedTensors) -> None:
        if self.role == "idle":
            consume(named_tensors)
            return
        channel = self._check_role("sender")
        dtype = self.dtype
        failed: list[BaseException] = []  # what the trainer's own iterator raised, if anything

        def cast() -> Any:
            iterator = iter(named_tensors)
            while True:
                try:
                    name, tensor = next(iterator)
                except StopIteration:
                    return
                except BaseException as exc:
                    failed.append(exc)
                    raise
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.detach().to(dtype)
                channel.taken += 1
                yield name, tensor

        try:
            offered = channel.offer(cast())
        except RuntimeError as exc:
            raise self.error(str(exc)) from None
        done = asyncio.wrap_future(offered)
        seen = -1
        while True:  # time out only when the receiver makes no progress for timeout_s
            try:
                await asyncio.wait_for(asyncio.shield(done), self.timeout_s)
                return
            except asyncio.TimeoutError:
                if channel.taken == seen:
                    channel.withdraw(offered)
                    offered.cancel()
                    raise self.error(
                        f"the receiver took no tensor for {self.timeout_s:g} s ({max(seen, 0)} so far); "
                        "is receive_weights running?"
                    ) from None
                seen = channel.taken
            except Exception as exc:
                if (failed and exc is failed[0]) or isinstance(exc, WeightSyncError):
                    raise
                raise self.error(f"the receiver failed: {type(exc).__name__}: {exc}") from exc

    async def receive_weights(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        channel = self._check_role("receiver")
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(channel.pending())), self.timeout_s)
            iterator, done = channel.take()
        except asyncio.TimeoutError:
            raise self.error(f"nothing was sent within {self.timeout_s:g} s.") from None
        count = 0
        try:
            for item in iterator:
                yield item
                count += 1
        except BaseException as exc:  # incl. GeneratorExit: the consumer stopped early
            if not isinstance(exc, Exception):
                exc = self.error(f"the receiver stopped after {count} tensors ({type(exc).__name__}).")
            _resolve(done, exc)
            raise
        _resolve(done)

    def finalize(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close(self.error(f"the {self.role} end was finalized."))
        self.role = None
