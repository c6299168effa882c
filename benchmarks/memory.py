"""Where a training run's memory goes, step by step: resident set, live tensors, Python objects, malloc.

    python benchmarks/memory.py [--preset demo|tiny] [--steps 12] [--objects] [--trim]
                                [--stages [--heap-live]] [key=value ...]

Runs a preset's training (``demo``: SmolLM2-135M-Instruct, GRPO, the demo's shapes; ``tiny``: the
tiny test model) for ``--steps`` steps, without validation or checkpoints, in this process
(``trainer.executor=local``), and prints one row per step, measured at the step's end:

- ``rss`` / ``peak``: the process's resident set now, and its peak during the step (``VmHWM``,
  reset at each step's start), GiB;
- ``tensors``: the bytes of the distinct storages of every live torch tensor the garbage collector
  can see (parameters, gradients, optimizer state, anything kept from earlier steps), GiB, and
  their count;
- ``heap`` / ``free``: glibc's ``mallinfo2``: bytes handed out from the malloc heaps
  (``uordblks``) and free bytes kept in them (``fordblks``), GiB; ``mmap``: bytes in chunks
  malloc got directly from ``mmap`` (``hblkhd``); ``arenas``: the heaps' total size (``arena``);
- ``trim``: with ``--trim``, how much RSS ``malloc_trim(0)`` gave back after the step, GiB;
- ``faults`` / ``sys``: the step's minor page faults (millions: pages touched for the first time since
  the process got them from the OS, each zeroed by the kernel) and its system CPU seconds, most of
  which is that zeroing; then the step's wall seconds.

A large ``free`` (and ``rss`` well above ``tensors`` + the model's own needs) means fragmentation
in the allocator; growing ``tensors`` means references kept alive; growing Python object counts
(``--objects``: the types whose count grew most since step 1) mean Python objects kept alive.
``--stages`` adds a line per stage of each step: its peak and the RSS at its end. ``--heap-live``
(with ``--stages``) also samples ``mallinfo2`` every 2 ms during each stage and adds the most bytes
malloc handed out at once (``live``) and the heaps' size then (``held``): ``held - live`` is what
fragmentation costs at the stage's peak. Sampling walks malloc's bins under its lock, so the stages
run slower (the demo's update took 1.7x as long): use it for the memory, not the times.

``trainer.host_memory=release`` (an override) compares the policies: under ``reuse`` (the default)
malloc keeps freed memory for the next stage; under ``release`` the engines give malloc's free heap
memory back at each phase's start and end (the ``cpu`` backend's ``empty_cache``; see
docs/performance.md, "Memory"). glibc tunables can be tried from outside as well
(``MALLOC_ARENA_MAX=2``, ``MALLOC_TRIM_THRESHOLD_=...``, ``MALLOC_MMAP_THRESHOLD_=...``).
This is a measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import gc
import os
import resource
import sys
import threading
import time
import warnings
from typing import Any

from _common import training_only  # benchmarks/_common.py: the script's own folder

GIB = 2**30


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _libc()


def mallinfo() -> dict[str, int]:
    """glibc's ``mallinfo2`` figures (bytes), or {} where there is no glibc."""
    if LIBC is None:
        return {}
    info = LIBC.mallinfo2()
    return {name: int(getattr(info, name)) for name, _ in _Mallinfo2._fields_}


class HeapSampler:
    """A thread that samples ``mallinfo2`` every ``interval_s`` while :meth:`measure` runs: the most
    bytes handed out from the heaps at once (``uordblks``) and the heaps' size (``arena``) at that
    moment, and at the end."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.live = self.held = 0
        self._on = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heap-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        info = mallinfo()
        if info.get("uordblks", 0) > self.live:
            self.live, self.held = info["uordblks"], info["arena"]

    def _run(self) -> None:
        while True:
            self._on.wait()
            self._sample()
            time.sleep(self.interval_s)

    @contextlib.contextmanager
    def measure(self) -> Any:
        self.live = self.held = 0
        self._on.set()
        try:
            yield self
        finally:
            self._on.clear()
            self._sample()  # the end counts too: a stage shorter than one interval


def arena_free() -> list[tuple[int, int]]:
    """``(size, free bytes)`` of each malloc arena (glibc's ``malloc_info``), the main arena first."""
    if LIBC is None:
        return []
    import re
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".xml") as out:
        stream = LIBC.fopen(out.name.encode(), b"w")
        LIBC.malloc_info(0, stream)
        LIBC.fclose(stream)
        xml = out.read()
    arenas = []
    for heap in re.findall(r"<heap nr=.*?</heap>", xml, flags=re.S):
        rest = re.search(r'<total type="rest" count="\d+" size="(\d+)"/>', heap)
        fast = re.search(r'<total type="fast" count="\d+" size="(\d+)"/>', heap)
        size = re.search(r'<system type="current" size="(\d+)"/>', heap)
        free = sum(int(m.group(1)) for m in (rest, fast) if m)
        arenas.append((int(size.group(1)) if size else 0, free))
    return arenas


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def live_tensors() -> tuple[int, int]:
    """``(count, bytes)`` of the live tensors the collector sees; bytes of distinct storages."""
    import torch

    count, seen, total = 0, set(), 0
    with warnings.catch_warnings():  # isinstance on deprecated torch module attributes warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        count += 1
        try:
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if key and key not in seen:
                seen.add(key)
                total += storage.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
    return count, total


def object_counts() -> collections.Counter[str]:
    return collections.Counter(type(obj).__qualname__ for obj in gc.get_objects())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="demo", choices=["demo", "tiny"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--objects", action="store_true", help="Python object counts: top growers")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after each step")
    parser.add_argument("--stages", action="store_true", help="a line per stage: peak and end RSS")
    parser.add_argument(
        "--heap-live",
        action="store_true",
        help="with --stages: malloc's live and held bytes at each stage's peak",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    if args.heap_live and (not args.stages or LIBC is None):
        parser.error("--heap-live needs --stages and glibc (mallinfo2).")

    import torch

    import trellis
    from trellis.hooks import get_plugin_manager, hookimpl
    from trellis.trainer import ppo

    overrides = [*training_only(args.preset, args.steps, "memory"), *args.overrides]
    env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k.endswith("_THREADS")}
    print(f"preset {args.preset}, {args.steps} steps, torch threads {torch.get_num_threads()}, env {env}")
    rows: list[dict[str, Any]] = []
    baseline: dict[str, Any] = {}
    state = {
        "step_start": time.perf_counter(),
        "step_peak": 0,
        "usage": resource.getrusage(resource.RUSAGE_SELF),
    }

    if args.stages:  # wrap the trainer's stages: a peak per stage (harness only, the trainer is unchanged)
        original = ppo.Trainer._stage
        sampler = HeapSampler() if args.heap_live else None

        @contextlib.contextmanager
        def stage(self: Any, name: str, timings: Any = None) -> Any:
            reset_peak()
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            sampling = sampler.measure() if sampler is not None else contextlib.nullcontext()
            with sampling, original(self, name, timings):
                yield
            state["step_peak"] = max(state["step_peak"], status_bytes("VmHWM"))
            usage = resource.getrusage(resource.RUSAGE_SELF)
            heap = (
                "" if sampler is None else f"  live {sampler.live / GIB:5.2f} held {sampler.held / GIB:5.2f}"
            )
            print(
                f"    stage {name:<14} peak {status_bytes('VmHWM') / GIB:6.2f}  "
                f"end rss {status_bytes('VmRSS') / GIB:6.2f}{heap}  "
                f"faults {(usage.ru_minflt - before.ru_minflt) / 1e6:5.2f}M"
                f"  sys {usage.ru_stime - before.ru_stime:5.1f}s  {time.perf_counter() - start:5.1f}s",
                flush=True,
            )
            reset_peak()

        ppo.Trainer._stage = stage  # type: ignore[method-assign]

    class Probe:
        @hookimpl
        def trellis_train_start(self) -> None:
            reset_peak()
            state["step_start"], state["usage"] = (
                time.perf_counter(),
                resource.getrusage(resource.RUSAGE_SELF),
            )
            print(f"before step 1: rss {status_bytes('VmRSS') / GIB:.2f} GiB", flush=True)

        @hookimpl
        def trellis_step_end(self, step: int, metrics: dict[str, float]) -> None:
            peak, rss = max(status_bytes("VmHWM"), state["step_peak"]), status_bytes("VmRSS")
            gc.collect()
            count, tensor_bytes = live_tensors()
            info = mallinfo()
            row = {
                "step": step,
                "rss": rss,
                "peak": peak,
                "tensors": tensor_bytes,
                "count": count,
                "heap": info.get("uordblks", 0),
                "free": info.get("fordblks", 0),
                "mmap": info.get("hblkhd", 0),
                "arenas": info.get("arena", 0),
                "trim": 0,
                "seconds": time.perf_counter() - state["step_start"],
            }
            usage, before = resource.getrusage(resource.RUSAGE_SELF), state["usage"]
            row["faults"], row["sys"] = usage.ru_minflt - before.ru_minflt, usage.ru_stime - before.ru_stime
            arenas = arena_free()
            if arenas:
                print(
                    f"      {len(arenas)} malloc arenas, GiB size/free: "
                    + ", ".join(f"{size / GIB:.2f}/{free / GIB:.2f}" for size, free in arenas if size > 2**24)
                )
            if args.trim and LIBC is not None:
                LIBC.malloc_trim(0)
                row["trim"] = rss - status_bytes("VmRSS")
            rows.append(row)
            print(
                f"step {step:3d}  rss {rss / GIB:6.2f}  peak {peak / GIB:6.2f}  tensors "
                f"{tensor_bytes / GIB:5.2f} ({count:5d})  heap {row['heap'] / GIB:5.2f}  free "
                f"{row['free'] / GIB:5.2f}  mmap {row['mmap'] / GIB:5.2f}  arenas {row['arenas'] / GIB:5.2f}"
                f"  trim {row['trim'] / GIB:5.2f}  faults {row['faults'] / 1e6:5.2f}M  sys {row['sys']:5.1f}s"
                f"  {row['seconds']:5.1f}s",
                flush=True,
            )
            if args.objects:
                counts = object_counts()
                if not baseline:
                    baseline["counts"] = counts
                else:
                    grown = [(name, n - baseline["counts"].get(name, 0)) for name, n in counts.items()]
                    grown = sorted((g for g in grown if g[1] > 0), key=lambda g: -g[1])[:6]
                    print("      objects grown since step 1: " + ", ".join(f"{n} +{d}" for n, d in grown))
            reset_peak()
            state["step_start"], state["step_peak"] = time.perf_counter(), 0
            state["usage"] = resource.getrusage(resource.RUSAGE_SELF)

    get_plugin_manager().register(Probe(), name="memory-probe")
    trellis.train(overrides=overrides)
    if len(rows) >= 3:
        second, last = rows[1], rows[-1]
        print(
            f"\nmax peak {max(r['peak'] for r in rows) / GIB:.2f} GiB (step "
            f"{max(rows, key=lambda r: r['peak'])['step']}); rss step 2 -> {last['step']}: "
            f"{second['rss'] / GIB:.2f} -> {last['rss'] / GIB:.2f} GiB "
            f"({last['rss'] / second['rss'] - 1:+.1%}); "
            f"live tensors {second['tensors'] / GIB:.2f} -> {last['tensors'] / GIB:.2f} GiB; malloc free "
            f"{second['free'] / GIB:.2f} -> {last['free'] / GIB:.2f} GiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
