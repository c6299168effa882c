"""The replay pool: a bounded buffer of response groups that rollout fills and training drains.

A *group* is one prompt's responses: a :class:`~trellis.data.DataProto` with

* one sample id per row in the non-tensor column ``id_key`` (default ``"sample_id"``): a str or
  int, unique across everything the pool holds, so a run can count what was trained;
* the version of the policy weights that generated it in ``meta_info["weight_version"]`` (an int
  >= 0), for staleness (:meth:`ReplayPool.drop_stale`, ``eviction="stalest"``).

:meth:`ReplayPool.sample` removes what it returns, so a sample is trained once; pass
``remove=False`` to reuse samples (they stay in the pool and may be returned again).

On disk (:meth:`ReplayPool.save`) a pool is a directory holding ``manifest.json`` (format
version, pool kind, settings, counters, RNG state, the sha256 of each data file) and one
``groups-<token>.pt`` written by ``torch.save`` with plain tensors, lists and dicts only, so
``torch.load(weights_only=True)`` reads it. The manifest is the commit point: data go to a new
file first, then the manifest is replaced atomically, then the files it no longer names are
removed. A save interrupted at any moment leaves the previous save loadable.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import os
import random
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from tensordict import TensorDict

from trellis.data.protocol import DataProto
from trellis.errors import ReplayPoolError

__all__ = [
    "EVICTIONS",
    "FORMAT_VERSION",
    "MANIFEST",
    "VERSION_KEY",
    "FifoReplayPool",
    "PrioritizedReplayPool",
    "ReplayPool",
    "ReplayPoolError",
    "UniformReplayPool",
    "load_pool",
]

FORMAT_VERSION = 1
"""The on-disk format :meth:`ReplayPool.save` writes and :meth:`ReplayPool.load` reads."""
MANIFEST = "manifest.json"
VERSION_KEY = "weight_version"
"""The ``meta_info`` key of the weight version that generated a group."""
EVICTIONS = ("oldest", "stalest")
_FORMAT_NAME = "trellis.replay_pool"


@dataclass
class _Entry:
    seq: int  # the order of arrival: lower is older
    group: DataProto
    ids: tuple[Any, ...]
    version: int
    priority: float | None


class ReplayPool:
    """Base class of replay pools (registry ``trellis.replay_pools``).

    A subclass says only which groups :meth:`sample` returns, in :meth:`_pick`; storage,
    capacity, eviction, staleness, counters and save/load live here.

    Args:
        capacity: the most groups held (an int >= 1); :meth:`add` evicts beyond it.
        eviction: which group goes when full: ``"oldest"`` (first added) or ``"stalest"``
            (lowest weight version, ties by age). The group just added may be the one evicted.
        seed: seeds the pool's random choices (``uniform``); saved and restored with the pool.
        id_key: the non-tensor column holding each row's sample id.

    Raises:
        ReplayPoolError: a bad argument (the message names it and its value).
    """

    kind: ClassVar[str] = "base"
    """The registry name the pool is saved under (``manifest.json`` ``kind``)."""

    def __init__(
        self, capacity: int, *, eviction: str = "oldest", seed: int = 0, id_key: str = "sample_id"
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ReplayPoolError(f"A replay pool's capacity must be an int >= 1, got {capacity!r}.")
        if eviction not in EVICTIONS:
            raise ReplayPoolError(f"Unknown eviction {eviction!r}; choose one of {', '.join(EVICTIONS)}.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ReplayPoolError(f"A replay pool's seed must be an int, got {seed!r}.")
        if not isinstance(id_key, str) or not id_key:
            raise ReplayPoolError(f"id_key must be a non-empty str, got {id_key!r}.")
        self._capacity = capacity
        self.eviction = eviction
        self.seed = seed
        self.id_key = id_key
        self._rng = random.Random(seed)
        self._entries: list[_Entry] = []  # kept in arrival order (ascending seq)
        self._ids: set[Any] = set()
        self._next_seq = 0
        self._counters = {"adds": 0, "samples": 0, "evictions": 0, "drops": 0}

    # ---------------------------------------------------------------- the protocol

    @property
    def capacity(self) -> int:
        """The most groups the pool holds."""
        return self._capacity

    def __len__(self) -> int:
        """The number of groups held."""
        return len(self._entries)

    @property
    def state(self) -> dict[str, int]:
        """Metrics: ``size``, ``capacity`` and the running counts of groups ``adds``, ``samples``
        (returned by :meth:`sample`), ``evictions`` and ``drops`` (by :meth:`drop_stale`)."""
        return {"size": len(self), "capacity": self._capacity, **self._counters}

    def add(self, groups: DataProto | Iterable[DataProto]) -> list[DataProto]:
        """Add one group or several; returns the groups evicted to stay within :attr:`capacity`.

        Every group is checked before any is added, so a bad one adds nothing.

        Raises:
            ReplayPoolError: a group that is not a DataProto, has no rows, lacks the ``id_key``
                column or ``meta_info["weight_version"]`` (or the subclass's own keys), or holds a
                sample id already in the pool or in another added group. The message names the
                group (its position in ``groups``) and the key.
        """
        batch = [groups] if isinstance(groups, DataProto) else list(groups)
        entries: list[_Entry] = []
        seen: set[Any] = set()
        for i, group in enumerate(batch):
            entry = self._entry(group, i)
            clash = (self._ids | seen).intersection(entry.ids)
            if clash:
                raise ReplayPoolError(
                    f"Group {i} holds sample ids already in the replay pool or in an earlier group of this "
                    f"add: {sorted(map(repr, clash))[:5]}; each {self.id_key!r} must be unique."
                )
            seen.update(entry.ids)
            entries.append(entry)
        evicted: list[DataProto] = []
        for entry in entries:
            self._entries.append(entry)
            self._ids.update(entry.ids)
            self._counters["adds"] += 1
            while len(self._entries) > self._capacity:
                evicted.append(self._remove(self._eviction_index()).group)
                self._counters["evictions"] += 1
        return evicted

    def sample(self, n: int, *, remove: bool = True) -> list[DataProto]:
        """Up to ``n`` groups (fewer when the pool holds fewer), in the pool's order.

        With ``remove=True`` (default) the groups leave the pool: each sample is returned once.
        With ``remove=False`` they stay and can be returned again (reuse).

        Raises:
            ReplayPoolError: ``n`` is not an int >= 0.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ReplayPoolError(f"sample(n) takes an int >= 0, got {n!r}.")
        k = min(n, len(self._entries))
        if k == 0:
            return []
        picked = self._pick(k)
        out = [self._entries[i].group for i in picked]
        if remove:
            for i in sorted(picked, reverse=True):
                self._remove(i)
        self._counters["samples"] += len(out)
        return out

    def drop_stale(self, current_version: int, max_staleness: int) -> list[DataProto]:
        """Remove and return the groups with ``current_version - weight_version > max_staleness``.

        Raises:
            ReplayPoolError: either argument is not an int (``max_staleness`` must be >= 0).
        """
        for name, value, low in (
            ("current_version", current_version, None),
            ("max_staleness", max_staleness, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
                bound = f" >= {low}" if low is not None else ""
                raise ReplayPoolError(f"drop_stale: {name} must be an int{bound}, got {value!r}.")
        stale = [i for i, e in enumerate(self._entries) if current_version - e.version > max_staleness]
        dropped = [self._entries[i].group for i in stale]
        for i in reversed(stale):
            self._remove(i)
        self._counters["drops"] += len(dropped)
        return dropped

    def sample_ids(self) -> list[Any]:
        """Every sample id the pool holds, oldest group first."""
        return [i for e in self._entries for i in e.ids]

    # ---------------------------------------------------------------- what subclasses define

    def _pick(self, k: int) -> list[int]:
        """Indices into ``self._entries`` (arrival order) of the ``k`` groups to return, in the
        order to return them; ``1 <= k <= len(self)``."""
        raise NotImplementedError

    def _settings(self) -> dict[str, Any]:
        """The constructor's keyword arguments, as saved in the manifest."""
        return {
            "capacity": self._capacity,
            "eviction": self.eviction,
            "seed": self.seed,
            "id_key": self.id_key,
        }

    def _priority(self, group: DataProto, index: int) -> float | None:
        """The group's priority (None where the pool has none)."""
        return None

    # ---------------------------------------------------------------- internals

    def _entry(self, group: Any, index: int) -> _Entry:
        if not isinstance(group, DataProto):
            raise ReplayPoolError(f"Group {index} is a {type(group).__name__}, not a DataProto.")
        if len(group) == 0:
            raise ReplayPoolError(f"Group {index} has no rows.")
        if self.id_key not in group.non_tensor_batch:
            raise ReplayPoolError(
                f"Group {index} has no sample ids: non-tensor key {self.id_key!r} is missing (it has "
                f"{sorted(group.non_tensor_batch)}); give each row an id in non_tensors[{self.id_key!r}]."
            )
        ids = tuple(v.item() if isinstance(v, np.generic) else v for v in group.non_tensor_batch[self.id_key])
        for v in ids:
            if isinstance(v, bool) or not isinstance(v, (str, int)):
                raise ReplayPoolError(
                    f"Group {index}: sample id {v!r} in {self.id_key!r} is a {type(v).__name__}; "
                    "use str or int."
                )
        if len(set(ids)) != len(ids):
            raise ReplayPoolError(f"Group {index} repeats a sample id in {self.id_key!r}: {list(ids)}.")
        version = group.meta_info.get(VERSION_KEY)
        if isinstance(version, np.integer):
            version = int(version)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ReplayPoolError(
                f"Group {index} needs meta_info[{VERSION_KEY!r}], the int >= 0 version of the weights that "
                f"generated it; got {version!r}."
            )
        return _Entry(self._take_seq(), group, ids, version, self._priority(group, index))

    def _take_seq(self) -> int:
        self._next_seq += 1
        return self._next_seq - 1

    def _remove(self, index: int) -> _Entry:
        entry = self._entries.pop(index)
        self._ids.difference_update(entry.ids)
        return entry

    def _eviction_index(self) -> int:
        if self.eviction == "oldest":
            return 0
        # stalest: lowest version, then oldest (entries are in arrival order, so min keeps the first)
        return min(range(len(self._entries)), key=lambda i: self._entries[i].version)

    # ---------------------------------------------------------------- save / load

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the pool to ``directory`` (created if needed), atomically.

        The groups go to a new ``groups-<token>.pt`` (fsynced), then ``manifest.json`` is replaced
        in one rename; a crash before that rename leaves the previous save as it was.

        Raises:
            ReplayPoolError: a group holds a value ``torch.load(weights_only=True)`` cannot read
                back (non-tensor values must be str, int, float, bool, None, lists or dicts).
        """
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        data_name = f"groups-{uuid.uuid4().hex}.pt"
        state = self.state_dict()
        payload = state.pop("entries")
        _write_atomic(root / data_name, lambda f: torch.save(payload, f))
        manifest = {
            "format": _FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            **state,
            "groups": len(payload),
            "files": {data_name: _sha256(root / data_name)},
        }
        text = json.dumps(manifest, indent=1).encode()
        _write_atomic(root / MANIFEST, lambda f: f.write(text))
        for stale in root.glob("groups-*.pt*"):
            if stale.name != data_name:
                with contextlib.suppress(OSError):
                    stale.unlink()

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ReplayPool:
        """The pool saved in ``directory`` by :meth:`save`, with its groups, counters and RNG state.

        Called on a subclass, the saved kind must be that subclass's; on :class:`ReplayPool` it
        resolves the kind through the ``trellis.replay_pools`` registry (see :func:`load_pool`).

        Raises:
            ReplayPoolError: a missing or unreadable manifest, an unknown format version, another
                kind, or a data file that is missing, truncated or edited (its checksum differs);
                the message names the file. Nothing is loaded partially.
        """
        root = Path(directory)
        manifest = _read_manifest(root)
        kind = manifest["kind"]
        target: type[ReplayPool] = cls
        if cls is ReplayPool:
            from trellis.registries import replay_pools

            resolved = replay_pools.get(kind)
            if not (isinstance(resolved, type) and issubclass(resolved, ReplayPool)):
                raise ReplayPoolError(
                    f"{root / MANIFEST}: kind {kind!r} resolves to {resolved!r}, not a ReplayPool."
                )
            target = resolved
        elif kind != cls.kind:
            raise ReplayPoolError(f"{root / MANIFEST} holds a {kind!r} pool, not a {cls.kind!r} one.")
        files = manifest["files"]
        if not isinstance(files, dict) or len(files) != 1:
            raise ReplayPoolError(f"{root / MANIFEST}: 'files' must name one data file, got {files!r}.")
        ((name, digest),) = files.items()
        path = root / name
        if not path.is_file():
            raise ReplayPoolError(f"Replay pool data file {path} is missing.")
        if _sha256(path) != digest:
            raise ReplayPoolError(
                f"Replay pool data file {path} does not match its checksum in {MANIFEST}: it was truncated "
                "or edited after the save. Restore it or start from an earlier save."
            )
        try:
            payload = torch.load(path, weights_only=True)
        except Exception as exc:  # checksum matched, so this is a format bug, still named
            raise ReplayPoolError(f"Replay pool data file {path} cannot be read: {exc}") from exc
        if not isinstance(payload, list) or len(payload) != manifest["groups"]:
            raise ReplayPoolError(
                f"Replay pool data file {path} holds {len(payload) if isinstance(payload, list) else '?'} "
                f"groups; {MANIFEST} says {manifest['groups']}."
            )
        return target._from_state({**manifest, "entries": payload}, str(root / MANIFEST))

    def state_dict(self) -> dict[str, Any]:
        """The whole pool as plain values (what ``torch.load(weights_only=True)`` reads back): kind,
        settings, counters, RNG state and every group. A training checkpoint stores it in the
        trainer's shard; :meth:`from_state_dict` rebuilds the pool.

        Raises:
            ReplayPoolError: a group holds a value that is not plain (see :meth:`save`).
        """
        return {
            "kind": self.kind,
            "settings": self._settings(),
            "counters": dict(self._counters),
            "next_seq": self._next_seq,
            "rng": _rng_to_json(self._rng.getstate()),
            "entries": [
                {
                    "seq": e.seq,
                    "version": e.version,
                    "priority": e.priority,
                    "group": _group_to_plain(e.group, e.seq),
                }
                for e in self._entries
            ],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ReplayPool:
        """The pool :meth:`state_dict` described, of its saved kind (resolved through the registry).

        Raises:
            ReplayPoolError: a kind that is not a registered replay pool, or settings that do not fit it.
        """
        from trellis.registries import replay_pools

        kind = state.get("kind")
        if not isinstance(kind, str):
            raise ReplayPoolError(f"A saved replay pool needs its kind (a registry name), got {kind!r}.")
        target = replay_pools.get(kind)
        if not (isinstance(target, type) and issubclass(target, ReplayPool)):
            raise ReplayPoolError(
                f"A saved replay pool of kind {kind!r} resolves to {target!r}, not a ReplayPool."
            )
        return target._from_state(state, "the saved replay pool")

    @classmethod
    def _from_state(cls, state: dict[str, Any], where: str) -> ReplayPool:
        try:
            pool = cls(**state["settings"])
        except TypeError as exc:
            raise ReplayPoolError(
                f"{where}: settings {state['settings']!r} do not fit {state['kind']!r}: {exc}"
            ) from exc
        for record in state["entries"]:
            group = _group_from_plain(record["group"])
            ids = tuple(group.non_tensor_batch[pool.id_key].tolist())
            pool._entries.append(_Entry(record["seq"], group, ids, record["version"], record["priority"]))
            pool._ids.update(ids)
        pool._next_seq = state["next_seq"]
        pool._counters.update(state["counters"])
        pool._rng.setstate(_rng_from_json(state["rng"]))
        return pool


def load_pool(directory: str | os.PathLike[str]) -> ReplayPool:
    """The pool saved in ``directory``, of whichever kind it was saved as (resolved through the
    ``trellis.replay_pools`` registry). Raises as :meth:`ReplayPool.load`."""
    return ReplayPool.load(directory)


# ---------------------------------------------------------------- the built-ins


class FifoReplayPool(ReplayPool):
    """Replay pool that returns groups oldest first (``fifo``).

    Args: as :class:`ReplayPool` (``capacity``, ``eviction``, ``seed``, ``id_key``).
    """

    kind = "fifo"

    def _pick(self, k: int) -> list[int]:
        return list(range(k))


class UniformReplayPool(ReplayPool):
    """Replay pool that returns groups drawn uniformly at random without replacement (``uniform``).

    The draws come from ``random.Random(seed)``, whose state is saved with the pool: the samples
    after a save and load are those the pool would have returned without them.

    Args: as :class:`ReplayPool` (``capacity``, ``eviction``, ``seed``, ``id_key``).
    """

    kind = "uniform"

    def _pick(self, k: int) -> list[int]:
        return self._rng.sample(range(len(self._entries)), k)


class PrioritizedReplayPool(ReplayPool):
    """Replay pool that returns the groups of highest priority first, ties oldest first
    (``prioritized``).

    A group's priority is ``meta_info[priority_key]`` (a real number) or, where the meta has no such
    key, the mean of the tensor ``batch[priority_key]`` over the group's rows and elements.

    Args:
        priority_key: where each group's priority is read.
        others: as :class:`ReplayPool`.

    Raises:
        ReplayPoolError: no ``priority_key``; at :meth:`add`, a group without it or whose value is not
            a finite number.
    """

    kind = "prioritized"

    def __init__(
        self,
        capacity: int,
        *,
        priority_key: str | None = None,
        eviction: str = "oldest",
        seed: int = 0,
        id_key: str = "sample_id",
    ) -> None:
        if not isinstance(priority_key, str) or not priority_key:
            raise ReplayPoolError(
                "The prioritized replay pool needs priority_key, the meta_info or tensor key of each "
                f"group's priority; got {priority_key!r}."
            )
        super().__init__(capacity, eviction=eviction, seed=seed, id_key=id_key)
        self.priority_key = priority_key

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "priority_key": self.priority_key}

    def _priority(self, group: DataProto, index: int) -> float:
        key = self.priority_key
        if key in group.meta_info:
            value = group.meta_info[key]
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, np.generic):
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ReplayPoolError(
                    f"Group {index}: meta_info[{key!r}] must be a number (the group's priority), "
                    f"got {value!r}."
                )
            priority = float(value)
        elif group.batch is not None and key in group.batch.keys():  # noqa: SIM118 - TensorDict has no `in`
            priority = float(group.batch[key].float().mean().item())
        else:
            raise ReplayPoolError(
                f"Group {index} has no priority: {key!r} is neither in its meta_info "
                f"({sorted(group.meta_info)}) nor one of its tensors. Set meta_info[{key!r}] to a number."
            )
        if not np.isfinite(priority):
            raise ReplayPoolError(f"Group {index}: priority {key!r} is {priority}; it must be finite.")
        return priority

    def _pick(self, k: int) -> list[int]:
        # highest priority first; among equals the lower index (older) first
        return heapq.nsmallest(
            k, range(len(self._entries)), key=lambda i: -(self._entries[i].priority or 0.0)
        )


# ---------------------------------------------------------------- on-disk helpers


def _group_to_plain(group: DataProto, seq: int) -> dict[str, Any]:
    """A group as tensors, lists and dicts only (what ``torch.load(weights_only=True)`` reads)."""
    columns = {}
    for key, column in group.non_tensor_batch.items():
        values = column.tolist()
        columns[key] = {"dtype": column.dtype.str if column.dtype != object else "object", "values": values}
    batch = None if group.batch is None else group.batch.to_dict()
    plain = {"batch": batch, "rows": len(group), "non_tensor": columns, "meta_info": dict(group.meta_info)}
    bad = _first_unloadable(plain["non_tensor"])
    if bad is _PLAIN:
        bad = _first_unloadable(plain["meta_info"])
    if bad is not _PLAIN:
        raise ReplayPoolError(
            f"A group (added as number {seq}) holds {bad!r} ({type(bad).__name__}), which "
            "torch.load(weights_only=True) cannot read back. Keep non-tensor and meta_info values to str, "
            "int, float, bool, None, lists, dicts and tensors."
        )
    return plain


_PLAIN = object()


def _first_unloadable(value: Any) -> Any:
    """The first value inside ``value`` that is not a plain type; ``_PLAIN`` when all are."""
    if value is None or isinstance(value, (str, int, float, bool, torch.Tensor)):
        return _PLAIN
    if isinstance(value, (list, tuple)):
        items: Iterable[Any] = value
    elif isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    else:
        return value
    for item in items:
        bad = _first_unloadable(item)
        if bad is not _PLAIN:
            return bad
    return _PLAIN


def _group_from_plain(plain: dict[str, Any]) -> DataProto:
    columns: dict[str, np.ndarray] = {}
    for key, column in plain["non_tensor"].items():
        values = column["values"]
        if column["dtype"] == "object":
            columns[key] = np.fromiter(values, dtype=object, count=len(values))
        else:
            columns[key] = np.asarray(values, dtype=np.dtype(column["dtype"]))
    batch = None if plain["batch"] is None else TensorDict(plain["batch"], batch_size=[plain["rows"]])
    return DataProto(batch=batch, non_tensor_batch=columns, meta_info=plain["meta_info"])


def _write_atomic(path: Path, write: Any) -> None:
    """Write ``path`` through a temporary file in the same directory, fsync it, rename it into place
    and fsync the directory, so ``path`` is either the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise ReplayPoolError(f"No replay pool saved in {root}: {MANIFEST} is missing.")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ReplayPoolError(f"Replay pool manifest {path} cannot be read: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT_NAME:
        raise ReplayPoolError(f"{path} is not a replay pool manifest (no format {_FORMAT_NAME!r}).")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ReplayPoolError(
            f"{path} has replay pool format version {version!r}; this Trellis reads version {FORMAT_VERSION}."
        )
    missing = [
        k for k in ("kind", "settings", "counters", "next_seq", "rng", "groups", "files") if k not in manifest
    ]
    if missing:
        raise ReplayPoolError(f"Replay pool manifest {path} lacks {missing}.")
    return manifest


def _rng_to_json(state: Any) -> Any:
    return [_rng_to_json(s) for s in state] if isinstance(state, (tuple, list)) else state


def _rng_from_json(state: Any) -> Any:
    return tuple(_rng_from_json(s) for s in state) if isinstance(state, list) else state
