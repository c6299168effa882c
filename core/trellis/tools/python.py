"""``python``: run model-written code in a subprocess sandbox and return its output.

The sandbox, per call:

- a private temp working directory (owned by the sandbox user, deleted afterwards);
- ``python -I`` with a clean environment (``PATH=/usr/bin:/bin``, nothing inherited);
- ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC`` and no core files, set in
  ``preexec_fn``; a wall-clock timeout after which the whole process group is killed;
- when running as root: new network and PID namespaces (``unshare -n -p -f --kill-child
  --mount-proc``) and uid/gid 65534, so there is no network, RLIMIT_NPROC holds (it is ignored for
  root), system files are not writable and every descendant dies with the sandbox. Where namespaces
  are unavailable the tool still drops privileges when root, and warns once that the network is open.

Output (stdout and stderr, each) is truncated to ``max_output_chars``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

from trellis.tools.base import BaseTool
from trellis.tools.schema import ToolResponse

NOBODY = 65534
_UNSHARE = ("-n", "-p", "-f", "--kill-child", "--mount-proc")
# pid 1 of a PID namespace ignores signals it has no handler for (SIGXCPU included), so the user's
# code runs as a child of this tiny init, which reports its status as a shell would (128 + signal).
_INIT = (
    "import os,sys\n"
    "pid=os.fork()\n"
    "if pid==0:\n"
    "    os.execv(sys.executable,[sys.executable,'-I','main.py'])\n"
    "_,st=os.waitpid(pid,0)\n"
    "os._exit(128+os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st))\n"
)


@dataclass
class SandboxResult:
    """How a sandboxed run ended. ``returncode`` < 0 or > 128 means killed by a signal."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    isolated: bool
    duration_s: float


@functools.cache
def namespaces_available() -> bool:
    """Whether ``unshare`` can give the sandbox its own network and PID namespaces as uid 65534.

    Probed once per process; when False a ``RuntimeWarning`` says the sandbox has network access.
    """
    unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
    ok = False
    if unshare and os.geteuid() == 0:
        cmd = [unshare, *_UNSHARE, "-S", str(NOBODY), "-G", str(NOBODY), "--", "/bin/true"]
        try:
            ok = subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
    if not ok:
        warnings.warn(
            "python tool: network/PID namespaces are unavailable (needs root and `unshare -n -p`); "
            "sandboxed code can reach the network and its descendants are only killed by process group",
            RuntimeWarning,
            stacklevel=2,
        )
    return ok


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
            f"python tool: {sys.executable} is not reachable by uid {NOBODY} and no python3 is on "
            "/usr/local/bin:/usr/bin:/bin; set `python_executable` in the tool config"
        )
    return found


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
) -> SandboxResult:
    """Run ``code`` in the sandbox described in the module docstring; blocks until it ends.

    Args:
        timeout_s: wall-clock seconds before the process group is killed.
        cpu_s: RLIMIT_CPU seconds (default: ``ceil(timeout_s)``).
        memory_mb: RLIMIT_AS in MiB; allocations beyond it raise MemoryError.
        max_procs: RLIMIT_NPROC (effective only for a non-root sandbox user).
        isolate: use namespaces when available (a warning is issued once when not).
    """
    root = os.geteuid() == 0
    use_ns = isolate and namespaces_available()
    python = python_executable or default_python(root)
    cpu = int(cpu_s if cpu_s is not None else max(1, -(-timeout_s // 1)))
    limits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20)),
        (resource.RLIMIT_FSIZE, (max_file_mb << 20, max_file_mb << 20)),
        (resource.RLIMIT_NPROC, (max_procs, max_procs)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]

    def preexec() -> None:  # runs in the child between fork and exec
        for which, value in limits:
            resource.setrlimit(which, value)
        if root and not use_ns:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)

    outdir = tempfile.mkdtemp(prefix="trellis-tool-out-")
    workdir = tempfile.mkdtemp(prefix="trellis-sandbox-")
    start = time.monotonic()
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if root:
            os.chown(workdir, NOBODY, NOBODY)
            os.chown(os.path.join(workdir, "main.py"), NOBODY, NOBODY)
        if use_ns:
            unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
            assert unshare is not None  # namespaces_available() found it
            argv = [unshare, *_UNSHARE, "-S", str(NOBODY), "-G", str(NOBODY), "--", python, "-I", "-c", _INIT]
        else:
            argv = [python, "-I", "main.py"]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}
        out_path, err_path = os.path.join(outdir, "stdout"), os.path.join(outdir, "stderr")
        timed_out = False
        # Output goes to files, not pipes: a descendant holding a pipe open cannot block us, and a
        # flood of output costs disk (bounded by RLIMIT_FSIZE), not parent memory.
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=workdir,
                env=env,
                preexec_fn=preexec,
                start_new_session=True,
                close_fds=True,
            )
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_sandbox(proc, namespaced=use_ns)
        return SandboxResult(
            stdout=_read(out_path, max_output_chars),
            stderr=_strip_unshare_noise(_read(err_path, max_output_chars))
            if use_ns
            else _read(err_path, max_output_chars),
            returncode=None if timed_out else proc.returncode,
            timed_out=timed_out,
            isolated=use_ns,
            duration_s=time.monotonic() - start,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(outdir, ignore_errors=True)


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


class PythonTool(BaseTool):
    """Runs Python code in a sandbox. Config keys: ``timeout_s`` (5), ``cpu_s`` (ceil(timeout_s)),
    ``memory_mb`` (1024), ``max_procs`` (16), ``max_file_mb`` (16), ``max_output_chars`` (4096),
    ``python_executable`` (auto), ``isolate`` (True)."""

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
            isolate=bool(cfg.get("isolate", True)),
        )
        parts = [describe_status(result, timeout_s)]
        if result.stdout:
            parts.append(f"stdout:\n{result.stdout}")
        if result.stderr:
            parts.append(f"stderr:\n{result.stderr}")
        metrics = {
            "python/timeouts": int(result.timed_out),
            "python/nonzero_exit": int(result.timed_out or result.returncode != 0),
            "python/duration_s": result.duration_s,
        }
        return ToolResponse(text="\n".join(parts)), 0.0, metrics
