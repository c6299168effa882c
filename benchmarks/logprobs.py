"""Chunked log-probs / entropy next to the naive torch expressions, forward + backward, in one run.

    python benchmarks/logprobs.py [--bs 4] [--seq 1024] [--vocab 49152] [--repeats 5] [--dtype float32]

Logits are a ``(bs, seq, vocab)`` leaf that requires grad; each call is forward, then
``torch.autograd.grad`` with a random upstream gradient (the returned gradient is kept until the
call ends, on both sides). Sides:

- log-probs, naive: ``torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)``
- log-probs, chunked: ``trellis.algorithms.logprobs.logprobs_from_logits`` (default chunk size)
- log-probs, chunked in place: the same with ``inplace_backward=True`` (logits made a non-leaf view)
- entropy, naive: ``torch.distributions.Categorical(logits=logits.float()).entropy()``
- entropy, chunked: ``entropy_from_logits``

Each side runs in a fresh subprocess, so one side's freed or cached memory never counts for
another. Peak memory is the peak *additional* memory of one call, beyond the logits, labels and
upstream gradient that exist before it (the same on both sides), measured two ways:

- alloc: the peak of bytes held through torch's CPU allocator during the call, above the level
  at its start, summed from the allocation events of ``torch.profiler`` (``profile_memory``).
  Exact for tensors, including temporaries inside ops; blind to anything else.
- rss: the growth of the process's peak resident set (VmHWM, reset through
  ``/proc/self/clear_refs`` just before the call) over its resident set at that moment. What the
  OS sees; includes the allocator's page-granular and heap effects. Taken on the first call.

Time is the median wall time of ``--repeats`` calls after the two measurement calls (which
also warm up), with torch's default threads. None of these ops is a matmul, so the limit is the
memory bandwidth (``benchmarks/_roofline.py``, measured by this script's own process after the
sides, at the sides' thread count): a call must read the logits twice (forward; backward) and
write their gradient once, so ``GB/s`` is ``3 x logits bytes / seconds`` and ``% bw`` its
fraction of the bandwidth (a call that moves more bytes than that minimum shows as a lower %).
Targets: peak memory <= 35% of naive, time <= 1.3x naive. This is a measurement, never a
pass/fail test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from _roofline import GIGA, memory_bandwidth  # benchmarks/_roofline.py: the script's own folder

MIB = 2**20
MEMORY_TARGET, TIME_TARGET = 0.35, 1.3
SIDES = {
    # name: (kind, label)
    "naive-logprobs": ("log-probs", "naive log_softmax+gather"),
    "chunked-logprobs": ("log-probs", "chunked"),
    "chunked-logprobs-inplace": ("log-probs", "chunked, inplace_backward"),
    "naive-entropy": ("entropy", "naive Categorical.entropy"),
    "chunked-entropy": ("entropy", "chunked"),
}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _alloc_peak_bytes(prof) -> int:
    """Peak of the running sum of allocation events (frees are negative) in a profile."""
    events = []

    def walk(nodes):
        for node in nodes:
            if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak


def worker(side: str, bs: int, seq: int, vocab: int, repeats: int, dtype_name: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trellis.algorithms.logprobs import entropy_from_logits, logprobs_from_logits

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    base = (torch.randn(bs, seq, vocab) * 2).to(dtype).requires_grad_(True)
    # inplace_backward refuses a leaf (it would overwrite it): give it a view of the leaf.
    logits = base.view_as(base) if side.endswith("inplace") else base
    labels = torch.randint(0, vocab, (bs, seq))
    upstream = torch.randn(bs, seq)

    def call(logits, labels, upstream):
        if side == "naive-logprobs":
            out = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
        elif side == "naive-entropy":
            out = torch.distributions.Categorical(logits=logits.float()).entropy()
        elif side.startswith("chunked-logprobs"):
            out = logprobs_from_logits(logits, labels, inplace_backward=side.endswith("inplace"))
        else:
            out = entropy_from_logits(logits)
        (grad,) = torch.autograd.grad(out, logits, upstream)
        return grad

    # Load the code paths first, on 8 tokens, so that first-use costs (libraries, thread
    # pools) do not count as the call's memory; this leaves no big buffer cached.
    call(logits[:1, :8], labels[:1, :8], upstream[:1, :8])
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM := VmRSS
    rss_start = _status_kib("VmRSS")
    call(logits, labels, upstream)
    rss_peak = (_status_kib("VmHWM") - rss_start) * 1024
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call(logits, labels, upstream)
    alloc_peak = _alloc_peak_bytes(prof)
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        call(logits, labels, upstream)
        times.append(time.perf_counter() - start)
    return {
        "seconds": statistics.median(times),
        "alloc": alloc_peak,
        "rss": rss_peak,
        "logits": base.numel() * base.element_size(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bs", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--worker", choices=sorted(SIDES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.bs, args.seq, args.vocab, args.repeats, args.dtype)
    if args.worker:
        print(json.dumps(worker(args.worker, *shape)))
        return

    results = {}
    for side in SIDES:
        cmd = [sys.executable, __file__, "--worker", side]
        cmd += ["--bs", str(args.bs), "--seq", str(args.seq), "--vocab", str(args.vocab)]
        cmd += ["--repeats", str(args.repeats), "--dtype", args.dtype]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results[side] = json.loads(done.stdout.strip().splitlines()[-1])

    first = results["naive-logprobs"]
    bandwidth = memory_bandwidth(first["threads"])  # after the sides: it never shares the cores with one
    print(
        f"log-probs / entropy of ({args.bs}, {args.seq}, {args.vocab}) {args.dtype} logits "
        f"({first['logits'] / MIB:.0f} MiB), forward + backward; median of {args.repeats} calls "
        f"(python {sys.version.split()[0]}, torch {first['torch']}, {first['threads']} threads, "
        f"{os.cpu_count()} cpus)"
    )
    print("peak = additional memory of one call beyond the logits: alloc = torch CPU allocator")
    print("events (torch.profiler), rss = growth of peak RSS; ratios are chunked / naive.")
    print(
        f"GB/s = 3 x logits bytes (read twice, gradient written once) / median s; % bw of the "
        f"{bandwidth / GIGA:.1f} GB/s measured here (best of a sum and a copy over 512 MiB)."
    )
    header = (
        f"{'case':10} {'side':28} {'median s':>9} {'GB/s':>6} {'% bw':>5} {'alloc MiB':>10} {'rss MiB':>9} "
        f"{'x logits':>9} {'time':>6} {'alloc':>6} {'rss':>6}  target"
    )
    print(header)
    for side, (kind, label) in SIDES.items():
        result = results[side]
        naive = results["naive-logprobs" if kind == "log-probs" else "naive-entropy"]
        time_ratio = result["seconds"] / naive["seconds"]
        alloc_ratio, rss_ratio = result["alloc"] / naive["alloc"], result["rss"] / naive["rss"]
        note = ""
        if side.startswith("chunked"):
            time_ok = "met" if time_ratio <= TIME_TARGET else "MISSED"
            memory_ok = "met" if max(alloc_ratio, rss_ratio) <= MEMORY_TARGET else "MISSED"
            note = f"time <= {TIME_TARGET}x: {time_ok}; memory <= {MEMORY_TARGET:.0%}: {memory_ok}"
        moved = 3 * result["logits"] / result["seconds"]
        print(
            f"{kind:10} {label:28} {result['seconds']:9.3f} "
            f"{moved / GIGA:6.1f} {100 * moved / bandwidth:4.0f}% "
            f"{result['alloc'] / MIB:10.0f} "
            f"{result['rss'] / MIB:9.0f} {result['alloc'] / result['logits']:9.2f} "
            f"{time_ratio:6.2f} {alloc_ratio:6.2f} {rss_ratio:6.2f}  {note}"
        )


if __name__ == "__main__":
    main()
