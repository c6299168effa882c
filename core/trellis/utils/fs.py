"""Files anywhere: local paths, any fsspec URL and HDFS, plus a locked local cache of remote files.

A *local path* is anything without a ``scheme://`` (``/data/model``, ``./ckpt``). Everything
else is a URL: ``file://``, ``memory://``, ``s3://``, ``gs://``, ... go through fsspec (the
backend package, e.g. ``s3fs``, must be installed); ``hdfs://`` goes through the ``hdfs``
command when it is on ``PATH``, else through fsspec's pyarrow HDFS filesystem.

:func:`copy_to_local` is what loaders call: it returns local paths unchanged and copies a
URL once into a cache directory, under a file lock, so that many processes on one node asking
for the same checkpoint copy it once and never see a half-written copy.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import posixpath
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from trellis.errors import HdfsUnavailableError

CACHE_DIR_ENV = "TRELLIS_CACHE_DIR"
RECORD_VERSION = 1

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_CHUNK = 8 * 2**20


# ---------------------------------------------------------------- paths


def is_non_local(path: str | os.PathLike[str]) -> bool:
    """True for a URL (``scheme://...``, ``file://`` included, or an fsspec chain ``a::b://...``).

    False for plain local paths, relative or absolute.
    """
    return any(_URL_RE.match(part) for part in os.fspath(path).split("::"))


def _is_hdfs(path: str) -> bool:
    return path.startswith("hdfs://")


def _hdfs_cli() -> str | None:
    return shutil.which("hdfs")


def _filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a URL or a local path."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, OSError) as exc:
        if not _is_hdfs(url):
            raise
        raise HdfsUnavailableError(
            f"Cannot reach {url!r}: there is no `hdfs` command on PATH, and pyarrow's HDFS client "
            f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Install "
            "the Hadoop client so that `hdfs` is on PATH, or make pyarrow's libhdfs usable: install "
            "pyarrow and a JDK, and set JAVA_HOME, HADOOP_HOME and CLASSPATH=$(hadoop classpath --glob)."
        ) from exc


def _is_local_fs(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


# ---------------------------------------------------------------- copy and makedirs


def copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str:
    """Copy a file or a directory tree from ``src`` to ``dst``; either may be local or a URL.

    ``dst`` names the copy itself, never a folder to put it in: a file is written at ``dst``
    (overwriting it), a directory's contents are copied into ``dst`` (created if missing,
    merged with what is already there). Missing parent directories are created.

    Returns:
        ``dst``, as a string.

    Raises:
        FileNotFoundError: ``src`` does not exist.
        IsADirectoryError: ``src`` is a file and ``dst`` an existing directory.
        HdfsUnavailableError: an ``hdfs://`` side, and no working HDFS client.
        OSError: an ``hdfs`` command failed (its stderr is in the message).
    """
    src, dst = os.fspath(src), os.fspath(dst)
    if (_is_hdfs(src) or _is_hdfs(dst)) and (cli := _hdfs_cli()) is not None:
        _hdfs_cli_copy(cli, src, dst)
        return dst
    src_fs, src_path = _filesystem(src)
    dst_fs, dst_path = _filesystem(dst)
    if not src_fs.exists(src_path):
        raise FileNotFoundError(f"Cannot copy {src!r}: it does not exist.")
    if _is_local_fs(src_fs) and _is_local_fs(dst_fs):
        _copy_local(src_path, dst_path, dst)
    else:
        _copy_fsspec(src_fs, src_path, dst_fs, dst_path, dst)
    return dst


def _copy_local(src: str, dst: str, dst_name: str) -> None:
    if os.path.isdir(src):
        shutil.copytree(src, dst, dirs_exist_ok=True)
        return
    if os.path.isdir(dst):
        raise IsADirectoryError(
            f"Cannot copy file {src!r} onto {dst_name!r}: that is a directory. Name the file itself, "
            f"e.g. {os.path.join(dst_name, os.path.basename(src))!r}."
        )
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    shutil.copy2(src, dst)


def _copy_fsspec(src_fs: Any, src_path: str, dst_fs: Any, dst_path: str, dst_name: str) -> None:
    """Stream file by file: works between any two fsspec filesystems."""
    if not src_fs.isdir(src_path):
        if dst_fs.isdir(dst_path):
            raise IsADirectoryError(f"Cannot copy file {src_path!r} onto {dst_name!r}: that is a directory.")
        _copy_one(src_fs, src_path, dst_fs, dst_path)
        return
    root = src_path.rstrip("/")
    dst_fs.makedirs(dst_path, exist_ok=True)
    for path, info in sorted(src_fs.find(root, withdirs=True, detail=True).items()):
        rel = posixpath.relpath(path.rstrip("/"), root)
        if rel == ".":
            continue
        target = dst_path.rstrip("/") + "/" + rel
        if info["type"] == "directory":
            dst_fs.makedirs(target, exist_ok=True)
        else:
            _copy_one(src_fs, path, dst_fs, target)


def _copy_one(src_fs: Any, src_path: str, dst_fs: Any, dst_path: str) -> None:
    parent = dst_fs._parent(dst_path)
    if parent:
        dst_fs.makedirs(parent, exist_ok=True)
    with src_fs.open(src_path, "rb") as reader, dst_fs.open(dst_path, "wb") as writer:
        shutil.copyfileobj(reader, writer, _CHUNK)


def makedirs(path: str | os.PathLike[str], exist_ok: bool = False) -> None:
    """Create directory ``path`` and its parents, locally or behind a URL.

    Raises:
        FileExistsError: ``path`` exists and ``exist_ok`` is False.
        HdfsUnavailableError: an ``hdfs://`` path, and no working HDFS client.
    """
    path = os.fspath(path)
    if _is_hdfs(path) and (cli := _hdfs_cli()) is not None:
        if not exist_ok and _hdfs_test(cli, "-e", path):
            raise FileExistsError(f"Cannot create directory {path!r}: it already exists.")
        _run_hdfs(cli, "-mkdir", "-p", path)
        return
    fs, fs_path = _filesystem(path)
    if not exist_ok and fs.exists(fs_path):
        raise FileExistsError(f"Cannot create directory {path!r}: it already exists.")
    fs.makedirs(fs_path, exist_ok=True)


# ---------------------------------------------------------------- the hdfs command


def _run_hdfs(cli: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [cli, "dfs", *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(
            f"`{' '.join(command)}` failed with exit code {done.returncode}: "
            f"{done.stderr.strip() or done.stdout.strip() or '(no output)'}"
        )
    return done


def _hdfs_test(cli: str, flag: str, path: str) -> bool:
    return subprocess.run([cli, "dfs", "-test", flag, path], capture_output=True).returncode == 0


def _hdfs_cli_copy(cli: str, src: str, dst: str) -> None:
    src_hdfs, dst_hdfs = _is_hdfs(src), _is_hdfs(dst)
    if (src_hdfs and is_non_local(dst)) or (dst_hdfs and is_non_local(src)):
        # The command talks to HDFS and the local disk only: stage everything else locally.
        with tempfile.TemporaryDirectory(prefix="trellis-hdfs-") as staging:
            local = os.path.join(staging, _basename(src))
            copy(src, local)
            copy(local, dst)
        return
    if src_hdfs:
        if not _hdfs_test(cli, "-e", src):
            raise FileNotFoundError(f"Cannot copy {src!r}: it does not exist.")
        parent = os.path.dirname(os.path.abspath(dst))
        os.makedirs(parent, exist_ok=True)
        # `-get` nests into an existing directory; fetch beside it, then move or merge into place.
        with tempfile.TemporaryDirectory(prefix=".trellis-hdfs-", dir=parent) as staging:
            fetched = os.path.join(staging, "fetched")
            _run_hdfs(cli, "-get", src, fetched)
            if os.path.lexists(dst):
                _copy_local(fetched, dst, dst)
            else:
                os.replace(fetched, dst)
        return
    if not os.path.exists(src):
        raise FileNotFoundError(f"Cannot copy {src!r}: it does not exist.")
    if os.path.isdir(src):
        # `-put` of a directory onto an existing one nests it; put its children instead.
        _run_hdfs(cli, "-mkdir", "-p", dst)
        children = [os.path.join(src, name) for name in sorted(os.listdir(src))]
        if children:
            _run_hdfs(cli, "-put", "-f", *children, dst)
        return
    if _hdfs_test(cli, "-d", dst):  # `-put` would nest the file inside it
        raise IsADirectoryError(f"Cannot copy file {src!r} onto {dst!r}: that is a directory.")
    _run_hdfs(cli, "-mkdir", "-p", posixpath.dirname(dst.rstrip("/")))
    _run_hdfs(cli, "-put", "-f", src, dst)


# ---------------------------------------------------------------- copy_to_local


def default_cache_dir() -> str:
    """Where :func:`copy_to_local` keeps copies.

    ``$TRELLIS_CACHE_DIR/copies`` when that variable is set, else ``~/.cache/trellis/copies``.
    """
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "trellis")
    return os.path.join(root, "copies")


def copy_to_local(
    src: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None, always_recopy: bool = False
) -> str:
    """A local path holding ``src``: local paths are returned as they are, URLs are copied once.

    A URL is copied to ``<cache_dir>/<key>/<name>``, where ``key`` is a hash of the URL and
    ``name`` its last path component; ``cache_dir`` defaults to :func:`default_cache_dir`.
    Beside it, ``<key>.lock`` serialises copies (``fcntl.flock``: processes and threads asking
    for the same URL wait for the one copying it) and ``<key>.json`` records what was copied
    (each file's path and size). The record is written last, so a copy that was interrupted
    has none and is redone. A later call reuses the copy unless ``always_recopy`` is set or the
    record shows a file missing or of another size. Changes to the *source* are not detected:
    pass ``always_recopy=True`` to fetch a URL whose content changed.

    Raises:
        FileNotFoundError: the URL does not exist.
        HdfsUnavailableError: an ``hdfs://`` URL, and no working HDFS client.
    """
    src = os.fspath(src)
    if not is_non_local(src):
        return src
    root = os.path.abspath(os.fspath(cache_dir) if cache_dir is not None else default_cache_dir())
    os.makedirs(root, exist_ok=True)
    key = hashlib.sha256(src.rstrip("/").encode()).hexdigest()[:16]
    entry = os.path.join(root, key)
    local = os.path.join(entry, _basename(src))
    record_path = entry + ".json"
    with _file_lock(entry + ".lock"):
        if not always_recopy and _record_matches(record_path, src, entry):
            return local
        # Drop the record before touching the copy: from here until the new record is written,
        # an interruption leaves no record, and the next call starts over.
        _remove(record_path)
        _remove(entry)
        os.makedirs(entry)
        try:
            copy(src, local)
        except BaseException:
            _remove(entry)
            raise
        _write_record(record_path, src, entry, local)
    return local


def _basename(url: str) -> str:
    path = urlsplit(url.split("::")[-1]).path if is_non_local(url) else url
    return posixpath.basename(path.rstrip("/")) or "root"


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    # flock locks belong to an open file description: two open() calls conflict even inside
    # one process, so this serialises threads as well as processes.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _files_under(entry: str) -> dict[str, int]:
    files: dict[str, int] = {}
    for folder, _, names in os.walk(entry):
        for name in names:
            full = os.path.join(folder, name)
            files[os.path.relpath(full, entry).replace(os.sep, "/")] = os.path.getsize(full)
    return dict(sorted(files.items()))


def _write_record(record_path: str, src: str, entry: str, local: str) -> None:
    files = _files_under(entry)
    record = {
        "version": RECORD_VERSION,
        "source": src,
        "local_path": local,
        "kind": "directory" if os.path.isdir(local) else "file",
        "files": files,
        "total_bytes": sum(files.values()),
        "copied_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    partial = record_path + ".partial"
    with open(partial, "w", encoding="utf-8") as out:
        json.dump(record, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, record_path)


def _record_matches(record_path: str, src: str, entry: str) -> bool:
    try:
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
        if record.get("version") != RECORD_VERSION or record.get("source", "").rstrip("/") != src.rstrip("/"):
            return False
        return all(
            os.path.isfile(path := os.path.join(entry, rel)) and os.path.getsize(path) == size
            for rel, size in record["files"].items()
        ) and os.path.exists(os.path.join(entry, _basename(src)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False  # no record, or an unreadable one: copy again
