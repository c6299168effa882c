"""Vision-language throughput on the tiny Qwen2-VL: images vs text only, packed vs padded training.

    python benchmarks/multimodal.py [--models tiny,wide] [--prompts 32] [--max-tokens 64] [--rounds 5]
                                    [--mixed-rows 32] [--mixed-tokens 128] [--micro-batch 8]
                                    [--repeats 9] [--threads 1]

Models (``--models``, comma-separated): ``tiny`` is :func:`trellis.recipes.tiny_vl.save_tiny_vl_model`
as the tests build it (text model: hidden 64, 2 layers); ``wide`` is the same with a text model of
hidden size 256, 4 layers, 8 heads (2 key-value heads); the vision tower's output follows the text
width. Random weights, fp32 (``model.dtype=float32``), written into a temporary
folder. ``torch.set_num_threads(--threads)`` (default 1: steadiest on shared cores), and the replica
generates with ``engine_kwargs.cpu_threads`` of the same count.

Prompts: ``--prompts`` chat prompts in verl's layout (a parquet file read by ``RLDataset`` with the
model's processor), each with 1 to 3 ``<image>`` placeholders and as many PNG images of random noise,
of sizes from 28x28 to 112x112 (1 to 16 image tokens each), fixed seed. The text-only side is the
same prompts with the placeholders removed and no images.

(a) Rollout: one ``hf`` replica (colocated: it loads the model itself) behind an
``AgentLoopManager`` (single-turn loop), ``generate_sequences`` over the whole batch (coalesced into
one batched ``model.generate``), temperature 1.0, ``rollout.seed`` fixed, ``--max-tokens`` new tokens
at most. Tokens/s counts generated tokens (up to and including eos) over the call's wall time; one
warm-up call per side, then ``--rounds`` rounds, the sides alternating which goes first; medians.

(b) Training: ``SingleEngine.forward_backward`` (actor, packed: ``model.use_remove_padding=true``,
the default; micro-batches of ``--micro-batch`` rows) over the batch each side's last rollout gave,
with a plain loss: minus the mean log-probability of the response tokens. Tokens/s counts real
tokens (prompt, image tokens included, and response; no padding); one warm-up, then ``--repeats``
timed passes per side, alternating; medians. Gradients are zeroed between passes; no optimizer step.

(c) Packed vs padded: ``--mixed-rows`` prompts with 1 to 3 images of different sizes and questions of
different lengths, rolled out once with ``--mixed-tokens`` new tokens at most; then each row's
response is cut to a length drawn uniformly from 4..``--mixed-tokens`` (fixed seed; the rest masked
out, as if eos had come there), so the responses are of varied lengths within the batch's fixed
response width, as a trainer's batch is. The same batch and the same micro-batches of
``--micro-batch`` rows run through ``forward_backward`` on two engines: ``use_remove_padding=false``
(padded: every micro-batch at the batch's full width) and ``true`` (packed: real tokens only,
varlen sdpa). "fed" is the tokens the model ran on; tokens/s counts real tokens. Target: packed
>= 1.3x padded (printed as met or not; never asserted).

A measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

# the tiny model has no video processor (no torchvision needed); transformers warns about it
warnings.filterwarnings("ignore", message=".*video processor.*")

SIZES = [(28, 28), (56, 28), (56, 56), (84, 56), (56, 84), (84, 84), (112, 56), (112, 112)]
QUESTIONS = [
    "What is in the picture?",
    "Describe the colours you see, then count the distinct regions and name the largest one.",
    "Compare the pictures. Which one is brighter? Answer in a short sentence with a reason.",
    "Is there text in it?",
    "List every shape you can find, say where each one is, and guess what the picture shows overall.",
]
WIDE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
MODELS = {"tiny": {}, "wide": WIDE}


def save_model(path: str, text_config: dict[str, Any]) -> str:
    """The tiny VL model (:func:`save_tiny_vl_model`) with ``text_config`` in ``path``; returns ``path``."""
    from trellis.recipes.tiny_vl import save_tiny_vl_model

    return save_tiny_vl_model(path, **text_config)


def noise_png(size: tuple[int, int], rng: random.Random) -> bytes:
    """A PNG of random pixels (the content does not change the cost)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (size[1], size[0], 3), np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def rows(n: int, seed: int, *, images: bool) -> list[dict[str, Any]]:
    """``n`` prompts with 1..3 images each (``images=False``: the same text, no placeholders, no images)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        count = rng.randint(1, 3)
        pictures = [{"bytes": noise_png(rng.choice(SIZES), rng), "path": None} for _ in range(count)]
        question = QUESTIONS[rng.randrange(len(QUESTIONS))]
        text = "<image>" * count + f"Picture set {i}. {question}"
        if not images:
            text, pictures = text.replace("<image>", ""), []
        out.append({"prompt": [{"role": "user", "content": text}], "images": pictures})
    return out


def dataset_batch(path: str, tokenizer: Any, processor: Any, data: list[dict[str, Any]], folder: str) -> Any:
    """``data`` written to parquet, read by ``RLDataset`` with the processor, collated."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trellis.data.dataset import RLDataset

    file = os.path.join(folder, f"rows-{len(os.listdir(folder))}.parquet")
    pq.write_table(pa.Table.from_pylist(data), file)
    dataset = RLDataset(file, tokenizer, processor=processor, max_prompt_length=512)
    return dataset.collate_fn([dataset[i] for i in range(len(dataset))])


def image_tokens(batch: Any, tokenizer: Any) -> int:
    return int((batch.tensors["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())


def rollout_config(path: str, max_tokens: int, threads: int) -> Any:
    from trellis.config import load_config

    return load_config(
        None,
        [
            f"model.path={path}",
            "model.dtype=float32",
            "rollout.seed=0",
            f"rollout.engine_kwargs.cpu_threads={threads}",
            f"data.max_response_length={max_tokens}",
        ],
    )


def serve(path: str, tokenizer: Any, max_tokens: int, threads: int) -> tuple[Any, Any]:
    """A colocated ``hf`` replica of the model at ``path`` and an ``AgentLoopManager`` over it."""
    from trellis.rollout.agent_loop import AgentLoopManager
    from trellis.rollout.hf import HFRolloutReplica

    config = rollout_config(path, max_tokens, threads)
    replica = HFRolloutReplica(0, config.rollout, config.model)
    asyncio.run(replica.init("colocated", tokenizer=tokenizer))
    return replica, AgentLoopManager(config.rollout, [replica], tokenizer, response_length=max_tokens)


def rollout(path: str, tokenizer: Any, batches: dict[str, Any], args: argparse.Namespace) -> tuple:
    """(a): ``{side: (median s, generated tokens)}`` and each side's last rollout batch."""
    replica, manager = serve(path, tokenizer, args.max_tokens, args.threads)
    times: dict[str, list[float]] = {side: [] for side in batches}
    tokens: dict[str, list[int]] = {side: [] for side in batches}
    outputs: dict[str, Any] = {}
    names = list(batches)
    for side in names:  # warm-up (the replica loads the processor on its first image request)
        manager.generate_sequences(batches[side])
    for round_ in range(args.rounds):
        for side in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            outputs[side] = manager.generate_sequences(batches[side])
            times[side].append(time.perf_counter() - start)
            tokens[side].append(int(outputs[side].tensors["response_mask"].sum()))
    asyncio.run(replica.shutdown())
    result = {side: (statistics.median(times[side]), statistics.median(tokens[side])) for side in names}
    return result, outputs


def engine_for(path: str, packed: bool, micro_batch: int) -> Any:
    from trellis.config import load_config
    from trellis.registries import training_engines

    config = load_config(
        None,
        [
            f"model.path={path}",
            "model.dtype=float32",
            f"model.use_remove_padding={str(packed).lower()}",
            f"actor.ppo_micro_batch_size_per_device={micro_batch}",
            "actor.use_dynamic_bsz=false",
        ],
    )
    return training_engines.get("single")(
        config.model, config.actor, role="actor", total_steps=1, device="cpu"
    )


def loss_fn(outputs: dict[str, torch.Tensor], micro: Any, info: dict[str, int]) -> tuple:
    """Minus the mean log-probability of the response tokens (over the whole batch)."""
    mask = micro.tensors["response_mask"]
    return -(outputs["log_probs"] * mask).sum() / info["batch_num_tokens"], {}


def time_training(engines: dict[str, Any], batches: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median seconds of one ``forward_backward`` per side (``engines`` and ``batches`` by side)."""
    names = list(engines)
    times: dict[str, list[float]] = {side: [] for side in names}
    for repeat in range(-1, repeats):  # -1: the warm-up
        for side in names if repeat % 2 == 0 else names[::-1]:
            engine = engines[side]
            with engine.phase():
                start = time.perf_counter()
                engine.forward_backward(batches[side], loss_fn)
                elapsed = time.perf_counter() - start
                engine.zero_grad()
            if repeat >= 0:
                times[side].append(elapsed)
    return {side: statistics.median(times[side]) for side in names}


def vary_responses(batch: Any, low: int, seed: int, pad_token_id: int) -> Any:
    """``batch`` with each row's response cut to a length uniform in ``low``..width (masked beyond)."""
    tensors = batch.tensors
    width = tensors["responses"].shape[1]
    generator = torch.Generator().manual_seed(seed)
    keep = torch.randint(min(low, width), width + 1, (len(batch),), generator=generator)
    cut = torch.arange(width)[None, :] >= keep[:, None]  # (bs, T): past the row's new end
    for key in ("response_mask", "responses"):
        value = tensors[key].clone()
        value[cut] = pad_token_id if key == "responses" else 0
        tensors[key] = value
    prompt = tensors["input_ids"].shape[1] - width
    for key in ("input_ids", "attention_mask"):
        value = tensors[key].clone()
        value[:, prompt:][cut] = pad_token_id if key == "input_ids" else 0
        tensors[key] = value
    return batch


def fed_tokens(batch: Any, packed: bool) -> int:
    """Tokens the model runs on: the real ones packed; every row at the batch's full width padded."""
    mask = batch.tensors["attention_mask"]
    return int(mask.sum()) if packed else mask.numel()


def bench(name: str, path: str, args: argparse.Namespace, folder: str) -> None:
    from trellis.data.dataset import pad_id
    from trellis.utils.tokenizer import hf_processor, hf_tokenizer

    tokenizer, processor = hf_tokenizer(path), hf_processor(path)
    params = sum(p.numel() for p in engine_for(path, True, 1).model.parameters())
    print(f"\n== {name}: {params / 1e6:.2f}M parameters ==")

    # (a) rollout, images vs text only
    prompts = {
        "text only": dataset_batch(path, tokenizer, processor, rows(args.prompts, 0, images=False), folder),
        "images": dataset_batch(path, tokenizer, processor, rows(args.prompts, 0, images=True), folder),
    }
    print(
        f"(a) rollout: hf replica + AgentLoopManager, {args.prompts} prompts (1-3 images each: "
        f"{image_tokens(prompts['images'], tokenizer)} image tokens in all), {args.max_tokens} new tokens "
        f"at most, median of {args.rounds} rounds"
    )
    results, outputs = rollout(path, tokenizer, prompts, args)
    base = results["text only"][1] / results["text only"][0]
    print(f"  {'side':<10} {'prompt tok':>10} {'gen tok':>8} {'median s':>9} {'tokens/s':>9} {'vs text':>8}")
    for side, (seconds, tokens) in results.items():
        prompt_tokens = int(prompts[side].tensors["attention_mask"].sum())
        rate = tokens / seconds
        figures = f"{prompt_tokens:>10} {tokens:>8.0f} {seconds:>9.3f} {rate:>9.0f} {rate / base:>7.2f}x"
        print(f"  {side:<10} {figures}")

    # (b) training, images vs text only (packed, the default)
    engine = engine_for(path, True, args.micro_batch)
    seconds = time_training({side: engine for side in outputs}, outputs, args.repeats)
    print(
        f"(b) training: forward_backward over each side's rollout batch (packed, micro-batches of "
        f"{args.micro_batch} rows), median of {args.repeats}"
    )
    print(f"  {'side':<10} {'real tok':>10} {'resp tok':>8} {'median s':>9} {'tokens/s':>9} {'vs text':>8}")
    base = int(outputs["text only"].tensors["attention_mask"].sum()) / seconds["text only"]
    for side, batch in outputs.items():
        real = int(batch.tensors["attention_mask"].sum())
        response = int(batch.tensors["response_mask"].sum())
        rate = real / seconds[side]
        print(
            f"  {side:<10} {real:>10} {response:>8} {seconds[side]:>9.3f} {rate:>9.0f} {rate / base:>7.2f}x"
        )
    del engine

    # (c) packed vs padded on mixed lengths
    mixed = dataset_batch(path, tokenizer, processor, rows(args.mixed_rows, 1, images=True), folder)
    replica, manager = serve(path, tokenizer, args.mixed_tokens, args.threads)
    batch = vary_responses(manager.generate_sequences(mixed), 4, seed=2, pad_token_id=pad_id(tokenizer))
    asyncio.run(replica.shutdown())
    engines = {
        "padded": engine_for(path, False, args.micro_batch),
        "packed": engine_for(path, True, args.micro_batch),
    }
    seconds = time_training(engines, {side: batch for side in engines}, args.repeats)
    real = int(batch.tensors["attention_mask"].sum())
    prompt_width = batch.tensors["input_ids"].shape[1] - args.mixed_tokens
    print(
        f"(c) packed vs padded: {args.mixed_rows} rows, 1-3 images each "
        f"({image_tokens(batch, tokenizer)} image tokens), prompt width {prompt_width}, "
        f"responses 4..{args.mixed_tokens} tokens "
        f"({int(batch.tensors['response_mask'].sum())} in all), micro-batches of {args.micro_batch} rows, "
        f"median of {args.repeats}"
    )
    print(f"  {'side':<10} {'fed tok':>10} {'real tok':>8} {'median s':>9} {'tokens/s':>9} {'vs padded':>9}")
    base = real / seconds["padded"]
    for side in engines:
        fed = fed_tokens(batch, side == "packed")
        rate = real / seconds[side]
        print(f"  {side:<10} {fed:>10} {real:>8} {seconds[side]:>9.3f} {rate:>9.0f} {rate / base:>8.2f}x")
    ratio = seconds["padded"] / seconds["packed"]
    print(f"  packed / padded: {ratio:.2f}x (target >= 1.3x: {'met' if ratio >= 1.3 else 'not met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,wide", help="comma-separated: tiny, wide")
    parser.add_argument("--prompts", type=int, default=32, help="prompts of (a) and (b)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens at most, (a) and (b)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rollout rounds per side")
    parser.add_argument("--mixed-rows", type=int, default=32, help="rows of the mixed batch (c)")
    parser.add_argument("--mixed-tokens", type=int, default=128, help="response width of the mixed batch (c)")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per training micro-batch")
    parser.add_argument("--repeats", type=int, default=9, help="timed training passes per side")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (and the replica's cpu_threads)"
    )
    args = parser.parse_args()
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    if min(args.prompts, args.max_tokens, args.rounds, args.mixed_rows, args.micro_batch, args.repeats) < 1:
        parser.error("sizes and counts must be >= 1")
    if args.mixed_tokens < 4 or args.threads < 1:
        parser.error("--mixed-tokens must be >= 4 and --threads >= 1")
    torch.set_num_threads(args.threads)

    print(
        f"Vision-language throughput, tiny Qwen2-VL (random weights), fp32 (python "
        f"{sys.version.split()[0]}, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s))"
    )
    with tempfile.TemporaryDirectory(prefix="trellis-bench-multimodal-") as folder:
        for name in models:
            path = save_model(os.path.join(folder, name), MODELS[name])
            bench(name, path, args, folder)


if __name__ == "__main__":
    main()
