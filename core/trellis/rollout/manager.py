"""``ReplicaManager``: the one object that owns a run's rollout replicas.

It starts them, routes samples to them, puts them all to sleep and wakes them all, updates their
weights, checks their health and shuts them down::

    # rollout.mode=standalone: replicas in Ray actors on a pool of their own
    manager = ReplicaManager.start_standalone(config)
    manager.connect_weight_sync(rollout_kwargs, trainer_half)     # once: the checkpoint engine's group
    stats = manager.update_weights(send)                           # every step: receive while send runs
    manager.sleep_all(); manager.wake_up_all()
    manager.health()                                               # {replica rank: pid}, or names the dead
    manager.shutdown()

    # hybrid / colocated: the replica of a training worker, in its process
    manager = ReplicaManager([replica], checkpoint_engine=cfg.rollout.checkpoint_engine)
    stats = manager.update_weights(actor.iter_full_params())      # through the engine, in process

Standalone replicas get ``rollout.nnodes`` × ``rollout.n_devices_per_node`` devices, one replica per
``rollout.tensor_parallel_size`` of them, placed by Ray placement groups (one per node, ``STRICT_PACK``)
apart from the trainer's workers.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from trellis.checkpoint.sync import SyncStats, WeightSyncManager
from trellis.distributed.ray import RayResourcePool
from trellis.errors import RolloutReplicaError
from trellis.rollout.agent_loop import ReplicaRouter
from trellis.rollout.remote import RemoteReplica, ReplicaActor, wake_and_resume
from trellis.utils.coroutines import run_coroutine

START_TIMEOUT_S = 600.0
"""How long replicas may take to load their model and start serving."""


class _ReplicaPool(RayResourcePool):
    """A resource pool whose bundles hold one replica each: ``devices_per_replica`` accelerators."""

    def __init__(self, process_on_nodes: Sequence[int], devices_per_replica: int, **kwargs: Any) -> None:
        super().__init__(process_on_nodes, **kwargs)
        self.devices_per_replica = devices_per_replica

    def bundle(self) -> dict[str, float]:
        spec = super().bundle()
        if self.accelerator:
            spec[self.accelerator] = self.devices_per_replica
        return spec


def replica_pool(config: Any) -> RayResourcePool:
    """The placement of a run's standalone replicas: ``rollout.nnodes`` placement groups of
    ``rollout.n_devices_per_node / rollout.tensor_parallel_size`` bundles, each bundle one replica with
    ``tensor_parallel_size`` devices of ``trainer.device``'s Ray resource (CPUs only on the CPU)."""
    rollout, trainer = config.rollout, config.trainer
    tp = int(rollout.tensor_parallel_size)
    return _ReplicaPool(
        [rollout.n_devices_per_node // tp] * rollout.nnodes,
        tp,
        device_name=None if trainer.device in ("auto", "cpu") else trainer.device,
        name_prefix=f"rollout_{uuid.uuid4().hex[:8]}",  # placement-group names are cluster-wide
    )


class ReplicaManager:
    """Owns the rollout replicas of a run; see the module docstring.

    Args:
        replicas: the replicas, in-process ones (:class:`~trellis.rollout.RolloutReplica`) or handles
            on replicas in processes of their own (:class:`~trellis.rollout.remote.RemoteReplica`,
            as :meth:`start_standalone` makes them); not both kinds.
        checkpoint_engine: the ``rollout.checkpoint_engine`` section (or an engine name) weights travel
            through.
        pool: the Ray placement groups the replicas run on (released by :meth:`shutdown`).
    """

    def __init__(
        self,
        replicas: Sequence[Any],
        *,
        checkpoint_engine: Any = None,
        pool: RayResourcePool | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("ReplicaManager needs at least one replica; got none.")
        remote = [isinstance(r, RemoteReplica) for r in replicas]
        if any(remote) and not all(remote):
            raise ValueError(
                "ReplicaManager: mix of in-process replicas and replicas in processes of their own; one "
                "manager owns one kind."
            )
        self.replicas = list(replicas)
        self.remote = all(remote)
        """Whether the replicas run in processes of their own (weights then need the trainer's send)."""
        self.router = ReplicaRouter(self.replicas)
        self.checkpoint_engine = checkpoint_engine
        self._pool = pool
        self._local_sync: WeightSyncManager | None = None
        self._connected = False
        self._loading: list[Any] = []  # receive_weights calls of an update that did not wait for them

    @property
    def world_size(self) -> int:
        """How many replicas receive weights."""
        return len(self.replicas)

    # ---------------------------------------------------------------- start

    @classmethod
    def start_standalone(
        cls,
        config: Any,
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = START_TIMEOUT_S,
        actor_cls: type = ReplicaActor,
    ) -> ReplicaManager:
        """Start ``rollout.nnodes × rollout.n_devices_per_node / rollout.tensor_parallel_size`` replicas
        of ``rollout.name``, each a Ray actor loading ``model.path`` on its own devices, and wait until
        all serve.

        Args:
            config: the run's :class:`~trellis.config.TrellisConfig`.
            env: extra environment variables for the replica processes.
            timeout_s: how long the replicas may take to start.
            actor_cls: the class each replica process runs, :class:`ReplicaActor` or a subclass.

        Raises:
            RolloutReplicaError: a replica failed to start or did not start within ``timeout_s``
                (named, with its error).
        """
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from trellis.distributed.ray import import_ray, passed_env

        ray = import_ray()
        rollout, trainer = config.rollout, config.trainer
        tp = int(rollout.tensor_parallel_size)
        pool = replica_pool(config)
        worker_env = {"TRELLIS_NUM_THREADS": "1", **passed_env(), **dict(env or {})}
        if trainer.device != "auto":
            worker_env.setdefault("TRELLIS_DEVICE", trainer.device)
        remote_cls = ray.remote(actor_cls)
        replicas: list[RemoteReplica] = []
        try:
            for pg, count in zip(pool.get_placement_groups(), pool.process_on_nodes, strict=True):
                for index in range(count):
                    options: dict[str, Any] = {
                        "scheduling_strategy": PlacementGroupSchedulingStrategy(
                            placement_group=pg, placement_group_bundle_index=index
                        ),
                        "num_cpus": pool.cpus_per_worker,
                        "runtime_env": {"env_vars": worker_env},
                    }
                    if pool.accelerator == "GPU":  # Ray takes GPUs as num_gpus, other devices as resources
                        options["num_gpus"] = tp
                    elif pool.accelerator:
                        options["resources"] = {pool.accelerator: tp}
                    actor = remote_cls.options(**options).remote(len(replicas), config)
                    replicas.append(RemoteReplica(actor, len(replicas), rollout, config.model))
        except BaseException:
            for replica in replicas:
                ray.kill(replica.actor)
            pool.release()
            raise
        manager = cls(replicas, checkpoint_engine=rollout.checkpoint_engine, pool=pool)
        try:
            infos = manager._wait([r.actor.init.remote() for r in replicas], "start", timeout_s)
        except BaseException:
            manager.shutdown()
            raise
        for replica, info in zip(replicas, infos, strict=True):
            replica.pid = int(info["pid"])
            replica._address = info["server_address"]
        return manager

    # ---------------------------------------------------------------- serving

    def route(self, request_id: str) -> Any:
        """The replica serving ``request_id`` (least-loaded for a new id, then sticky until released)."""
        return self.router.replica_for(request_id)

    def sleep_all(self) -> None:
        """Put every awake replica to sleep (their KV caches, and where the backend can, weights, freed)."""
        run_coroutine(self._each(lambda r: r.sleep(), only=lambda r: not r.asleep))

    def wake_up_all(self) -> None:
        """Wake every sleeping replica and let it serve again."""
        run_coroutine(self._each(wake_and_resume, only=lambda r: r.asleep))

    async def _each(self, call: Callable[[Any], Any], only: Callable[[Any], bool]) -> None:
        await asyncio.gather(*(call(r) for r in self.replicas if only(r)))

    # ---------------------------------------------------------------- weights

    def connect_weight_sync(
        self, rollout_kwargs: Sequence[Mapping[str, Any]], trainer_half: Callable[[], Any]
    ) -> None:
        """Join every replica to the checkpoint engine's group while ``trainer_half`` joins the trainer's
        ranks (both ends must meet); ``rollout_kwargs[i]`` is replica ``i``'s part of the trainer's plan
        (:meth:`~trellis.checkpoint.sync.WeightSyncManager.plan`)."""
        self._require_remote("connect_weight_sync")
        if len(rollout_kwargs) != self.world_size:
            raise ValueError(
                f"connect_weight_sync: the plan has {len(rollout_kwargs)} rollout ranks for "
                f"{self.world_size} replicas; plan with rollout_world_size={self.world_size}."
            )
        pairs = zip(self.replicas, rollout_kwargs, strict=True)
        refs = [replica.actor.connect_weight_sync.remote(dict(kw)) for replica, kw in pairs]
        trainer_half()
        self._wait(refs, "connect_weight_sync", START_TIMEOUT_S)
        self._connected = True

    def share_cores(self, path: str, timeout_s: float = START_TIMEOUT_S) -> list[bool]:
        """Ask every replica process to join the core ledger at ``path`` as participant
        ``replica_rank + 1`` (:mod:`trellis.device.core_share`); by replica, whether it took part."""
        self._require_remote("share_cores")
        refs = [r.actor.share_cores.remote(path, r.replica_rank + 1) for r in self.replicas]
        return [bool(v) for v in self._wait(refs, "share_cores", timeout_s)]

    def update_weights(
        self,
        source: Iterable[tuple[str, Any]] | Callable[[], Any],
        *,
        version: int | None = None,
        wait: bool = True,
    ) -> SyncStats:
        """Load new weights into every replica; what one replica loaded (tensors, bytes) and the seconds.

        In-process replicas: ``source`` is the ``(name, tensor)`` pairs, streamed through the checkpoint
        engine bucket by bucket (each replica is woken first and resumed after). Replicas in processes of
        their own: ``source`` is the trainer's half, a callable that makes the trainer's ranks send
        (after :meth:`connect_weight_sync`); every replica receives concurrently, and this returns once
        all have loaded every bucket. A replica generates again only after its sync ends.
        ``version`` is the policy version of the new weights (None: each replica counts one more);
        tokens generated afterwards carry it.

        ``wait=False`` (replicas in processes of their own; the asynchronous trainer): each replica
        reads every bucket before it waits for its generation in flight (a staged receive), and this
        returns once the trainer's ranks have sent, without waiting for the replicas to load. Requests
        sent afterwards still get the new weights: each replica stops admitting before it reads. The
        stats are then the trainer's send (``source()`` returns each rank's ``{"tensors", "bytes",
        "seconds"}``). The next update and :meth:`wait_for_weights` wait for the loads and raise a
        replica's failure to load; :meth:`shutdown` waits for them (up to a minute) without raising.
        """
        if not self.remote:
            if callable(source):
                raise TypeError(
                    "update_weights: these replicas run in this process; pass the (name, tensor) pairs, "
                    "not a send callable."
                )
            if self._local_sync is None:  # one engine pair for the whole run
                self._local_sync = WeightSyncManager(self.checkpoint_engine)
            return run_coroutine(self._local_sync.sync(source, self.replicas, version=version))
        if not callable(source):
            raise TypeError(
                "update_weights: these replicas run in processes of their own; pass the trainer's send "
                "(a callable), the tensors travel through the checkpoint engine."
            )
        if not self._connected:
            raise RolloutReplicaError(
                "update_weights: the checkpoint engine is not connected; call connect_weight_sync first."
            )
        self.wait_for_weights()
        start = time.perf_counter()
        refs = [r.actor.receive_weights.remote(version, not wait) for r in self.replicas]
        sent = source()
        for replica in self.replicas:
            replica.asleep = False  # the receive wakes it
            replica.weight_version = replica.weight_version + 1 if version is None else int(version)
        if not wait:
            self._loading = refs
            ranks = [r for r in (sent if isinstance(sent, list) else [sent]) if isinstance(r, dict)]
            if not ranks:
                raise TypeError(
                    "update_weights(wait=False): the send callable must return each trainer rank's "
                    f"{{'tensors', 'bytes', 'seconds'}} (the stats it reports), got {sent!r}."
                )
            first = max(ranks, key=lambda r: float(r.get("bytes", 0.0)))
            return SyncStats(int(first.get("tensors", 0)), int(first["bytes"]), time.perf_counter() - start)
        first = self._wait(refs, "receive_weights", START_TIMEOUT_S)[0]
        return SyncStats(int(first["tensors"]), int(first["bytes"]), time.perf_counter() - start)

    def wait_for_weights(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every replica has loaded the last update that did not wait (``wait=False``).

        Raises:
            RolloutReplicaError: a replica failed to load it, or did not within ``timeout_s`` (named).
        """
        loading, self._loading = self._loading, []
        if loading:
            self._wait(loading, "receive_weights", timeout_s)

    # ---------------------------------------------------------------- health and shutdown

    def health(self, timeout_s: float = 30.0) -> dict[int, int]:
        """``{replica rank: process id}`` once every replica answered.

        Raises:
            RolloutReplicaError: a replica is dead or did not answer within ``timeout_s`` (named).
        """
        if not self.remote:
            return {r.replica_rank: os.getpid() for r in self.replicas}
        pids = self._wait([r.actor.ping.remote() for r in self.replicas], "health check", timeout_s)
        return {r.replica_rank: int(pid) for r, pid in zip(self.replicas, pids, strict=True)}

    def shutdown(self) -> None:
        """Shut every replica down (engines, servers, processes) and release their resources."""
        local, self._local_sync = self._local_sync, None
        if local is not None:
            local.close()
        if not self.remote:
            run_coroutine(self._each(_shutdown, only=lambda r: True))
            return
        from trellis.distributed.ray import import_ray

        ray = import_ray()
        loading, self._loading = self._loading, []  # let a load not waited for end first (its errors moot)
        if loading:
            ray.wait(loading, num_returns=len(loading), timeout=60)
        refs = [r.actor.shutdown.remote() for r in self.replicas]
        ray.wait(refs, num_returns=len(refs), timeout=60)
        for replica in self.replicas:
            ray.kill(replica.actor)
        if self._pool is not None:
            self._pool.release()
            self._pool = None

    # ---------------------------------------------------------------- helpers

    def _require_remote(self, where: str) -> None:
        if not self.remote:
            raise RolloutReplicaError(
                f"{where}: these replicas run in this process; only replicas in processes of their own "
                "(rollout.mode=standalone) join a weight-sync group or a core ledger."
            )

    def _wait(self, refs: list[Any], what: str, timeout_s: float) -> list[Any]:
        """The values of ``refs`` (one per replica); a dead, failed or silent replica named in the error."""
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        from trellis.distributed.ray import import_ray

        ray = import_ray()
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        values = []
        for replica, ref in zip(self.replicas, refs, strict=True):
            if ref not in ready:
                raise RolloutReplicaError(
                    f"{replica.describe()} did not finish {what} within {timeout_s:g} s; it is stuck or "
                    "overloaded (check its log: ray logs)."
                )
            try:
                values.append(ray.get(ref))
            except RayActorError as exc:
                raise RolloutReplicaError(
                    f"{replica.describe()} is dead ({type(exc).__name__}) during {what}; its process "
                    "exited. Check its log (ray logs)."
                ) from exc
            except (RayTaskError, GetTimeoutError) as exc:
                cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
                raise RolloutReplicaError(
                    f"{replica.describe()} failed during {what}: {type(cause).__name__}: {cause}"
                ) from exc
        return values


async def _shutdown(replica: Any) -> None:
    shutdown = getattr(replica, "shutdown", None)
    if shutdown is not None:
        await shutdown()


class AgentWorkerPool:
    """``rollout.agent.num_workers`` processes running agent loops over a manager's replicas.

    Each batch is cut into that many contiguous shares (rows keep their ``__row__`` numbers, so seeds
    do not depend on the cut); each :class:`~trellis.rollout.remote.AgentWorker` runs its share's loops
    on its own event loop and the shares' rollouts are joined re-padded to the widest. With one worker
    the loops run in this process.

    Args:
        config: the run's :class:`~trellis.config.TrellisConfig`.
        manager: the standalone replicas (:meth:`ReplicaManager.start_standalone`).
        tokenizer: the model's tokenizer (for the in-process worker).
        env: extra environment variables for the worker processes.
    """

    def __init__(
        self, config: Any, manager: ReplicaManager, tokenizer: Any, *, env: Mapping[str, str] | None = None
    ) -> None:
        self.num_workers = int(config.rollout.agent.num_workers)
        self._turn = 0  # generate_async's next worker
        self.local: Any = None
        self.workers: list[Any] = []
        if self.num_workers == 1:
            from trellis.rollout.agent_loop import AgentLoopManager
            from trellis.utils.tokenizer import hf_processor

            model = config.model
            self.local = AgentLoopManager(
                config.rollout,
                manager.replicas,
                tokenizer,
                response_length=config.data.max_response_length,
                processor=hf_processor(
                    model.tokenizer_path or model.path, trust_remote_code=model.trust_remote_code
                ),
            )
            return
        from trellis.distributed.ray import import_ray, passed_env
        from trellis.rollout.remote import AgentWorker

        ray = import_ray()
        handles = [(r.replica_rank, r.actor, r.pid) for r in manager.replicas]
        worker_env = {"TRELLIS_NUM_THREADS": "1", **passed_env(), **dict(env or {})}
        # agent loops mostly wait on replicas and tools: they take no CPU reservation from the pools
        remote_cls = ray.remote(AgentWorker).options(num_cpus=0, runtime_env={"env_vars": worker_env})
        self.workers = [remote_cls.remote(config, handles) for _ in range(self.num_workers)]
        self.pids = self._get([w.ping.remote() for w in self.workers], "start")

    def generate_sequences(self, prompts: Any) -> Any:
        """The rollouts of ``prompts``, generated by the workers' agent loops, in the rows' order."""
        import numpy as np

        from trellis.rollout.agent_loop import concat_rollouts

        if self.local is not None:
            return self.local.generate_sequences(prompts)
        shares = [part.tolist() for part in np.array_split(np.arange(len(prompts)), self.num_workers)]
        used = [(worker, rows) for worker, rows in zip(self.workers, shares, strict=True) if rows]
        refs = [worker.generate_sequences.remote(prompts[rows]) for worker, rows in used]
        return concat_rollouts(self._get(refs, "generate_sequences"))

    async def generate_async(self, prompts: Any) -> Any:
        """:meth:`generate_sequences` as a coroutine, for a caller that runs many batches concurrently
        on its own event loop (the async trainer's rollout stream: one group per call). With several
        workers each call goes whole to the next worker in turn."""
        from ray.exceptions import RayActorError

        if self.local is not None:
            return await self.local.generate_sequences_async(prompts)
        worker = self.workers[self._turn % len(self.workers)]
        self._turn += 1
        try:
            return await worker.generate_sequences.remote(prompts)
        except RayActorError as exc:
            raise _worker_died("generate_sequences", exc) from exc

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        from ray.exceptions import RayActorError

        from trellis.distributed.ray import import_ray

        try:
            return list(import_ray().get(refs))
        except RayActorError as exc:
            raise _worker_died(what, exc) from exc

    def shutdown(self) -> None:
        """Stop the worker processes."""
        if self.workers:
            from trellis.distributed.ray import import_ray

            ray = import_ray()
            for worker in self.workers:
                ray.kill(worker)
            self.workers = []


def _worker_died(what: str, exc: BaseException) -> RolloutReplicaError:
    return RolloutReplicaError(
        f"an agent worker died during {what} ({type(exc).__name__}); check its log (ray logs)."
    )
