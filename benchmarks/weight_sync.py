"""Weight sync of a SmolLM2-135M-sized state dict: each checkpoint engine next to torch.save/torch.load.

    python benchmarks/weight_sync.py [--repeats N] [--bucket-mb 64,512] [--engines naive,shm,gloo]

Builds random tensors with SmolLM2-135M's shapes (30 layers, hidden 576, intermediate 1536,
9 heads / 3 kv heads of dim 64, vocab 49152, tied embeddings: 272 tensors, 134.5 M parameters)
in float32 and in bfloat16. A sender process holds the state dict; a receiver process gets it
through each engine, N times after one warm-up step, and drops each tensor once it has it. The
baseline, in the same two processes: the sender writes the state dict to ``/dev/shm`` with
``torch.save``, then the receiver reads it with ``torch.load``. A sync's time runs from the
sender's start to the receiver holding the last tensor. ``naive`` hands tensors over inside one process (no
copy at all), so it has no second process. Each engine runs with each bucket size (512 MiB is
the config default; smaller buckets pipeline more). Every process uses one torch thread.

Prints the median seconds per sync, MB/s (10**6 bytes of the state dict per second) and the
speed-up over the baseline (x > 1: faster). Target: ``shm`` beats the baseline. This is a
measurement, never a pass/fail test.

**End to end** (``--end-to-end``, on by default; needs Ray and the cached SmolLM2-135M-Instruct):
the real pieces of ``rollout.mode=standalone``. A trainer rank (``ActorRolloutRefWorker`` with the
``single`` engine, in this process) sends its weights, cast to ``model.dtype``, to a standalone
``hf`` replica in a Ray actor of its own through each cross-process engine, and the replica loads
them into the model it serves (``ReplicaManager.update_weights``). The baseline, in the same run:
the trainer rank ``torch.save``-s the same weights to ``/dev/shm``, the replica ``torch.load``-s the
file and loads it the same way. Times run from the trainer's first byte to the replica's model
holding the last tensor.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

TARGET_ENGINE = "shm"  # the engine that must beat the baseline


def smollm2_135m_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of SmolLM2-135M (tied embeddings: no ``lm_head.weight``)."""
    hidden, intermediate, layers, heads, kv_heads, head_dim, vocab = 576, 1536, 30, 9, 3, 64, 49152
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        layer = f"model.layers.{i}."
        shapes[layer + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[layer + "self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[layer + "self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[layer + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        shapes[layer + "mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[layer + "mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[layer + "mlp.down_proj.weight"] = (hidden, intermediate)
        shapes[layer + "input_layernorm.weight"] = (hidden,)
        shapes[layer + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def build_state(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=generator) * 0.02).to(dtype)
        for name, shape in smollm2_135m_shapes().items()
    }


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ---------------------------------------------------------------- the two processes


async def _drain(engine: Any) -> tuple[int, int]:
    count = total = 0
    async for _, tensor in engine.receive_weights():
        count += 1
        total += tensor.numel() * tensor.element_size()
    return count, total


def worker(conn: Any) -> None:
    """A sender or receiver process, driven by commands from the main process."""
    torch.set_num_threads(1)
    from trellis.registries import checkpoint_engines

    state: dict[str, torch.Tensor] = {}
    engine: Any = None
    while True:
        command, *args = conn.recv()
        if command == "state":
            state = build_state(getattr(torch, args[0]))
            conn.send(nbytes(state))
        elif command == "engine":
            name, kwargs, prepare = args
            engine = checkpoint_engines.get(name)(**kwargs)
            conn.send(engine.prepare() if prepare else None)
        elif command == "init":
            engine.init_process_group(**args[0])
            conn.send("ready")
        elif command == "send":
            start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
            asyncio.run(engine.send_weights(iter(state.items())))
            conn.send(start)
        elif command == "receive":
            count, total = asyncio.run(_drain(engine))
            conn.send((time.monotonic(), count, total))
        elif command == "save":
            start = time.monotonic()
            torch.save(state, args[0])
            conn.send(start)
        elif command == "load":
            loaded = torch.load(args[0])
            done = time.monotonic()
            conn.send((done, len(loaded), nbytes(loaded)))
            del loaded
        elif command == "finalize":
            engine.finalize()
            engine = None
            conn.send("finalized")
        elif command == "exit":
            return


class Peer:
    """One spawned worker and its pipe."""

    def __init__(self, context: Any) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=worker, args=(child,), daemon=True)
        self.process.start()

    def ask(self, *command: Any) -> Any:
        self.conn.send(command)
        return self.conn.recv()

    def tell(self, *command: Any) -> None:
        self.conn.send(command)

    def answer(self) -> Any:
        return self.conn.recv()

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(("exit",))
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def time_engine(
    name: str, sender: Peer, receiver: Peer, kwargs: dict[str, Any], repeats: int, size: int
) -> list[float]:
    from trellis.registries import checkpoint_engines

    metadata = sender.ask("engine", name, kwargs, True)
    receiver.ask("engine", name, kwargs, False)
    trainer, rollout = checkpoint_engines.get(name).build_topology(1, 1, metadata)
    sender.tell("init", trainer[0])
    receiver.tell("init", rollout[0])
    assert sender.answer() == receiver.answer() == "ready"
    times = []
    try:
        for _ in range(repeats + 1):  # the first step faults the buffers in: not what is measured
            receiver.tell("receive")
            sender.tell("send")
            start = sender.answer()
            done, _, total = receiver.answer()
            assert total == size, (name, total, size)
            times.append(done - start)
    finally:
        sender.ask("finalize")
        receiver.ask("finalize")
    return times[1:]


def time_baseline(sender: Peer, receiver: Peer, repeats: int, size: int) -> list[float]:
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(directory, f"trellis-bench-{os.getpid()}.pt")
    times = []
    try:
        for _ in range(repeats + 1):
            start = sender.ask("save", path)
            done, _, total = receiver.ask("load", path)
            assert total == size, (total, size)
            times.append(done - start)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return times[1:]


def time_naive(dtype: str, kwargs: dict[str, Any], repeats: int, size: int) -> list[float]:
    """naive in this process: a sender and a receiver engine sharing one event loop."""
    from trellis.checkpoint.naive import NaiveCheckpointEngine

    state = build_state(getattr(torch, dtype))
    sender, receiver = NaiveCheckpointEngine(**kwargs), NaiveCheckpointEngine(**kwargs)
    trainer, rollout = NaiveCheckpointEngine.build_topology(1, 1, sender.prepare())
    sender.init_process_group(**trainer[0])
    receiver.init_process_group(**rollout[0])

    async def step() -> float:
        start = time.monotonic()
        (_, (_, total)) = await asyncio.gather(sender.send_weights(iter(state.items())), _drain(receiver))
        assert total == size
        return time.monotonic() - start

    times = [asyncio.run(step()) for _ in range(repeats + 1)]
    sender.finalize()
    receiver.finalize()
    return times[1:]


# ---------------------------------------------------------------- end to end: trainer -> standalone replica


def _baseline_actor() -> type:
    """A replica process that can also load weights from a ``torch.save`` file (the baseline)."""
    from trellis.rollout.remote import ReplicaActor

    class FileLoadingReplicaActor(ReplicaActor):
        async def load_file(self, path: str) -> tuple[float, int]:
            state = await asyncio.to_thread(torch.load, path, map_location="cpu", weights_only=True)
            await self.replica.update_weights(state.items())
            return time.perf_counter(), sum(t.numel() * t.element_size() for t in state.values())

    return FileLoadingReplicaActor


def _time_transport(model_path: str, dtype: str, name: str, repeats: int) -> tuple[list[float], int]:
    """Seconds per sync (warm-up dropped) and bytes per sync of one transport (``baseline`` or an engine)."""
    import ray

    from trellis.config import load_config
    from trellis.distributed import ClassWithInitArgs, LocalWorkerGroup
    from trellis.rollout.manager import ReplicaManager
    from trellis.trainer.workers import ActorRolloutRefWorker

    engine = "shm" if name == "baseline" else name
    config = load_config(
        overrides=[
            f"model.path={model_path}",
            f"model.dtype={dtype}",
            "rollout.mode=standalone",
            f"rollout.checkpoint_engine.name={engine}",
            "trainer.run_dir=/tmp/trellis-bench-weight-sync",
        ]
    )
    group = LocalWorkerGroup(ClassWithInitArgs(ActorRolloutRefWorker, config))
    group.init_model(1)
    manager = ReplicaManager.start_standalone(config, actor_cls=_baseline_actor())
    actor = group.workers[0].actor
    times, size = [], 0
    try:
        if name == "baseline":
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path = os.path.join(folder, f"trellis-bench-{os.getpid()}.pt")
            replica = manager.replicas[0].actor
            for _ in range(repeats + 1):
                start = time.perf_counter()
                torch.save({n: t.to(actor.dtype) for n, t in actor.iter_full_params()}, path)
                done, size = ray.get(replica.load_file.remote(path))
                times.append(done - start)  # one host: perf_counter is the same clock in both
            os.unlink(path)
        else:
            trainer_kwargs, rollout_kwargs = group.plan_rollout_sync(manager.world_size)[0]
            manager.connect_weight_sync(rollout_kwargs, lambda: group.connect_rollout_sync(trainer_kwargs))
            for _ in range(repeats + 1):
                stats = manager.update_weights(group.send_rollout_weights)
                times.append(stats.seconds)
                size = stats.bytes
    finally:
        manager.shutdown()
        group.release_rollout()
    return times[1:], size


def end_to_end(model_path: str, dtype: str, engines: list[str], repeats: int) -> None:
    """One table block: the file baseline and each engine, trainer rank -> standalone replica."""
    rows = [(name, *_time_transport(model_path, dtype, name, repeats)) for name in ["baseline", *engines]]
    baseline = statistics.median(rows[0][1])
    for name, times, size in rows:
        seconds = statistics.median(times)
        label = "torch.save + torch.load (/dev/shm)" if name == "baseline" else name
        note = "baseline" if name == "baseline" else ""
        print(
            f"{dtype:9} {label:35} {size / 1e6:7.1f} {seconds:9.3f} {size / 1e6 / seconds:8.0f} "
            f"{baseline / seconds:10.2f}x  {note}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", default="64,512", help="update_weights_bucket_megabytes values")
    parser.add_argument("--engines", default="naive,shm,gloo")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--end-to-end", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--only-end-to-end", action="store_true", help="skip the two-process table")
    args = parser.parse_args()
    if not args.only_end_to_end:
        two_processes(args)
    if args.end_to_end:
        _end_to_end_tables(args)


def _end_to_end_tables(args: Any) -> None:
    from _common import smollm2_or_note

    path, note = smollm2_or_note(False)
    if path is None:
        print(f"\nEnd to end: {note}")
        return
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        print(
            f"\nEnd to end, SmolLM2-135M-Instruct: trainer rank (single engine, this process) -> standalone "
            f"hf replica (Ray actor), into the served model; median of {args.repeats} after 1 warm-up; "
            "default bucket (rollout.checkpoint_engine.update_weights_bucket_megabytes)"
        )
        print(f"{'dtype':9} {'transport':35} {'MB':>7} {'median s':>9} {'MB/s':>8} {'x baseline':>11}  note")
        engines = [e for e in args.engines.split(",") if e and e != "naive"]  # naive: same process only
        for dtype in [d for d in args.dtypes.split(",") if d]:
            end_to_end(path, dtype, engines, args.repeats)
    finally:
        ray.shutdown()


def two_processes(args: Any) -> None:
    torch.set_num_threads(1)
    engines = [e for e in args.engines.split(",") if e]
    buckets = [float(b) for b in args.bucket_mb.split(",") if b]
    shapes = smollm2_135m_shapes()
    params = sum(torch.Size(s).numel() for s in shapes.values())

    print(
        f"Weight sync, SmolLM2-135M shapes ({len(shapes)} tensors, {params / 1e6:.1f} M params), sender -> "
        f"receiver process; median of {args.repeats} after 1 warm-up; 1 torch thread per process "
        f"(python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} cpus)"
    )
    print(
        f"{'dtype':9} {'transport':35} {'bucket MiB':>10} {'MB':>7} {'median s':>9} {'MB/s':>8} "
        f"{'x baseline':>11}  note"
    )
    context = multiprocessing.get_context("spawn")
    for dtype in [d for d in args.dtypes.split(",") if d]:
        sender, receiver = Peer(context), Peer(context)
        try:
            size = sender.ask("state", dtype)
            baseline_times = time_baseline(sender, receiver, args.repeats, size)
            rows = [("torch.save + torch.load (/dev/shm)", "-", baseline_times, "baseline")]
            for name in engines:
                if name == "naive":  # no buckets: one row
                    times = time_naive(dtype, {"timeout_s": 600.0}, args.repeats, size)
                    rows.append(("naive", "-", times, "same process: hands tensors over, no copy"))
                    continue
                for bucket in buckets:
                    kwargs = {"bucket_megabytes": bucket, "timeout_s": 600.0}
                    times = time_engine(name, sender, receiver, kwargs, args.repeats, size)
                    rows.append((name, f"{bucket:g}", times, ""))
        finally:
            sender.close()
            receiver.close()
        baseline = statistics.median(baseline_times)
        for label, bucket_mb, times, note in rows:
            seconds = statistics.median(times)
            speedup = baseline / seconds
            if label == TARGET_ENGINE:
                note = f"> 1x baseline: {'met' if speedup > 1 else 'MISSED'}"
            print(
                f"{dtype:9} {label:35} {bucket_mb:>10} {size / 1e6:7.1f} {seconds:9.3f} "
                f"{size / 1e6 / seconds:8.0f} {speedup:10.2f}x  {note}"
            )


if __name__ == "__main__":
    main()
