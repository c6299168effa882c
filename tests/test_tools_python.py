"""trellis.tools.python: the subprocess sandbox (limits, no network, private filesystem, per-call uid)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from trellis.tools import python as python_tool
from trellis.tools.base import ToolConfigError
from trellis.tools.python import (
    SANDBOX_UID_BASE,
    SANDBOX_UID_SLOTS,
    PythonTool,
    SandboxUnavailableError,
    namespaces_available,
    run_sandboxed,
    sandbox_uid,
    unavailable_reason,
)

ROOT = os.geteuid() == 0
ISOLATED = namespaces_available()
needs_isolation = pytest.mark.skipif(not ISOLATED, reason=f"no isolated sandbox here: {unavailable_reason()}")
SANDBOX_UIDS = range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UID_SLOTS)


def sandbox_pids() -> set[int]:
    """Host processes running as a sandbox uid."""
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if uid in SANDBOX_UIDS:
                found.add(int(pid))
    return found


def run(code: str, **config):
    """One call through the tool; isolated wherever this machine allows it (else ``isolate: false``)."""
    config.setdefault("isolate", ISOLATED)
    tool = PythonTool(config)

    async def main():
        iid, _ = await tool.create()
        try:
            return await tool.execute(iid, {"code": code})
        finally:
            await tool.release(iid)

    return asyncio.run(main())


def stdout_of(response) -> str:
    return response.text.split("stdout:\n", 1)[1].split("\nstderr:\n")[0]


def test_runs_code_in_a_clean_private_directory():
    response, reward, metrics = run(
        "import os, sys\nprint(os.getcwd()); print(sorted(os.environ)); print(sys.flags.isolated)"
    )
    assert response.text.startswith("exit status 0\nstdout:\n")
    cwd, env, isolated = response.text.split("stdout:\n")[1].splitlines()
    assert env == "['HOME', 'LANG', 'PATH']" and isolated == "1"
    assert os.path.basename(cwd).startswith("trellis-sandbox-") and not os.path.exists(cwd)
    assert reward == 0.0 and metrics["python/timeouts"] == 0 and metrics["python/nonzero_exit"] == 0
    assert metrics["python/disk_full"] == 0


def test_errors_and_exit_status_come_back_as_text():
    response, _, metrics = run("import sys\nprint('out'); print('bad', file=sys.stderr); sys.exit(3)")
    assert response.text == "exit status 3\nstdout:\nout\n\nstderr:\nbad\n"
    assert metrics["python/nonzero_exit"] == 1


def test_infinite_loop_stopped_by_wall_clock_timeout():
    start = time.monotonic()
    response, _, metrics = run("while True: pass", timeout_s=1, cpu_s=30)
    assert time.monotonic() - start < 10
    assert response.text == "timed out after 1 s (killed)" and metrics["python/timeouts"] == 1


def test_infinite_loop_stopped_by_cpu_limit():
    start = time.monotonic()
    response, _, metrics = run("while True: pass", timeout_s=30, cpu_s=1)
    assert time.monotonic() - start < 20
    assert response.text == "killed by signal SIGXCPU (CPU time limit)" and metrics["python/timeouts"] == 0


def test_10gb_allocation_fails_under_the_address_space_limit():
    response, _, _ = run("x = bytearray(10 * 2**30)\nprint('allocated')", memory_mb=512)
    assert "MemoryError" in response.text and "allocated" not in response.text


def test_environment_secrets_do_not_reach_the_code(monkeypatch):
    secret = f"trellis-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("TRELLIS_TEST_TOKEN", secret)
    code = (
        "import os\nprint(dict(os.environ))\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n            print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "        except OSError as e:\n            print(pid, type(e).__name__)\n"
    )
    response, _, _ = run(code)
    assert response.text.startswith("exit status 0") and secret not in response.text


@pytest.mark.skipif(not ROOT, reason="the per-call uid needs root")
def test_cannot_write_outside_its_directory():
    targets = [f"/etc/trellis-probe-{uuid.uuid4().hex}", f"/root/trellis-probe-{uuid.uuid4().hex}"]
    code = "import os, errno\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
    for target in targets:
        code += (
            f"try:\n    open({target!r}, 'w').write('x')\n    print('WROTE')\n"
            "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
        )
    response, _, _ = run(code)
    ids, *errors = stdout_of(response).splitlines()
    uid, gid, groups = ids.split(" ", 2)
    assert int(uid) in SANDBOX_UIDS and gid == uid and groups == "[]"
    assert set(errors) <= {"EACCES", "EROFS"} and len(errors) == 2
    assert not any(os.path.exists(t) for t in targets)


@pytest.mark.skipif(not ROOT, reason="RLIMIT_NPROC only holds for the unprivileged sandbox user")
def test_fork_bomb_is_bounded_and_leaves_no_process():
    before = sandbox_pids()
    counted = (
        "import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print('blocked after', n)\n"
    )
    response, _, _ = run(counted, max_procs=8, timeout_s=10)
    assert "blocked after" in response.text
    assert int(response.text.split("blocked after ")[1].split()[0]) < 8
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    response, _, metrics = run(bomb, max_procs=8, timeout_s=1, cpu_s=5)
    assert metrics["python/timeouts"] == 1 or "killed" in response.text
    assert sandbox_pids() - before == set()


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('CONNECTED')"
        )
        response, _, _ = run(code)
    finally:
        server.close()
    if ISOLATED:
        assert "Network is unreachable" in response.text and "CONNECTED" not in response.text
    else:  # only `isolate: false` runs here, and it says it has the network (see the refusal tests)
        assert "CONNECTED" in response.text


def test_output_is_truncated():
    response, _, _ = run(
        "print('x' * 10000)\nimport sys; print('y' * 50, file=sys.stderr)", max_output_chars=100
    )
    stdout = response.text.split("stdout:\n")[1].split("\nstderr:")[0]
    assert stdout == "x" * 100 + "\n... [output truncated to 100 characters]"
    assert response.text.endswith("stderr:\n" + "y" * 50 + "\n")


def test_code_must_be_a_string():
    response, _, _ = run(None)
    assert response.text == "Error: 'code' must be a string, got None"


# --- the private filesystem -------------------------------------------------------------------


@needs_isolation
def test_tmp_var_tmp_and_dev_shm_are_private_empty_and_gone_after_the_call():
    tag = uuid.uuid4().hex
    host_files = [f"/tmp/trellis-host-{tag}", f"/dev/shm/trellis-host-{tag}", f"/var/tmp/trellis-host-{tag}"]
    for path in host_files:
        with open(path, "w") as f:
            f.write("host")
    inner = [f"/tmp/trellis-probe-{tag}", f"/dev/shm/trellis-probe-{tag}", f"/var/tmp/trellis-probe-{tag}"]
    code = (
        "import json, os\n"
        "seen = {d: sorted(os.listdir(d)) for d in ('/tmp', '/var/tmp', '/dev/shm')}\n"
        f"for p in {inner!r}:\n    open(p, 'w').write('sandbox')\n"
        "print(json.dumps({'cwd': os.getcwd(), 'seen': seen, 'after': sorted(os.listdir('/tmp'))}))\n"
    )
    try:
        response, _, _ = run(code)
        report = json.loads(stdout_of(response))
        workdir = os.path.basename(report["cwd"])
        assert report["seen"] == {"/tmp": [workdir], "/var/tmp": [], "/dev/shm": []}
        assert report["after"] == sorted([workdir, f"trellis-probe-{tag}"])
        assert not any(os.path.exists(p) for p in inner)  # never on the host, nothing left behind
        for path in host_files:
            with open(path) as f:
                assert f.read() == "host"
    finally:
        for path in host_files:
            os.unlink(path)


@needs_isolation
def test_the_rest_of_the_filesystem_is_read_only():
    # a host folder the sandbox sees as it is: not under /tmp, /var/tmp or /dev/shm, which it replaces
    # (a clone of the repository may well live under /tmp)
    # and one every uid can reach (each folder above it searchable by others: not /root, 0700)
    private = ("/tmp", "/var/tmp", "/dev/shm")

    def reachable(folder: str) -> bool:
        real = os.path.realpath(folder)
        parts = [real, *(os.path.dirname(real[:i]) for i in range(len(real), 0, -1) if real[i - 1] == "/")]
        return not real.startswith(private) and all(os.stat(p).st_mode & 0o001 for p in set(parts) if p)

    candidates = [os.path.dirname(os.path.abspath(__file__)), "/run", "/var/lib"]
    home = next(c for c in candidates if os.path.isdir(c) and reachable(c))
    shared = tempfile.mkdtemp(prefix=".trellis-world-writable-", dir=home)
    os.chmod(shared, 0o1777)  # writable by anyone, the sandbox's uid included, were it not read-only
    targets = [
        os.path.join(shared, "x"),
        f"/run/lock/trellis-probe-{uuid.uuid4().hex}",
        f"/etc/trellis-probe-{uuid.uuid4().hex}",
    ]
    code = "import errno\n" + "".join(
        f"try:\n    open({t!r}, 'w')\n    print('WROTE')\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
        for t in targets
    )
    try:
        response, _, _ = run(code)
        assert stdout_of(response).splitlines() == ["EROFS"] * 3
        assert os.listdir(shared) == [] and not os.path.exists(targets[1]) and not os.path.exists(targets[2])
    finally:
        shutil.rmtree(shared)


CONCURRENT = r"""
import glob, json, os, time
token = {token!r}
me = os.getcwd()
for d in (me, '/tmp', '/var/tmp', '/dev/shm'):
    open(os.path.join(d, 'shared-name'), 'w').write(token)
start = time.time()
foreign, reads = set(), set()
while time.time() - start < {seconds}:
    for d in ('/tmp', '/var/tmp', '/dev/shm'):
        foreign |= {{os.path.join(d, n) for n in os.listdir(d)}} - {{me, os.path.join(d, 'shared-name')}}
    foreign |= set(glob.glob('/tmp/trellis-sandbox-*')) - {{me}}
    foreign |= {{p for p in os.listdir('/proc') if p.isdigit() and int(p) > 2}} - {{str(os.getpid())}}
    for d in (me, '/tmp', '/var/tmp', '/dev/shm'):
        reads.add(open(os.path.join(d, 'shared-name')).read())
    time.sleep(0.05)
print(json.dumps({{'uid': os.getuid(), 'start': start, 'end': time.time(), 'foreign': sorted(foreign),
                  'reads': sorted(reads)}}))
"""


@needs_isolation
def test_concurrent_calls_cannot_read_list_or_write_each_others_files():
    tokens = [uuid.uuid4().hex for _ in range(3)]
    results: dict[str, object] = {}

    def call(token: str) -> None:
        results[token] = run_sandboxed(CONCURRENT.format(token=token, seconds=3), timeout_s=60, cpu_s=30)

    threads = [threading.Thread(target=call, args=(t,)) for t in tokens]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reports = {}
    for token in tokens:
        result = results[token]
        assert result.returncode == 0, result.stderr
        reports[token] = json.loads(result.stdout)
    # they ran at the same time, each writing the same names in the same places ...
    assert max(r["start"] for r in reports.values()) < min(r["end"] for r in reports.values())
    for token, report in reports.items():
        assert report["foreign"] == []  # ... saw nothing of the others (files, sandboxes, processes)
        assert report["reads"] == [token]  # ... and read back only what it wrote itself
    assert len({r["uid"] for r in reports.values()}) == 3 and all(
        r["uid"] in SANDBOX_UIDS for r in reports.values()
    )


@pytest.mark.skipif(not ROOT, reason="per-call uids need root")
def test_each_concurrent_holder_gets_its_own_uid_and_slots_are_reused():
    with sandbox_uid() as a, sandbox_uid() as b:
        assert a != b and a in SANDBOX_UIDS and b in SANDBOX_UIDS
        holder = subprocess.run(  # another process on the host sees both slots taken
            [
                sys.executable,
                "-c",
                "from trellis.tools.python import sandbox_uid\nwith sandbox_uid() as u: print(u)",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            check=True,
        )
        assert int(holder.stdout) not in (a, b)
    with sandbox_uid() as again:  # slots are reused: few lock files, low uids
        assert again - SANDBOX_UID_BASE < 1024


@needs_isolation
def test_ten_thousand_small_files_hit_the_tmpfs_cap_with_a_clear_error():
    code = (
        "for i in range(10000):\n    with open(f'f{i}', 'w') as f:\n        f.write('x' * 100)\n"
        "print('all written')"
    )
    response, _, metrics = run(code, tmpfs_mb=8)
    assert "all written" not in response.text
    assert "OSError: [Errno 28] No space left on device" in response.text
    assert response.text.endswith(
        "note: the sandbox's disk space is exhausted (8 MiB shared by /tmp, /var/tmp, /dev/shm and the "
        "working directory); writes failed with 'No space left on device'"
    )
    assert metrics["python/disk_full"] == 1 and metrics["python/nonzero_exit"] == 1


@needs_isolation
@pytest.mark.parametrize("tmpfs_mb", [None, 8])
def test_tmpfs_mb_sizes_the_one_tmpfs_behind_tmp_var_tmp_and_dev_shm(tmpfs_mb):
    code = (
        "import os\nst = os.statvfs('/tmp')\nprint(st.f_blocks * st.f_frsize >> 20, st.f_files)\n"
        "print(len({os.stat(d).st_dev for d in ('/tmp', '/var/tmp', '/dev/shm', '.')}))\n"
        "try:\n    open('/dev/shm/big', 'wb').write(b'x' * (12 << 20))\n    print('12 MiB fit')\n"
        "except OSError as e:\n    print(e.strerror)\n"
    )
    response, _, _ = run(code, **({} if tmpfs_mb is None else {"tmpfs_mb": tmpfs_mb}))
    size, devices, big = stdout_of(response).splitlines()[:3]
    mb = 64 if tmpfs_mb is None else tmpfs_mb
    assert size == f"{mb} {mb * 256}" and devices == "1"
    assert big == ("12 MiB fit" if mb == 64 else "No space left on device")
    assert ("disk space is exhausted (8 MiB" in response.text) == (mb == 8)


@needs_isolation
def test_escapes_through_ipc_keyrings_and_user_namespaces_are_contained():
    key = int(uuid.uuid4().hex[:7], 16)
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def result(r): return 'ok' if r >= 0 else os.strerror(ctypes.get_errno())
print('shmget', result(libc.shmget({key}, 4096, 0o1666)))
add_key = {{'x86_64': 248, 'aarch64': 217}}[os.uname().machine]
print('add_key', result(libc.syscall(add_key, b'user', b'trellis', b'data', 4, -4)))
print('unshare', result(libc.unshare(0x10000000 | 0x20000)))
print('umount /tmp', result(libc.umount2(b'/tmp', 2)))
print('remount / rw', result(libc.mount(None, b'/', None, 0x20 | 0x1000, None)))
print(sorted(os.listdir('/tmp')) == [os.path.basename(os.getcwd())])
"""
    response, _, _ = run(code)
    shm, keyring, userns, umount, remount, tmp_intact = stdout_of(response).splitlines()
    assert shm == "shmget ok"  # a SysV segment in the call's own IPC namespace ...
    assert keyring == "add_key Operation not permitted"  # the kernel keyring is not namespaced: denied
    # where unprivileged user namespaces are allowed, one gives a mount namespace of its own, but the
    # mounts it inherits are locked: /tmp cannot be lifted off the host's, nor / made writable
    assert userns in ("unshare ok", "unshare Operation not permitted")
    assert umount in ("umount /tmp Invalid argument", "umount /tmp Operation not permitted")
    assert remount == "remount / rw Operation not permitted" and tmp_intact == "True"
    ipcs = subprocess.run(["ipcs", "-m"], capture_output=True, text=True).stdout
    assert f"0x{key:08x}" not in ipcs  # ... is gone with it


@pytest.mark.skipif(not ISOLATED, reason="needs root and unshare")
def test_read_only_fallback_for_kernels_without_mount_setattr():
    """Each mount remounted read-only on its own, its other per-mount flags (nosuid, ...) kept."""
    probe = tempfile.mkdtemp(prefix=".trellis-ro-probe-", dir=os.path.dirname(os.path.abspath(__file__)))
    script = (
        "import importlib.util, json\n"
        f"spec = importlib.util.spec_from_file_location('init', {python_tool._INIT_PY!r})\n"
        "init = importlib.util.module_from_spec(spec); spec.loader.exec_module(init)\n"
        "def flags():\n"
        "    rows = [line.split() for line in open('/proc/self/mountinfo')]\n"
        "    return {r[4]: sorted(set(r[5].split(',')) - {'ro', 'rw'}) for r in rows}\n"
        "init.mount(None, '/', None, init.MS_REC | init.MS_PRIVATE)\n"
        "before = flags()\n"
        "init.make_readonly_per_mount()\n"
        "ro = {l.split()[4]: 'ro' in l.split()[5].split(',') for l in open('/proc/self/mountinfo')}\n"
        "print(json.dumps({'same': flags() == before, 'all_ro': all(ro.values())}))\n"
        f"open({os.path.join(probe, 'x')!r}, 'w')\n"
    )
    try:
        done = subprocess.run(
            ["unshare", "-m", "--", sys.executable, "-I", "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert json.loads(done.stdout) == {"same": True, "all_ro": True}
        assert "Read-only file system" in done.stderr and os.listdir(probe) == []
    finally:
        shutil.rmtree(probe)


# --- no namespaces: refuse, unless `isolate: false` -------------------------------------------


def test_refuses_without_namespaces_and_says_why(monkeypatch):
    monkeypatch.setattr(python_tool, "namespaces_available", lambda: False)
    with pytest.raises(
        SandboxUnavailableError, match=r"refusing to run code without isolation.*isolate: false"
    ):
        PythonTool({})
    with pytest.raises(SandboxUnavailableError, match="isolate: false"):
        run_sandboxed("print('hi')")


def test_the_refusal_names_the_missing_capability(monkeypatch):
    unavailable_reason.cache_clear()
    monkeypatch.setattr(python_tool, "_unshare_path", lambda: None)
    try:
        with pytest.raises(SandboxUnavailableError) as info:
            PythonTool({"timeout_s": 2})
        missing = "util-linux `unshare` is not on" if ROOT else "need root"
        assert missing in str(info.value) and "`isolate: false`" in str(info.value)
    finally:
        unavailable_reason.cache_clear()
    monkeypatch.undo()
    assert namespaces_available() is ISOLATED


def test_isolate_false_runs_anyway(monkeypatch):
    monkeypatch.setattr(python_tool, "namespaces_available", lambda: False)
    response, _, _ = run("import os\nprint(os.getuid(), os.getcwd())", isolate=False)
    uid, cwd = stdout_of(response).split()
    assert response.text.startswith("exit status 0") and os.path.dirname(cwd) == tempfile.gettempdir()
    assert int(uid) in SANDBOX_UIDS if ROOT else int(uid) == os.geteuid()
    result = run_sandboxed("print('still runs')", isolate=False)
    assert result.stdout == "still runs\n" and result.isolated is False


@pytest.mark.parametrize("bad", [{"isolate": "false"}, {"isolate": 0}, {"tmpfs_mb": 0}, {"tmpfs_mb": "64"}])
def test_config_values_are_checked(bad):
    with pytest.raises(ToolConfigError, match=next(iter(bad))):
        PythonTool(bad)
