"""Training checkpoints: save every rank's state atomically, find the latest, resume, prune.

    manager = CheckpointManager(run_dir + "/checkpoints", max_to_keep=3, rank=rank, world_size=world,
                                barrier=torch.distributed.barrier)
    path = manager.resolve_resume(trainer.resume_mode, trainer.resume_from_path)
    if path is not None:
        states = manager.load(path)          # this rank's states, as saved
        engine.load_state_dict(states["actor"]); ...
    ...
    manager.save(step, {"actor": engine.state_dict(), "trainer": {...}}, hf_files=model_path)

Layout under the root (a local path or any fsspec URL: ``file://``, ``memory://``, ``s3://``, ...)::

    latest_checkpointed_iteration.txt   the step of the latest complete checkpoint ("12\\n")
    global_step_12/
        rank_0.pt ... rank_{W-1}.pt     each rank's states (torch.save), one file per rank
        hf/                             config and tokenizer files, for `trellis export` (optional)
        meta.json                       the manifest, written last: step, world size, and every
                                        file above with its size and sha256
    .tmp_global_step_13/                a save in progress (or killed): never read, removed by
                                        the next save

A save writes everything into ``.tmp_global_step_N/``, the manifest last, then renames the
folder to ``global_step_N/`` and only then rewrites the pointer file (through a temporary file
and a rename). On a local disk every file and folder is fsynced before the rename that
publishes it. So a process killed at any instant leaves the checkpoint the pointer names
complete and loadable; an interrupted save leaves a temporary folder, or a folder the pointer
does not name, and the next save of that step replaces it.

Loading checks the manifest (present, of this format, of this world size, every file present
with its size) and the sha256 of the rank file it reads (a local one is then memory-mapped);
anything wrong raises :class:`~trellis.errors.CheckpointError` naming the path and the fault.
Nothing is loaded silently from an incomplete or corrupt folder, and a pointer naming a missing
or broken folder is an error, never a fallback to an older one. Pruning counts only the
checkpoints up to the latest one: folders of later steps (left by a run that went further
before this one resumed from an earlier step) stay until this run saves those steps again.

Several ranks: every rank writes its own ``rank_R.pt`` into the shared temporary folder; the
``barrier`` (e.g. ``torch.distributed.barrier``) separates the phases, and rank 0 alone writes
the manifest, renames, moves the pointer and prunes. The root must be storage all ranks see.

States are pickled with :func:`torch.save` and read back with ``torch.load(weights_only=True)``,
which runs no code from the file. So a state may hold only tensors, numbers, strings, bytes,
``None``, torch dtypes/devices/sizes, and lists, tuples, sets and dicts of those (numpy
arrays: convert them, as :mod:`trellis.checkpoint.rng` does); :meth:`CheckpointManager.save`
checks this before writing and names the offending entry.
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
    "hf_file_contents",
    "load_rank_file",
    "read_manifest",
    "step_dir_name",
    "verify_checkpoint",
]

FORMAT = "trellis-checkpoint"
FORMAT_VERSION = 1
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
_CHUNK = 8 * 2**20


def step_dir_name(step: int) -> str:
    """``"global_step_<step>"``: the folder of the checkpoint of ``step``."""
    return f"{STEP_PREFIX}{step}"


def rank_file_name(rank: int) -> str:
    """``"rank_<rank>.pt"``: the file holding one rank's states."""
    return f"rank_{rank}.pt"


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
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"Checkpoint {where!r} has format version {manifest.get('version')!r}; this Trellis reads "
            f"version {FORMAT_VERSION}. Use the Trellis version that wrote it."
        )
    files, world = manifest.get("files"), manifest.get("world_size")
    if not isinstance(files, dict) or not isinstance(world, int) or not isinstance(manifest.get("step"), int):
        raise CheckpointError(f"Checkpoint {where!r}: its {MANIFEST} lacks step, world_size or files.")
    return manifest


def verify_checkpoint(
    path: str | os.PathLike[str], *, world_size: int | None = None, checksums: bool = False
) -> dict[str, Any]:
    """Check checkpoint folder ``path`` against its manifest; returns the manifest.

    Args:
        path: a ``global_step_N`` folder (local path or URL).
        world_size: the number of ranks that will load it; None accepts any.
        checksums: also re-hash every file (reads the whole checkpoint); sizes are always checked.

    Raises:
        CheckpointError: as :func:`read_manifest`; another world size; a listed file missing, of
            another size or (``checksums``) content. The message names the path and the file.
    """
    manifest = read_manifest(path)
    store = Store(os.fspath(path))
    where = store.display()
    if world_size is not None and manifest["world_size"] != world_size:
        raise CheckpointError(
            f"Checkpoint {where!r} was saved by {manifest['world_size']} ranks, but {world_size} are loading "
            f"it; resume with the same number of ranks (or export it: trellis export {where} --to HF_DIR)."
        )
    for rank in range(manifest["world_size"]):
        if rank_file_name(rank) not in manifest["files"]:
            raise CheckpointError(
                f"Checkpoint {where!r}: its {MANIFEST} does not list {rank_file_name(rank)}."
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
    manifest: dict[str, Any] | None = None,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """The states rank ``rank`` saved into checkpoint folder ``path``, checksum verified.

    Args:
        path: a ``global_step_N`` folder.
        rank: whose file to read.
        manifest: the folder's manifest when already read (:func:`verify_checkpoint`).
        map_location: where tensors go (``torch.load``'s); ``"cpu"`` by default.

    Raises:
        CheckpointError: as :func:`verify_checkpoint`; the file fails its checksum or does not load.
    """
    import io

    import torch

    manifest = manifest if manifest is not None else verify_checkpoint(path)
    store = Store(os.fspath(path))
    rel = rank_file_name(rank)
    where = store.display(rel)
    if rel not in manifest["files"]:
        raise CheckpointError(
            f"Checkpoint {store.display()!r} has no file for rank {rank}: it was saved by "
            f"{manifest['world_size']} ranks."
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
    ):
        raise CheckpointError(
            f"Checkpoint file {where!r} does not hold rank {rank}'s states of step {manifest['step']}."
        )
    return payload["states"]


# ---------------------------------------------------------------- the manager


class CheckpointManager:
    """Saves and loads the training checkpoints under one root folder, for one rank.

    Args:
        root: the folder holding ``global_step_N`` folders and the pointer file; a local path or
            an fsspec URL (``file://``, ``memory://``, ``s3://``, ...). Created on the first save.
        max_to_keep: keep this many checkpoints (the latest and the ones just before it); older
            ones are deleted after each successful save. None keeps all.
        rank: this process's rank among the ``world_size`` that save together.
        world_size: how many ranks save (each its own file) and later load this checkpoint.
        barrier: called by every rank to wait for all of them (e.g. ``torch.distributed.barrier``);
            needed when ``world_size > 1``.

    Raises:
        ValueError: a bad ``max_to_keep``, ``rank`` or ``world_size``, or no ``barrier`` for several
            ranks; the message names the value.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], Any] | None = None,
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

    # ---------------------------------------------------------------- save

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
        if not _is_int(step) or step < 0:
            raise ValueError(f"CheckpointManager.save: step={step!r} must be an int >= 0.")
        _check_savable(states, "states")
        store, name = self._store, step_dir_name(step)
        tmp = f"{TMP_PREFIX}{name}"
        try:
            if self.rank == 0:
                store.makedirs()
                self._remove_stale()
                store.makedirs(tmp)
            self._barrier()
            self._write_rank_file(tmp, step, states)
            self._barrier()
            if self.rank == 0:
                self._publish(step, tmp, hf_files)
            self._barrier()
        except CheckpointError:
            raise
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(
                f"Saving checkpoint {store.display(name)!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        return store.display(name)

    def _write_rank_file(self, tmp: str, step: int, states: Mapping[str, Any]) -> None:
        import torch

        payload = {"step": step, "rank": self.rank, "world_size": self.world_size, "states": dict(states)}
        rel = f"{tmp}/{rank_file_name(self.rank)}"
        size, digest = self._store.write_stream(rel, lambda f: torch.save(payload, f))
        # the sidecar tells rank 0 what to put into the manifest without re-reading the file
        self._store.write_bytes(f"{rel}.json", json.dumps({"size": size, "sha256": digest}).encode())

    def _publish(self, step: int, tmp: str, hf_files: Any) -> None:
        """Rank 0: manifest, rename, pointer, prune — in this order (see the module docstring)."""
        store, name = self._store, step_dir_name(step)
        files: dict[str, dict[str, Any]] = {}
        for rank in range(self.world_size):
            rel = rank_file_name(rank)
            sidecar = f"{tmp}/{rel}.json"
            if not store.exists(sidecar):
                raise CheckpointError(
                    f"Saving checkpoint {store.display(name)!r}: rank {rank} did not write {rel}; every rank "
                    "must call save() with the same step."
                )
            files[rel] = json.loads(store.read_bytes(sidecar))
            store.remove(sidecar)
        if hf_files is not None:
            store.makedirs(f"{tmp}/{HF_DIR}")
            for file_name, data in hf_file_contents(hf_files):
                files[f"{HF_DIR}/{file_name}"] = _entry(
                    *store.write_bytes(f"{tmp}/{HF_DIR}/{file_name}", data)
                )
            store.fsync_dir(f"{tmp}/{HF_DIR}")
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "world_size": self.world_size,
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
                or of another world size (the message names the pointer and the folder).
        """
        step = self._pointer_step()
        if step is None:
            return None
        path = self.path_of(step)
        try:
            verify_checkpoint(path, world_size=self.world_size)
        except CheckpointError as exc:
            raise CheckpointError(
                f"The checkpoint pointer {self._store.display(POINTER)!r} names step {step}, but: {exc}"
            ) from exc
        return path

    def load(self, path: str | os.PathLike[str], *, map_location: Any = "cpu") -> dict[str, Any]:
        """This rank's states from checkpoint folder ``path``, as they were passed to :meth:`save`.

        Verifies the manifest (present, complete, this world size, sizes) and the sha256 of this
        rank's file before unpickling it (``weights_only``).

        Raises:
            CheckpointError: the folder is missing, incomplete or corrupt (the message says which file
                and what is wrong).
        """
        manifest = verify_checkpoint(path, world_size=self.world_size)
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
            found = CheckpointManager(path, rank=self.rank, world_size=self.world_size, barrier=self._barrier)
            located = found.latest()
            if located is None:  # pragma: no cover - latest() returns a path when a pointer exists
                raise CheckpointError(f"resume_from_path {path!r} holds no checkpoint.")
            return located
        verify_checkpoint(path, world_size=self.world_size)
        return path


# ---------------------------------------------------------------- helpers


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(size: int, digest: str) -> dict[str, Any]:
    return {"size": size, "sha256": digest}


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
