"""The OpenAI-compatible gateway: throughput against direct replica calls, and capture exactness.

    python benchmarks/gateway.py [--rounds 3] [--sessions 64] [--max-tokens 32] [--turns 12]
                                 [--turn-tokens 24] [--no-smollm2]

One ``hf`` replica per model, in this process, loads the model itself (colocated, fp32, one torch
thread: ``engine_kwargs.cpu_threads=1`` and ``torch.set_num_threads(1)``) and lives on the
gateway's event loop (:func:`trellis.rollout.gateway.start_gateway`, uvicorn on a thread of its
own, ``auto_sessions=True``).

Throughput. ``--sessions`` chat prompts (short arithmetic questions, the same every run), each
answered once, sampled at temperature 1.0 with a seed per request (so both sides generate the same
tokens) and ``--max-tokens`` new tokens at most:

- direct: ``--sessions`` concurrent ``replica.generate(prompt_ids, SamplingParams(...))`` calls on
  the replica's event loop, the prompts rendered with the chat template beforehand (log-probs on,
  as the gateway asks for them in a session);
- gateway: ``--sessions`` concurrent sessions, each one chat completion over HTTP with an
  ``openai.AsyncOpenAI`` client of its own against ``/sessions/<id>/v1``, from an event loop in the
  main thread;
- HTTP floor: the same clients posting the same requests to a route of the same server that parses the
  body and returns a canned reply of the same size: what HTTP, the web framework and the client cost
  with no gateway and no generation. All three share one interpreter (one GIL), so the floor's time
  adds to generation's; ``direct / (direct + floor)`` is the best ratio a gateway on this server and
  client could reach.

Tokens/s counts generated tokens (up to and including eos) over the wall time of the whole round
(the first request sent to the last answer received). Each side runs one warm-up round, then
``--rounds`` rounds, the sides alternating which goes first; the median is printed, with the
batched ``model.generate`` calls per round (the replica coalesces requests that arrive together;
requests that trickle in over HTTP may split into more batches) and the ratio gateway / direct
(target: >= 0.9x). Whether both sides generated the same tokens is checked against the gateway's
session capture.

Capture exactness. One session of ``--turns`` chat turns, greedy (temperature 0, at most
``--turn-tokens`` tokens a turn): each turn appends the reply the gateway returned as the assistant
message, then a new user message. The session's captured trajectory is checked twice:

- against the replica: at every call's position the trajectory holds exactly the prompt that call
  sent and the tokens (and log-probs) the replica returned, with loss mask 1 on those tokens and
  0 elsewhere (printed: ``generated-token mismatches``; target 0);
- against a re-tokenisation: the final conversation (every message, the last reply included)
  rendered with ``tokenizer.apply_chat_template(messages, tokenize=True)``, compared position by
  position up to the shorter length (printed: ``mismatches`` and the length difference; the
  template adds its closing tokens after the last reply, e.g. ChatML's newline). Decoding
  generated tokens and encoding the text again need not give the same ids (a text has more than
  one tokenisation, and the reply text drops special tokens); the turns where that happens are
  counted, since the gateway never re-encodes what the model said.

Models: the tiny test model (built into a temporary folder) and SmolLM2-135M-Instruct when
``trellis.utils.demo_model.smollm2_path()`` can provide it (skipped with a note otherwise, or with
``--no-smollm2``). A measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from _common import smollm2_or_note  # benchmarks/_common.py: the script's own folder

MODEL = "policy"
SEED = 1234
FOLLOW_UPS = [
    "Are you sure? Check it again.",
    "Now add 5 to that.",
    "Explain the last step briefly.",
    "What is that number times 2?",
    "Thanks. One more: what is 9 - 4?",
    "Write the answer in words.",
]


def questions(n: int) -> list[str]:
    """``n`` short arithmetic questions, the same every run."""
    ops = ["+", "-", "*"]
    return [f"What is {(7 * i + 3) % 50} {ops[i % 3]} {(11 * i + 5) % 20}?" for i in range(n)]


def ids_of(tokenizer: Any, text: str) -> list[int]:
    from trellis.utils.tokenizer import normalize_token_ids

    return normalize_token_ids(tokenizer(text, add_special_tokens=False))


def differing(a: list[Any], b: list[Any]) -> int:
    """Positions where ``a`` and ``b`` differ, the longer one's extra positions included."""
    return sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))


class Served:
    """One hf replica loading ``path`` itself, behind a gateway started on a thread of its own."""

    def __init__(self, path: str, sessions: int) -> None:
        from transformers import AutoTokenizer

        from trellis.config.schema import ModelConfig, RolloutConfig
        from trellis.rollout.gateway import Gateway, start_gateway
        from trellis.rollout.hf import HFRolloutReplica

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        config = RolloutConfig(seed=0, engine_kwargs={"cpu_threads": 1})
        self.replica = HFRolloutReplica(0, config, ModelConfig(path=path, dtype="float32"))
        self.gateway = Gateway(
            self.tokenizer,
            replicas=[self.replica],
            model_name=MODEL,
            auto_sessions=True,
            max_inflight=max(256, sessions),
        )
        self.running = start_gateway(self.gateway)
        try:
            self.running.call(self.replica.init("colocated"))
        except BaseException:
            self.running.stop()
            raise

    def close(self) -> None:
        try:
            self.running.call(self.replica.shutdown(), timeout=60)
        finally:
            self.running.stop()


# ---------------------------------------------------------------- throughput


def throughput(served: Served, args: argparse.Namespace, rounds: int) -> dict[str, Any]:
    """Median seconds, tokens and batches per round of each side, and whether they generated alike."""
    import openai

    from trellis.rollout.chat import ChatTemplate
    from trellis.rollout.sampling import SamplingParams

    replica, running, n = served.replica, served.running, args.sessions
    chat = ChatTemplate(served.tokenizer)
    conversations = [[{"role": "user", "content": q}] for q in questions(n)]
    prompts = [chat.prompt_ids(m) for m in conversations]
    seeds = [SEED + i for i in range(n)]
    sids = [f"tp-{i}" for i in range(n)]
    results: dict[str, dict[str, list]] = {
        side: {"seconds": [], "tokens": [], "batches": [], "ids": []}
        for side in ("direct", "gateway", "floor")
    }

    async def direct_round() -> list[list[int]]:
        def params(seed: int) -> SamplingParams:
            return SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=seed, logprobs=True)

        requests = enumerate(zip(prompts, seeds, strict=True))
        outs = await asyncio.gather(*(replica.generate(p, params(s), f"d{i}") for i, (p, s) in requests))
        return [list(o.token_ids) for o in outs]

    client_loop = asyncio.new_event_loop()
    # one client (and connection pool) per session, as separate agents would have: a pool shared by 64
    # concurrent requests checks every pooled connection on each request, which costs the client
    # more than the whole gateway does on the tiny model
    clients = [
        openai.AsyncOpenAI(base_url=running.session_url(sid), api_key="unused", max_retries=0, timeout=600)
        for sid in sids
    ]
    floor_clients = [c.with_options(base_url=f"{running.url}/floor/v1") for c in clients]
    canned: dict[str, Any] = {}

    from fastapi.responses import JSONResponse

    async def floor(request: Any) -> JSONResponse:  # a plain Starlette route: the request, no validation
        await request.json()
        return JSONResponse(canned)

    served.gateway.app.add_route("/floor/v1/chat/completions", floor, methods=["POST"])

    async def gateway_round(floor_only: bool = False) -> int:
        async def one(i: int) -> int:
            reply = await (floor_clients if floor_only else clients)[i].chat.completions.create(
                model=MODEL,
                messages=conversations[i],
                temperature=1.0,
                max_tokens=args.max_tokens,
                seed=seeds[i],
            )
            if not canned:
                canned.update(reply.model_dump(exclude_none=True))
            return reply.usage.completion_tokens

        return sum(await asyncio.gather(*(one(i) for i in range(n))))

    def run(side: str, record: bool) -> None:
        calls = replica.generate_calls
        start = time.perf_counter()
        if side == "direct":
            ids = running.call(direct_round())
            seconds = time.perf_counter() - start
            tokens = sum(len(t) for t in ids)
            prompt_ok = True
        elif side == "floor":
            tokens = client_loop.run_until_complete(gateway_round(floor_only=True))
            seconds = time.perf_counter() - start
            ids, prompt_ok = [], True
        else:
            tokens = client_loop.run_until_complete(gateway_round())
            seconds = time.perf_counter() - start
            captured = [served.gateway.close_session(sid).samples() for sid in sids]  # reopened next round
            pairs = zip(captured, prompts, strict=True)
            prompt_ok = all(len(c) == 1 and c[0].prompt_ids == p for c, p in pairs)
            ids = [c[0].response_ids if c else [] for c in captured]
            if sum(len(t) for t in ids) != tokens:
                prompt_ok = False  # usage and capture disagree
        if record:
            r = results[side]
            r["seconds"].append(seconds)
            r["tokens"].append(tokens)
            r["batches"].append(replica.generate_calls - calls)
            r["ids"].append(ids)
            r.setdefault("prompt_ok", []).append(prompt_ok)
        print(
            f"    {side:<8} {seconds:7.3f} s  {tokens:5d} tokens  "
            f"{replica.generate_calls - calls:3d} batches{'' if record else '  (warm-up)'}",
            file=sys.stderr,
            flush=True,
        )

    try:
        run("direct", record=False)
        run("gateway", record=False)
        run("floor", record=False)
        for r in range(rounds):
            for side in ("direct", "gateway", "floor") if r % 2 == 0 else ("floor", "gateway", "direct"):
                run(side, record=True)
    finally:

        async def close_all() -> None:
            await asyncio.gather(*(c.close() for c in clients))

        client_loop.run_until_complete(close_all())
        client_loop.close()

    summary: dict[str, Any] = {}
    for side, r in results.items():
        rates = [t / s for t, s in zip(r["tokens"], r["seconds"], strict=True)]
        summary[side] = {
            "seconds": statistics.median(r["seconds"]),
            "tokens": statistics.median(r["tokens"]),
            "rate": statistics.median(rates),
            "batches": statistics.median(r["batches"]),
        }
    direct_ids, gateway_ids = results["direct"]["ids"], results["gateway"]["ids"]
    results["floor"]["prompt_ok"] = []
    summary["same_tokens"] = all(g == d for g in gateway_ids for d in direct_ids) and all(
        results["gateway"]["prompt_ok"]
    )
    return summary


# ---------------------------------------------------------------- capture exactness


def capture(served: Served, args: argparse.Namespace) -> dict[str, Any]:
    """A ``--turns``-turn greedy session through the gateway, checked against the replica's outputs and
    against a re-tokenisation of the final conversation."""
    import openai

    from trellis.rollout.chat import ChatTemplate
    from trellis.utils.tokenizer import normalize_token_ids

    replica, running, tok = served.replica, served.running, served.tokenizer
    calls: list[tuple[list[int], Any]] = []  # (prompt ids, TokenOutput) of every generate call

    async def generate(prompt_ids: list[int], params: Any) -> Any:
        out = await replica.generate(prompt_ids, params, f"capture-{len(calls)}")
        calls.append((list(prompt_ids), out))
        return out

    sid = "capture"
    served.gateway.open_session(sid, generate=generate)  # on the gateway's loop, where the replica lives
    messages: list[dict[str, Any]] = [{"role": "user", "content": questions(1)[0]}]

    async def converse() -> None:
        client = openai.AsyncOpenAI(base_url=running.session_url(sid), api_key="unused", max_retries=0)
        try:
            for turn in range(args.turns):
                reply = await client.chat.completions.create(
                    model=MODEL, messages=messages, temperature=0, max_tokens=args.turn_tokens
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
                if turn < args.turns - 1:
                    messages.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})
        finally:
            await client.close()

    asyncio.run(converse())
    session = served.gateway.close_session(sid)
    samples = session.samples()
    traj = samples[-1]
    full = traj.prompt_ids + traj.response_ids
    mask = [0] * len(traj.prompt_ids) + list(traj.response_mask)
    logprobs = [0.0] * len(traj.prompt_ids) + list(traj.response_logprobs)

    # 1. against the replica: each call's prompt, then exactly its tokens (mask 1) and log-probs
    expected_mask = [0] * len(full)
    generated_mismatches = prompt_mismatches = logprob_mismatches = 0
    for prompt_ids, out in calls:
        start, tokens = len(prompt_ids), list(out.token_ids)
        prompt_mismatches += differing(full[:start], prompt_ids)
        generated_mismatches += differing(full[start : start + len(tokens)], tokens)
        logprob_mismatches += differing(logprobs[start : start + len(tokens)], list(out.log_probs or []))
        for j in range(start, min(start + len(tokens), len(full))):
            expected_mask[j] = 1
    last_prompt, last_out = calls[-1] if calls else ([], None)
    end = len(last_prompt) + (len(last_out.token_ids) if last_out is not None else 0)
    mask_mismatches = sum(a != b for a, b in zip(mask, expected_mask, strict=True)) + abs(len(full) - end)

    # 2. against a re-tokenisation of the final conversation
    reference = normalize_token_ids(tok.apply_chat_template(messages, tokenize=True))
    shorter = min(len(reference), len(full))
    diffs = [i for i in range(shorter) if reference[i] != full[i]]
    chat = ChatTemplate(tok)
    eos = set(chat.eos_token_ids)
    retokenised = 0  # turns whose generated ids are not what their reply text encodes to
    for _, out in calls:
        tokens = list(out.token_ids)
        body = tokens[:-1] if tokens and tokens[-1] in eos else tokens
        if ids_of(tok, tok.decode(tokens, skip_special_tokens=True)) != body:
            retokenised += 1
    return {
        "samples": len(samples),
        "calls": traj.calls,
        "generate_calls": len(calls),
        "rewritten": session.metrics["gateway/rewritten_history"],
        "length": len(full),
        "generated": sum(mask),
        "finish": [out.stop_reason for _, out in calls],
        "generated_mismatches": generated_mismatches,
        "prompt_mismatches": prompt_mismatches,
        "logprob_mismatches": logprob_mismatches,
        "mask_mismatches": mask_mismatches,
        "reference_length": len(reference),
        "mismatches": len(diffs),
        "first_mismatch": diffs[0] if diffs else None,
        "tail": reference[len(full) :],
        "closing": chat.closing_ids(),
        "eos": chat.eos_token_ids,
        "retokenised": retokenised,
    }


def print_capture(label: str, c: dict[str, Any], args: argparse.Namespace) -> None:
    stops = sum(r == "stop" for r in c["finish"])
    print(
        f"\n{label}: capture of one {args.turns}-turn session (greedy, <= {args.turn_tokens} tokens a turn; "
        f"{stops} turns ended at eos)"
    )
    print(
        f"  samples {c['samples']}, calls in the trajectory {c['calls']} of {c['generate_calls']} generate "
        f"calls, rewritten history {c['rewritten']}; {c['length']} tokens, {c['generated']} of them "
        "generated (mask 1)"
    )
    against = c["generated_mismatches"] + c["prompt_mismatches"] + c["mask_mismatches"]
    print(
        f"  against the replica's outputs: generated-token mismatches {c['generated_mismatches']}, prompt "
        f"mismatches {c['prompt_mismatches']}, mask mismatches {c['mask_mismatches']}, log-prob mismatches "
        f"{c['logprob_mismatches']} -> {'exact' if against == 0 else 'NOT EXACT'}"
    )
    diff = c["reference_length"] - c["length"]
    tail = c["tail"]
    tail_note = ""
    if diff > 0 and tail == c["closing"]:
        tail_note = f" (the template's closing tokens after the last reply: {tail})"
    elif diff > 0 and tail == c["eos"][:1] + c["closing"]:
        tail_note = (
            f" (the last reply stopped at its token limit, so the template adds its end-of-turn token, then "
            f"its closing tokens: {tail})"
        )
    elif diff > 0:
        tail_note = f" (the reference's extra tokens: {tail[:8]}{' ...' if len(tail) > 8 else ''})"
    first = "" if c["first_mismatch"] is None else f", first at position {c['first_mismatch']}"
    print(
        f"  against apply_chat_template(final conversation): mismatches: {c['mismatches']} over the "
        f"first {min(c['length'], c['reference_length'])} positions{first}; length difference "
        f"{diff:+d}{tail_note}"
    )
    if c["mismatches"]:
        print(
            f"  {c['retokenised']} of {c['generate_calls']} turns generated ids that their reply text "
            "does not encode back to (decode then encode is not the identity: special tokens dropped from "
            "the text, other tokenisations of the same text), and a length change shifts every later "
            "position; the capture itself holds the generated ids (the gateway never re-encodes a reply)."
        )


# ---------------------------------------------------------------- main


def bench(label: str, path: str, args: argparse.Namespace, rounds: int) -> None:
    print(f"  {label}: starting the replica and gateway", file=sys.stderr, flush=True)
    served = Served(path, args.sessions)
    try:
        t = throughput(served, args, rounds)
        c = capture(served, args)
    finally:
        served.close()
    print(
        f"\n{label}: {args.sessions} concurrent sessions, one chat completion each, temperature 1.0 with "
        f"a seed per request, <= {args.max_tokens} new tokens, median of {rounds} round(s), fp32, "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    print(f"  {'side':<9}{'seconds':>9}{'tokens':>8}{'tokens/s':>10}{'batches':>9}")
    for side in ("direct", "gateway"):
        s = t[side]
        print(f"  {side:<9}{s['seconds']:>9.3f}{s['tokens']:>8.0f}{s['rate']:>10.0f}{s['batches']:>9.1f}")
    ratio = t["gateway"]["rate"] / t["direct"]["rate"]
    same = "yes" if t["same_tokens"] else "NO"
    print(f"  gateway / direct: {ratio:.2f}x (target >= 0.9x); same tokens on both sides: {same}")
    floor, n = t["floor"]["seconds"], args.sessions
    over = t["gateway"]["seconds"] - t["direct"]["seconds"]
    best = t["direct"]["seconds"] / (t["direct"]["seconds"] + floor)
    print(
        f"  HTTP floor: the same clients posting the same requests to a route that parses the body and "
        f"returns a canned reply (no generation): {floor:.3f} s a round, {1e3 * floor / n:.2f} ms a "
        f"request; the gateway adds {1e3 * over / n:.2f} ms a request to direct calls; best ratio the "
        f"floor leaves (direct / (direct + floor)): {best:.2f}x"
    )
    print_capture(label, c, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side (after one warm-up)")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions (and direct calls)")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (throughput)")
    parser.add_argument("--turns", type=int, default=12, help="chat turns of the capture session")
    parser.add_argument("--turn-tokens", type=int, default=24, help="new tokens per turn (capture)")
    parser.add_argument("--no-smollm2", action="store_true", help="benchmark the tiny model only")
    args = parser.parse_args(argv)
    if min(args.rounds, args.sessions, args.max_tokens, args.turns, args.turn_tokens) < 1:
        parser.error("--rounds, --sessions, --max-tokens, --turns and --turn-tokens must be >= 1")
    torch.set_num_threads(1)

    from trellis.recipes.tiny import save_tiny_model

    smollm2, note = smollm2_or_note(args.no_smollm2)
    with tempfile.TemporaryDirectory(prefix="trellis-gateway-bench-") as tmp:
        bench("tiny", save_tiny_model(tmp), args, args.rounds)
    if smollm2 is not None:
        bench("SmolLM2-135M", smollm2, args, args.rounds)
    else:
        print(f"\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
