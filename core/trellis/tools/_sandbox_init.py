"""pid 1 of a ``python`` tool sandbox: builds the call's private filesystem, then runs the program.

``trellis.tools.python`` runs this file as root, as the first process of fresh mount, PID, network
and IPC namespaces::

    unshare -m -n -p -i -f --kill-child --mount-proc -- PYTHON -I -S _sandbox_init.py \
        run UID TMPFS_BYTES NR_INODES WORKDIR STATUS_FD

with the program's source on stdin. In this process's own mount namespace it

1. makes every mount private (nothing propagates to or from the host) and read-only, recursively;
2. mounts one tmpfs (``size=TMPFS_BYTES,nr_inodes=NR_INODES``) and bind-mounts three empty
   directories of it over ``/tmp``, ``/var/tmp`` and ``/dev/shm``, so the three (and the working
   directory ``WORKDIR``, inside ``/tmp``) share one cap and vanish with the namespace;
3. writes ``WORKDIR/main.py``, owned by ``UID``;

then forks the program: ``setgroups([])``, gid and uid ``UID``, ``PR_SET_NO_NEW_PRIVS``, a seccomp
filter that denies the kernel keyring syscalls (keyrings are not namespaced: a key would outlive the
call and be readable by a later call with the same uid), and ``exec PYTHON -I main.py`` with stdin
``/dev/null``. pid 1 of a PID namespace ignores signals it has no handler for (SIGXCPU included), so
the program is a child, and its status is reported as a shell would (128 + signal).

``STATUS_FD`` gets ``key=value`` lines for the parent: ``disk_full=0|1`` once the program has ended,
or ``error=...`` (exit status 125) when the setup failed. ``probe`` instead of ``run`` (no other
arguments) does step 1 and one tmpfs mount and exits 0: the parent's availability check.

Standard library only: this runs with ``-I -S``, outside the package.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and aarch64 (Linux >= 5.12)
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
# arch -> (AUDIT_ARCH_*, numbers of add_key, request_key, keyctl)
KEYRING_SYSCALLS = {"x86_64": (0xC000003E, (248, 249, 250)), "aarch64": (0xC00000B7, (217, 218, 219))}
X32_SYSCALL_BIT = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(
    source: str | None, target: str | bytes, fstype: str | None, flags: int, data: str | None = None
) -> None:
    path = target if isinstance(target, bytes) else target.encode()
    enc = [None if s is None else s.encode() for s in (source, fstype, data)]
    _check(_libc.mount(enc[0], path, enc[1], flags, enc[2]), f"mount {os.fsdecode(path)}")


def make_readonly() -> None:
    """Every mount of this namespace read-only: one ``mount_setattr`` call, or one remount per mount."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    ret = _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(b"/"),
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    if ret == 0:
        return
    if ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL, errno.E2BIG):
        _check(-1, "mount_setattr / ro")
    make_readonly_per_mount()


_KEEP = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}


def make_readonly_per_mount() -> None:
    """Kernels before 5.12: remount each mount point read-only, keeping its other per-mount flags."""
    import re

    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        # mountinfo writes space, tab, newline and backslash in a path as octal escapes (\040)
        target = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for opt in fields[5].decode().split(","):
            flags |= _KEEP.get(opt, 0)
        mount(None, target, None, flags)


def build_filesystem(tmpfs_bytes: int, nr_inodes: int) -> None:
    """Steps 1 and 2 of the module docstring."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    make_readonly()
    mount(
        "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_bytes},nr_inodes={nr_inodes},mode=0755"
    )
    targets = {"tmp": "/tmp"}
    for name, path in (("var-tmp", "/var/tmp"), ("shm", "/dev/shm")):
        real = os.path.realpath(path)
        if os.path.isdir(real) and not (real + "/").startswith("/tmp/"):
            targets[name] = real
    for name in targets:
        os.mkdir(f"/tmp/{name}")
        os.chmod(f"/tmp/{name}", 0o1777)
    for name, path in targets.items():
        if name != "tmp":
            mount(f"/tmp/{name}", path, None, MS_BIND)
    mount("/tmp/tmp", "/tmp", None, MS_BIND)  # last: covers the tmpfs root and its staging directories


def seccomp_filter() -> bytes | None:
    """A classic-BPF program: deny add_key/request_key/keyctl and foreign ABIs (EPERM), allow the rest."""
    machine = os.uname().machine
    if machine not in KEYRING_SYSCALLS:
        return None
    arch, numbers = KEYRING_SYSCALLS[machine]
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EPERM
    prog: list[tuple[int, int, int, int]] = [
        (ld_abs, 0, 0, 4),
        (jeq, 1, 0, arch),
        (ret, 0, 0, deny),
        (ld_abs, 0, 0, 0),
    ]
    checks = [(jge, X32_SYSCALL_BIT)] if machine == "x86_64" else []
    checks += [(jeq, nr) for nr in numbers]
    for i, (op, k) in enumerate(checks):
        prog.append((op, len(checks) - i, 0, k))  # jump over the remaining checks and ALLOW to DENY
    prog += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in prog)


def drop_privileges(uid: int) -> None:
    """In the program's process, before exec: the unprivileged uid, no new privileges, no keyrings."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    code = seccomp_filter()
    if code is not None:
        prog = _SockFprog(len(code) // 8, code)
        _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0), "seccomp")


def _read_stdin() -> bytes:
    chunks = []
    while chunk := os.read(0, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def main(argv: list[str]) -> int:
    if argv[1:] == ["probe"]:
        build_filesystem(1 << 20, 64)
        return 0
    _, _, uid_s, tmpfs_s, inodes_s, workdir, status_s = argv
    uid, status_fd = int(uid_s), int(status_s)
    os.set_inheritable(status_fd, False)
    try:
        code = _read_stdin()
        build_filesystem(int(tmpfs_s), int(inodes_s))
        os.mkdir(workdir, 0o700)
        main_py = os.path.join(workdir, "main.py")
        with open(main_py, "wb") as f:
            f.write(code)
        os.chown(main_py, uid, uid)
        os.chown(workdir, uid, uid)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    except Exception as exc:  # reported to the parent, which raises it
        os.write(status_fd, f"error={type(exc).__name__}: {exc}\n".encode())
        return 125
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(workdir)
            drop_privileges(uid)
            os.execv(sys.executable, [sys.executable, "-I", "main.py"])
        except BaseException as exc:
            os.write(status_fd, f"error=starting the program: {type(exc).__name__}: {exc}\n".encode())
        os._exit(125)
    _, status = os.waitpid(pid, 0)
    st = os.statvfs("/tmp")
    full = st.f_bavail * 100 < st.f_blocks or st.f_favail * 100 < st.f_files  # under 1% left
    os.write(status_fd, f"disk_full={int(full)}\n".encode())
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


if __name__ == "__main__":
    os._exit(main(sys.argv))
