"""``python``: run model-written code in a subprocess sandbox and return its output.

The sandbox, per call (``isolate: true``, the default; needs Linux, root and util-linux ``unshare``):

- new mount, PID, network and IPC namespaces (``unshare -m -n -p -i -f --kill-child --mount-proc``):
  no network, no view of other processes, every descendant dies with the call, SysV/POSIX IPC
  objects die with it;
- a private filesystem view (``_sandbox_init.py`` builds it as root before the program starts): every
  mount read-only, and one size-capped tmpfs (``tmpfs_mb``) mounted over ``/tmp``, ``/var/tmp`` and
  ``/dev/shm``, which start empty; the working directory ``/tmp/trellis-sandbox-*`` holds ``main.py``.
  Nothing the call writes survives it, and no call sees another's files. When the tmpfs fills up,
  writes fail with ``ENOSPC`` and the result says the sandbox's disk space is exhausted;
- its own uid and gid, ``SANDBOX_UID_BASE + slot``, the slot held (``flock``) for the call so no two
  concurrent calls on the host share a uid (signals, ``ptrace`` and RLIMIT_NPROC are per uid), no
  supplementary groups, ``PR_SET_NO_NEW_PRIVS`` and a seccomp filter denying the kernel keyring
  syscalls (keyrings are not namespaced: a key would outlive the call) and foreign syscall ABIs;
- ``python -I`` with a clean environment (``PATH=/usr/bin:/bin``, nothing inherited) and stdin
  ``/dev/null``;
- ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC`` and no core files; a wall-clock
  timeout after which the whole sandbox is killed.

Where namespaces are unavailable, the tool refuses to run (``SandboxUnavailableError``, naming the
missing capability) unless the config says ``isolate: false``. Then the code runs in a plain
subprocess in a temp directory of the host's ``/tmp`` with the limits above and, when the tool runs as
root, the per-call uid; it shares ``/tmp`` and ``/dev/shm`` with the host, can reach the network, and
only its process group is killed.

Output (stdout and stderr, each) is truncated to ``max_output_chars``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from trellis.tools.base import BaseTool, ToolConfigError
from trellis.tools.schema import ToolResponse

# Per-call uids/gids: systemd's UID table lists 0x70000000 (1879048192) upward, above the container
# ranges and below its "foreign" range at 0x7FFE0000, as unused, so no host file should belong to one.
SANDBOX_UID_BASE = 0x70000000
SANDBOX_UID_SLOTS = 65536
_UNSHARE = ("-m", "-n", "-p", "-i", "-f", "--kill-child", "--mount-proc")
_INIT_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_init.py")
_SBIN_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
ESCAPE_HATCH = (
    "set `isolate: false` in the python tool's config to run without isolation (the code then shares "
    "/tmp and /dev/shm with the host and with other calls, and can reach the network)"
)


class SandboxUnavailableError(RuntimeError):
    """The isolated sandbox cannot be built here; the message names the missing capability."""


class SandboxError(RuntimeError):
    """Building one call's sandbox failed (after the availability check had passed)."""


@dataclass
class SandboxResult:
    """How a sandboxed run ended. ``returncode`` < 0 or > 128 means killed by a signal.

    ``disk_full``: the sandbox's tmpfs (``/tmp``, ``/var/tmp``, ``/dev/shm``, the working directory)
    had under 1% of its space or inodes left when the program ended (isolated runs only).
    """

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    isolated: bool
    duration_s: float
    disk_full: bool = False


def _unshare_path() -> str | None:
    return shutil.which("unshare", path=_SBIN_PATH)


@functools.cache
def unavailable_reason() -> str | None:
    """Why the isolated sandbox cannot be built here, or None when it can. Probed once per process.

    The probe runs ``_sandbox_init.py probe`` under ``unshare`` exactly as a call would (new mount,
    PID, network and IPC namespaces; every mount read-only; a tmpfs mounted), so a pass means calls work.
    """
    if not sys.platform.startswith("linux"):
        return f"Linux namespaces are needed, but this is {sys.platform}"
    if os.geteuid() != 0:
        return f"mount namespaces and per-call uids need root, and this process runs as uid {os.geteuid()}"
    unshare = _unshare_path()
    if unshare is None:
        return f"util-linux `unshare` is not on {_SBIN_PATH}"
    cmd = [unshare, *_UNSHARE, "--", sys.executable, "-I", "-S", _INIT_PY, "probe"]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`unshare {' '.join(_UNSHARE)}` could not run: {exc}"
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        return (
            f"`unshare {' '.join(_UNSHARE)}` with a read-only remount and a tmpfs failed "
            f"(exit {done.returncode}): {why[-1] if why else 'no message'}"
        )
    return None


def namespaces_available() -> bool:
    """Whether each call can get its own mount, PID, network and IPC namespaces (see module doc)."""
    return unavailable_reason() is None


def require_isolation() -> None:
    """Raise ``SandboxUnavailableError`` (what is missing, and the ``isolate: false`` escape hatch)."""
    if namespaces_available():
        return
    reason = unavailable_reason() or "the namespace availability check failed"
    raise SandboxUnavailableError(
        "python tool: refusing to run code without isolation: " + reason + ". The sandbox needs private "
        "mount, PID, network and IPC namespaces (Linux, root, util-linux `unshare`) to give each call its "
        "own /tmp, /var/tmp and /dev/shm, a read-only filesystem and no network. Run the tool as root "
        "on Linux, or " + ESCAPE_HATCH + "."
    )


def _readable_by_all(path: str) -> bool:
    """Whether another user can execute ``path`` (every parent directory traversable)."""
    path = os.path.realpath(path)
    if not os.stat(path).st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(path)
    while parent and parent != "/":
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(parent)
    return True


def default_python(drop_privileges: bool) -> str:
    """This interpreter, unless the sandbox user cannot reach it (e.g. under /root): then python3."""
    if not drop_privileges or _readable_by_all(sys.executable):
        return sys.executable
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if found is None:
        raise RuntimeError(
            f"python tool: {sys.executable} is not reachable by an unprivileged uid and no python3 is "
            "on /usr/local/bin:/usr/bin:/bin; set `python_executable` in the tool config"
        )
    return found


@functools.cache
def _uid_lock_dir() -> str:
    """A root-only directory of per-slot lock files (``/run/trellis-sandbox-uids`` where possible)."""
    base = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    path = os.path.join(base, "trellis-sandbox-uids")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise RuntimeError(f"python tool: {path} must be a directory owned by uid {os.geteuid()}, mode 0700")
    return path


@contextlib.contextmanager
def sandbox_uid() -> Iterator[int]:
    """Hold a uid no other concurrent call on this host holds (an ``flock``-ed slot, released on exit)."""
    lock_dir = _uid_lock_dir()
    for slot in range(SANDBOX_UID_SLOTS):
        fd = os.open(
            os.path.join(lock_dir, str(slot)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield SANDBOX_UID_BASE + slot
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"python tool: all {SANDBOX_UID_SLOTS} sandbox uids are in use")


def _strip_unshare_noise(text: str) -> str:
    """Drop the lines ``unshare`` itself prints when its child is killed (not the user's output)."""
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("unshare: "))


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or os.path.getsize(path) > len(data):
        return text[:limit] + f"\n... [output truncated to {limit} characters]"
    return text


def _read_status(path: str) -> dict[str, str]:
    status: dict[str, str] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            key, _, value = line.rstrip("\n").partition("=")
            status.setdefault(key, value)
    return status


def run_sandboxed(
    code: str,
    *,
    timeout_s: float = 5.0,
    cpu_s: int | None = None,
    memory_mb: int = 1024,
    max_procs: int = 16,
    max_file_mb: int = 16,
    max_output_chars: int = 4096,
    python_executable: str | None = None,
    isolate: bool = True,
    tmpfs_mb: int = 64,
) -> SandboxResult:
    """Run ``code`` in the sandbox described in the module docstring; blocks until it ends.

    Args:
        timeout_s: wall-clock seconds before the sandbox is killed.
        cpu_s: RLIMIT_CPU seconds (default: ``ceil(timeout_s)``).
        memory_mb: RLIMIT_AS in MiB; allocations beyond it raise MemoryError.
        max_procs: RLIMIT_NPROC (effective only for a non-root sandbox user).
        max_file_mb: RLIMIT_FSIZE in MiB (largest file, and each of stdout and stderr).
        isolate: True: namespaces and a private filesystem, or ``SandboxUnavailableError``;
            False: a plain subprocess (see the module docstring).
        tmpfs_mb: size of the private tmpfs behind ``/tmp``, ``/var/tmp``, ``/dev/shm`` and the working
            directory (isolated runs); it also allows ``256 * tmpfs_mb`` files and directories.

    Raises:
        SandboxUnavailableError: ``isolate`` is True and namespaces are unavailable here.
        SandboxError: building this call's sandbox failed.
    """
    if isolate:
        require_isolation()
    if tmpfs_mb < 1:
        raise ValueError(f"python tool: tmpfs_mb must be >= 1, got {tmpfs_mb}")
    root = os.geteuid() == 0
    python = python_executable or default_python(root)
    cpu = int(cpu_s if cpu_s is not None else max(1, -(-timeout_s // 1)))
    limits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20)),
        (resource.RLIMIT_FSIZE, (max_file_mb << 20, max_file_mb << 20)),
        (resource.RLIMIT_NPROC, (max_procs, max_procs)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    with contextlib.ExitStack() as stack:
        uid = stack.enter_context(sandbox_uid()) if root else None

        def preexec() -> None:  # runs in the child between fork and exec
            for which, value in limits:
                resource.setrlimit(which, value)
            if uid is not None and not isolate:  # isolated: _sandbox_init.py drops privileges
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)

        outdir = tempfile.mkdtemp(prefix="trellis-tool-out-")  # root-only (0700): output and status
        stack.callback(shutil.rmtree, outdir, ignore_errors=True)
        out_path, err_path = os.path.join(outdir, "stdout"), os.path.join(outdir, "stderr")
        status_path = os.path.join(outdir, "status")
        if isolate:
            # The source reaches _sandbox_init.py on stdin; it writes main.py into the private /tmp.
            unshare = _unshare_path()
            assert unshare is not None and uid is not None  # require_isolation() checked both
            code_path = os.path.join(outdir, "main.py")
            with open(code_path, "w", encoding="utf-8") as f:
                f.write(code)
            stdin: Any = stack.enter_context(open(code_path, "rb"))
            status_fd = os.open(status_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            stack.callback(os.close, status_fd)
            cwd = "/"
            home = f"/tmp/trellis-sandbox-{secrets.token_hex(4)}"
            argv = [unshare, *_UNSHARE, "--", python, "-I", "-S", _INIT_PY, "run", str(uid)]
            argv += [str(tmpfs_mb << 20), str(tmpfs_mb * 256), home, str(status_fd)]
            pass_fds = [status_fd]
        else:
            cwd = home = tempfile.mkdtemp(prefix="trellis-sandbox-")
            stack.callback(shutil.rmtree, cwd, ignore_errors=True)
            with open(os.path.join(cwd, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            if uid is not None:
                os.chown(cwd, uid, uid)
                os.chown(os.path.join(cwd, "main.py"), uid, uid)
            stdin, pass_fds = subprocess.DEVNULL, []
            argv = [python, "-I", "main.py"]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home}
        timed_out = False
        start = time.monotonic()
        # Output goes to files, not pipes: a descendant holding a pipe open cannot block us, and a
        # flood of output costs disk (bounded by RLIMIT_FSIZE), not parent memory.
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env=env,
                preexec_fn=preexec,
                start_new_session=True,
                close_fds=True,
                pass_fds=pass_fds,
            )
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_sandbox(proc, namespaced=isolate)
        duration_s = time.monotonic() - start
        status = _read_status(status_path) if isolate else {}
        if "error" in status:
            raise SandboxError(f"python tool: building the sandbox failed: {status['error']}")
        stderr = _read(err_path, max_output_chars)
        return SandboxResult(
            stdout=_read(out_path, max_output_chars),
            stderr=_strip_unshare_noise(stderr) if isolate else stderr,
            returncode=None if timed_out else proc.returncode,
            timed_out=timed_out,
            isolated=isolate,
            duration_s=duration_s,
            disk_full=status.get("disk_full") == "1",
        )


def _kill_sandbox(proc: subprocess.Popen[bytes], *, namespaced: bool) -> None:
    """Kill everything the sandbox started and reap it.

    Killing the PID namespace's init first lets the kernel tear the namespace down while ``unshare``
    is still there to reap it (orphaned zombies would wait on the container's init instead).
    """
    if proc.poll() is None and not namespaced:
        proc.kill()
        proc.wait()
    if proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except OSError:
            children = []
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _kill_group(proc.pid)


def _kill_group(pgid: int, grace_s: float = 2.0) -> None:
    """SIGKILL the sandbox's process group (stragglers of a normal exit too) and wait until it is gone."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


def describe_status(result: SandboxResult, timeout_s: float) -> str:
    """``exit status 0``, ``timed out after 5 s`` or ``killed by signal SIGXCPU (CPU time limit)``."""
    if result.timed_out:
        return f"timed out after {timeout_s:g} s (killed)"
    code = result.returncode
    sig = -code if code is not None and code < 0 else code - 128 if code is not None and code > 128 else None
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed)", "SIGXFSZ": " (file size limit)"}
        return f"killed by signal {name}{why.get(name, '')}"
    return f"exit status {code}"


DISK_FULL_NOTE = (
    "note: the sandbox's disk space is exhausted ({mb} MiB shared by /tmp, /var/tmp, /dev/shm and the "
    "working directory); writes failed with 'No space left on device'"
)


class PythonTool(BaseTool):
    """Runs Python code in a sandbox (see the module docstring). Config keys:

    - ``timeout_s`` (5), ``cpu_s`` (ceil(timeout_s)), ``memory_mb`` (1024), ``max_procs`` (16),
      ``max_file_mb`` (16), ``max_output_chars`` (4096), ``python_executable`` (auto);
    - ``tmpfs_mb`` (64): the per-call tmpfs behind ``/tmp``, ``/var/tmp``, ``/dev/shm`` and the
      working directory (and ``256 * tmpfs_mb`` inodes). When it fills up the response ends with a
      note that the sandbox's disk space is exhausted, and ``python/disk_full`` is 1. Each concurrent
      call can hold this much memory;
    - ``isolate`` (true): false runs the code in a plain subprocess, without namespaces or a private
      filesystem. With true, building the tool raises ``SandboxUnavailableError`` where namespaces are
      unavailable (not Linux, not root, no ``unshare``), naming what is missing.
    """

    default_schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python program and see its stdout, stderr and exit status. "
            "No network; print what you want to see.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the Python source to run"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: Any = None, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        isolate = self.config.get("isolate", True)
        if not isinstance(isolate, bool):
            raise ToolConfigError(f"python tool: `isolate` must be true or false, got {isolate!r}")
        tmpfs_mb = self.config.get("tmpfs_mb", 64)
        if isinstance(tmpfs_mb, bool) or not isinstance(tmpfs_mb, int) or tmpfs_mb < 1:
            raise ToolConfigError(
                f"python tool: `tmpfs_mb` must be a positive integer (MiB), got {tmpfs_mb!r}"
            )
        self.isolate, self.tmpfs_mb = isolate, tmpfs_mb
        if isolate:
            require_isolation()  # fail when the tool is built, not on every call

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResponse(text=f"Error: 'code' must be a string, got {code!r:.100}"), 0.0, {}
        cfg = self.config
        timeout_s = float(cfg.get("timeout_s", 5.0))
        result = await asyncio.to_thread(
            run_sandboxed,
            code,
            timeout_s=timeout_s,
            cpu_s=cfg.get("cpu_s"),
            memory_mb=int(cfg.get("memory_mb", 1024)),
            max_procs=int(cfg.get("max_procs", 16)),
            max_file_mb=int(cfg.get("max_file_mb", 16)),
            max_output_chars=int(cfg.get("max_output_chars", 4096)),
            python_executable=cfg.get("python_executable"),
            isolate=self.isolate,
            tmpfs_mb=self.tmpfs_mb,
        )
        parts = [describe_status(result, timeout_s)]
        if result.stdout:
            parts.append(f"stdout:\n{result.stdout}")
        if result.stderr:
            parts.append(f"stderr:\n{result.stderr}")
        if result.disk_full:
            parts.append(DISK_FULL_NOTE.format(mb=self.tmpfs_mb))
        metrics = {
            "python/timeouts": int(result.timed_out),
            "python/nonzero_exit": int(result.timed_out or result.returncode != 0),
            "python/duration_s": result.duration_s,
            "python/disk_full": int(result.disk_full),
        }
        return ToolResponse(text="\n".join(parts)), 0.0, metrics
