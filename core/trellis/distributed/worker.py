"""``Worker``: the base class of everything a worker group runs, and the ``@register`` decorator.

A worker is one process's (or, locally, one object's) share of a role — an actor, a critic, a
rollout — and its methods marked ``@register`` become methods of the worker group::

    class Actor(Worker):
        def __init__(self, config):
            self.engine = ...            # self.rank / self.world_size are already set

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def compute_log_prob(self, data: DataProto) -> DataProto: ...

    group.compute_log_prob(batch)        # split over the workers, results concatenated

A method that takes a ``DataProtoFuture`` gets its value, fetched inside the worker; in a worker
class with async methods (a Ray async actor), take futures in async methods only: a sync method
there would block the actor's event loop while it waits.

A worker's rank and world size come from its group (locally) or from the ``RANK`` / ``WORLD_SIZE``
environment variables its Ray actor is started with (``MASTER_ADDR`` / ``MASTER_PORT`` are set too,
for ``torch.distributed.init_process_group``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from trellis.distributed.dispatch import Dispatch, Execute, get_dispatch_mode, mesh_name_of

REGISTER_ATTR = "__trellis_register__"
PICK_MASTER_ENV = "TRELLIS_PICK_MASTER"
"""Set for a group's rank-0 Ray actor: it chooses ``MASTER_ADDR`` / ``MASTER_PORT`` on its own node."""

F = TypeVar("F", bound=Callable[..., Any])

_RANK: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "trellis_worker_rank", default=None
)


@dataclass(frozen=True)
class MethodSpec:
    """How a group calls a ``@register`` method: its dispatch mode, execute mode and blocking."""

    dispatch_mode: Any
    execute_mode: str
    blocking: bool


def register(
    dispatch_mode: Any = Dispatch.ALL_TO_ALL, execute_mode: str = Execute.ALL, blocking: bool = True
) -> Callable[[F], F]:
    """Mark a worker method as callable through its worker group.

    Args:
        dispatch_mode: a :class:`~trellis.distributed.dispatch.Dispatch` name, a name given to
            ``register_dispatch_mode``, or a ``{"dispatch_fn", "collect_fn"}`` dict (e.g. from
            ``make_nd_compute_dataproto_dispatch_fn``).
        execute_mode: ``Execute.ALL`` (every worker runs it) or ``Execute.RANK_ZERO``.
        blocking: False returns futures (a ``DataProtoFuture`` for DataProto results) at once.

    Raises:
        ValueError: an unknown dispatch or execute mode (at decoration time).
    """
    if isinstance(dispatch_mode, str):
        get_dispatch_mode(dispatch_mode)  # an unknown name fails where the method is declared
    if execute_mode not in (Execute.ALL, Execute.RANK_ZERO):
        raise ValueError(f"Unknown execute mode {execute_mode!r}; use Execute.ALL or Execute.RANK_ZERO.")
    spec = MethodSpec(dispatch_mode, execute_mode, bool(blocking))

    def decorate(fn: F) -> F:
        wrapper: Callable[..., Any]
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def call_async(self: Any, *args: Any, **kwargs: Any) -> Any:
                args, kwargs = await resolve_futures_async(args, kwargs)
                return await fn(self, *args, **kwargs)

            wrapper = call_async
        else:

            @functools.wraps(fn)
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                args, kwargs = resolve_futures(args, kwargs)
                return fn(self, *args, **kwargs)

            wrapper = call
        setattr(wrapper, REGISTER_ATTR, spec)
        return cast(F, wrapper)  # functools.wraps: same name, signature and docstring as fn

    return decorate


def resolve_futures(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` / ``kwargs`` with every ``DataProtoFuture`` replaced by its value (fetched here)."""
    from trellis.distributed.future import DataProtoFuture

    if not any(isinstance(v, DataProtoFuture) for v in (*args, *kwargs.values())):
        return args, kwargs
    args = tuple(a.get() if isinstance(a, DataProtoFuture) else a for a in args)
    kwargs = {k: v.get() if isinstance(v, DataProtoFuture) else v for k, v in kwargs.items()}
    return args, kwargs


async def resolve_futures_async(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """:func:`resolve_futures` without blocking the event loop (for async methods)."""
    from trellis.distributed.future import DataProtoFuture

    async def value(v: Any) -> Any:
        return await v.get_async() if isinstance(v, DataProtoFuture) else v

    return tuple([await value(a) for a in args]), {k: await value(v) for k, v in kwargs.items()}


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """``{method name: spec}`` of every ``@register`` method of ``cls`` (inherited ones included)."""
    found = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), REGISTER_ATTR, None)
        if isinstance(spec, MethodSpec):
            found[name] = spec
    return found


def mesh_names(cls: type) -> list[str]:
    """The meshes the ``@register`` methods of ``cls`` are dispatched over (``make_nd_compute_*`` modes),
    sorted: what each of its workers must register with ``_register_dispatch_collect_info``."""
    return sorted({m for spec in registered_methods(cls).values() if (m := mesh_name_of(spec.dispatch_mode))})


@contextlib.contextmanager
def worker_rank(rank: int, world_size: int) -> Iterator[None]:
    """Within this block, new workers take ``rank`` / ``world_size`` (how local groups place them)."""
    token = _RANK.set((rank, world_size))
    try:
        yield
    finally:
        _RANK.reset(token)


def _free_address() -> tuple[str, int]:
    """This machine's address as Ray sees it (loopback outside Ray) and a free port on it."""
    host = "127.0.0.1"
    with contextlib.suppress(Exception):
        import ray

        if ray.is_initialized():
            host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


class Worker:
    """Base class of worker-group workers; see the module docstring.

    ``__init__`` must not wait for other workers (no collectives there): a Ray group starts its
    actors one by one. Join ``torch.distributed`` in a registered init method instead, e.g.
    ``@register(dispatch_mode=Dispatch.ONE_TO_ALL) def init_model(self): ...``.
    """

    _rank: int
    _world_size: int
    _dispatch_info: dict[str, int]  # mesh name -> this worker's data-parallel rank on it
    _collect_info: dict[str, bool]  # mesh name -> whether this worker's output is kept
    _trellis_profiler: Any = None  # the torch profiler of a profiled stage (_trellis_start_profile)

    def __new__(cls, *args: Any, **kwargs: Any) -> Worker:
        self = super().__new__(cls)
        placed = _RANK.get()
        if placed is not None:
            self._rank, self._world_size = placed
        else:
            self._rank = int(os.environ.get("RANK", "0"))
            self._world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._dispatch_info = {}
        self._collect_info = {}
        if os.environ.pop(PICK_MASTER_ENV, None) == "1":
            os.environ["MASTER_ADDR"], port = _free_address()
            os.environ["MASTER_PORT"] = str(port)
        return self

    @property
    def rank(self) -> int:
        """This worker's index in its group, 0-based."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Workers in the group."""
        return self._world_size

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this worker's data-parallel rank on mesh ``mesh_name`` and whether its output is kept.

        Raises:
            ValueError: the mesh is already registered on this worker, or ``dp_rank`` is negative.
        """
        if mesh_name in self._dispatch_info:
            raise ValueError(
                f"Mesh {mesh_name!r} is already registered on worker {self.rank} (dp_rank "
                f"{self._dispatch_info[mesh_name]}); register each mesh once."
            )
        if not isinstance(dp_rank, int) or dp_rank < 0:
            raise ValueError(f"dp_rank must be a non-negative int, got {dp_rank!r}.")
        self._dispatch_info[mesh_name] = dp_rank
        self._collect_info[mesh_name] = bool(is_collect)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_collect_info(self, mesh_name: str) -> tuple[int, bool]:
        if mesh_name not in self._dispatch_info:
            raise ValueError(
                f"Worker {self.rank} ({type(self).__name__}) has not registered mesh {mesh_name!r}; call "
                "self._register_dispatch_collect_info(mesh_name, dp_rank, is_collect) in its __init__."
            )
        return self._dispatch_info[mesh_name], self._collect_info[mesh_name]

    def _trellis_master(self) -> tuple[str, str]:
        """This process's ``MASTER_ADDR`` and ``MASTER_PORT`` (how a Ray group learns rank 0's choice)."""
        return os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")

    def _trellis_process(self) -> dict[str, Any]:
        """This worker's process: ``pid``, ``host`` and ``log`` (the file its stderr goes to, '' when it
        is a terminal or unknown). Called once by a Ray group when it starts the worker, which also makes
        ``SIGUSR1`` dump the process's Python stacks to that log (how a stall report shows where it is
        stuck, :mod:`trellis.utils.watchdog`)."""
        import socket

        from trellis.utils.watchdog import enable_stack_dumps

        enable_stack_dumps()
        try:
            log = os.readlink("/proc/self/fd/2")
        except OSError:
            log = ""
        return {"pid": os.getpid(), "host": socket.gethostname(), "log": log if log.startswith("/") else ""}

    def _trellis_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` by name (how groups reach methods of colocated roles)."""
        return getattr(self, method)(*args, **kwargs)

    def _trellis_start_profile(self, options: dict[str, Any]) -> None:
        """Start the torch profiler in this worker's process, every thread of it (``options``: keyword
        arguments of :func:`trellis.utils.profiling.start_profiler`); :meth:`_trellis_stop_profile` stops
        it. How a group's :meth:`~trellis.distributed.worker_group.WorkerGroup.start_profiling` reaches it."""
        from trellis.utils.profiling import start_profiler

        running = self._trellis_profiler
        if running is not None:  # left running by a stage that failed: the trainer does not stop those
            running.stop()
        self._trellis_profiler = start_profiler(**options)

    def _trellis_stop_profile(self, output_dir: str, stem: str, top_k: int, title: str) -> Any:
        """Stop the profiler :meth:`_trellis_start_profile` started and write what it recorded as
        ``<output_dir>/<stem>.rank<rank>.json`` (Chrome trace) and ``.txt`` (top ``top_k`` operators,
        headed by ``title`` and this rank); returns the :class:`~trellis.utils.profiling.ProfileReport`,
        or None when no profiler was running."""
        from trellis.utils.profiling import write_profile

        prof = self._trellis_profiler
        if prof is None:
            return None
        self._trellis_profiler = None
        prof.stop()
        return write_profile(
            prof,
            output_dir,
            f"{stem}.rank{self.rank}",
            top_k=top_k,
            title=f"{title}, worker rank {self.rank}",
        )
