"""Training checkpoints: save every process's state atomically, find the latest, resume, prune.

A checkpoint is made of *parts*, one per group of processes that own state (the trainer's: an
``actor`` part written by the policy workers, a ``critic`` part by the critic workers, and a
``trainer`` part by the driver). Each rank of a part writes its own shard; the driver never
holds another process's state::

    manager = CheckpointManager(run_dir + "/checkpoints", max_to_keep=3, parts={"actor": 2})
    manager.begin(step)                                        # driver: opens the save
    # in each actor worker (any process that sees the root):
    CheckpointManager(root).save_shard(step, "actor", rank, {"actor": engine.state_dict(), ...})
    # driver, after every worker returned (the barrier):
    manager.save_shard(step, "trainer", 0, {"trainer": {...}})
    manager.publish(step, {"actor": 2, "trainer": 1}, hf_files=model_path)

    path = manager.resolve_resume(trainer.resume_mode, trainer.resume_from_path)
    states = load_rank_file(path, rank, part="actor")          # each worker reads its own shard

A program whose ranks all hold the same kinds of state can save without parts: every rank calls
``save(step, states)`` with a ``barrier`` (e.g. ``torch.distributed.barrier``), and reads back
with ``load(path)``.

Layout under the root (a local path or any fsspec URL: ``file://``, ``memory://``, ``s3://``, ...)::

    latest_checkpointed_iteration.txt   the step of the latest complete checkpoint ("12\\n")
    global_step_12/
        actor/rank_0.pt ... rank_{W-1}.pt   part "actor": each rank's shard (torch.save)
        critic/rank_0.pt ...                part "critic"
        trainer/rank_0.pt                   part "trainer" (the driver's)
        rank_0.pt ... rank_{W-1}.pt     instead of parts, with save(): each rank's states
        hf/                             config and tokenizer files, for `trellis export` (optional)
        meta.json                       the manifest, written last: step, the parts and their
                                        ranks (or the world size), and every file above with its
                                        size and sha256
    .tmp_global_step_13/                a save in progress (or killed): never read, removed by
                                        the next save

A save writes everything into ``.tmp_global_step_N/`` (each shard with a small ``.json``
sidecar of its size and sha256, so the manifest is written without re-reading a shard), the
manifest last, then renames the folder to ``global_step_N/`` and only then rewrites the pointer
file (through a temporary file and a rename). On a local disk every file and folder is fsynced
before the rename that publishes it. So a process killed at any instant leaves the checkpoint
the pointer names complete and loadable; an interrupted save leaves a temporary folder, or a
folder the pointer does not name, and the next save (``begin``) removes or replaces it. A
shard's writer must be done (or dead) before the next save of the root begins: the trainer
waits for every worker's call, and a killed driver's Ray workers die with it.

Loading checks the manifest (present, of a known format, the expected ranks, every file present
with its size) and the sha256 of the shard it reads (a local one is then memory-mapped);
anything wrong raises :class:`~trellis.errors.CheckpointError` naming the path and the fault.
Nothing is loaded silently from an incomplete or corrupt folder, and a pointer naming a missing
or broken folder is an error, never a fallback to an older one. Pruning counts only the
checkpoints up to the latest one: folders of later steps (left by a run that went further
before this one resumed from an earlier step) stay until this run saves those steps again.

Manifest versions: ``save`` writes version 1 (``world_size``, ``rank_R.pt``), which Trellis
read before parts existed; ``publish`` writes version 2 (``parts``). Both are read. A version 1
checkpoint reads as if every part had its world size of ranks, each rank's file holding them
all, so a run checkpointed by a Trellis before parts (whose rank files hold ``actor``,
``critic`` and ``trainer``) resumes too. The root must be storage every writer sees.

States are pickled with :func:`torch.save` and read back with ``torch.load(weights_only=True)``,
which runs no code from the file. So a state may hold only tensors, numbers, strings, bytes,
``None``, torch dtypes/devices/sizes, and lists, tuples, sets and dicts of those (numpy
arrays: convert them, as :mod:`trellis.checkpoint.rng` does); :meth:`CheckpointManager.save`
and :meth:`CheckpointManager.save_shard` check this before writing and name the offending entry.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import json
import os
import posixpath
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, cast

from trellis.config.base import schema_default
from trellis.config.schema import TrainerConfig
from trellis.errors import CheckpointError
from trellis.utils.fs import is_non_local
from trellis.utils.settings import setting

__all__ = [
    "FORMAT",
    "HF_DIR",
    "MANIFEST",
    "POINTER",
    "RESUME_MODES",
    "CheckpointManager",
    "Store",
    "checkpoint_parts",
    "hf_file_contents",
    "load_rank_file",
    "rank_file_name",
    "read_manifest",
    "step_dir_name",
    "verify_checkpoint",
]

FORMAT = "trellis-checkpoint"
FORMAT_VERSION = 2
"""The manifest version :meth:`CheckpointManager.publish` writes: a checkpoint in parts."""
RANKS_VERSION = 1
"""The manifest version :meth:`CheckpointManager.save` writes: one group of ranks, no parts (the
format of Trellis before parts, which still reads it)."""
READABLE_VERSIONS = (RANKS_VERSION, FORMAT_VERSION)
MANIFEST = "meta.json"
POINTER = "latest_checkpointed_iteration.txt"
HF_DIR = "hf"
STEP_PREFIX = "global_step_"
TMP_PREFIX = ".tmp_"
OLD_PREFIX = ".old_"
RESUME_MODES = ("auto", "disable", "resume_path")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
"""Files of a Hugging Face folder that ``hf_files`` does not copy (weights live in the rank files)."""

_STEP_RE = re.compile(r"^global_step_(\d+)$")
_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_SHARD_RE = re.compile(r"^rank_(\d+)\.pt\.json$")
_CHUNK = 8 * 2**20


def step_dir_name(step: int) -> str:
    """``"global_step_<step>"``: the folder of the checkpoint of ``step``."""
    return f"{STEP_PREFIX}{step}"


def rank_file_name(rank: int, part: str | None = None) -> str:
    """``"<part>/rank_<rank>.pt"``: the file of rank ``rank``'s shard of ``part``; without a part,
    ``"rank_<rank>.pt"`` (a checkpoint saved by :meth:`CheckpointManager.save`)."""
    return f"{part}/rank_{rank}.pt" if part else f"rank_{rank}.pt"


def checkpoint_parts(manifest: Mapping[str, Any]) -> dict[str, int] | None:
    """``{part: number of ranks}`` of a checkpoint's manifest; None for a checkpoint without parts
    (version 1, saved by :meth:`CheckpointManager.save`: ``manifest["world_size"]`` ranks)."""
    parts = manifest.get("parts") if manifest.get("version") == FORMAT_VERSION else None
    return dict(parts) if parts is not None else None


# ---------------------------------------------------------------- storage


class Store:
    """A folder on a local disk (atomic renames, fsync) or behind an fsspec URL.

    Paths given to its methods are relative to the folder, ``/``-separated.
    """

    def __init__(self, root: str):
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem

        self.url = root.rstrip("/") or root
        if is_non_local(root):
            self.fs, base = url_to_fs(root)
            self.local = isinstance(self.fs, LocalFileSystem)  # file:// gets the local guarantees
        else:
            self.fs, base, self.local = None, os.path.abspath(root), True
        self.base = base.rstrip("/") or base

    def full(self, rel: str = "") -> str:
        """The path of ``rel`` for the filesystem (a local path, or the fsspec path)."""
        if not rel:
            return self.base
        return os.path.join(self.base, *rel.split("/")) if self.local else f"{self.base}/{rel}"

    def display(self, rel: str = "") -> str:
        """The path of ``rel`` as the user wrote the root (for messages and return values)."""
        return self.url if not rel else f"{self.url}/{rel}"

    # -- queries

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.full(rel)) if self.local else self.fs.exists(self.full(rel))

    def isdir(self, rel: str = "") -> bool:
        return os.path.isdir(self.full(rel)) if self.local else self.fs.isdir(self.full(rel))

    def listdir(self, rel: str = "") -> list[str]:
        """Names in folder ``rel`` (empty when it does not exist)."""
        if self.local:
            try:
                return sorted(os.listdir(self.full(rel)))
            except (FileNotFoundError, NotADirectoryError):
                return []
        if not self.fs.isdir(self.full(rel)):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.full(rel), detail=False))

    def size(self, rel: str) -> int:
        return os.path.getsize(self.full(rel)) if self.local else int(self.fs.size(self.full(rel)))

    # -- reading

    def open_read(self, rel: str) -> BinaryIO:
        return open(self.full(rel), "rb") if self.local else self.fs.open(self.full(rel), "rb")

    def read_bytes(self, rel: str) -> bytes:
        with self.open_read(rel) as f:
            return f.read()

    # -- writing

    def makedirs(self, rel: str = "") -> None:
        if self.local:
            os.makedirs(self.full(rel), exist_ok=True)
        else:
            self.fs.makedirs(self.full(rel), exist_ok=True)

    def write_stream(self, rel: str, write: Callable[[BinaryIO], object]) -> tuple[int, str]:
        """Create file ``rel`` by ``write(file)``; returns its (size, sha256). Durable on local disks."""
        path = self.full(rel)
        with open(path, "wb") if self.local else self.fs.open(path, "wb") as raw:
            out = _HashingWriter(raw)
            write(cast(BinaryIO, out))  # duck-typed: write() and flush(), all torch.save needs
            raw.flush()
            if self.local:
                os.fsync(raw.fileno())
        return out.size, out.sha256.hexdigest()

    def write_bytes(self, rel: str, data: bytes) -> tuple[int, str]:
        return self.write_stream(rel, lambda f: f.write(data))

    def replace_file(self, rel: str, data: bytes) -> None:
        """Set file ``rel`` to ``data`` in one step: readers see the old content or the new, whole."""
        if not self.local:
            self.fs.pipe_file(self.full(rel), data)  # one object PUT (or one in-memory assignment)
            return
        partial = f"{rel}.{uuid.uuid4().hex}.partial"
        self.write_bytes(partial, data)
        os.replace(self.full(partial), self.full(rel))
        self.fsync_dir(posixpath.dirname(rel))

    def rename(self, src: str, dst: str) -> None:
        if self.local:
            os.rename(self.full(src), self.full(dst))
            self.fsync_dir(posixpath.dirname(dst))
        else:
            self.fs.mv(self.full(src), self.full(dst), recursive=True)

    def remove(self, rel: str) -> None:
        """Delete file or folder ``rel`` (nothing when it is absent)."""
        if self.local:
            import shutil

            path = self.full(rel)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                os.remove(path)
        elif self.fs.exists(self.full(rel)):
            self.fs.rm(self.full(rel), recursive=True)

    def fsync_dir(self, rel: str = "") -> None:
        if not self.local:
            return
        fd = os.open(self.full(rel), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _HashingWriter:
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.size, self.sha256 = raw, 0, hashlib.sha256()

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        self.raw.write(view)
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()


# ---------------------------------------------------------------- reading and checking


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest (``meta.json``) of checkpoint folder ``path``, checked for format only.

    Raises:
        CheckpointError: the folder does not exist, has no manifest (an interrupted save), or the
            manifest is unreadable or of another format; the message names the path.
    """
    store = Store(os.fspath(path))
    where = store.display()
    if not store.isdir():
        raise CheckpointError(f"Checkpoint {where!r} does not exist (or is not a folder).")
    if not store.exists(MANIFEST):
        raise CheckpointError(
            f"Checkpoint {where!r} is incomplete: it has no {MANIFEST} (its save was interrupted before it "
            "finished). Resume from another checkpoint, or delete this folder."
        )
    try:
        manifest = json.loads(store.read_bytes(MANIFEST))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"Checkpoint {where!r}: its {MANIFEST} is unreadable ({exc}).") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"Checkpoint {where!r}: its {MANIFEST} is not a {FORMAT} manifest.")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"Checkpoint {where!r} has format version {manifest.get('version')!r}; this Trellis reads "
            f"versions {list(READABLE_VERSIONS)}. Use the Trellis version that wrote it."
        )
    files, step = manifest.get("files"), manifest.get("step")
    if manifest["version"] == RANKS_VERSION:
        ranks_ok = _is_int(manifest.get("world_size")) and manifest["world_size"] >= 1
        what = "world_size"
    else:
        parts = manifest.get("parts")
        ranks_ok = (
            isinstance(parts, dict)
            and bool(parts)
            and all(_valid_part(p) and _is_int(n) and n >= 1 for p, n in parts.items())
        )
        what = "parts"
    if not isinstance(files, dict) or not ranks_ok or not _is_int(step):
        raise CheckpointError(f"Checkpoint {where!r}: its {MANIFEST} lacks step, {what} or files.")
    return manifest


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    parts: Mapping[str, int] | None = None,
    checksums: bool = False,
) -> dict[str, Any]:
    """Check checkpoint folder ``path`` against its manifest; returns the manifest.

    Args:
        path: a ``global_step_N`` folder (local path or URL).
        world_size: the number of ranks that will load a checkpoint without parts (one saved by
            :meth:`CheckpointManager.save`); None accepts any. Not checked on one in parts.
        parts: ``{part: ranks}`` that will load it: each must be in the checkpoint with that many
            ranks (others may be there too); a checkpoint without parts has every part with its
            world size of ranks. None accepts any.
        checksums: also re-hash every file (reads the whole checkpoint); sizes are always checked.

    Raises:
        CheckpointError: as :func:`read_manifest`; another world size or number of ranks of a part;
            a part's shard not listed; a listed file missing, of another size or (``checksums``)
            content. The message names the path and the file.
    """
    manifest = read_manifest(path)
    store = Store(os.fspath(path))
    where = store.display()
    saved = checkpoint_parts(manifest)
    fix = f"resume with the same number of workers (or export it: trellis export {where} --to HF_DIR)"
    if saved is None:
        if world_size is not None and manifest["world_size"] != world_size:
            raise CheckpointError(
                f"Checkpoint {where!r} was saved by {manifest['world_size']} ranks, but {world_size} are "
                f"loading it; {fix}."
            )
        listed = {"": manifest["world_size"]}
    else:
        listed = saved
    for part, ranks in (parts or {}).items():
        have = manifest["world_size"] if saved is None else saved.get(part)
        if have is None:
            raise CheckpointError(
                f"Checkpoint {where!r} has no part {part!r} (it holds {sorted(saved or {})}); resume it with "
                "the components it was saved with, or start afresh (trainer.resume_mode=disable)."
            )
        if have != ranks:
            raise CheckpointError(
                f"Checkpoint {where!r}: its part {part!r} was saved by {have} ranks, but {ranks} are loading "
                f"it; {fix}."
            )
    for part, ranks in listed.items():
        for rank in range(ranks):
            if rank_file_name(rank, part) not in manifest["files"]:
                raise CheckpointError(
                    f"Checkpoint {where!r}: its {MANIFEST} does not list {rank_file_name(rank, part)}."
                )
    for rel, entry in manifest["files"].items():
        _check_file(store, rel, entry, checksums=checksums)
    return manifest


def _check_file(store: Store, rel: str, entry: Any, *, checksums: bool) -> None:
    where = store.display(rel)
    if (
        not isinstance(entry, dict)
        or not _is_int(entry.get("size"))
        or not isinstance(entry.get("sha256"), str)
    ):
        raise CheckpointError(f"Checkpoint file {where!r}: its {MANIFEST} entry {entry!r} is malformed.")
    if not store.exists(rel):
        raise CheckpointError(f"Checkpoint file {where!r} is missing (listed in its {MANIFEST}).")
    _check_size(where, store.size(rel), entry["size"])
    if checksums:
        digest = hashlib.sha256()
        with store.open_read(rel) as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                digest.update(chunk)
        _check_digest(where, digest.hexdigest(), entry["sha256"])


def _check_size(where: str, size: int, expected: int) -> None:
    if size != expected:
        raise CheckpointError(
            f"Checkpoint file {where!r} is {size} bytes, but its {MANIFEST} says {expected}: it is truncated "
            "or was changed. Resume from another checkpoint."
        )


def _check_digest(where: str, actual: str, expected: str) -> None:
    if actual != expected:
        raise CheckpointError(
            f"Checkpoint file {where!r} is corrupt: its sha256 is {actual[:16]}..., its {MANIFEST} says "
            f"{expected[:16]}.... Resume from another checkpoint."
        )


def load_rank_file(
    path: str | os.PathLike[str],
    rank: int,
    *,
    part: str | None = None,
    manifest: dict[str, Any] | None = None,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """The states rank ``rank`` saved (of ``part``) into checkpoint folder ``path``, checksum verified.

    Args:
        path: a ``global_step_N`` folder.
        rank: whose shard to read.
        part: the part to read, in a checkpoint in parts (e.g. ``"actor"``). A checkpoint without
            parts has one file per rank holding all its states: that file is read, whatever ``part``.
        manifest: the folder's manifest when already read (:func:`verify_checkpoint`).
        map_location: where tensors go (``torch.load``'s); ``"cpu"`` by default.

    Returns:
        The ``states`` given to :meth:`CheckpointManager.save_shard` (or ``save``).

    Raises:
        CheckpointError: as :func:`verify_checkpoint`; no such part or rank (the message lists what
            the checkpoint holds); the file fails its checksum, does not load or holds another
            rank's, part's or step's states.
    """
    import io

    import torch

    manifest = manifest if manifest is not None else verify_checkpoint(path)
    store = Store(os.fspath(path))
    parts = checkpoint_parts(manifest)
    if parts is None:
        part, ranks = None, manifest["world_size"]
    elif part is None:
        raise CheckpointError(
            f"Checkpoint {store.display()!r} is saved in parts {sorted(parts)}: name the part to read "
            "(load_rank_file(path, rank, part=...))."
        )
    elif part not in parts:
        raise CheckpointError(
            f"Checkpoint {store.display()!r} has no part {part!r}; it holds {sorted(parts)}."
        )
    else:
        ranks = parts[part]
    rel = rank_file_name(rank, part)
    where = store.display(rel)
    if not _is_int(rank) or not 0 <= rank < ranks or rel not in manifest["files"]:
        of = f" of part {part!r}" if part else ""
        raise CheckpointError(
            f"Checkpoint {store.display()!r} has no file for rank {rank!r}{of}: it was saved by "
            f"{ranks} ranks."
        )
    entry = manifest["files"][rel]
    try:
        if store.local:  # hash it streaming, then map it: the tensors are read as they are used
            _check_file(store, rel, entry, checksums=True)
            payload = torch.load(store.full(rel), map_location=map_location, weights_only=True, mmap=True)
        else:
            data = store.read_bytes(rel)
            _check_size(where, len(data), entry["size"])
            _check_digest(where, hashlib.sha256(data).hexdigest(), entry["sha256"])
            payload = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"Checkpoint file {where!r} does not load: {type(exc).__name__}: {exc}"
        ) from exc
    if (
        not isinstance(payload, dict)
        or payload.get("rank") != rank
        or payload.get("step") != manifest["step"]
        or payload.get("part") != part
    ):
        raise CheckpointError(
            f"Checkpoint file {where!r} does not hold rank {rank}'s states"
            f"{f' of part {part!r}' if part else ''} of step {manifest['step']}."
        )
    return payload["states"]


# ---------------------------------------------------------------- the manager


class CheckpointManager:
    """Saves and loads the training checkpoints under one root folder.

    Saving in parts (see the module docstring): :meth:`begin`, then every rank of every part
    :meth:`save_shard` (each in its own process), then :meth:`publish`. Saving without parts: every
    one of ``world_size`` ranks calls :meth:`save`, each with its own manager.

    Args:
        root: the folder holding ``global_step_N`` folders and the pointer file; a local path or
            an fsspec URL (``file://``, ``memory://``, ``s3://``, ...). Created on the first save.
        max_to_keep: keep this many checkpoints (the latest and the ones just before it); older
            ones are deleted after each successful save. None keeps all.
        rank: this process's rank among the ``world_size`` that :meth:`save` together.
        world_size: how many ranks :meth:`save` (each its own file) and later :meth:`load` this
            checkpoint.
        barrier: called by every rank to wait for all of them (e.g. ``torch.distributed.barrier``);
            needed by :meth:`save` when ``world_size > 1``.
        parts: ``{part: ranks}`` a checkpoint must hold for :meth:`latest` and
            :meth:`resolve_resume` to return it (e.g. ``{"actor": 2}`` for two policy workers; a
            checkpoint without parts holds every part with its world size). None: only a
            checkpoint without parts is checked, against ``world_size``.

    Raises:
        ValueError: a bad ``max_to_keep``, ``rank``, ``world_size`` or ``parts``, or no ``barrier``
            for several ranks; the message names the value.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], Any] | None = None,
        parts: Mapping[str, int] | None = None,
    ):
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"CheckpointManager: world_size={world_size!r} must be an int >= 1.")
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"CheckpointManager: rank={rank!r} must be an int in [0, {world_size}).")
        if max_to_keep is not None and (not _is_int(max_to_keep) or max_to_keep < 1):
            raise ValueError(
                f"CheckpointManager: max_to_keep={max_to_keep!r} must be an int >= 1, or None to keep all."
            )
        if world_size > 1 and barrier is None:
            raise ValueError(
                f"CheckpointManager: world_size={world_size} needs barrier= (e.g. "
                "torch.distributed.barrier), so that rank 0 publishes the checkpoint only after "
                "every rank wrote its file."
            )
        self.root = os.fspath(root)
        self.max_to_keep, self.rank, self.world_size = max_to_keep, rank, world_size
        self.parts = None if parts is None else _checked_parts(parts, "CheckpointManager")
        self._barrier = barrier if barrier is not None else (lambda: None)
        self._store = Store(self.root)

    @classmethod
    def from_config(
        cls, trainer: Any, *, rank: int = 0, world_size: int = 1, barrier: Callable[[], Any] | None = None
    ) -> CheckpointManager:
        """The manager of a ``TrainerConfig``: root ``<run_dir>/checkpoints``, ``max_actor_ckpt_to_keep``."""
        run_dir = setting(trainer, "run_dir", None)
        if not run_dir:
            raise ValueError("trainer.run_dir is not set: name the folder (or URL) the run writes into.")
        return cls(
            f"{os.fspath(run_dir).rstrip('/')}/checkpoints",
            max_to_keep=setting(
                trainer, "max_actor_ckpt_to_keep", schema_default(TrainerConfig, "max_actor_ckpt_to_keep")
            ),
            rank=rank,
            world_size=world_size,
            barrier=barrier,
        )

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, rank={self.rank}, world_size={self.world_size})"

    def path_of(self, step: int) -> str:
        """The folder the checkpoint of ``step`` is (or would be) saved in."""
        return self._store.display(step_dir_name(step))

    # ---------------------------------------------------------------- save in parts

    def begin(self, step: int) -> str:
        """Open the save of ``step`` in parts: remove what killed saves left (temporary folders,
        pointer files), create the temporary folder. Called once (by the driver), before any
        :meth:`save_shard` of ``step``.

        Returns:
            The temporary folder the shards go into (``<root>/.tmp_global_step_<step>``).

        Raises:
            CheckpointError: the storage failed (the message names the path).
            ValueError: a bad ``step``.
        """
        _check_step(step, "begin")
        store, tmp = self._store, f"{TMP_PREFIX}{step_dir_name(step)}"
        with self._storage_errors(step):
            store.makedirs()
            self._remove_stale()
            store.makedirs(tmp)
        return store.display(tmp)

    def save_shard(self, step: int, part: str, rank: int, states: Mapping[str, Any]) -> dict[str, Any]:
        """Write ``states`` as rank ``rank``'s shard of ``part`` into the save of ``step`` that
        :meth:`begin` opened: ``<part>/rank_<rank>.pt`` and its sidecar. Any process that sees the
        root calls it for its own shard (a worker writes its engine state itself).

        Args:
            step: the step :meth:`begin` opened.
            part: the part's name (letters, digits, ``_ . -``; not ``hf``), e.g. ``"actor"``.
            rank: this shard's rank in the part, ``0 <= rank < ranks`` of :meth:`publish`.
            states: the shard's named states (what :func:`load_rank_file` gives back); tensors are
                read as they are now.

        Returns:
            The shard's manifest entry ``{"file", "size", "sha256"}`` (no tensors).

        Raises:
            CheckpointError: a state entry that cannot be saved safely (named, with its type), or the
                storage failed; the message names the path.
            ValueError: a bad ``step``, ``part`` or ``rank``.
        """
        _check_step(step, "save_shard")
        _checked_parts({part: 1}, "save_shard")
        if not _is_int(rank) or rank < 0:
            raise ValueError(f"save_shard: rank={rank!r} must be an int >= 0.")
        _check_savable(states, "states")
        rel = rank_file_name(rank, part)
        with self._storage_errors(step):
            self._store.makedirs(f"{TMP_PREFIX}{step_dir_name(step)}/{part}")
            size, digest = self._write_shard(step, part, rank, states)
        return {"file": rel, **_entry(size, digest)}

    def publish(
        self,
        step: int,
        parts: Mapping[str, int],
        *,
        hf_files: str | os.PathLike[str] | Mapping[str, bytes | str] | None = None,
    ) -> str:
        """Make the save of ``step`` the latest checkpoint, once every shard of ``parts`` is written
        (the caller's barrier: e.g. every worker's call returned): the manifest (each file's size
        and sha256 from the shards' sidecars), the rename into ``global_step_<step>``, the pointer,
        pruning.

        Args:
            step: the step :meth:`begin` opened.
            parts: ``{part: ranks}`` of every part of the checkpoint, e.g. ``{"actor": 2,
                "trainer": 1}``; each rank of each must have called :meth:`save_shard`.
            hf_files: as :meth:`save`.

        Returns:
            The checkpoint folder (``<root>/global_step_<step>``).

        Raises:
            CheckpointError: a shard not written (the message names the part and the rank), a shard
                of a part or rank not in ``parts``, or the storage failed; nothing is published.
            ValueError: a bad ``step`` or ``parts``.
        """
        _check_step(step, "publish")
        parts = _checked_parts(parts, "publish")
        store, name = self._store, step_dir_name(step)
        tmp = f"{TMP_PREFIX}{name}"
        with self._storage_errors(step):
            files: dict[str, dict[str, Any]] = {}
            for part, ranks in parts.items():
                for rank in range(ranks):
                    files[rank_file_name(rank, part)] = self._read_sidecar(
                        tmp,
                        rank_file_name(rank, part),
                        f"rank {rank} of part {part!r} did not write its shard {rank_file_name(rank, part)}",
                        f"every rank of every part calls save_shard({step}, part, rank, states) between "
                        f"begin({step}) and publish",
                    )
            self._refuse_extra_shards(step, tmp, parts)
            for rel in files:  # only once every shard is there: a failed publish can be retried
                store.remove(f"{tmp}/{rel}.json")
            for part in parts:
                store.fsync_dir(f"{tmp}/{part}")
            self._finish(step, tmp, files, {"parts": parts}, FORMAT_VERSION, hf_files)
        return store.display(name)

    def _write_shard(
        self, step: int, part: str | None, rank: int, states: Mapping[str, Any]
    ) -> tuple[int, str]:
        """Write one shard and its sidecar into the temporary folder of ``step``; its (size, sha256)."""
        import torch

        payload: dict[str, Any] = {"step": step, "rank": rank, "states": dict(states)}
        if part:
            payload["part"] = part
        else:
            payload["world_size"] = self.world_size
        rel = f"{TMP_PREFIX}{step_dir_name(step)}/{rank_file_name(rank, part)}"
        size, digest = self._store.write_stream(rel, lambda f: torch.save(payload, f))
        # the sidecar tells the publisher what to put into the manifest without re-reading the file
        self._store.write_bytes(f"{rel}.json", json.dumps(_entry(size, digest)).encode())
        return size, digest

    def _read_sidecar(self, tmp: str, rel: str, missing: str, fix: str) -> dict[str, Any]:
        """The manifest entry a shard's sidecar holds."""
        store = self._store
        sidecar = f"{tmp}/{rel}.json"
        if not store.exists(sidecar):
            raise CheckpointError(
                f"Saving checkpoint {store.display(tmp.removeprefix(TMP_PREFIX))!r}: {missing}; {fix}."
            )
        entry = json.loads(store.read_bytes(sidecar))
        return _entry(int(entry["size"]), str(entry["sha256"]))

    def _refuse_extra_shards(self, step: int, tmp: str, parts: Mapping[str, int]) -> None:
        """Raise when the temporary folder holds shards that ``parts`` does not count."""
        store = self._store
        extra = []
        for entry in store.listdir(tmp):
            if entry == HF_DIR or not store.isdir(f"{tmp}/{entry}"):
                continue
            for file_name in store.listdir(f"{tmp}/{entry}"):
                match = _SHARD_RE.match(file_name)
                if match and (entry not in parts or int(match.group(1)) >= parts[entry]):
                    extra.append(f"{entry}/{file_name.removesuffix('.json')}")
        if extra:
            raise CheckpointError(
                f"Saving checkpoint {store.display(step_dir_name(step))!r}: shards {sorted(extra)} were "
                f"written, but parts={dict(parts)} does not count them; give publish every part with its "
                "number of ranks."
            )

    def _storage_errors(self, step: int) -> _StorageErrors:
        """A context that turns a failing storage call into a CheckpointError naming the checkpoint."""
        return _StorageErrors(self._store.display(step_dir_name(step)))

    # ---------------------------------------------------------------- save without parts

    def save(
        self,
        step: int,
        states: Mapping[str, Any],
        *,
        hf_files: str | os.PathLike[str] | Mapping[str, bytes | str] | None = None,
    ) -> str:
        """Save this rank's ``states`` as the checkpoint of ``step``; every rank must call it.

        Args:
            step: the trainer step the states are at (``>= 0``); the folder is ``global_step_<step>``.
            states: this rank's named states, e.g. ``{"actor": engine.state_dict(), "trainer":
                {"step": ..., "tracker_run_id": ..., "dataloader": loader.state_dict(),
                "rng": capture_rng_state()}}``; tensors are read as they are now.
            hf_files: what ``trellis export`` needs besides weights, written once (by rank 0) into
                ``hf/``: a Hugging Face model folder (local or URL) whose files other than weights
                (config, tokenizer, generation config) are copied, or a mapping ``{file name:
                content}``. Read by rank 0 only.

        Returns:
            The checkpoint folder (``<root>/global_step_<step>``).

        Raises:
            CheckpointError: a state entry that cannot be saved safely (named, with its type), or
                the storage failed; the message names the path.
            ValueError: a bad ``step``.
        """
        _check_step(step, "save")
        _check_savable(states, "states")
        store, name = self._store, step_dir_name(step)
        tmp = f"{TMP_PREFIX}{name}"
        with self._storage_errors(step):
            if self.rank == 0:
                store.makedirs()
                self._remove_stale()
                store.makedirs(tmp)
            self._barrier()
            self._write_shard(step, None, self.rank, states)
            self._barrier()
            if self.rank == 0:
                files = {
                    rank_file_name(rank): self._read_sidecar(
                        tmp,
                        rank_file_name(rank),
                        f"rank {rank} did not write {rank_file_name(rank)}",
                        "every rank must call save() with the same step",
                    )
                    for rank in range(self.world_size)
                }
                for rel in files:
                    store.remove(f"{tmp}/{rel}.json")
                self._finish(step, tmp, files, {"world_size": self.world_size}, RANKS_VERSION, hf_files)
            self._barrier()
        return store.display(name)

    def _finish(
        self,
        step: int,
        tmp: str,
        files: dict[str, dict[str, Any]],
        layout: Mapping[str, Any],
        version: int,
        hf_files: Any,
    ) -> None:
        """hf files, manifest, rename, pointer, prune — in this order (see the module docstring)."""
        store, name = self._store, step_dir_name(step)
        if hf_files is not None:
            store.makedirs(f"{tmp}/{HF_DIR}")
            for file_name, data in hf_file_contents(hf_files):
                files[f"{HF_DIR}/{file_name}"] = _entry(
                    *store.write_bytes(f"{tmp}/{HF_DIR}/{file_name}", data)
                )
            store.fsync_dir(f"{tmp}/{HF_DIR}")
        manifest = {
            "format": FORMAT,
            "version": version,
            "step": step,
            **layout,
            "files": files,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        store.write_bytes(f"{tmp}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        store.fsync_dir(tmp)
        if store.exists(name):  # an earlier save of this step that the pointer may not name
            if self._pointer_step() == step:
                # never leave the pointer naming a folder that is being replaced
                self._set_pointer(max((s for s in self._complete_steps() if s < step), default=None))
            store.rename(name, f"{OLD_PREFIX}{name}")
        store.rename(tmp, name)
        self._set_pointer(step)
        store.remove(f"{OLD_PREFIX}{name}")
        self._prune(step)

    def _set_pointer(self, step: int | None) -> None:
        if step is None:
            self._store.remove(POINTER)
        else:
            self._store.replace_file(POINTER, f"{step}\n".encode())

    def _prune(self, latest: int) -> None:
        """Delete checkpoints older than the ``max_to_keep`` newest up to ``latest``.

        Folders of steps after ``latest`` (left by a run that went further before this one
        resumed from an earlier step) are not counted and not touched.
        """
        if self.max_to_keep is None:
            return
        older = sorted((s for s in self._all_steps() if s < latest), reverse=True)
        for step in older[self.max_to_keep - 1 :]:
            self._store.remove(step_dir_name(step))

    def _remove_stale(self) -> None:
        """Remove what killed saves left: temporary folders and pointer files (rank 0, before a save)."""
        for entry in self._store.listdir():
            stale_folder = entry.startswith((f"{TMP_PREFIX}{STEP_PREFIX}", f"{OLD_PREFIX}{STEP_PREFIX}"))
            if stale_folder or (entry.startswith(f"{POINTER}.") and entry.endswith(".partial")):
                self._store.remove(entry)

    # ---------------------------------------------------------------- find and load

    def _all_steps(self) -> list[int]:
        return sorted(int(m.group(1)) for entry in self._store.listdir() if (m := _STEP_RE.match(entry)))

    def _complete_steps(self) -> list[int]:
        return [s for s in self._all_steps() if self._store.exists(f"{step_dir_name(s)}/{MANIFEST}")]

    def steps(self) -> list[int]:
        """The steps that have a checkpoint folder with a manifest under the root, oldest first."""
        return self._complete_steps()

    def _pointer_step(self) -> int | None:
        if not self._store.exists(POINTER):
            return None
        text = self._store.read_bytes(POINTER).decode(errors="replace").strip()
        if not text.isdigit():
            raise CheckpointError(
                f"The checkpoint pointer {self._store.display(POINTER)!r} holds {text[:40]!r}, not a step "
                "number. Write the step of a complete checkpoint into it, or delete it to start afresh."
            )
        return int(text)

    def latest(self) -> str | None:
        """The checkpoint folder the pointer file names, checked; None when there is no pointer.

        Raises:
            CheckpointError: the pointer is unreadable, or names a folder that is missing, incomplete
                or of other ranks than ``world_size`` / ``parts`` (the message names the pointer and
                the folder).
        """
        step = self._pointer_step()
        if step is None:
            return None
        path = self.path_of(step)
        try:
            self._verify(path)
        except CheckpointError as exc:
            raise CheckpointError(
                f"The checkpoint pointer {self._store.display(POINTER)!r} names step {step}, but: {exc}"
            ) from exc
        return path

    def _verify(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        world_size = self.world_size if self.parts is None else None  # the parts say who loads it
        return verify_checkpoint(path, world_size=world_size, parts=self.parts)

    def load(self, path: str | os.PathLike[str], *, map_location: Any = "cpu") -> dict[str, Any]:
        """This rank's states from checkpoint folder ``path``, as they were passed to :meth:`save`.

        Verifies the manifest (present, complete, this world size, sizes) and the sha256 of this
        rank's file before unpickling it (``weights_only``). A checkpoint in parts is read one shard
        at a time with :func:`load_rank_file` (``part=``).

        Raises:
            CheckpointError: the folder is missing, incomplete or corrupt (the message says which file
                and what is wrong), or it is saved in parts.
        """
        manifest = self._verify(path)
        return load_rank_file(path, self.rank, manifest=manifest, map_location=map_location)

    def resolve_resume(
        self, mode: str = "auto", resume_from_path: str | os.PathLike[str] | None = None
    ) -> str | None:
        """The checkpoint folder to resume from, per ``trainer.resume_mode``; None = start afresh.

        Args:
            mode: ``"auto"`` (the latest checkpoint under the root, if any), ``"disable"`` (None), or
                ``"resume_path"`` (``resume_from_path``: a ``global_step_N`` folder, or a root whose
                pointer names one).
            resume_from_path: the folder for ``"resume_path"``.

        Raises:
            ValueError: an unknown mode, or ``"resume_path"`` without a path.
            CheckpointError: the chosen checkpoint is missing, incomplete or corrupt.
        """
        if mode == "disable":
            return None
        if mode == "auto":
            return self.latest()
        if mode != "resume_path":
            raise ValueError(f"resume_mode={mode!r} is not one of {list(RESUME_MODES)}.")
        if resume_from_path is None or not os.fspath(resume_from_path):
            raise ValueError(
                "resume_mode='resume_path' needs resume_from_path: the global_step_N folder to continue from."
            )
        path = os.fspath(resume_from_path).rstrip("/")
        store = Store(path)
        if not store.exists(MANIFEST) and store.exists(POINTER):
            found = CheckpointManager(
                path, rank=self.rank, world_size=self.world_size, barrier=self._barrier, parts=self.parts
            )
            located = found.latest()
            if located is None:  # pragma: no cover - latest() returns a path when a pointer exists
                raise CheckpointError(f"resume_from_path {path!r} holds no checkpoint.")
            return located
        self._verify(path)
        return path


# ---------------------------------------------------------------- helpers


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(size: int, digest: str) -> dict[str, Any]:
    return {"size": size, "sha256": digest}


def _check_step(step: Any, method: str) -> None:
    if not _is_int(step) or step < 0:
        raise ValueError(f"CheckpointManager.{method}: step={step!r} must be an int >= 0.")


def _valid_part(part: Any) -> bool:
    return isinstance(part, str) and part != HF_DIR and bool(_PART_RE.match(part))


def _checked_parts(parts: Any, where: str) -> dict[str, int]:
    """``parts`` as a dict, or ValueError naming the bad name or number of ranks."""
    if not isinstance(parts, Mapping) or not parts:
        raise ValueError(
            f"{where}: parts={parts!r} must be a non-empty mapping {{part name: number of ranks}}."
        )
    for part, ranks in parts.items():
        if not _valid_part(part):
            raise ValueError(
                f"{where}: part name {part!r} is not allowed; use letters, digits, '_', '.' and '-' (not "
                f"starting with '.', '_' or '-', and not {HF_DIR!r})."
            )
        if not _is_int(ranks) or ranks < 1:
            raise ValueError(f"{where}: part {part!r} has ranks={ranks!r}; it must be an int >= 1.")
    return dict(parts)


class _StorageErrors:
    """Turns an OSError or RuntimeError (a broken barrier) inside it into a CheckpointError naming
    the checkpoint; CheckpointErrors pass through."""

    def __init__(self, where: str):
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, (OSError, RuntimeError)) and not isinstance(exc, CheckpointError):
            raise CheckpointError(
                f"Saving checkpoint {self.where!r} failed: {type(exc).__name__}: {exc}"
            ) from exc


_LEAVES = (type(None), bool, int, float, complex, str, bytes)


def _check_savable(value: Any, where: str) -> None:
    """Raise CheckpointError unless ``torch.load(weights_only=True)`` can read ``value`` back."""
    import torch

    if type(value) in _LEAVES or isinstance(value, torch.dtype | torch.device | torch.Size):
        return
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise CheckpointError(
                f"Cannot save {where}: it is a {type(value).__name__}, a tensor subclass; save a plain "
                "tensor (a DTensor's .to_local() shard, or .full_tensor())."
            )
        return
    if type(value) in (dict, collections.OrderedDict):
        for key, item in value.items():
            if type(key) not in _LEAVES:
                raise CheckpointError(f"Cannot save {where}: key {key!r} is a {type(key).__name__}.")
            _check_savable(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple, set):
        for index, item in enumerate(value):
            _check_savable(item, f"{where}[{index}]")
        return
    raise CheckpointError(
        f"Cannot save {where}: it is a {type(value).__module__}.{type(value).__qualname__}, which "
        "torch.load(weights_only=True) would refuse on resume. Store tensors, numbers, strings, None, "
        "and lists/tuples/dicts of them (numpy arrays as torch.from_numpy(array), numpy scalars as "
        "float/int, objects as their state_dict())."
    )


def hf_file_contents(hf_files: Any) -> Iterator[tuple[str, bytes]]:
    """(file name, bytes) of what goes into ``hf/``: a folder's non-weight files, or a mapping."""
    if isinstance(hf_files, Mapping):
        for file_name, data in hf_files.items():
            if not isinstance(file_name, str) or "/" in file_name or file_name in ("", ".", ".."):
                raise CheckpointError(f"hf_files: {file_name!r} is not a plain file name.")
            yield file_name, data.encode() if isinstance(data, str) else bytes(data)
        return
    source = Store(os.fspath(hf_files))
    if not source.isdir():
        raise CheckpointError(
            f"hf_files={source.display()!r} is not a folder; pass the Hugging Face model folder (config and "
            "tokenizer files), or a mapping of file names to contents."
        )
    names = [
        entry
        for entry in source.listdir()
        if not source.isdir(entry)
        and not entry.endswith(WEIGHT_SUFFIXES)
        and not entry.endswith(".index.json")
    ]
    if "config.json" not in names:
        raise CheckpointError(
            f"hf_files={source.display()!r} has no config.json; pass the Hugging Face model folder the run "
            "trains (model.path)."
        )
    for entry in names:
        yield entry, source.read_bytes(entry)
