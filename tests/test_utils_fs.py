"""trellis.utils.fs: copies between local paths and URLs, and the locked, recorded local cache."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import fsspec
import pytest

import trellis.utils.fs as fs
from trellis.errors import TrellisError
from trellis.utils.fs import HdfsUnavailableError, copy, copy_to_local, is_non_local, makedirs

MODEL_FILES = {"config.json": b'{"hidden_size": 64}', "weights/shard-0.bin": b"\x00" * 1000, "README": b""}


@pytest.fixture
def memfs():
    """The in-memory fsspec filesystem, emptied after the test."""
    memory = fsspec.filesystem("memory")
    yield memory
    memory.store.clear()
    memory.pseudo_dirs[:] = [""]


def write_tree(root, files=MODEL_FILES):
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def read_tree(root):
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            full = os.path.join(folder, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root).replace(os.sep, "/")] = f.read()
    return out


def key_of(url):
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


# ---------------------------------------------------------------- is_non_local, copy, makedirs


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/data/model", False),
        ("relative/dir", False),
        ("./file.json", False),
        ("weird:name", False),
        ("hdfs://namenode:8020/models/qwen", True),
        ("s3://bucket/key", True),
        ("memory://x", True),
        ("file:///tmp/x", True),
        ("simplecache::s3://bucket/key", True),
    ],
)
def test_is_non_local(path, expected):
    assert is_non_local(path) is expected


def test_copy_local_file_and_directory(tmp_path):
    write_tree(tmp_path / "src")
    assert copy(tmp_path / "src" / "config.json", tmp_path / "out" / "deep" / "c.json") == str(
        tmp_path / "out" / "deep" / "c.json"
    )
    assert (tmp_path / "out" / "deep" / "c.json").read_bytes() == MODEL_FILES["config.json"]
    copy(tmp_path / "src", tmp_path / "copy")
    assert read_tree(tmp_path / "copy") == MODEL_FILES


def test_copy_directory_merges_into_an_existing_one(tmp_path):
    write_tree(tmp_path / "src")
    write_tree(tmp_path / "dst", {"config.json": b"old", "extra.txt": b"kept"})
    copy(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert read_tree(tmp_path / "dst") == {**MODEL_FILES, "extra.txt": b"kept"}


def test_copy_errors(tmp_path, memfs):
    with pytest.raises(FileNotFoundError, match=r"Cannot copy '.*missing': it does not exist\."):
        copy(str(tmp_path / "missing"), str(tmp_path / "x"))
    with pytest.raises(FileNotFoundError, match=r"Cannot copy 'memory://nope': it does not exist\."):
        copy("memory://nope", str(tmp_path / "x"))
    (tmp_path / "f.txt").write_text("data")
    (tmp_path / "folder").mkdir()
    with pytest.raises(
        IsADirectoryError, match=r"that is a directory\. Name the file itself, e\.g\. '.*f\.txt'"
    ):
        copy(str(tmp_path / "f.txt"), str(tmp_path / "folder"))


def test_copy_between_local_and_memory_urls(tmp_path, memfs):
    write_tree(tmp_path / "src")
    copy(str(tmp_path / "src"), "memory://bucket/model")
    assert memfs.cat("/bucket/model/weights/shard-0.bin") == MODEL_FILES["weights/shard-0.bin"]
    assert memfs.cat("/bucket/model/README") == b""
    copy(str(tmp_path / "src" / "config.json"), "memory://bucket/single.json")
    assert memfs.cat("/bucket/single.json") == MODEL_FILES["config.json"]

    copy("memory://bucket/model", str(tmp_path / "back"))
    assert read_tree(tmp_path / "back") == MODEL_FILES
    copy("memory://bucket/model", "memory://other/model")  # URL to URL
    assert memfs.cat("/other/model/config.json") == MODEL_FILES["config.json"]
    copy(f"file://{tmp_path}/src", str(tmp_path / "via-file-url"))
    assert read_tree(tmp_path / "via-file-url") == MODEL_FILES


def test_makedirs_local_and_memory(tmp_path, memfs):
    makedirs(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    with pytest.raises(FileExistsError, match=r"Cannot create directory '.*b': it already exists\."):
        makedirs(str(tmp_path / "a" / "b"))
    makedirs(str(tmp_path / "a" / "b"), exist_ok=True)

    makedirs("memory://bucket/run/ckpt")
    assert memfs.isdir("/bucket/run/ckpt")
    with pytest.raises(FileExistsError):
        makedirs("memory://bucket/run/ckpt")
    makedirs("memory://bucket/run/ckpt", exist_ok=True)


# ---------------------------------------------------------------- copy_to_local


def test_copy_to_local_returns_local_paths_unchanged(tmp_path):
    assert copy_to_local("/no/such/local/path", cache_dir=tmp_path) == "/no/such/local/path"
    assert copy_to_local("relative/model") == "relative/model"
    assert os.listdir(tmp_path) == []


def test_copy_to_local_copies_a_directory_and_records_it(tmp_path, memfs):
    write_tree(tmp_path / "src")
    copy(str(tmp_path / "src"), "memory://hub/qwen")
    cache = tmp_path / "cache"
    local = copy_to_local("memory://hub/qwen", cache_dir=cache)
    key = key_of("memory://hub/qwen")
    assert local == str(cache / key / "qwen")
    assert read_tree(local) == MODEL_FILES
    assert sorted(os.listdir(cache)) == [key, f"{key}.json", f"{key}.lock"]
    record = json.loads((cache / f"{key}.json").read_text())
    assert record.pop("copied_at").endswith("+00:00")
    assert record == {
        "version": 1,
        "source": "memory://hub/qwen",
        "local_path": local,
        "kind": "directory",
        "files": {"qwen/README": 0, "qwen/config.json": 19, "qwen/weights/shard-0.bin": 1000},
        "total_bytes": 1019,
    }


def test_copy_to_local_file_url_and_single_file(tmp_path):
    write_tree(tmp_path / "src")
    url = f"file://{tmp_path}/src/config.json"
    local = copy_to_local(url, cache_dir=tmp_path / "cache")
    assert local == str(tmp_path / "cache" / key_of(url) / "config.json")
    with open(local, "rb") as f:
        assert f.read() == MODEL_FILES["config.json"]
    record = json.loads((tmp_path / "cache" / f"{key_of(url)}.json").read_text())
    assert (record["kind"], record["files"]) == ("file", {"config.json": 19})


def test_copy_to_local_reuses_a_recorded_copy(tmp_path, memfs):
    memfs.pipe("/hub/data.txt", b"version 1")
    cache = tmp_path / "cache"
    local = copy_to_local("memory://hub/data.txt", cache_dir=cache)
    memfs.pipe("/hub/data.txt", b"version 2, longer")
    # The record matches the copy: no new copy, so the old content is still there.
    assert copy_to_local("memory://hub/data.txt", cache_dir=cache) == local
    with open(local, "rb") as f:
        assert f.read() == b"version 1"
    # always_recopy fetches again.
    assert copy_to_local("memory://hub/data.txt", cache_dir=cache, always_recopy=True) == local
    with open(local, "rb") as f:
        assert f.read() == b"version 2, longer"
    assert json.loads((cache / f"{key_of('memory://hub/data.txt')}.json").read_text())["files"] == {
        "data.txt": 17
    }


@pytest.mark.parametrize("damage", ["missing file", "changed size", "no record", "corrupt record"])
def test_copy_to_local_recopies_a_damaged_copy(tmp_path, memfs, damage):
    write_tree(tmp_path / "src")
    copy(str(tmp_path / "src"), "memory://hub/model")
    cache = tmp_path / "cache"
    local = copy_to_local("memory://hub/model", cache_dir=cache)
    record = cache / f"{key_of('memory://hub/model')}.json"
    if damage == "missing file":
        os.remove(os.path.join(local, "weights", "shard-0.bin"))
    elif damage == "changed size":
        with open(os.path.join(local, "weights", "shard-0.bin"), "wb") as f:
            f.write(b"\x00" * 10)  # truncated
    elif damage == "no record":  # a copy interrupted before its record was written
        os.remove(record)
        os.remove(os.path.join(local, "config.json"))
        with open(os.path.join(local, "partial.tmp"), "wb") as f:
            f.write(b"left over")
    else:
        record.write_text('{"version": 1, "files": ')
    assert copy_to_local("memory://hub/model", cache_dir=cache) == local
    assert read_tree(local) == MODEL_FILES  # complete again, and the left-overs are gone
    assert json.loads(record.read_text())["files"]["model/config.json"] == 19


def test_copy_to_local_default_cache_dir(tmp_path, memfs, monkeypatch):
    memfs.pipe("/hub/a.txt", b"a")
    monkeypatch.setenv("TRELLIS_CACHE_DIR", str(tmp_path / "trellis-cache"))
    local = copy_to_local("memory://hub/a.txt")
    assert local == str(tmp_path / "trellis-cache" / "copies" / key_of("memory://hub/a.txt") / "a.txt")
    monkeypatch.delenv("TRELLIS_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    local = copy_to_local("memory://hub/a.txt")
    assert local == str(
        tmp_path / "home" / ".cache" / "trellis" / "copies" / key_of("memory://hub/a.txt") / "a.txt"
    )


def test_copy_to_local_missing_url_leaves_no_entry(tmp_path, memfs):
    with pytest.raises(FileNotFoundError, match="'memory://hub/absent'"):
        copy_to_local("memory://hub/absent", cache_dir=tmp_path)
    assert os.listdir(tmp_path) == [f"{key_of('memory://hub/absent')}.lock"]


def test_copy_to_local_threads_copy_once(tmp_path, memfs, monkeypatch):
    write_tree(tmp_path / "src")
    copy(str(tmp_path / "src"), "memory://hub/model")
    events = []
    real_copy = fs.copy

    def slow_copy(src, dst):
        events.append(("start", threading.get_ident()))
        time.sleep(0.2)  # long enough for the other thread to arrive while this one copies
        result = real_copy(src, dst)
        events.append(("end", threading.get_ident()))
        return result

    monkeypatch.setattr(fs, "copy", slow_copy)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(copy_to_local("memory://hub/model", tmp_path / "c")))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [kind for kind, _ in events] == ["start", "end"]  # one copy; the other thread reused it
    assert len(results) == 2 and results[0] == results[1]
    assert read_tree(results[0]) == MODEL_FILES


WORKER = textwrap.dedent(
    """
    import os, sys, time
    import trellis.utils.fs as fs

    real_copy = fs.copy
    log = sys.argv[3]

    def logged_copy(src, dst):
        with open(log, "a") as f:
            f.write(f"start {os.getpid()}\\n")
        time.sleep(0.3)
        result = real_copy(src, dst)
        with open(log, "a") as f:
            f.write(f"end {os.getpid()}\\n")
        return result

    fs.copy = logged_copy
    print(fs.copy_to_local(sys.argv[1], cache_dir=sys.argv[2], always_recopy=sys.argv[4] == "1"))
    """
)


@pytest.mark.parametrize("always_recopy", [False, True])
def test_copy_to_local_processes_never_overlap(tmp_path, always_recopy):
    write_tree(tmp_path / "src")
    url, cache, log = f"file://{tmp_path}/src", str(tmp_path / "cache"), str(tmp_path / "log")
    (tmp_path / "worker.py").write_text(WORKER)
    argv = [sys.executable, str(tmp_path / "worker.py"), url, cache, log, "1" if always_recopy else "0"]
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=60) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0] == str(tmp_path / "cache" / key_of(url) / "src") + "\n"
    with open(log) as f:
        lines = f.read().split()
    kinds = lines[0::2]
    if always_recopy:  # both copy, one after the other: never two starts in a row
        assert kinds == ["start", "end", "start", "end"]
        assert lines[1] == lines[3] and lines[5] == lines[7] and lines[1] != lines[5]
    else:
        assert kinds == ["start", "end"]
    assert read_tree(tmp_path / "cache" / key_of(url) / "src") == MODEL_FILES


# ---------------------------------------------------------------- hdfs


FAKE_HDFS = textwrap.dedent(
    """
    #!{python}
    # A stand-in for the Hadoop `hdfs` command: hdfs://host:port/path is $FAKE_HDFS_ROOT/path.
    import os, shutil, sys
    from urllib.parse import urlsplit

    root = os.environ["FAKE_HDFS_ROOT"]
    with open(os.environ["FAKE_HDFS_LOG"], "a") as log:
        log.write(" ".join(sys.argv[1:]) + "\\n")

    def real(p):
        return os.path.join(root, urlsplit(p).path.lstrip("/")) if p.startswith("hdfs://") else p

    def cp(src, dst):
        if os.path.isdir(dst):
            dst = os.path.join(dst, os.path.basename(src.rstrip("/")))
        (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, dst)

    _, op, *args = sys.argv[1:]
    flags = [a for a in args if a.startswith("-")]
    paths = [real(a) for a in args if not a.startswith("-")]
    if op == "-test":
        sys.exit(0 if (os.path.isdir if "-d" in flags else os.path.exists)(paths[0]) else 1)
    if op == "-mkdir":
        os.makedirs(paths[0], exist_ok="-p" in flags)
    elif op in ("-get", "-put"):
        *sources, dst = paths
        for src in sources:
            if not os.path.exists(src):
                sys.exit(f"{{op}}: `{{src}}': No such file or directory")
            cp(src, dst)
    else:
        sys.exit(f"unsupported: {{op}}")
    """
).lstrip()


@pytest.fixture
def fake_hdfs(tmp_path, monkeypatch):
    """An `hdfs` command on PATH over a local folder; returns (root, log path)."""
    bin_dir, root, log = tmp_path / "bin", tmp_path / "hdfs-root", tmp_path / "hdfs.log"
    bin_dir.mkdir()
    root.mkdir()
    script = bin_dir / "hdfs"
    script.write_text(FAKE_HDFS.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_HDFS_ROOT", str(root))
    monkeypatch.setenv("FAKE_HDFS_LOG", str(log))
    return root, log


def test_hdfs_through_the_command(tmp_path, fake_hdfs):
    root, log = fake_hdfs
    write_tree(root / "models" / "qwen")
    url = "hdfs://namenode:8020/models/qwen"
    local = copy_to_local(url, cache_dir=tmp_path / "cache")
    assert local == str(tmp_path / "cache" / key_of(url) / "qwen")
    assert read_tree(local) == MODEL_FILES
    assert copy_to_local(url, cache_dir=tmp_path / "cache") == local  # reused: no second -get
    assert [line.split()[:2] for line in log.read_text().splitlines()] == [["dfs", "-test"], ["dfs", "-get"]]

    # Upload a directory, merging into an existing one, and a single file.
    write_tree(tmp_path / "ckpt", {"step-1/model.bin": b"abc"})
    makedirs("hdfs://namenode:8020/runs/r1")
    with pytest.raises(FileExistsError):
        makedirs("hdfs://namenode:8020/runs/r1")
    copy(str(tmp_path / "ckpt"), "hdfs://namenode:8020/runs/r1")
    assert (root / "runs" / "r1" / "step-1" / "model.bin").read_bytes() == b"abc"
    copy(str(tmp_path / "ckpt" / "step-1" / "model.bin"), "hdfs://namenode:8020/runs/r2/m.bin")
    assert (root / "runs" / "r2" / "m.bin").read_bytes() == b"abc"
    with pytest.raises(IsADirectoryError, match=r"onto 'hdfs://namenode:8020/runs/r1': that is a directory"):
        copy(str(tmp_path / "ckpt" / "step-1" / "model.bin"), "hdfs://namenode:8020/runs/r1")
    # Download into an existing folder: merged, not nested.
    write_tree(tmp_path / "down", {"old.txt": b"old"})
    copy("hdfs://namenode:8020/runs/r1", str(tmp_path / "down"))
    assert read_tree(tmp_path / "down") == {"old.txt": b"old", "step-1/model.bin": b"abc"}


def test_hdfs_to_other_urls_is_staged_locally(tmp_path, fake_hdfs, memfs):
    root, _ = fake_hdfs
    write_tree(root / "models" / "qwen")
    copy("hdfs://nn/models/qwen", "memory://mirror/qwen")
    assert memfs.cat("/mirror/qwen/weights/shard-0.bin") == MODEL_FILES["weights/shard-0.bin"]
    copy("memory://mirror/qwen", "hdfs://nn/backup/qwen")
    copy("hdfs://nn/backup/qwen", "hdfs://nn/backup2/qwen")
    assert read_tree(root / "backup2" / "qwen") == MODEL_FILES


def test_hdfs_missing_path_through_the_command(tmp_path, fake_hdfs):
    with pytest.raises(FileNotFoundError, match=r"Cannot copy 'hdfs://nn/absent': it does not exist\."):
        copy_to_local("hdfs://nn/absent", cache_dir=tmp_path / "cache")


def test_hdfs_without_any_client_says_what_to_install(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no `hdfs` command
    monkeypatch.setenv("JAVA_HOME", str(empty))  # and no JVM for pyarrow's libhdfs
    monkeypatch.setenv("ARROW_LIBHDFS_DIR", str(empty))
    with pytest.raises(HdfsUnavailableError) as info:
        copy_to_local("hdfs://namenode:8020/models/qwen", cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert message.startswith(
        "Cannot reach 'hdfs://namenode:8020/models/qwen': there is no `hdfs` command on PATH"
    )
    assert "Install the Hadoop client so that `hdfs` is on PATH, or make pyarrow's libhdfs usable" in message
    assert isinstance(info.value, TrellisError)
    with pytest.raises(HdfsUnavailableError):
        makedirs("hdfs://namenode:8020/runs")
