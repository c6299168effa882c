"""Dispatch modes: how a worker-group call splits its arguments over the workers and joins the results.

A dispatch mode is a pair of functions::

    dispatch_fn(group, *args, **kwargs) -> (args, kwargs)   # every value a list, one item per worker
    collect_fn(group, outputs) -> result                    # outputs: one per worker, in rank order

Built-ins (names of :class:`Dispatch`):

- ``ONE_TO_ALL``: every worker gets the same arguments; the result is the list of outputs.
- ``ALL_TO_ALL``: an argument that is a list with one item per worker is split, anything else is
  given to every worker; outputs are returned as a list.
- ``DP_COMPUTE``: every argument must already be a list with one item per worker; outputs as a list.
- ``DP_COMPUTE_PROTO``: ``DataProto`` arguments are split into one chunk per worker (padded to a
  multiple of the world size by repeating rows; the padding is stripped from the concatenated
  result); other arguments are given to every worker; the outputs are concatenated.
- ``DP_COMPUTE_METRIC``: split like ``DP_COMPUTE_PROTO``; the outputs (e.g. metric dicts) are
  returned as a list, not concatenated.

:func:`make_nd_compute_dataproto_dispatch_fn` builds the mode of a named device mesh, where workers
declare their data-parallel rank with ``Worker._register_dispatch_collect_info``: each data-parallel
rank gets one chunk (workers of the same rank — tensor or sequence parallel peers — get the same
chunk), and one worker per rank is collected from. :func:`make_nd_compute_metric_dispatch_fn` splits
the same way and returns the collected workers' outputs (e.g. metric dicts) as a list in data-parallel
order, as ``DP_COMPUTE_METRIC`` does. :func:`register_dispatch_mode` adds a custom mode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from trellis.data.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

PAD_KEY = "__trellis_pad_size__"
"""Key a dispatch function sets in ``kwargs`` to have the group strip that many padded rows."""


class Dispatch:
    """Names of the built-in dispatch modes (plain strings, usable in ``@register(dispatch_mode=...)``)."""

    ONE_TO_ALL = "ONE_TO_ALL"
    ALL_TO_ALL = "ALL_TO_ALL"
    DP_COMPUTE = "DP_COMPUTE"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"
    DP_COMPUTE_METRIC = "DP_COMPUTE_METRIC"


class Execute:
    """Which workers run a call: ``ALL`` of them, or only ``RANK_ZERO`` (its output is the result)."""

    ALL = "ALL"
    RANK_ZERO = "RANK_ZERO"


DispatchFn = Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]
CollectFn = Callable[[Any, list[Any]], Any]

_MODES: dict[str, tuple[DispatchFn, CollectFn]] = {}


def register_dispatch_mode(name: str, dispatch_fn: DispatchFn, collect_fn: CollectFn) -> None:
    """Add a dispatch mode usable as ``@register(dispatch_mode=name)``.

    Raises:
        ValueError: ``name`` is already a dispatch mode.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"A dispatch mode needs a non-empty string name, got {name!r}.")
    if name in _MODES:
        raise ValueError(f"Dispatch mode {name!r} is already registered; choose another name.")
    if not callable(dispatch_fn) or not callable(collect_fn):
        raise TypeError(f"Dispatch mode {name!r}: dispatch_fn and collect_fn must be callables.")
    _MODES[name] = (dispatch_fn, collect_fn)


def dispatch_mode_names() -> list[str]:
    return sorted(_MODES)


def get_dispatch_mode(mode: str | Mapping[str, Any]) -> tuple[DispatchFn, CollectFn]:
    """``(dispatch_fn, collect_fn)`` of a mode name or of a ``{"dispatch_fn": .., "collect_fn": ..}`` dict.

    Raises:
        ValueError: an unknown name (the message lists the known ones) or an incomplete dict.
    """
    if isinstance(mode, Mapping):
        try:
            return mode["dispatch_fn"], mode["collect_fn"]
        except KeyError:
            raise ValueError(
                f"A dispatch mode dict needs 'dispatch_fn' and 'collect_fn', got keys {sorted(mode)}."
            ) from None
    if mode not in _MODES:
        raise ValueError(f"Unknown dispatch mode {mode!r}; known: {', '.join(dispatch_mode_names())}.")
    return _MODES[mode]


# ---------------------------------------------------------------- built-in modes


def _one_to_all(group: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    n = group.world_size
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def _all_to_all(group: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    n = group.world_size

    def per_worker(value: Any) -> list[Any]:
        return list(value) if isinstance(value, list | tuple) and len(value) == n else [value] * n

    return tuple(per_worker(a) for a in args), {k: per_worker(v) for k, v in kwargs.items()}


def _dp_compute(group: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    n = group.world_size
    for where, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(value, list | tuple) or len(value) != n:
            raise ValueError(
                f"DP_COMPUTE needs every argument as a list with one item per worker ({n}); {where} is "
                f"{type(value).__name__}{f' of length {len(value)}' if hasattr(value, '__len__') else ''}."
            )
    return tuple(list(a) for a in args), {k: list(v) for k, v in kwargs.items()}


def _split_protos(
    chunks: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """Split every DataProto (or DataProtoFuture) argument into ``chunks``; others repeated."""
    from trellis.distributed.future import DataProtoFuture

    pad = None

    def split(value: Any) -> list[Any]:
        nonlocal pad
        if isinstance(value, DataProto):
            padded, size = pad_dataproto_to_divisor(value, chunks)
            if pad is not None and size != pad:
                raise ValueError(
                    "DataProto arguments of one call must have the same number of rows; "
                    f"got sizes needing {pad} and {size} padding rows."
                )
            pad = size
            return padded.chunk(chunks)
        if isinstance(value, DataProtoFuture):
            return value.chunk(chunks)
        return [value] * chunks

    split_args = tuple(split(a) for a in args)
    split_kwargs = {k: split(v) for k, v in kwargs.items()}
    return split_args, split_kwargs, pad or 0


def _dp_compute_proto(group: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    split_args, split_kwargs, pad = _split_protos(group.world_size, args, kwargs)
    if pad:
        split_kwargs[PAD_KEY] = pad
    return split_args, split_kwargs


def _concat(group: Any, outputs: list[Any]) -> Any:
    return concat_outputs(outputs)


def concat_outputs(outputs: list[Any]) -> Any:
    """``DataProto.concat`` of DataProto outputs; a list of anything else (e.g. None from every worker)."""
    if outputs and all(isinstance(o, DataProto) for o in outputs):
        return DataProto.concat(outputs)
    return list(outputs)


def _as_list(group: Any, outputs: list[Any]) -> list[Any]:
    return list(outputs)


def strip_padding(result: Any, pad: int) -> Any:
    """``result`` without its last ``pad`` rows (a DataProto or a list)."""
    if not pad:
        return result
    if isinstance(result, DataProto):
        return unpad_dataproto(result, pad)
    return result[: len(result) - pad]


register_dispatch_mode(Dispatch.ONE_TO_ALL, _one_to_all, _as_list)
register_dispatch_mode(Dispatch.ALL_TO_ALL, _all_to_all, _as_list)
register_dispatch_mode(Dispatch.DP_COMPUTE, _dp_compute, _as_list)
register_dispatch_mode(Dispatch.DP_COMPUTE_PROTO, _dp_compute_proto, _concat)
register_dispatch_mode(Dispatch.DP_COMPUTE_METRIC, _dp_compute_proto, _as_list)


# ---------------------------------------------------------------- device meshes


def _mesh_dispatch(
    mesh_name: str, group: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    ranks = group.dispatch_info(mesh_name)
    dp_size = max(ranks) + 1
    split_args, split_kwargs, pad = _split_protos(dp_size, args, kwargs)
    per_worker_args = tuple([chunks[r] for r in ranks] for chunks in split_args)
    per_worker_kwargs: dict[str, Any] = {k: [chunks[r] for r in ranks] for k, chunks in split_kwargs.items()}
    if pad:
        per_worker_kwargs[PAD_KEY] = pad
    return per_worker_args, per_worker_kwargs


def _mesh_collect_list(mesh_name: str, group: Any, outputs: list[Any]) -> list[Any]:
    """The outputs of the workers collected on ``mesh_name``, in data-parallel order."""
    ranks = group.dispatch_info(mesh_name)
    collect = group.collect_info(mesh_name)
    return [outputs[i] for _, i in sorted((r, i) for i, r in enumerate(ranks) if collect[i])]


def _mesh_collect(mesh_name: str, group: Any, outputs: list[Any]) -> Any:
    return concat_outputs(_mesh_collect_list(mesh_name, group, outputs))


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict[str, Any]:
    """The dispatch mode of mesh ``mesh_name``: one DataProto chunk per data-parallel rank, collected
    from the workers that registered ``is_collect=True`` for it, concatenated in data-parallel order."""
    return {
        "dispatch_fn": functools.partial(_mesh_dispatch, mesh_name),
        "collect_fn": functools.partial(_mesh_collect, mesh_name),
        "mesh_name": mesh_name,
    }


def make_nd_compute_metric_dispatch_fn(mesh_name: str) -> dict[str, Any]:
    """``DP_COMPUTE_METRIC`` on mesh ``mesh_name``: split as :func:`make_nd_compute_dataproto_dispatch_fn`
    does; the result is the list of the collecting workers' outputs (one per data-parallel rank, in
    data-parallel order), not concatenated — e.g. the metric dicts of an update, for the driver to average.
    A non-blocking call returns those workers' futures, in the same order."""
    return {
        "dispatch_fn": functools.partial(_mesh_dispatch, mesh_name),
        "collect_fn": functools.partial(_mesh_collect_list, mesh_name),
        "mesh_name": mesh_name,
        "concat": False,
    }


def mesh_name_of(dispatch_mode: Any) -> str | None:
    """The mesh a dispatch mode splits over (a dict from the ``make_nd_compute_*`` functions), else None."""
    if isinstance(dispatch_mode, Mapping):
        name = dispatch_mode.get("mesh_name")
        return name if isinstance(name, str) else None
    return None
