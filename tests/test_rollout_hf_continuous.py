"""Continuous batching in the hf replica: rows join and leave between steps; results equal generate's."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.rollout import SamplingParams
from trellis.rollout.hf import HFRolloutReplica
from trellis.rollout.hf_continuous import supports_continuous
from trellis.testing.rollout import teacher_forced_log_probs

TEXTS = ["What is 12 + 7?", "Compute 3 * 4 - 5. First", "The quick brown fox", "system You are"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(tiny_model_path):
    """The tiny model with an eos id outside its vocabulary (responses run to max_tokens), its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = model.config.vocab_size
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


def prompts(tok, n):
    return [tok(TEXTS[i % 4] + " 1" * (i % 5))["input_ids"] for i in range(n)]


def run(model, tok, body, **engine_kwargs):
    async def main():
        replica = HFRolloutReplica(0, RolloutConfig(seed=0, engine_kwargs=engine_kwargs), ModelConfig())
        await replica.init("hybrid", model=model, tokenizer=tok)
        try:
            return await asyncio.wait_for(body(replica), 30)
        finally:
            await replica.shutdown()

    return asyncio.run(main())


async def wait_for_steps(replica, steps):
    while replica.decode_stats.steps < steps:
        await asyncio.sleep(0.001)


def test_tiny_llama_batches_continuously_and_sliding_window_models_do_not():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    small = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1
    )
    full = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, **small))
    sliding = Qwen2ForCausalLM(
        Qwen2Config(
            num_hidden_layers=2,
            use_sliding_window=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **small,
        )
    )
    assert supports_continuous(full) is True
    assert supports_continuous(sliding) is False


@pytest.mark.parametrize("decode_step", ["auto", "hf"])
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_long_tail_requests_match_the_generate_path_and_a_teacher_forced_pass(base, params, decode_step):
    """Seeded requests of uneven prompts and lengths get the same tokens from a continuous session as
    from one generate call; their log-probs equal a teacher-forced forward pass to 1e-4 (fp32)."""
    model, tok = base
    ps = prompts(tok, 12)
    lengths = [3, 40, 7, 12, 25, 4, 33, 9, 16, 5, 28, 11]

    async def body(replica):
        calls = [
            replica.generate(p, SamplingParams(max_tokens=m, seed=100 + i, logprobs=True, **params), f"r{i}")
            for i, (p, m) in enumerate(zip(ps, lengths, strict=True))
        ]
        return await asyncio.gather(*calls), replica.decode_stats

    continuous, stats = run(model, tok, body, batching="continuous", decode_step=decode_step)
    static, static_stats = run(model, tok, body, batching="static")
    assert stats.steps == max(lengths) - 1  # the first token of each row comes from its prefill
    assert stats.lean_steps == (stats.steps if decode_step == "auto" else 0)
    assert static_stats.steps == 0  # batching=static never decodes continuously
    for p, m, a, b in zip(ps, lengths, continuous, static, strict=True):
        assert len(a.token_ids) == m and a.stop_reason == "length"
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0)
        expected = teacher_forced_log_probs(model, p, a.token_ids, params["temperature"])
        torch.testing.assert_close(torch.tensor(a.log_probs), expected, atol=1e-4, rtol=0)


def test_the_samples_of_one_prompt_share_its_prefill_and_still_match_the_generate_path(base):
    """GRPO's rollout.n samples of a prompt: one prefill row per distinct prompt, the KV cache copied to
    each sample; every sample's tokens equal the generate path's and its log-probs a teacher-forced pass."""
    model, tok = base
    ps = prompts(tok, 3)
    rows = [(p, 4 * k + j) for k, p in enumerate(ps) for j in range(4)]  # 3 prompts x 4 samples

    async def body(replica):
        calls = [
            replica.generate(p, SamplingParams(max_tokens=6 + i % 5, seed=i, logprobs=True), f"r{i}")
            for p, i in rows
        ]
        return await asyncio.gather(*calls), copy.copy(replica.decode_stats)

    continuous, stats = run(model, tok, body, batching="continuous")
    static, _ = run(model, tok, body, batching="static")
    assert stats.prefills == 1 and stats.shared_prefill_rows == 12 - 3
    assert len({tuple(out.token_ids) for out in continuous}) > 3  # the samples differ, not copies
    for (p, _), a, b in zip(rows, continuous, static, strict=True):
        assert a.token_ids == b.token_ids
        expected = teacher_forced_log_probs(model, p, a.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(a.log_probs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("decode_step", ["auto", "hf"])
def test_distinct_prompts_with_a_common_start_prefill_it_once_and_still_match(base, decode_step):
    """Prompts that begin with the same system prompt: its tokens are prefilled once, the rows' own
    tokens after a padding hole; tokens equal the generate path's, log-probs a teacher-forced pass
    (fp32, 1e-4), for the samples of each prompt and for a request that joins the running rows."""
    from trellis.rollout.hf_continuous import MIN_COMMON_PREFIX

    model, tok = base
    system = tok("system: " + "be brief and answer with digits only. " * 3)["input_ids"]
    assert len(system) >= MIN_COMMON_PREFIX
    ps = [system + tok(TEXTS[i] + " 1" * i)["input_ids"] for i in range(4)]  # own parts of 4 lengths
    rows = [(p, 2 * k + j) for k, p in enumerate(ps) for j in range(2)]  # 4 prompts x 2 samples
    late = system + tok("late 9 9")["input_ids"]

    async def body(replica):
        calls = [
            replica.generate(p, SamplingParams(max_tokens=5 + i % 3, seed=i, logprobs=True), f"r{i}")
            for p, i in rows
        ]
        first = asyncio.gather(*calls)
        if replica.batching == "continuous":  # join the running rows (static batching never steps)
            await wait_for_steps(replica, 2)
        joined = await replica.generate(late, SamplingParams(max_tokens=4, seed=99, logprobs=True), "late")
        return [*(await first), joined], copy.copy(replica.decode_stats)

    continuous, stats = run(model, tok, body, batching="continuous", decode_step=decode_step)
    static, _ = run(model, tok, body, batching="static")
    distinct = len({tuple(p) for p, _ in rows})
    assert stats.shared_prefill_rows == len(rows) - distinct
    # the first prefill shares the system prompt (and the template after it) among its 4 prompts
    common = len(system)
    assert stats.shared_prefix_tokens >= common * (distinct - 1)
    for p, a, b in zip([p for p, _ in rows] + [late], continuous, static, strict=True):
        assert a.token_ids == b.token_ids
        expected = teacher_forced_log_probs(model, p, a.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(a.log_probs), expected, atol=1e-4, rtol=0)


def test_the_common_prefix_leaves_each_context_its_last_token():
    from trellis.rollout.hf_continuous import _common_prefix

    assert _common_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == 2
    assert _common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shorter keeps its last token
    assert _common_prefix([[7, 8], [6, 8]]) == 0
    assert _common_prefix([[1, 2, 3]]) == 0  # one context: nothing to share


def test_a_request_joins_the_running_batch_and_leaves_before_the_long_one(base):
    model, tok = base
    long_prompt, short_prompt = prompts(tok, 2)

    async def body(replica):
        long = asyncio.ensure_future(
            replica.generate(long_prompt, SamplingParams(temperature=0, max_tokens=80, logprobs=True), "long")
        )
        await wait_for_steps(replica, 5)
        short = await replica.generate(
            short_prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=True), "short"
        )
        long_done_when_short_returned = long.done()
        return await long, short, long_done_when_short_returned, replica.generate_calls, replica.decode_stats

    long, short, long_done, calls, stats = run(model, tok, body)
    assert not long_done  # the short request came back while the long one still ran
    assert calls == 1 and stats.prefills == 2 and stats.peak_rows == 2
    assert len(long.token_ids) == 80 and len(short.token_ids) == 4
    # joining mid-run changed neither row: both equal their teacher-forced greedy continuation
    for prompt, out in ((long_prompt, long), (short_prompt, short)):
        expected = teacher_forced_log_probs(model, prompt, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=1e-4, rtol=0)
        direct = model.generate(
            torch.tensor([prompt]), max_new_tokens=len(out.token_ids), do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert out.token_ids == direct


@pytest.mark.parametrize(("batching", "calls", "prefills"), [("continuous", 1, 2), ("static", 2, 0)])
def test_a_finished_row_frees_its_slot_for_a_waiting_request(base, batching, calls, prefills):
    """max_batch_size=2, three requests: continuously, the third starts as soon as the short one ends,
    in the same session; statically it waits for the whole first batch."""
    model, tok = base
    ps = prompts(tok, 3)

    async def body(replica):
        outs = await asyncio.gather(
            *(
                replica.generate(p, SamplingParams(temperature=0, max_tokens=m), f"r{i}")
                for i, (p, m) in enumerate(zip(ps, [2, 30, 30], strict=True))
            )
        )
        return outs, replica.generate_calls, replica.decode_stats

    outs, n_calls, stats = run(model, tok, body, max_batch_size=2, batching=batching)
    assert [len(o.token_ids) for o in outs] == [2, 30, 30]
    assert n_calls == calls and stats.prefills == prefills
    if batching == "continuous":
        assert stats.peak_rows == 2  # never more than max_batch_size
        assert stats.steps == 1 + 29  # the third joined after step 1 and decoded alongside the second


def test_a_weight_update_stops_admission_and_the_waiting_request_gets_the_new_weights(base):
    model, tok = base
    model = copy.deepcopy(model)
    p0, p1 = prompts(tok, 2)
    sp = SamplingParams(temperature=0, max_tokens=30)

    async def body(replica):
        first = asyncio.ensure_future(replica.generate(p0, sp, "first"))
        await wait_for_steps(replica, 3)
        update = asyncio.ensure_future(replica.begin_weight_update())
        await asyncio.sleep(0)
        second = asyncio.ensure_future(replica.generate(p1, sp, "second"))
        await update  # returns once the running row finished
        first_done = first.done()
        await replica.update_weights(
            [(name, t * 0) for name, t in model.state_dict().items() if "norm" not in name]
        )
        await replica.end_weight_update(7)
        return await first, await second, first_done

    first, second, first_done = run(model, tok, body)
    assert first_done and first.weight_versions == [0] * 30
    assert second.weight_versions == [7] * 30
    assert len(set(second.token_ids)) == 1  # zero weights: uniform logits, greedy takes token 0 each step


def test_wake_up_of_an_awake_replica_does_not_wait_for_its_running_session(base):
    """A weight sync wakes the replica first: awake, that returns at once instead of waiting for the
    running session (which keeps admitting requests) to drain; a sleep still pending is waited for."""
    model, tok = base
    p0 = prompts(tok, 1)[0]
    sp = SamplingParams(temperature=0, max_tokens=100)

    async def body(replica):
        first = asyncio.ensure_future(replica.generate(p0, sp, "first"))
        await wait_for_steps(replica, 3)
        await replica.wake_up()
        steps_at_wake = replica.decode_stats.steps
        running = not first.done()
        sleep = asyncio.ensure_future(replica.sleep())  # waits for the session, then sleeps
        await asyncio.sleep(0)
        await replica.wake_up()  # waits for that sleep, then wakes
        return running, steps_at_wake, sleep.done(), replica.asleep, await first

    running, steps_at_wake, slept, asleep, first = run(model, tok, body)
    assert running and steps_at_wake < 99  # woke while the row still decoded
    assert slept and not asleep and len(first.token_ids) == 100


def test_shutdown_aborts_the_running_rows_and_stops_the_thread(base):
    model, tok = base
    p0, p1 = prompts(tok, 2)

    async def main():
        replica = HFRolloutReplica(0, RolloutConfig(seed=0), ModelConfig())
        await replica.init("hybrid", model=model, tokenizer=tok)
        a = asyncio.ensure_future(replica.generate(p0, SamplingParams(max_tokens=100_000), "a"))
        await wait_for_steps(replica, 3)
        b = asyncio.ensure_future(replica.generate(p1, SamplingParams(max_tokens=100_000), "b"))
        await wait_for_steps(replica, 6)
        await replica.shutdown()
        outs = await asyncio.wait_for(asyncio.gather(a, b), 5)
        steps = replica.decode_stats.steps
        await asyncio.sleep(0.2)
        return outs, steps, replica.decode_stats.steps

    outs, steps, later = asyncio.run(main())
    assert [o.stop_reason for o in outs] == ["abort", "abort"] and all(o.token_ids == [] for o in outs)
    assert later <= steps + 1  # the decoder thread stopped after at most its current step


def test_a_failing_forward_reaches_every_waiting_caller_and_the_replica_recovers(base):
    model, tok = base
    model = copy.deepcopy(model)
    ps = prompts(tok, 3)
    embed = model.model.embed_tokens  # every prefill and every decoding step (lean or not) embeds
    real = embed.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected forward failure")
        return real(*args, **kwargs)

    embed.forward = flaky

    async def body(replica):
        outs = await asyncio.gather(
            *(replica.generate(p, SamplingParams(max_tokens=10), f"r{i}") for i, p in enumerate(ps)),
            return_exceptions=True,
        )
        again = await replica.generate(ps[0], SamplingParams(max_tokens=5), "again")
        return outs, again

    outs, again = run(model, tok, body)
    assert all(isinstance(o, RuntimeError) and "injected forward failure" in str(o) for o in outs)
    assert len(again.token_ids) == 5


def test_stop_strings_and_stop_ids_end_each_row_on_its_own(base):
    model, tok = base
    ps = prompts(tok, 4)

    async def body(replica):
        free = await asyncio.gather(
            *(
                replica.generate(p, SamplingParams(temperature=0, max_tokens=20), f"f{i}")
                for i, p in enumerate(ps)
            )
        )
        stop_id = free[0].token_ids[5]
        text = tok.decode(free[1].token_ids[:8], skip_special_tokens=False)
        stop_string = text[-3:]
        outs = await asyncio.gather(
            replica.generate(
                ps[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]), "a"
            ),
            replica.generate(ps[1], SamplingParams(temperature=0, max_tokens=20, stop=[stop_string]), "b"),
            replica.generate(ps[2], SamplingParams(temperature=0, max_tokens=20), "c"),
        )
        return free, stop_id, stop_string, outs

    free, stop_id, stop_string, (a, b, c) = run(model, tok, body)
    cut = free[0].token_ids.index(stop_id) + 1
    assert a.token_ids == free[0].token_ids[:cut] and a.stop_reason == "stop"
    assert stop_string in tok.decode(b.token_ids, skip_special_tokens=False) and b.stop_reason == "stop"
    assert stop_string not in tok.decode(b.token_ids[:-1], skip_special_tokens=False)
    assert b.token_ids == free[1].token_ids[: len(b.token_ids)]
    assert c.token_ids == free[2].token_ids and c.stop_reason == "length"


def test_batching_must_be_continuous_or_static():
    with pytest.raises(
        ValueError, match=r'engine_kwargs.batching must be "continuous" or "static", got .paged.'
    ):
        HFRolloutReplica(0, RolloutConfig(engine_kwargs={"batching": "paged"}), ModelConfig())


def test_many_staggered_requests_all_resolve_with_their_own_lengths(base):
    """64 requests arriving over time with long-tail lengths: each gets exactly its max_tokens."""
    model, tok = base
    rng = random.Random(0)
    lengths = [int(4 * 16 ** (rng.random() ** 3)) for _ in range(64)]
    ps = prompts(tok, 64)

    async def body(replica):
        tasks = []
        for i, (p, m) in enumerate(zip(ps, lengths, strict=True)):
            tasks.append(asyncio.ensure_future(replica.generate(p, SamplingParams(max_tokens=m), f"r{i}")))
            if i % 8 == 7:
                await asyncio.sleep(0.003)
        return await asyncio.gather(*tasks), replica.decode_stats

    outs, stats = run(model, tok, body, max_batch_size=16)
    assert [len(o.token_ids) for o in outs] == lengths
    assert stats.peak_rows <= 16 and stats.prefills >= 4


def test_decode_thread_loop_decodes_on_the_loops_thread_with_the_same_results(base):
    """decode_thread: "auto" decodes on the CPU on the event loop's thread, between its other tasks (a
    request that arrives mid-batch still joins); "worker" in another thread; the tokens and log-probs of
    both are the same."""
    import threading

    model, tok = base
    ps = prompts(tok, 6)

    def go(decode_thread):
        threads = set()
        hook = model.get_input_embeddings().register_forward_hook(
            lambda *_: threads.add(threading.get_ident())
        )

        async def body(replica):
            loop_thread = threading.get_ident()
            first = [
                asyncio.ensure_future(
                    replica.generate(p, SamplingParams(max_tokens=12, seed=i, logprobs=True), f"r{i}")
                )
                for i, p in enumerate(ps[:5])
            ]
            await wait_for_steps(replica, 3)
            late = await replica.generate(ps[5], SamplingParams(max_tokens=4, seed=5, logprobs=True), "late")
            outs = [*(await asyncio.gather(*first)), late]
            return outs, loop_thread, replica.generate_calls, replica._decodes_on_loop()

        try:
            outs, loop_thread, calls, on_loop = run(model, tok, body, decode_thread=decode_thread)
        finally:
            hook.remove()
        return outs, threads, loop_thread, calls, on_loop

    loop_outs, loop_threads, loop_thread, loop_calls, on_loop = go("auto")
    worker_outs, worker_threads, worker_loop, worker_calls, worker_on_loop = go("worker")
    assert on_loop is True and worker_on_loop is False
    assert loop_threads == {loop_thread}
    assert worker_loop not in worker_threads and len(worker_threads) == 1
    assert loop_calls == worker_calls == 1  # the late request joined the running session in both
    for a, b in zip(loop_outs, worker_outs, strict=True):
        # the same tokens; log-probs to float32 rounding: the step at which the late request joins
        # depends on timing, and a batch of other rows may sum a matmul in another order (oneDNN's
        # blocking follows the row count: two runs of one mode differed by 5e-7 on an AMX Xeon)
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r'decode_thread must be "auto", "loop" or "worker", got \'main\''):
        HFRolloutReplica(0, RolloutConfig(engine_kwargs={"decode_thread": "main"}), ModelConfig())
