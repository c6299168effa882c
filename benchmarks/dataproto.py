"""DataProto operations next to the same operations on a bare TensorDict + numpy dict, in one run.

    python benchmarks/dataproto.py [--repeats N] [--rows R] [--width W]

Builds a batch of R rows (default 4096) with 10 tensor keys of shape (R, W) (int64 and
float32 alternately) and 5 non-tensor object columns (strings, dicts, ints, lists, mixed).
For each operation it prints the median wall time of the DataProto call and of the bare
version (TensorDict + numpy, written the fastest straightforward way), and their ratio.
The two sides are timed alternately, in the same process, with torch's default threads.
Target: no operation above 1.3x bare. This is a measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from tensordict import TensorDict

from trellis.data.protocol import DataProto

TARGET = 1.3
CHUNKS = 8
REPEAT_TIMES = 4
SAMPLE_SECONDS = 0.05  # calls shorter than this are timed in loops of about this total length
WARMUP_CALLS = 3  # the first calls fault in fresh memory pages: not what is measured


def build(rows: int, width: int, seed: int = 0) -> tuple[TensorDict, dict[str, np.ndarray]]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(10):
        if i % 2 == 0:
            tensors[f"tensor_{i}"] = torch.randint(0, 32000, (rows, width), generator=generator)
        else:
            tensors[f"tensor_{i}"] = torch.rand(rows, width, generator=generator)
    ids = range(rows)
    columns = {
        "uid": [f"uid-{i:06d}" for i in ids],
        "extra_info": [{"index": i, "split": "train", "tags": ["math", str(i % 7)]} for i in ids],
        "step": list(ids),
        "tools": [[f"tool-{i % 3}", i % 5] for i in ids],
        "mixed": [i if i % 2 else f"text-{i}" for i in ids],
    }
    non_tensors = {key: np.fromiter(values, dtype=object, count=rows) for key, values in columns.items()}
    return TensorDict(tensors, batch_size=[rows]), non_tensors


def per_call_seconds(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def compare(ours: Callable[[], object], bare: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds per call of each side.

    Both sides are warmed up alternately, then sampled alternately (the order flips every
    repeat) with the same number of calls per sample: one for slow calls, a loop of about
    SAMPLE_SECONDS for fast ones.
    """
    for _ in range(WARMUP_CALLS):
        ours()
        bare()
    once = min(per_call_seconds(ours, 1), per_call_seconds(bare, 1))
    loops = 1 if once >= SAMPLE_SECONDS else max(1, round(SAMPLE_SECONDS / max(once, 1e-7)))
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(repeats):
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            gc.collect()
            times[side].append(per_call_seconds((ours, bare)[side], loops))
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()

    td, nt = build(args.rows, args.width)
    data = DataProto(batch=td, non_tensor_batch=dict(nt), meta_info={"temperature": 1.0})
    rows = args.rows
    size = rows // CHUNKS
    tensor_keys = [f"tensor_{i}" for i in range(5)]
    column_keys = ["uid", "extra_info"]
    index = np.random.default_rng(0).permutation(rows)[: rows // 2]
    index_t = torch.from_numpy(index)
    mask = np.random.default_rng(1).random(rows) < 0.5
    mask_t = torch.from_numpy(mask)

    ours_chunks = data.chunk(CHUNKS)
    bare_chunks = td.chunk(CHUNKS)
    bare_column_chunks = [{k: v[i * size : (i + 1) * size] for k, v in nt.items()} for i in range(CHUNKS)]

    def bare_chunk():
        return td.chunk(CHUNKS), [
            {k: v[i * size : (i + 1) * size] for k, v in nt.items()} for i in range(CHUNKS)
        ]

    def bare_concat():
        return torch.cat(bare_chunks, dim=0), {
            k: np.concatenate([c[k] for c in bare_column_chunks]) for k in nt
        }

    def bare_repeat():
        return td.repeat_interleave(REPEAT_TIMES, dim=0), {
            k: np.repeat(v, REPEAT_TIMES, axis=0) for k, v in nt.items()
        }

    def bare_select():
        return td.select(*tensor_keys), {k: nt[k] for k in column_keys}

    def bare_index():
        return td[index_t], {k: v[index] for k, v in nt.items()}

    def bare_mask():
        return td[mask_t], {k: v[mask] for k, v in nt.items()}

    cases = [
        (f"chunk({CHUNKS})", lambda: data.chunk(CHUNKS), bare_chunk),
        (f"concat({CHUNKS} chunks)", lambda: DataProto.concat(ours_chunks), bare_concat),
        (
            f"repeat({REPEAT_TIMES}, interleave)",
            lambda: data.repeat(REPEAT_TIMES, interleave=True),
            bare_repeat,
        ),
        (
            "select(5 tensors, 2 columns)",
            lambda: data.select(batch_keys=tensor_keys, non_tensor_batch_keys=column_keys),
            bare_select,
        ),
        (f"index ({len(index)} random ints)", lambda: data[index], bare_index),
        (f"index (bool mask, {int(mask.sum())} rows)", lambda: data[mask], bare_mask),
    ]

    nbytes = sum(t.numel() * t.element_size() for t in td.values())
    print(
        f"DataProto vs bare TensorDict + numpy: {rows} rows, 10 tensors of ({rows}, {args.width}) "
        f"({nbytes / 2**20:.0f} MiB), 5 object columns; median of {args.repeats} "
        f"(python {sys.version.split()[0]}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} cpus)"
    )
    print(f"{'op':36} {'DataProto ms':>13} {'bare ms':>10} {'ratio':>7}  target")
    for label, ours, bare in cases:
        ours_s, bare_s = compare(ours, bare, args.repeats)
        ratio = ours_s / bare_s
        note = f"<= {TARGET}x: {'met' if ratio <= TARGET else 'MISSED'}"
        print(f"{label:36} {ours_s * 1e3:13.4f} {bare_s * 1e3:10.4f} {ratio:7.2f}  {note}")


if __name__ == "__main__":
    main()
