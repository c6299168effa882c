"""Seconds per GRPO step: Trellis vs TRL's ``GRPOTrainer``, same model, prompts, batch and optimizer.

    python benchmarks/grpo_vs_trl.py [--steps 8] [--smollm2-steps 2] [--warmup 1] [--rounds 1]
        [--threads 1] [--prompts 8] [--group 4] [--max-tokens 32] [--micro 16] [--no-smollm2]

Each side trains the same model for ``--warmup`` + ``--steps`` GRPO steps (``--smollm2-steps`` for
SmolLM2) in its own fresh Python process, started by this script one after the other so they
never share the cores, with ``torch.set_num_threads(--threads)`` in both (default 1: on shared
cores two threads made either side's step times vary several-fold). A step is one generation and
one optimizer update, the same on both sides:

- prompts: the same generated arithmetic questions (chat messages, "What is 23 + 58? ..."), in the
  same order (no shuffling on either side), ``--prompts`` per step, each sampled ``--group`` times
  (Trellis ``rollout.n`` = TRL ``num_generations``) at temperature 1.0, no top-k / top-p, at most
  ``--max-tokens`` new tokens (Trellis ``data.max_response_length`` = TRL ``max_completion_length``);
- reward: the same Python function, ``score`` (1.0 when the response's last number is the answer),
  wrapped in each framework's reward signature; prompt token ids are identical on both sides;
- update: one optimizer step per batch (Trellis ``ppo_mini_batch_size`` = prompts per step,
  ``ppo_epochs=1``; TRL ``num_iterations=1``, ``steps_per_generation`` = gradient accumulation
  steps), forward/backward in micro-batches of ``--micro`` responses (Trellis
  ``ppo_micro_batch_size_per_device``; TRL ``per_device_train_batch_size``, gradients accumulated
  over the rest), token-mean loss over the batch (Trellis ``token-mean``, TRL ``dapo``), clip ε
  0.2, advantages normalised by the group's std;
- optimizer: ``torch.optim.AdamW`` over all parameters, lr 1e-6, betas (0.9, 0.999), weight decay
  0.01, constant schedule, no warm-up, gradient norm clipped to 1.0 (TRL is handed that very
  optimizer and a constant ``LambdaLR``; Trellis builds the same itself);
- fp32 weights and compute, no gradient checkpointing (TRL's default is on), no KL and no reference
  model (TRL ``beta=0.0``), no vLLM, seed 1, logging / evaluation / checkpoints off.

Beyond that each framework runs as it is: Trellis' ``hf`` rollout replica (its own sampler and
continuous batching; on the CPU it generates with one intra-op thread for models under 10M
parameters), its entropy metric and ``trainer.flush_denormal`` (on by default); TRL's
``model.generate``. Neither computes the old log-probs in a forward pass of their own: with one
update per batch they equal the current ones (Trellis' ``old_log_prob`` stage is then 0).

Timing excludes model loading and start-up: Trellis' ``timing/step`` of each step (generation to
the end of the update), TRL's wall time from ``on_step_begin`` to ``on_step_end`` of a callback
(the same span). The first ``--warmup`` steps are dropped; figures are medians over the timed
steps (of all ``--rounds``; the sides alternate which goes first). Both sample, so responses end
at eos at different lengths: tokens/step is the mean number of generated tokens (eos included)
and the last column compares seconds per generated token. Below the table: the median seconds of
each Trellis stage and of TRL's ``model.generate``, and, as a cross-check of the span, the median
wall time from one step's end to the next (Trellis' ``trellis_step_end`` hook, TRL's
``on_step_end``), which also counts data loading and the rest of each loop.

Against the machine's limit (``benchmarks/_roofline.py``; the peak and the bandwidth are measured
by this script's own process before the sides run, at ``--threads``, so never while a side
runs): model FLOP/s of Trellis' ``update_actor`` (forward + backward + optimizer step) and of
TRL's step less its ``model.generate`` (its update, plus scoring) as a fraction of the fp32
``torch.mm`` peak, counting ``(6N + 12 L d T)`` FLOPs for each prompt and response token
trained (``N`` the matmul parameters, ``T`` the mean prompt + response length); Trellis'
``old_log_prob`` the same with the forward's ``2N + 4 L d T``; and each side's generation as
generated tokens / generation seconds (prefill and sampling included) against the decode
roofline at batch ``--prompts`` x ``--group``, ``min(batch * bandwidth / weight bytes, peak / 2N)``.
Trellis' ``hf`` replica generates the tiny model with one thread whatever ``--threads`` says.

Models: the tiny test model (built into a temporary folder) and SmolLM2-135M-Instruct when
``trellis.utils.demo_model.smollm2_path()`` can provide it (skipped with a note otherwise).
Needs ``trl`` (with its ``accelerate`` and ``datasets``) for the TRL side; without it the Trellis side
runs alone, with a note, and its columns are printed with the TRL ones left blank.
Targets (issue 22): Trellis <= 0.75x TRL seconds per step on the tiny model and <= 0.6x on SmolLM2,
the update at >= 60% of the fp32 peak, generation at >= 50% of its roofline. A measurement, never a
pass/fail test.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from _common import smollm2_or_note  # benchmarks/_common.py: the script's own folder
from _roofline import (
    GIGA,
    Limits,
    ModelShape,
    decode_roofline,
    folder_shape,
    forward_flops,
    machine_limits,
    training_flops,
    utilisation_line,
)

RESULT_TAG = "GRPO_VS_TRL_RESULT "
LR, WEIGHT_DECAY, BETAS, GRAD_CLIP, SEED = 1e-6, 0.01, (0.9, 0.999), 1.0, 1
TRELLIS_STAGES = ("generate", "score", "old_log_prob", "advantage", "update_actor", "weight_sync")


def questions(n: int, seed: int = 0) -> list[tuple[list[dict[str, str]], str]]:
    """``n`` arithmetic questions as (chat messages, answer)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        text = f"What is {a} + {b}? Answer with the number."
        rows.append(([{"role": "user", "content": text}], str(a + b)))
    return rows


def score(response: str, answer: str) -> float:
    """1.0 when the last number in ``response`` is ``answer``, else 0.0."""
    numbers = re.findall(r"-?\d+", response)
    return 1.0 if numbers and numbers[-1] == answer else 0.0


# ---------------------------------------------------------------------- the two sides (child processes)


def run_trellis(args: argparse.Namespace, model: str, tmp: str) -> dict:
    import trellis
    from trellis.hooks import get_plugin_manager, hookimpl

    class StepEnds:  # wall clock at each step's end: the whole loop, data and hooks included
        def __init__(self) -> None:
            self.times: list[float] = []

        @hookimpl
        def trellis_step_end(self, step: int) -> None:
            self.times.append(time.perf_counter())

    ends = StepEnds()
    get_plugin_manager().register(ends)
    rows = questions(args.prompts * (args.warmup + args.steps + 1))
    train = os.path.join(tmp, "train.jsonl")
    with open(train, "w", encoding="utf-8") as f:
        for messages, answer in rows:
            row = {"prompt": messages, "data_source": "arithmetic", "reward_model": {"ground_truth": answer}}
            f.write(json.dumps(row) + "\n")

    def reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
        return score(solution_str, ground_truth)

    result = trellis.train(
        overrides=[
            f"model.path={model}",
            "model.dtype=float32",
            "model.gradient_checkpointing=false",
            f"data.train_files=[{train}]",
            f"data.train_batch_size={args.prompts}",
            "data.max_prompt_length=256",
            f"data.max_response_length={args.max_tokens}",
            "data.shuffle=false",
            f"rollout.n={args.group}",
            "rollout.temperature=1.0",
            "rollout.top_p=1.0",
            "rollout.top_k=-1",
            f"actor.ppo_mini_batch_size={args.prompts}",
            f"actor.ppo_micro_batch_size_per_device={args.micro}",
            "actor.ppo_epochs=1",
            "actor.clip_ratio=0.2",
            "actor.loss_agg_mode=token-mean",
            "actor.use_kl_loss=false",
            "actor.entropy_coeff=0.0",
            f"actor.grad_clip={GRAD_CLIP}",
            f"actor.optim.lr={LR}",
            f"actor.optim.weight_decay={WEIGHT_DECAY}",
            f"actor.optim.betas=[{BETAS[0]},{BETAS[1]}]",
            "actor.optim.lr_warmup_steps=0",
            "actor.optim.lr_scheduler=constant",
            "ref.enable=false",
            "algorithm.adv_estimator=grpo",
            "algorithm.norm_adv_by_std_in_grpo=true",
            "algorithm.use_kl_in_reward=false",
            f"trainer.total_training_steps={args.warmup + args.steps}",
            f"trainer.seed={SEED}",
            "trainer.device=cpu",
            "trainer.trackers=[]",
            f"trainer.run_dir={os.path.join(tmp, 'run')}",
            "trainer.resume_mode=disable",
            "trainer.save_freq=-1",
            "trainer.test_freq=-1",
        ],
        reward_fn=reward,
    )
    responses = args.prompts * args.group
    return {
        "seconds": [m["timing/step"] for m in result.history],
        "intervals": [b - a for a, b in itertools.pairwise(ends.times)],
        "tokens": [m["response_length/mean"] * responses for m in result.history],
        "update_tokens": [m["perf/total_tokens"] for m in result.history],  # prompt + response, unpadded
        "stages": {s: [m.get(f"timing/{s}", 0.0) for m in result.history] for s in TRELLIS_STAGES},
    }


def run_trl(args: argparse.Namespace, model_path: str, tmp: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = questions(args.prompts * (args.warmup + args.steps + 1))
    dataset = Dataset.from_list([{"prompt": messages, "answer": answer} for messages, answer in rows])
    tokens: list[int] = []
    update_tokens: list[int] = []  # prompt + completion tokens of each generation batch
    prompt_lengths: dict[str, int] = {}

    def prompt_length(messages: list[dict[str, str]]) -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if text not in prompt_lengths:
            prompt_lengths[text] = len(tokenizer(text, add_special_tokens=False).input_ids)
        return prompt_lengths[text]

    def reward(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
        tokens.append(sum(len(ids) for ids in completion_ids))
        update_tokens.append(tokens[-1] + sum(prompt_length(p) for p in prompts))
        return [score(c[-1]["content"], a) for c, a in zip(completions, answer, strict=True)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.ends: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            self.seconds.append(self.ends[-1] - self.start)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    generate_seconds: list[float] = []
    generate = model.generate

    def timed_generate(*a, **kw):  # TRL's only generation call on this path
        start = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            generate_seconds.append(time.perf_counter() - start)

    model.generate = timed_generate
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    responses = args.prompts * args.group
    config = GRPOConfig(
        output_dir=os.path.join(tmp, "out"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=responses // args.micro,
        steps_per_generation=responses // args.micro,
        num_iterations=1,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=GRAD_CLIP,
        max_steps=args.warmup + args.steps,
        shuffle_dataset=False,
        seed=SEED,
        use_vllm=False,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        optimizers=(optimizer, schedule),
        callbacks=[timer],
    )
    trainer.train()
    return {
        "seconds": timer.seconds,
        "intervals": [b - a for a, b in itertools.pairwise(timer.ends)],
        "tokens": tokens,
        "update_tokens": update_tokens,
        "stages": {"generate": generate_seconds},
    }


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run = run_trellis if args.side == "trellis" else run_trl
        out = run(args, args.model, tmp)
    out["threads"] = torch.get_num_threads()
    print(RESULT_TAG + json.dumps(out), flush=True)


# ---------------------------------------------------------------------- the driver


def side(args: argparse.Namespace, name: str, model: str, steps: int) -> dict:
    """Run one side in a fresh process; its parsed result, warm-up steps dropped."""
    cmd = [sys.executable, os.path.abspath(__file__), "--side", name, "--model", model, "--steps", str(steps)]
    for flag in ("warmup", "threads", "prompts", "group", "max_tokens", "micro"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"the {name} side failed (exit code {proc.returncode}); its output is above.")
    out = json.loads(lines[-1][len(RESULT_TAG) :])
    w = args.warmup
    out["intervals"] = out["intervals"][max(w - 1, 0) :]  # intervals[i] ends at step i + 2
    for key in ("seconds", "tokens", "update_tokens"):
        out[key] = out[key][w:]
    out["stages"] = {stage: values[w:] for stage, values in out["stages"].items()}
    return out


def bench(
    label: str, model: str, args: argparse.Namespace, steps: int, sides: tuple[str, ...]
) -> dict[str, dict]:
    """``sides`` on ``model``, ``args.rounds`` times in alternating order; per-step lists merged."""
    runs: dict[str, dict] = {name: {"stages": {}} for name in sides}
    for r in range(args.rounds):
        for name in sides if r % 2 == 0 else sides[::-1]:
            out, merged = side(args, name, model, steps), runs[name]
            for key in ("seconds", "intervals", "tokens", "update_tokens"):
                merged.setdefault(key, []).extend(out[key])
            for stage, values in out["stages"].items():
                merged["stages"].setdefault(stage, []).extend(values)
            merged["threads"] = out["threads"]
            secs = ", ".join(f"{s:.2f}" for s in out["seconds"])
            print(f"  {label} {name} (round {r + 1}): s/step {secs}", file=sys.stderr, flush=True)
    return runs


Result = tuple[str, int, dict[str, dict], ModelShape]  # (label, timed steps, per-side runs, model shape)


def report(results: list[Result], args: argparse.Namespace, limits: Limits) -> None:
    med = statistics.median
    threads = sorted({runs[name]["threads"] for _, _, runs, _ in results for name in runs})
    print(
        f"\nGRPO, {args.prompts} prompts x {args.group} responses per step, <= {args.max_tokens} new tokens, "
        f"micro-batch {args.micro}, fp32, {'/'.join(map(str, threads))} torch thread(s); medians over the "
        f"timed steps ({args.warmup} warm-up step(s) dropped, {args.rounds} round(s))"
    )
    print(
        f"{'model':<14} {'steps':>5} {'Trellis s/step':>14} {'TRL s/step':>11} {'ratio':>7} "
        f"{'Trellis tok/step':>16} {'TRL tok/step':>12} {'ratio s/token':>13}"
    )
    for label, steps, runs, _ in results:
        ours = runs["trellis"]
        s_ours, t_ours = med(ours["seconds"]), statistics.mean(ours["tokens"])
        if "trl" in runs:
            theirs = runs["trl"]
            s_theirs, t_theirs = med(theirs["seconds"]), statistics.mean(theirs["tokens"])
            per_token = (s_ours / t_ours) / (s_theirs / t_theirs)
            cells = (
                f"{s_theirs:>11.3f} {s_ours / s_theirs:>6.2f}x {t_ours:>16.0f} {t_theirs:>12.0f} "
                f"{per_token:>12.2f}x"
            )
        else:
            cells = f"{'-':>11} {'-':>7} {t_ours:>16.0f} {'-':>12} {'-':>13}"
        print(f"{label:<14} {steps * args.rounds:>5} {s_ours:>14.3f} {cells}")
    print("\nWhere the time goes (median seconds per step):")
    for label, _, runs, _ in results:
        ours = runs["trellis"]
        parts = "  ".join(f"{stage} {med(values):.3f}" for stage, values in ours["stages"].items())
        print(f"  {label:<14} Trellis: {parts}")
        if "trl" not in runs:
            continue
        theirs = runs["trl"]
        generate = med(theirs["stages"]["generate"])
        print(
            f"  {label:<14} TRL:     model.generate {generate:.3f}  "
            f"everything else {med(theirs['seconds']) - generate:.3f}"
        )
        if ours["intervals"] and theirs["intervals"]:
            a, b = med(ours["intervals"]), med(theirs["intervals"])
            print(f"  {label:<14} step end to step end: Trellis {a:.3f}  TRL {b:.3f}  ratio {a / b:.2f}x")
    batch = args.prompts * args.group
    print(
        f"\nAgainst the machine's limit at {limits.threads} thread(s), measured in this run: fp32 matmul "
        f"peak {limits.fp32_flops / GIGA:.1f} GFLOP/s, bandwidth {limits.bandwidth / GIGA:.1f} GB/s. Update: "
        f"(prompt + response tokens) x (6N + 12 L d T) FLOPs; forward: 2N + 4 L d T; generate: "
        f"generated tokens/s against min(batch x bandwidth / weight bytes, peak / 2N) at batch {batch} "
        f"(medians over the timed steps)"
    )
    for label, _, runs, shape in results:
        bound, kind = decode_roofline(shape, batch, limits)
        peak = limits.peak(shape.dtype)
        for name, run in runs.items():
            update_seconds = (
                run["stages"]["update_actor"]
                if name == "trellis"
                else [s - g for s, g in zip(run["seconds"], run["stages"]["generate"], strict=False)]
            )
            lines = [
                utilisation_line(
                    "update_actor" if name == "trellis" else "step less model.generate (update, scoring)",
                    med(flop_rates(shape, run["update_tokens"], update_seconds, batch, training_flops)),
                    peak,
                    "GFLOP/s",
                )
            ]
            if name == "trellis":
                rates = flop_rates(
                    shape, run["update_tokens"], run["stages"]["old_log_prob"], batch, forward_flops
                )
                if rates:  # none when Trellis skips the stage (one update per batch: current log-probs)
                    lines.append(utilisation_line("old_log_prob", med(rates), peak, "GFLOP/s"))
            decode = [t / g for t, g in zip(run["tokens"], run["stages"]["generate"], strict=False) if g > 0]
            generate = "generate" if name == "trellis" else "model.generate"
            lines.append(utilisation_line(f"{generate} ({kind}-bound)", med(decode), bound, "tok/s"))
            side_name = "Trellis:" if name == "trellis" else "TRL:"
            for line in lines:
                print(f"  {label:<14} {side_name:<8} {line}")


def flop_rates(
    shape: ModelShape,
    tokens: list[float],
    seconds: list[float],
    batch: int,
    count: Callable[[ModelShape, float, float], float],
) -> list[float]:
    """Per step, ``count(shape, tokens, T) / seconds`` FLOP/s, with ``T = tokens / batch`` the mean length."""
    return [count(shape, t, t / batch) / s for t, s in zip(tokens, seconds, strict=False) if s > 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side, tiny model")
    parser.add_argument("--smollm2-steps", type=int, default=2, help="timed steps per side, SmolLM2")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps per side")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side, alternating order")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads, both sides; 1 is steadiest on shared cores",
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="responses per prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="most new tokens per response")
    parser.add_argument("--micro", type=int, default=16, help="responses per forward/backward pass")
    parser.add_argument("--no-smollm2", action="store_true", help="benchmark the tiny model only")
    parser.add_argument("--side", choices=("trellis", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        child(args)
        return
    if (args.prompts * args.group) % args.micro:
        parser.error(f"--micro {args.micro} must divide --prompts x --group = {args.prompts * args.group}.")
    sides: tuple[str, ...] = ("trellis", "trl")
    missing = [name for name in ("trl", "accelerate", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"TRL side skipped: {', '.join(missing)} not installed (pip install trl); Trellis runs alone.")
        sides = ("trellis",)

    from trellis.recipes.tiny import save_tiny_model

    # Measured here, before the sides run one after the other, so it never shares the cores with one.
    print(f"  measuring the machine's limit at {args.threads} thread(s) ...", file=sys.stderr, flush=True)
    limits = machine_limits(args.threads)
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = save_tiny_model(os.path.join(tmp, "tiny"))
        results.append(("tiny", args.steps, bench("tiny", tiny, args, args.steps, sides), folder_shape(tiny)))
    path, note = smollm2_or_note(args.no_smollm2)
    if path is not None:
        runs = bench("SmolLM2-135M", path, args, args.smollm2_steps, sides)
        results.append(("SmolLM2-135M", args.smollm2_steps, runs, folder_shape(path)))
    report(results, args, limits)
    if note:
        print(note)


if __name__ == "__main__":
    main()
