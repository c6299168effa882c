"""``WeightSyncManager``: each step, stream the trainer's weights into the rollout replicas.

One step of weight sync is: wake the replicas up, stream the weights through the configured
checkpoint engine into :meth:`RolloutReplica.update_weights` one bucket at a time (never the
whole model at once), then let the replicas resume.

**Same process** (the trainer and its replicas share a process: ``hybrid`` mode, tests, the
laptop demo)::

    manager = WeightSyncManager(cfg.rollout.checkpoint_engine, dtype=torch.bfloat16)
    stats = await manager.sync(actor.iter_full_params(), replicas)   # every step
    manager.close()                                                    # at the end

The first ``sync`` sets up a sender and a receiver engine (a 1 x 1 topology) and keeps them for
the following steps; every replica gets each bucket from the one receiver.

**Separate processes** use the two halves. The trainer (rank 0) plans the topology and ships each
rollout rank its (picklable) kwargs; every end then calls ``init_process_group`` concurrently::

    # trainer rank 0
    manager = WeightSyncManager(cfg.rollout.checkpoint_engine)
    engine, trainer_kwargs, rollout_kwargs = manager.plan(trainer_world_size, rollout_world_size)
    # ... send rollout_kwargs[i] to rollout rank i (and trainer_kwargs[r] to trainer rank r) ...
    engine.init_process_group(**trainer_kwargs[0])
    stats = await manager.send(engine, actor.iter_full_params())      # every step, every trainer rank

    # rollout rank i
    manager = WeightSyncManager(cfg.rollout.checkpoint_engine)
    engine = manager.create_engine()
    engine.init_process_group(**rollout_kwargs[i])
    stats = await manager.receive(engine, [replica])                  # every step, concurrently

Trainer ranks other than 0 build their engine with ``create_engine()`` and
``init_process_group(**trainer_kwargs[r])``, then call ``send`` like rank 0 (it only iterates).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trellis.checkpoint.base import DEFAULT_TIMEOUT_S, CheckpointEngine, NamedTensors
from trellis.config.base import schema_default
from trellis.config.schema import CheckpointEngineConfig
from trellis.errors import WeightSyncError


@dataclass(frozen=True)
class SyncStats:
    """What one step of weight sync moved: ``tensors`` tensors of ``bytes`` bytes in ``seconds``."""

    tensors: int
    bytes: int
    seconds: float

    @property
    def megabytes_per_second(self) -> float:
        """Throughput in MB/s (10**6 bytes per second)."""
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")


class WeightSyncManager:
    """Streams weights from the trainer into rollout replicas through a checkpoint engine.

    Args:
        engine: a name in ``trellis.checkpoint_engines`` (or a ``module:Class`` reference), a
            :class:`~trellis.config.schema.CheckpointEngineConfig` (its ``name`` and
            ``update_weights_bucket_megabytes``), or an engine class. None = the config's default
            engine (``naive``).
        bucket_megabytes: bucket size in MiB; overrides the config's. None = the config's (default
            ``rollout.checkpoint_engine.update_weights_bucket_megabytes``, 512).
        dtype: cast floating tensors to this dtype on the sender (usually the rollout's dtype);
            None sends them as they are.
        timeout_s: seconds any end waits on a peer before raising :class:`WeightSyncError`.
        **engine_kwargs: more arguments for the engine class (e.g. ``bucket_bytes``, ``host``).

    Raises:
        UnknownComponentError: no engine has that name (the message lists those that do).
    """

    def __init__(
        self,
        engine: str | type | Any = None,
        *,
        bucket_megabytes: float | None = None,
        dtype: torch.dtype | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **engine_kwargs: Any,
    ) -> None:
        if engine is None:
            engine = CheckpointEngineConfig()
        # A CheckpointEngine in shape (the registry checks it), if not always by subclassing.
        self.engine_class: type[CheckpointEngine]
        if isinstance(engine, type):
            self.engine_class = engine
        else:
            from trellis.registries import checkpoint_engines

            if not isinstance(engine, str):  # a CheckpointEngineConfig (or anything shaped like one)
                if bucket_megabytes is None:
                    bucket_megabytes = engine.update_weights_bucket_megabytes
                engine = engine.name or "naive"  # null outside a run's config: the in-process engine
            self.engine_class = checkpoint_engines.get(engine)
        self.engine_kwargs: dict[str, Any] = {
            "bucket_megabytes": (
                schema_default(CheckpointEngineConfig, "update_weights_bucket_megabytes")
                if bucket_megabytes is None
                else bucket_megabytes
            ),
            "dtype": dtype,
            "timeout_s": timeout_s,
            **engine_kwargs,
        }
        self._local: tuple[CheckpointEngine, CheckpointEngine] | None = None

    @property
    def bucket_bytes(self) -> int:
        """How many bytes of tensors each ``update_weights`` call gets (at least one whole tensor)."""
        explicit = self.engine_kwargs.get("bucket_bytes")
        return int(explicit) if explicit else int(float(self.engine_kwargs["bucket_megabytes"]) * 2**20)

    @property
    def engine_name(self) -> str:
        """The engine's registry name (``naive``, ``shm``, ...)."""
        return str(getattr(self.engine_class, "name", self.engine_class.__name__))

    def create_engine(self) -> CheckpointEngine:
        """A new, unconnected engine with this manager's settings (one per end)."""
        return self.engine_class(**self.engine_kwargs)

    def plan(
        self, trainer_world_size: int, rollout_world_size: int
    ) -> tuple[CheckpointEngine, list[dict[str, Any]], list[dict[str, Any]]]:
        """On trainer rank 0: the sending engine, prepared, and every rank's ``init_process_group`` kwargs.

        Returns:
            ``(engine, trainer_kwargs, rollout_kwargs)``; call
            ``engine.init_process_group(**trainer_kwargs[0])`` next, concurrently with the peers.
        """
        engine = self.create_engine()
        try:
            metadata = engine.prepare()
            trainer_kwargs, rollout_kwargs = self.engine_class.build_topology(
                trainer_world_size, rollout_world_size, metadata
            )
        except BaseException:
            engine.finalize()
            raise
        return engine, trainer_kwargs, rollout_kwargs

    # ---------------------------------------------------------------- the halves

    async def send(self, engine: CheckpointEngine, named_tensors: NamedTensors) -> SyncStats:
        """The trainer's half of one step: stream ``named_tensors`` through ``engine``.

        Counts what went through (before any dtype cast). Returns once every receiver has it.
        """
        counted = _Counter(named_tensors)
        start = time.perf_counter()
        await engine.send_weights(counted)
        return SyncStats(counted.tensors, counted.bytes, time.perf_counter() - start)

    async def receive(
        self,
        engine: CheckpointEngine,
        replicas: Any,
        *,
        wake_up: bool = True,
        version: int | None = None,
        staged: bool = False,
    ) -> SyncStats:
        """The rollout's half of one step: wake ``replicas`` up, load every bucket, resume them.

        Each replica's ``update_weights`` is called once per bucket with that bucket's
        ``(name, tensor)`` pairs (a bucket holds up to ``bucket_megabytes`` of tensors, or one
        larger tensor), between its ``begin_weight_update()`` and ``end_weight_update(version)``
        (replicas that have them: generation in flight waits, or is interrupted, meanwhile).
        Replicas that define an async ``resume()`` (backends that restore serving separately from
        weights) have it awaited at the end.

        Args:
            engine: a connected receiving engine.
            replicas: one :class:`~trellis.rollout.RolloutReplica` or a sequence of them.
            wake_up: await each replica's ``wake_up()`` first.
            version: the policy version the weights are (None: each replica counts one more).
            staged: read every bucket before waiting for the hold, so the sender (which returns once
                every receiver has read its buckets) never waits for generation in flight. Each
                ``begin_weight_update`` still starts first (a replica stops admitting requests before
                the sender is released, so a request sent after the sync gets the new weights); the
                loading follows the hold. Costs one more copy of the weights, where the engine
                delivers them, until they are loaded. The asynchronous trainer receives so.
        """
        replicas = _as_list(replicas)
        start = time.perf_counter()
        if wake_up:
            await asyncio.gather(*(replica.wake_up() for replica in replicas))
        tensors = total = 0
        limit = self.bucket_bytes
        holds = asyncio.gather(*(_hook(replica, "begin_weight_update") for replica in replicas))
        loaded = False
        try:
            source = _group_by_bytes(engine.receive_weights(), limit)
            if staged:  # read every bucket now (the sender is released), load them after the hold
                await asyncio.sleep(0)  # every begin runs to its first wait: admission is held from here
                async with contextlib.aclosing(source) as read:
                    source = _replay([bucket async for bucket in read])
            await holds
            async with contextlib.aclosing(source) as buckets:
                async for bucket in buckets:
                    await asyncio.gather(*(replica.update_weights(bucket) for replica in replicas))
                    tensors += len(bucket)
                    total += sum(t.numel() * t.element_size() for _, t in bucket)
            loaded = True
        finally:  # a failed load releases held generation too, its version unchanged
            if not holds.done():  # the read failed while a hold waited: it never began
                holds.cancel()
            with contextlib.suppress(BaseException):
                await holds
            await asyncio.gather(
                *(
                    _hook(
                        replica,
                        "end_weight_update",
                        version if loaded else getattr(replica, "weight_version", 0),
                    )
                    for replica in replicas
                )
            )
        for replica in replicas:
            resume = getattr(replica, "resume", None)
            if resume is not None:
                await resume()
        return SyncStats(tensors, total, time.perf_counter() - start)

    # ---------------------------------------------------------------- same process

    async def sync(
        self, named_tensors: NamedTensors, replicas: Any, *, wake_up: bool = True, version: int | None = None
    ) -> SyncStats:
        """One step in one process: stream ``named_tensors`` into every replica of ``replicas``.

        Runs :meth:`send` and :meth:`receive` concurrently over a sender/receiver pair made on the
        first call and kept until :meth:`close`. After a failure the pair is torn down (the next
        call builds a new one) and the error is raised: an exception of a replica or of the
        iterator as it is, else the :class:`WeightSyncError`.

        Returns:
            The receiving side's :class:`SyncStats` (tensors and bytes as loaded).
        """
        sender, receiver = await self._local_pair()
        sending = asyncio.ensure_future(self.send(sender, named_tensors))
        errors: list[BaseException] = []
        try:
            stats = await self.receive(receiver, replicas, wake_up=wake_up, version=version)
        except BaseException as received_error:
            errors.append(received_error)
        if errors:
            receiver.finalize()  # so the sender fails at once instead of waiting out its timeout
            try:
                await sending
            except BaseException as sent_error:
                errors.append(sent_error)
            self.close()
            # Raise the root cause: a replica's own error, else the iterator's, else the transport's.
            own = [e for e in errors if not isinstance(e, WeightSyncError)]
            raise (own or errors)[0]
        try:
            await sending
        except BaseException:
            self.close()
            raise
        return stats

    async def _local_pair(self) -> tuple[CheckpointEngine, CheckpointEngine]:
        if self._local is None:
            sender, trainer_kwargs, rollout_kwargs = self.plan(1, 1)
            receiver = self.create_engine()
            try:
                # Both ends block until they meet: each waits in its own thread.
                await asyncio.gather(
                    asyncio.to_thread(sender.init_process_group, **trainer_kwargs[0]),
                    asyncio.to_thread(receiver.init_process_group, **rollout_kwargs[0]),
                )
            except BaseException:
                receiver.finalize()
                sender.finalize()
                raise
            self._local = (sender, receiver)
        return self._local

    def close(self) -> None:
        """Finalize the same-process pair, if any (``sync`` makes a new one next time)."""
        pair, self._local = self._local, None
        if pair is not None:
            for engine in reversed(pair):
                engine.finalize()

    def __enter__(self) -> WeightSyncManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Counter:
    """Passes ``(name, tensor)`` pairs through, counting them and their bytes."""

    def __init__(self, named_tensors: NamedTensors) -> None:
        self._source = named_tensors
        self.tensors = 0
        self.bytes = 0

    def __iter__(self) -> Any:
        for name, tensor in self._source:
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def _as_list(replicas: Any) -> list[Any]:
    if isinstance(replicas, Sequence) and not isinstance(replicas, (str, bytes)):
        return list(replicas)
    return [replicas]


async def _replay(
    buckets: list[list[tuple[str, torch.Tensor]]],
) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
    """``buckets`` read ahead (a staged receive), handed out one at a time, each dropped once handed."""
    while buckets:
        yield buckets.pop(0)


async def _group_by_bytes(
    stream: AsyncGenerator[tuple[str, torch.Tensor], None], limit: int
) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
    """Lists of consecutive pairs from ``stream``, each closed once it reaches ``limit`` bytes."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    async with contextlib.aclosing(stream) as pairs:
        async for name, tensor in pairs:
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= limit:
                yield bucket
                bucket, size = [], 0
    if bucket:
        yield bucket


async def _hook(replica: Any, name: str, *args: Any) -> None:
    """Await ``replica.<name>(*args)`` when the replica has it (plain objects used as replicas may not)."""
    hook = getattr(replica, name, None)
    if hook is not None:
        await hook(*args)
