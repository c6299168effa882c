"""Ulysses sequence parallelism: activation memory per rank and step time at SP = 1, 2, 4, in one run.

    python benchmarks/sequence_parallel.py [--tokens 8192] [--sizes 1,2,4] [--repeats 2]

One sequence of ``--tokens`` tokens (half prompt, half response) through a small Llama (hidden
256, 4 layers, 8 attention heads, 2 KV heads, FP32, built at run time) in the ``fsdp`` engine with
``actor.ulysses_sequence_parallel_size`` = each size, as that many gloo processes on this machine
(one data-parallel rank: every process holds a slice of the same sequence). One step is
``forward_backward`` of the clipped policy loss over that one row (packed, varlen sdpa).

Per rank: the bytes autograd saves for backward during the step (every tensor packed by
``torch.autograd.graph.saved_tensors_hooks``, counted once per storage: the activations, plus the
few weight views the matmuls keep) and the seconds per step (median of ``--repeats`` after one
warm-up), each as a ratio to SP=1. Rank 0's figures are printed; the ranks hold equal slices.

Target: activation memory per rank <= 0.6x at SP=2 and <= 0.35x at SP=4. The processes share this
machine's cores, so the time column shows the cost of the all-to-alls and of splitting the cores,
not a speed-up: that needs a device per rank. This is a measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

MIB = 2**20


def build_model(folder: str) -> str:
    from trellis.recipes.tiny import save_tiny_model

    return save_tiny_model(
        folder,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        head_dim=32,
        num_key_value_heads=2,
        max_position_embeddings=32768,
    )


def make_batch(tokens: int, vocab: int) -> Any:
    from trellis.data.protocol import DataProto

    gen = torch.Generator().manual_seed(0)
    response = tokens // 2
    ids = torch.randint(4, vocab, (1, tokens), generator=gen)
    mask = torch.ones_like(ids)
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": torch.arange(tokens)[None],
            "responses": ids[:, -response:],
            "response_mask": torch.ones(1, response),
            "old_log_probs": torch.full((1, response), -7.0),
            "advantages": torch.ones(1, response),
        }
    )


def loss_fn(outputs: dict, micro: Any, info: dict) -> Any:
    from trellis.registries import get_policy_loss_fn

    b = micro.batch
    vanilla = get_policy_loss_fn("vanilla")
    return vanilla(
        b["old_log_probs"], outputs["log_probs"], b["advantages"], b["response_mask"], "token-mean",
        global_batch_info=info,
    )  # fmt: skip


def rank_main(rank: int, size: int, port: int, path: str, tokens: int, repeats: int, out: Any) -> None:
    import torch.distributed as dist

    from trellis.config.schema import ActorConfig, ModelConfig, OptimConfig
    from trellis.engine.fsdp import FSDPEngine

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(minutes=20),
    )
    try:
        engine = FSDPEngine(
            ModelConfig(path=path, dtype="float32", use_remove_padding=True),
            ActorConfig(
                ppo_micro_batch_size_per_device=1,
                optim=OptimConfig(lr=1e-6),
                ulysses_sequence_parallel_size=size,
            ),
            role="actor",
            device="cpu",
        )
        batch = make_batch(tokens, engine.model.config.vocab_size)
        seen: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        times, saved = [], []
        for step in range(repeats + 1):
            seen.clear()
            engine.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                engine.forward_backward(batch, loss_fn)
            dist.barrier()
            if step:  # the first is a warm-up
                times.append(time.perf_counter() - start)
                saved.append(sum(seen.values()))
        if rank == 0:
            out.put({"size": size, "seconds": statistics.median(times), "saved_bytes": max(saved)})
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    path = build_model(tempfile.mkdtemp(prefix="sp-bench-"))
    sizes = [int(size) for size in args.sizes.split(",")]
    print(
        f"one {args.tokens}-token sequence, Llama hidden 256 x 4 layers, 8 heads / 2 KV heads, fp32; "
        f"{os.cpu_count()} cores shared by the ranks"
    )
    context = mp.get_context("spawn")
    rows = []
    for size in sizes:
        queue = context.SimpleQueue()
        mp.start_processes(
            rank_main,
            args=(size, free_port(), path, args.tokens, args.repeats, queue),
            nprocs=size,
            start_method="spawn",
        )
        rows.append(queue.get())
    base = rows[0]
    print(f"\n{'SP':>3}{'s/step':>10}{'x SP=1':>9}{'saved MiB/rank':>16}{'x SP=1':>9}")
    for row in rows:
        print(
            f"{row['size']:>3}{row['seconds']:>10.2f}{row['seconds'] / base['seconds']:>9.2f}"
            f"{row['saved_bytes'] / MIB:>16.1f}{row['saved_bytes'] / base['saved_bytes']:>9.3f}"
        )


if __name__ == "__main__":
    sys.exit(main())
