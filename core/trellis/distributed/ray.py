"""The Ray backend: resource pools (placement groups) and worker groups of Ray actors.

::

    pool = RayResourcePool([2])                          # one node, two workers
    group = RayWorkerGroup(pool, ClassWithInitArgs(ActorWorker, config))
    out = group.compute_log_prob(batch)                  # same interface as LocalWorkerGroup

Each worker is an actor placed on one bundle of a placement group (``STRICT_PACK`` per node), with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment, so
``torch.distributed.init_process_group`` needs no arguments. A bundle is ``cpus_per_worker`` CPUs plus,
on an accelerator backend, one device of the backend's Ray resource (``GPU`` for cuda, ``NPU`` for the
npu plugin); ``max_colocate_count`` actors may share a bundle (e.g. colocated roles as separate
actors). Ray is imported only when this module is used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from trellis.distributed.worker import PICK_MASTER_ENV
from trellis.distributed.worker_group import ClassWithInitArgs, WorkerGroup
from trellis.errors import TrellisError
from trellis.utils.watchdog import tail


def import_ray() -> Any:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is an optional extra
        raise ImportError(
            "trainer.executor=ray needs Ray: pip install 'trellis-rl[ray]' (or pip install ray)."
        ) from None
    return ray


def _accelerator_resource(device_name: str | None) -> str | None:
    if device_name in (None, "cpu"):
        return None
    from trellis.registries import device_backends

    return getattr(device_backends.get(device_name), "ray_resource", None)


class RayResourcePool:
    """Placement groups for a role's workers: ``process_on_nodes[i]`` workers on node ``i``.

    Args:
        process_on_nodes: workers per node, e.g. ``[8, 8]`` for two nodes of eight devices.
        device_name: a device backend name (``cpu``, ``cuda``, ...); its ``ray_resource`` is asked for
            per bundle. None or ``cpu``: CPUs only.
        cpus_per_worker: CPUs in each bundle.
        max_colocate_count: actors that may share one bundle.
        name_prefix: placement-group names start with it.
        ready_timeout_s: how long to wait for the cluster to place the bundles.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int],
        *,
        device_name: str | None = None,
        cpus_per_worker: float = 1,
        max_colocate_count: int = 1,
        name_prefix: str = "trellis",
        ready_timeout_s: float = 120.0,
    ) -> None:
        counts = list(process_on_nodes)
        if not counts or any(not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(
                f"process_on_nodes must be positive worker counts per node, got {process_on_nodes!r}."
            )
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count!r}.")
        self.process_on_nodes = counts
        self.device_name = device_name
        self.accelerator = _accelerator_resource(device_name)
        self.cpus_per_worker = cpus_per_worker
        self.max_colocate_count = max_colocate_count
        self.name_prefix = name_prefix
        self.ready_timeout_s = ready_timeout_s
        self._pgs: list[Any] | None = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        """The resources of one bundle."""
        spec: dict[str, float] = {"CPU": self.cpus_per_worker}
        if self.accelerator:
            spec[self.accelerator] = 1
        return spec

    def get_placement_groups(self) -> list[Any]:
        """The pool's placement groups (created and awaited on first use), one per node.

        Raises:
            RuntimeError: the cluster cannot host them within ``ready_timeout_s``; the message shows what was
                asked for and what the cluster has.
        """
        if self._pgs is None:
            ray = import_ray()
            from ray.util.placement_group import placement_group

            pgs = [
                placement_group([self.bundle()] * n, strategy="STRICT_PACK", name=f"{self.name_prefix}_{i}")
                for i, n in enumerate(self.process_on_nodes)
            ]
            ready, _ = ray.wait(
                [pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.ready_timeout_s
            )
            if len(ready) < len(pgs):
                for pg in pgs:
                    ray.util.remove_placement_group(pg)
                raise RuntimeError(
                    f"Ray could not place {self.process_on_nodes} workers with {self.bundle()} each within "
                    f"{self.ready_timeout_s:g} s; the cluster has {ray.cluster_resources()}. Ask for fewer "
                    "workers (trainer.n_devices_per_node / nnodes) or start Ray with more resources."
                )
            self._pgs = pgs
        return self._pgs

    def release(self) -> None:
        """Remove the placement groups (their actors should be gone first)."""
        if self._pgs is not None:
            ray = import_ray()
            for pg in self._pgs:
                ray.util.remove_placement_group(pg)
            self._pgs = None


class ResourcePoolManager:
    """Named resource pools and which role runs on which.

    Args:
        resource_pool_spec: ``{pool name: workers per node}``, e.g. ``{"global_pool": [2]}``.
        mapping: ``{role: pool name}``, e.g. ``{"actor_rollout": "global_pool", "critic": "global_pool"}``.
        **pool_kwargs: passed to every :class:`RayResourcePool` (``device_name``, ``cpus_per_worker`` ...).
    """

    def __init__(
        self, resource_pool_spec: Mapping[str, Sequence[int]], mapping: Mapping[str, str], **pool_kwargs: Any
    ) -> None:
        unknown = sorted({pool for pool in mapping.values() if pool not in resource_pool_spec})
        if unknown:
            raise ValueError(
                f"Roles are mapped to undefined pools {unknown}; pools: {sorted(resource_pool_spec)}."
            )
        self.resource_pool_spec = {k: list(v) for k, v in resource_pool_spec.items()}
        self.mapping = dict(mapping)
        self.pool_kwargs = pool_kwargs
        self.resource_pool_dict: dict[str, RayResourcePool] = {}

    def create_resource_pool(self) -> None:
        for name, counts in self.resource_pool_spec.items():
            if name not in self.resource_pool_dict:
                self.resource_pool_dict[name] = RayResourcePool(counts, name_prefix=name, **self.pool_kwargs)

    def get_resource_pool(self, role: str) -> RayResourcePool:
        """The pool ``role`` runs on (pools are created on first use)."""
        if role not in self.mapping:
            raise KeyError(f"No resource pool for role {role!r}; roles: {sorted(self.mapping)}.")
        self.create_resource_pool()
        return self.resource_pool_dict[self.mapping[role]]


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per worker of ``resource_pool``; see the module docstring.

    Args:
        resource_pool: where the actors go.
        cls_with_init: the worker class and its arguments (built inside each actor).
        name_prefix: actor names start with it (None: unnamed actors).
        env: extra environment variables for every worker.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        cls_with_init: ClassWithInitArgs,
        *,
        name_prefix: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.resource_pool = resource_pool
        pgs = resource_pool.get_placement_groups()
        world_size = resource_pool.world_size
        remote_cls = ray.remote(cls_with_init.cls)
        share = 1.0 / resource_pool.max_colocate_count
        self.workers: list[Any] = []
        master: tuple[str, int] | None = None
        rank = 0
        for node, pg in enumerate(pgs):
            for local_rank in range(resource_pool.process_on_nodes[node]):
                worker_env = {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(resource_pool.process_on_nodes[node]),
                    **({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])} if master else {}),
                    **passed_env(),
                    **dict(env or {}),
                }
                options: dict[str, Any] = {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=local_rank
                    ),
                    "num_cpus": resource_pool.cpus_per_worker * share,
                    "runtime_env": {"env_vars": worker_env},
                }
                if resource_pool.accelerator:
                    options["resources"] = {resource_pool.accelerator: share}
                if name_prefix:
                    options["name"] = f"{name_prefix}_{rank}"
                if master is None:  # rank 0 picks the rendezvous address on its own node
                    worker_env[PICK_MASTER_ENV] = "1"
                actor = remote_cls.options(**options).remote(*cls_with_init.args, **cls_with_init.kwargs)
                if master is None:
                    host, port = ray.get(actor._trellis_master.remote())
                    master = (host, int(port))
                self.workers.append(actor)
                rank += 1
        self.master_address = master
        self.processes: list[dict[str, Any]] = ray.get([a._trellis_process.remote() for a in self.workers])
        """Per rank: ``pid``, ``host`` and ``log`` of the worker's process (stall and death reports)."""
        self._calls: dict[Any, tuple[int, str]] = {}  # pending future -> (rank, method), for reports
        super().__init__(cls_with_init.cls, world_size)

    def _execute(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        future = getattr(self.workers[rank], method).remote(*args, **kwargs)
        self._calls[future] = (rank, method)
        return future

    def _get(self, futures: list[Any]) -> list[Any]:
        ray = import_ray()
        from ray.exceptions import RayActorError

        futures = list(futures)
        try:
            return list(ray.get(futures))
        except RayActorError as exc:
            raise self._died(futures, exc) from exc
        finally:
            for future in futures:
                self._calls.pop(future, None)

    def _died(self, futures: list[Any], exc: BaseException) -> WorkerDiedError:
        """The report of a worker whose process died during one of ``futures``: which worker, during
        which call, why (Ray's account: a signal, the OOM killer, an exit), and its log's last lines."""
        ray = import_ray()
        dead = None
        for future in futures:  # the first call whose actor is gone
            try:
                ray.get(future, timeout=0)
            except ray.exceptions.RayActorError:
                dead = self._calls.get(future)
                break
            except Exception:
                continue
        rank, method = dead if dead is not None else (-1, "?")
        process = self.processes[rank] if 0 <= rank < len(self.processes) else {}
        cause = " ".join(str(exc).split())[:1500]
        log = process.get("log", "")
        lines = tail(log, 40) if log else ""
        pid, host = process.get("pid", "?"), process.get("host", "?")
        where = f"worker {rank} ({self._worker_cls.__name__}, pid {pid} on {host})"
        return WorkerDiedError(
            f"{where} died during {method}: {cause}\n"
            + (f"Last lines of its log {log}:\n{lines}" if lines else "Its log could not be read.")
        )

    def shutdown(self) -> None:
        """Kill the actors (and free the pool's placement groups)."""
        ray = import_ray()
        for actor in self.workers:
            ray.kill(actor)
        self.workers = []
        self.resource_pool.release()


class WorkerDiedError(TrellisError, RuntimeError):
    """A worker process of a Ray group died (signal, OOM kill, exit); the message says which, during
    which call, and ends with its log's last lines."""


def passed_env() -> dict[str, str]:
    """Settings of this process that workers must share (offline Hugging Face, thread counts)."""
    keys = (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "OMP_NUM_THREADS",
        "TRELLIS_CACHE_DIR",
    )
    return {k: os.environ[k] for k in keys if k in os.environ}
