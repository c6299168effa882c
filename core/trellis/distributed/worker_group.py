"""Worker groups: one interface over a role's workers, in-process (:class:`LocalWorkerGroup`) or as Ray
actors (:class:`trellis.distributed.ray.RayWorkerGroup`).

A group gets one method per ``@register`` method of its worker class. Calling it dispatches the
arguments (see :mod:`trellis.distributed.dispatch`), runs the method on the workers, waits (unless
the method is non-blocking) and collects the outputs. Several roles can share the same workers —
one process holding, say, the actor and the reference policy — through
:func:`create_colocated_worker_cls` and :meth:`WorkerGroup.spawn`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from trellis.data.protocol import DataProto
from trellis.distributed.dispatch import (
    PAD_KEY,
    Dispatch,
    Execute,
    get_dispatch_mode,
    mesh_name_of,
    strip_padding,
)
from trellis.distributed.future import DataProtoFuture
from trellis.distributed.worker import REGISTER_ATTR, MethodSpec, Worker, registered_methods, worker_rank
from trellis.utils.coroutines import run_coroutine


class ClassWithInitArgs:
    """A worker class and the arguments to build it with (in each worker process)."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        if not isinstance(cls, type) or not issubclass(cls, Worker):
            raise TypeError(f"A worker class must subclass trellis.distributed.Worker, got {cls!r}.")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> Any:
        return self.cls(*self.args, **self.kwargs)


def _run(result: Any) -> Any:
    """The value of a method's result, running it to completion when it is a coroutine."""
    if inspect.iscoroutine(result):
        return run_coroutine(result)
    return result


class WorkerGroup:
    """What both backends share: method binding, dispatch, collection, colocated views.

    Subclasses implement :meth:`_execute` (start ``method`` on one worker, return a future or value)
    and :meth:`_get` (wait for futures).
    """

    def __init__(self, worker_cls: type, world_size: int) -> None:
        self.world_size = world_size
        self._worker_cls = worker_cls
        self._combined_cls = worker_cls  # the class the workers really are (a view's role differs)
        self._prefix = ""
        self._mesh_info: dict[str, tuple[list[int], list[bool]]] = {}
        self._bound: list[str] = []
        self._bind(worker_cls)

    # -- backends

    def _execute(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _get(self, futures: list[Any]) -> list[Any]:
        raise NotImplementedError

    # -- binding

    def _bind(self, worker_cls: type, prefix: str = "") -> None:
        for name, spec in registered_methods(worker_cls).items():
            if name.startswith(prefix) and prefix:
                public = name[len(prefix) :]
            elif prefix:
                continue
            else:
                public = name
            if hasattr(self, public) and public not in self._bound:
                raise ValueError(
                    f"{worker_cls.__name__}.{public} clashes with the worker group's own attribute "
                    f"{type(self).__name__}.{public}; rename the method."
                )
            setattr(self, public, self._caller(name, spec))
            self._bound.append(public)

    def _caller(self, method: str, spec: MethodSpec) -> Any:
        dispatch_fn, collect_fn = get_dispatch_mode(spec.dispatch_mode)
        mesh = mesh_name_of(spec.dispatch_mode)
        proto_collect = spec.dispatch_mode == Dispatch.DP_COMPUTE_PROTO or (
            mesh is not None and spec.dispatch_mode.get("concat", True)
        )

        def call(*args: Any, **kwargs: Any) -> Any:
            d_args, d_kwargs = dispatch_fn(self, *args, **kwargs)
            pad = d_kwargs.pop(PAD_KEY, 0)
            ranks = [0] if spec.execute_mode == Execute.RANK_ZERO else range(self.world_size)
            futures = [
                self._execute(
                    rank,
                    method,
                    tuple(a[rank] for a in d_args),
                    {k: v[rank] for k, v in d_kwargs.items()},
                )
                for rank in ranks
            ]
            if spec.execute_mode == Execute.RANK_ZERO:
                return futures[0] if not spec.blocking else self._get(futures)[0]
            if not spec.blocking:
                if proto_collect:
                    return DataProtoFuture([futures[i] for i in self._collected(spec)], pad)
                return [futures[i] for i in self._collected(spec)] if mesh is not None else futures
            result = collect_fn(self, self._get(futures))
            # padding rows are rows of a DataProto; a list holds one output per worker (metric dicts)
            return strip_padding(result, pad) if isinstance(result, DataProto) else result

        call.__name__ = method
        call.__doc__ = getattr(getattr(self._worker_cls, method, None), "__doc__", None)
        return call

    def _collected(self, spec: MethodSpec) -> list[int]:
        """Ranks whose outputs make up a result, in data-parallel order."""
        mesh = mesh_name_of(spec.dispatch_mode)
        if mesh is not None:
            ranks, collect = self.dispatch_info(mesh), self.collect_info(mesh)
            return [i for _, i in sorted((r, i) for i, r in enumerate(ranks) if collect[i])]
        return list(range(self.world_size))

    # -- profiling

    def start_profiling(self, **options: Any) -> None:
        """Start the torch profiler in every worker (``options``: keyword arguments of
        :func:`trellis.utils.profiling.start_profiler`); :meth:`stop_profiling` writes what each recorded.

        For groups whose workers run in processes of their own (Ray): a :class:`LocalWorkerGroup`'s
        workers run in the caller's process, inside the caller's own profile, and torch runs one
        profiler per process at a time.
        """
        self._get(
            [self._execute(r, "_trellis_start_profile", (options,), {}) for r in range(self.world_size)]
        )

    def stop_profiling(self, output_dir: str, stem: str, *, top_k: int, title: str) -> list[Any]:
        """Stop every worker's profiler; each writes ``<output_dir>/<stem>.rank<rank>.json`` (its Chrome
        trace) and ``.txt`` (its top ``top_k`` operators under ``title``). Returns the workers'
        :class:`~trellis.utils.profiling.ProfileReport` objects in rank order (None for a worker whose
        profiler was not running)."""
        args = (output_dir, stem, top_k, title)
        return self._get(
            [self._execute(r, "_trellis_stop_profile", args, {}) for r in range(self.world_size)]
        )

    # -- meshes

    def _mesh(self, mesh_name: str) -> tuple[list[int], list[bool]]:
        if mesh_name not in self._mesh_info:
            method = f"{self._prefix}_query_dispatch_collect_info"
            futures = [self._execute(r, method, (mesh_name,), {}) for r in range(self.world_size)]
            info = self._get(futures)
            ranks, collect = [int(r) for r, _ in info], [bool(c) for _, c in info]
            dp_size = max(ranks) + 1
            missing = sorted(set(range(dp_size)) - {r for r, c in zip(ranks, collect, strict=True) if c})
            if missing:
                raise ValueError(
                    f"Mesh {mesh_name!r}: no worker collects data-parallel rank(s) {missing}; exactly one "
                    "worker per rank must register is_collect=True."
                )
            self._mesh_info[mesh_name] = (ranks, collect)
        return self._mesh_info[mesh_name]

    def dispatch_info(self, mesh_name: str) -> list[int]:
        """Each worker's data-parallel rank on ``mesh_name`` (asked of the workers once)."""
        return self._mesh(mesh_name)[0]

    def collect_info(self, mesh_name: str) -> list[bool]:
        """Whether each worker's output is collected on ``mesh_name``."""
        return self._mesh(mesh_name)[1]

    # -- colocation

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, WorkerGroup]:
        """One group per role of a colocated worker class, all sharing this group's workers.

        Raises:
            ValueError: this group's worker class is not colocated, or a prefix is not one of its roles.
        """
        roles: dict[str, type] = getattr(self._worker_cls, "_trellis_roles", {})
        if not roles:
            raise ValueError(
                f"spawn() needs a group of a colocated worker class (create_colocated_worker_cls); "
                f"{self._worker_cls.__name__} is not one."
            )
        views = {}
        for prefix in prefix_set:
            if prefix not in roles:
                raise ValueError(f"Unknown role {prefix!r}; this colocated class holds {sorted(roles)}.")
            view = copy.copy(self)
            for name in self._bound:  # the combined class's methods are not the role's
                delattr(view, name)
            view._bound = []
            view._prefix = f"{prefix}_"
            view._mesh_info = {}
            view._worker_cls = roles[prefix]
            view._bind(self._combined_cls, prefix=f"{prefix}_")
            views[prefix] = view
        return views


class LocalWorkerGroup(WorkerGroup):
    """Workers as objects in this process, called one after another in rank order.

    The laptop / test backend: ``world_size`` workers are built with ranks 0..world_size-1, but they
    share one process, so they cannot run collectives with each other (use Ray for that).
    """

    def __init__(self, cls_with_init: ClassWithInitArgs, world_size: int = 1) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}.")
        self.workers = []
        for rank in range(world_size):
            with worker_rank(rank, world_size):
                self.workers.append(cls_with_init())
        super().__init__(cls_with_init.cls, world_size)

    def _execute(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _run(getattr(self.workers[rank], method)(*args, **kwargs))

    def _get(self, futures: list[Any]) -> list[Any]:
        return list(futures)


def create_colocated_worker_cls(class_dict: Mapping[str, ClassWithInitArgs]) -> ClassWithInitArgs:
    """One worker class holding several roles, so they share processes (and devices).

    ``class_dict`` maps a role prefix (``"actor"``, ``"ref"``) to the role's class and arguments. The
    combined worker builds every role in each process; its group's :meth:`WorkerGroup.spawn` returns
    one group per role whose methods reach that role.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role.")
    roles = {prefix: spec.cls for prefix, spec in class_dict.items()}
    for prefix in roles:
        if not prefix.isidentifier():
            raise ValueError(f"A role prefix must be an identifier, got {prefix!r}.")
    inits = {prefix: (spec.args, spec.kwargs) for prefix, spec in class_dict.items()}

    def __init__(self: Any) -> None:
        self.roles = {}
        for prefix, cls in roles.items():
            args, kwargs = inits[prefix]
            with worker_rank(self.rank, self.world_size):
                self.roles[prefix] = cls(*args, **kwargs)

    namespace: dict[str, Any] = {"__init__": __init__, "_trellis_roles": roles}
    for prefix, cls in roles.items():
        for name, spec in registered_methods(cls).items():
            namespace[f"{prefix}_{name}"] = _forward(prefix, name, spec, cls)
    combined = type("Colocated_" + "_".join(roles), (Worker,), namespace)
    combined.__module__ = __name__
    return ClassWithInitArgs(combined)


def _forward(prefix: str, name: str, spec: MethodSpec, cls: type) -> Any:
    target = getattr(cls, name)
    if inspect.iscoroutinefunction(target):

        async def forward_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self.roles[prefix], name)(*args, **kwargs)

        method = forward_async
    else:

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.roles[prefix], name)(*args, **kwargs)

        method = forward
    method.__name__ = f"{prefix}_{name}"
    method.__doc__ = target.__doc__
    setattr(method, REGISTER_ATTR, spec)
    return method
