"""A small training run that checkpoints every step and resumes wherever it was killed.

Used by ``tests/test_checkpoint_kill.py``; run from the repository root:

    python tests/checkpoint_run.py run --model TINY_MODEL --root CKPT_ROOT --out FINAL.safetensors
    python tests/checkpoint_run.py serve      # a fork server: one run per JSON line on stdin

The loop is a realistic one: the tiny model in the ``single`` engine (AdamW, cosine schedule
with warm-up, attention dropout in training mode), prompts drawn by a shuffling
:class:`~trellis.data.dataset.ResumableSampler`, and every step draws from every global
generator: Python's ``random`` subsamples the rows, numpy draws the advantages, torch draws
the old log-prob noise, a response-mask dropout and the attention dropout. A state not saved
or not restored therefore changes the final weights. Each step ends with a checkpoint
(``max_to_keep=2``, so older ones are pruned); a restarted run resumes from the latest
(``resume_mode=auto``). At the end the weights, the tracker run id and one more draw of each
generator are written to ``--out`` (a safetensors file, written to a temporary name and renamed).

Markers, one line each on stdout (written with one ``write`` call, so a kill never tears one):
``START <resumed step or 0> <run id>``, ``SAVE_BEGIN <step>``, ``SAVE_END <step>``, ``DONE``.

``serve`` imports everything once, prints ``READY``, then for every JSON object on stdin (the
keyword arguments of :func:`run`) forks a child that does the run, prints ``PID <pid>``
and, when the child ends, ``EXIT <pid> <exit code>`` (``-9`` when SIGKILLed); the child is
reaped when the next request comes, so its pid is never reused while the caller may still
signal it. Forking skips the 3-5 s interpreter start-up per run; each child is still a
separate process, killed for real.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import traceback
import uuid

PROMPT, RESPONSE = 6, 5
DATA_ROWS = 20
ROWS_DRAWN, ROWS_USED = 6, 4


def emit(line: str) -> None:
    os.write(1, (line + "\n").encode())


def make_data(vocab: int) -> dict:
    """The dataset: ``DATA_ROWS`` rows of left-padded prompt + right-padded response token ids."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    length = PROMPT + RESPONSE
    prompt_lens = torch.randint(1, PROMPT + 1, (DATA_ROWS,), generator=gen)
    response_lens = torch.randint(1, RESPONSE + 1, (DATA_ROWS,), generator=gen)
    cols = torch.arange(length)
    mask = ((cols >= PROMPT - prompt_lens[:, None]) & (cols < PROMPT + response_lens[:, None])).long()
    ids = torch.where(mask.bool(), torch.randint(4, vocab, (DATA_ROWS, length), generator=gen), 3)
    return {"input_ids": ids, "attention_mask": mask}


def next_indices(sampler, iterator, count: int):
    """``count`` indices from the sampler, across epochs; returns (indices, iterator)."""
    indices = []
    while len(indices) < count:
        try:
            indices.append(next(iterator))
        except StopIteration:
            iterator = iter(sampler)
    return indices, iterator


def run(
    model: str,
    root: str,
    out: str,
    steps: int = 10,
    seed: int = 7,
    gate: str | None = None,
    gate_step: int = 0,
) -> None:
    """Train ``steps`` steps from the latest checkpoint under ``root`` (if any); weights to ``out``.

    ``gate``: a named pipe; before saving step ``gate_step`` the run reads one byte from it, so a
    test can start a kill's delay at the very start of that save.
    """
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from trellis.checkpoint.rng import capture_rng_state, restore_rng_state
    from trellis.checkpoint.training import CheckpointManager
    from trellis.config.schema import ActorConfig, ModelConfig, OptimConfig
    from trellis.data.dataset import ResumableSampler
    from trellis.data.protocol import DataProto
    from trellis.engine.single import SingleEngine
    from trellis.registries import get_policy_loss_fn

    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    engine = SingleEngine(
        ModelConfig(path=model, dtype="float32", override_config={"attention_dropout": 0.2}),
        ActorConfig(
            ppo_micro_batch_size_per_device=2,
            optim=OptimConfig(lr=2e-2, lr_scheduler="cosine", lr_warmup_steps=2, min_lr_ratio=0.1),
        ),
        role="actor",
        total_steps=steps,
        device="cpu",
    )
    data = make_data(engine.model.config.vocab_size)
    sampler = ResumableSampler(DATA_ROWS, shuffle=True, seed=seed)
    manager = CheckpointManager(root, max_to_keep=2)
    vanilla = get_policy_loss_fn("vanilla")

    def loss_fn(outputs, micro, info):
        b = micro.batch
        return vanilla(
            b["old_log_probs"],
            outputs["log_probs"],
            b["advantages"],
            b["response_mask"],
            "token-mean",
            global_batch_info=info,
        )

    step, run_id = 0, uuid.uuid4().hex  # uuid4 reads os.urandom: no global generator is touched
    path = manager.resolve_resume("auto")
    if path is not None:
        states = manager.load(path)
        engine.load_state_dict(states["actor"])
        trainer = states["trainer"]
        step, run_id = trainer["step"], trainer["tracker_run_id"]
        sampler.load_state_dict(trainer["sampler"])
        restore_rng_state(trainer["rng"])
    emit(f"START {step} {run_id}")

    iterator = iter(sampler)
    while step < steps:
        drawn, iterator = next_indices(sampler, iterator, ROWS_DRAWN)
        rows = sorted(random.sample(drawn, ROWS_USED))  # python random
        ids, mask = data["input_ids"][rows], data["attention_mask"][rows]
        batch = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, PROMPT:]})
        old = engine.forward(batch)["log_probs"]
        response_mask = mask[:, PROMPT:].float()
        response_mask = response_mask * torch.bernoulli(torch.full_like(response_mask, 0.9))  # torch
        response_mask[:, 0] = mask[:, PROMPT].float()  # every row keeps its first token
        batch.batch["response_mask"] = response_mask
        batch.batch["old_log_probs"] = old + 0.05 * torch.randn_like(old)  # torch
        batch.batch["advantages"] = torch.from_numpy(np.random.normal(size=tuple(old.shape))).float()  # numpy
        engine.zero_grad()
        engine.forward_backward(batch, loss_fn)  # attention dropout: torch, in training mode
        engine.optimizer_step()
        step += 1

        emit(f"SAVE_BEGIN {step}")
        if gate is not None and step == gate_step:
            with open(gate, "rb") as fifo:
                fifo.read(1)
        trainer = {
            "step": step,
            "tracker_run_id": run_id,
            "sampler": sampler.state_dict(),
            "rng": capture_rng_state(),
        }
        manager.save(step, {"actor": engine.state_dict(), "trainer": trainer}, hf_files=model)
        emit(f"SAVE_END {step}")

    tensors = {
        name: tensor.detach().clone().contiguous() for name, tensor in engine.model.state_dict().items()
    }
    draws = {"python": random.random(), "numpy": float(np.random.rand()), "torch": float(torch.rand(()))}
    metadata = {"run_id": run_id, "steps": str(step), "draws": json.dumps(draws)}
    partial = f"{out}.{os.getpid()}.partial"
    save_file(tensors, partial, metadata=metadata)
    os.replace(partial, out)
    emit("DONE")


def serve() -> None:
    """The fork server (see the module docstring)."""
    import numpy  # noqa: F401  (imported once here, inherited by every child)
    import safetensors.torch  # noqa: F401
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401

    import trellis.checkpoint.training
    import trellis.engine.single
    import trellis.registries  # noqa: F401

    torch.set_num_threads(1)
    emit("READY")
    child = None
    while line := sys.stdin.readline():
        if child is not None:
            os.waitpid(child, 0)  # reap the previous run only now: its pid stays its own until then
        kwargs = json.loads(line)
        sys.stderr.flush()
        child = os.fork()
        if child == 0:  # the child: one run, then out without the parent's clean-up
            code = 0
            try:
                run(**kwargs)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        emit(f"PID {child}")
        # wait for the end without reaping (WNOWAIT): until the next request the pid cannot be reused,
        # so a kill sent after the run ended hits its zombie, never another process
        info = os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        emit(f"EXIT {child} {code}")
    if child is not None:
        os.waitpid(child, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="train (resuming from the latest checkpoint) to the end")
    one.add_argument("--model", required=True)
    one.add_argument("--root", required=True)
    one.add_argument("--out", required=True)
    one.add_argument("--steps", type=int, default=10)
    one.add_argument("--seed", type=int, default=7)
    commands.add_parser("serve", help="fork server: one run per JSON line on stdin")
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve()
    else:
        run(args.model, args.root, args.out, args.steps, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
