"""The hf rollout replica: batching, exact greedy and log-probs, stopping, seeds, weights, lifecycle."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.registries import get_rollout_replica_class
from trellis.rollout import SamplingParams, TokenOutput
from trellis.rollout.hf import HFRolloutReplica
from trellis.testing import RolloutReplicaContract
from trellis.testing.rollout import teacher_forced_log_probs as teacher_forced_logprobs

PROMPTS = ["What is 12 + 7?", "Compute 3 * 4 - 5. First", "The quick brown fox", "system You are"]


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    return model, tok


def prompts(tok, n):
    return [tok(PROMPTS[i % 4] + " 1" * (i // 4))["input_ids"] for i in range(n)]


def run(tiny_model_path, body, mode="colocated", model=None, tokenizer=None, **engine_kwargs):
    async def main():
        replica = HFRolloutReplica(
            0,
            RolloutConfig(seed=0, engine_kwargs=engine_kwargs),
            ModelConfig(path=tiny_model_path, dtype="float32"),
        )
        await replica.init(mode, model=model, tokenizer=tokenizer)
        try:
            return await body(replica)
        finally:
            await replica.shutdown()

    return asyncio.run(main())


def test_registry_round_trip():
    assert get_rollout_replica_class("hf") is HFRolloutReplica


def test_greedy_equals_direct_generate_and_logprobs_equal_forward(tiny_model_path, hf):
    model, tok = hf
    ps = prompts(tok, 6)

    async def body(replica):
        sp = SamplingParams(temperature=0, max_tokens=12, logprobs=True)
        return await asyncio.gather(*(replica.generate(p, sp, f"r{i}") for i, p in enumerate(ps)))

    outs = run(tiny_model_path, body, mode="hybrid", model=model, tokenizer=tok)
    for p, out in zip(ps, outs, strict=True):
        direct = model.generate(
            torch.tensor([p]),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=None,
        )[0, len(p) :].tolist()
        n = len(out.token_ids)
        assert out.token_ids == direct[:n]
        if out.stop_reason == "length":
            assert n == 12
        expected = teacher_forced_logprobs(model, p, out.token_ids, 0)
        torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_sampled_logprobs_equal_forward_with_temperature(tiny_model_path, hf, params):
    model, tok = hf
    ps = prompts(tok, 5)

    async def body(replica):
        sp = SamplingParams(max_tokens=10, logprobs=True, **params)
        return await asyncio.gather(*(replica.generate(p, sp, f"r{i}") for i, p in enumerate(ps)))

    outs = run(tiny_model_path, body)
    for p, out in zip(ps, outs, strict=True):
        expected = teacher_forced_logprobs(model, p, out.token_ids, params["temperature"])
        torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=1e-4, rtol=0)


def test_top_k_one_is_greedy(tiny_model_path, hf):
    _, tok = hf
    p = prompts(tok, 1)[0]

    async def body(replica):
        a = await replica.generate(p, SamplingParams(temperature=1.0, top_k=1, max_tokens=8), "a")
        b = await replica.generate(p, SamplingParams(temperature=0, max_tokens=8), "b")
        return a, b

    a, b = run(tiny_model_path, body)
    assert a.token_ids == b.token_ids


def test_coalescing_batches_concurrent_requests(tiny_model_path, hf):
    _, tok = hf
    ps = prompts(tok, 16)

    async def body(replica):
        outs = await asyncio.gather(
            *(
                replica.generate(p, SamplingParams(temperature=1.0, max_tokens=6), f"r{i}")
                for i, p in enumerate(ps)
            )
        )
        return outs, replica.generate_calls

    outs, calls = run(tiny_model_path, body)
    assert len(outs) == 16 and all(isinstance(o, TokenOutput) for o in outs)
    assert calls <= 2


def test_max_batch_size_splits_batches(tiny_model_path, hf):
    """Statically, 10 requests in batches of at most 4 take 3 generate calls; continuously, one session
    whose running batch never holds more than 4 rows."""
    _, tok = hf
    ps = prompts(tok, 10)

    async def body(replica):
        await asyncio.gather(
            *(replica.generate(p, SamplingParams(max_tokens=3), f"r{i}") for i, p in enumerate(ps))
        )
        return replica.generate_calls, replica.decode_stats.peak_rows

    assert run(tiny_model_path, body, max_batch_size=4, batching="static") == (3, 0)
    assert run(tiny_model_path, body, max_batch_size=4) == (1, 4)


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_model_path, hf):
    _, tok = hf
    ps = prompts(tok, 8)
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)

    async def body(replica):
        alone = await replica.generate(ps[0], sp, "alone")
        batched = await asyncio.gather(
            replica.generate(ps[0], sp, "seeded"),
            *(
                replica.generate(p, SamplingParams(temperature=1.0, max_tokens=12), f"o{i}")
                for i, p in enumerate(ps)
            ),
        )
        other_seed = await replica.generate(
            ps[0], SamplingParams(temperature=1.0, max_tokens=12, seed=99), "x"
        )
        return alone, batched[0], other_seed

    alone, batched, other = run(tiny_model_path, body)
    assert alone.token_ids == batched.token_ids
    assert other.token_ids != alone.token_ids
    again, _, _ = run(tiny_model_path, body)
    assert again.token_ids == alone.token_ids


def test_stop_token_ids_strings_and_max_tokens(tiny_model_path, hf):
    _, tok = hf
    p = prompts(tok, 1)[0]
    base_sp = SamplingParams(temperature=1.0, max_tokens=12, seed=7)

    async def body(replica):
        base = await replica.generate(p, base_sp, "base")
        assert base.stop_reason == "length" and len(base.token_ids) == 12
        stop_id = base.token_ids[4]
        first = base.token_ids.index(stop_id)
        by_id = await replica.generate(
            p, SamplingParams(temperature=1.0, max_tokens=12, seed=7, stop_token_ids=[stop_id]), "id"
        )
        assert by_id.token_ids == base.token_ids[: first + 1] and by_id.stop_reason == "stop"
        text = tok.decode(base.token_ids[5:7])
        by_str = await replica.generate(
            p, SamplingParams(temperature=1.0, max_tokens=12, seed=7, stop=text), "s"
        )
        assert by_str.stop_reason == "stop"
        assert text in tok.decode(by_str.token_ids) and text not in tok.decode(by_str.token_ids[:-1])
        assert by_str.token_ids == base.token_ids[: len(by_str.token_ids)]
        short = await replica.generate(p, SamplingParams(temperature=1.0, max_tokens=3, seed=7), "short")
        assert short.token_ids == base.token_ids[:3] and short.stop_reason == "length"

    run(tiny_model_path, body)


def test_eos_stops_with_reason_stop(tiny_model_path, hf):
    model, tok = hf
    p = prompts(tok, 1)[0]

    async def body(replica):
        return await replica.generate(p, SamplingParams(temperature=0, max_tokens=6, logprobs=True), "r")

    base = run(tiny_model_path, body, mode="hybrid", model=model, tokenizer=tok)
    # a model whose eos is the token greedy decoding emits first
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    other.generation_config.eos_token_id = base.token_ids[0]
    out = run(tiny_model_path, body, mode="hybrid", model=other, tokenizer=tok)
    assert out.token_ids == base.token_ids[:1] and out.stop_reason == "stop"
    assert len(out.log_probs) == 1


def test_update_weights_loads_in_place_and_rejects_bad_names(tiny_model_path, hf):
    model, tok = hf
    p = prompts(tok, 1)[0]
    original = {k: v.clone() for k, v in model.state_dict().items()}

    async def body(replica):
        sp = SamplingParams(temperature=0, max_tokens=8, logprobs=True)
        before = await replica.generate(p, sp, "a")
        served = replica.model
        ptr = served.model.embed_tokens.weight.data_ptr()
        await replica.update_weights((k, v * 3.0) for k, v in original.items())
        assert served.model.embed_tokens.weight.data_ptr() == ptr
        changed = await replica.generate(p, sp, "b")
        with pytest.raises(KeyError, match=r"no parameter 'nope\.weight'"):
            await replica.update_weights([("nope.weight", torch.zeros(1))])
        with pytest.raises(ValueError, match="has shape"):
            await replica.update_weights([("model.norm.weight", torch.zeros(3))])
        await replica.update_weights(original.items())
        after = await replica.generate(p, sp, "c")
        return before, changed, after

    before, changed, after = run(tiny_model_path, body)
    assert changed.log_probs != before.log_probs
    assert after.token_ids == before.token_ids
    assert after.log_probs == pytest.approx(before.log_probs, abs=1e-6)


def test_sleep_blocks_generate_until_wake_up(tiny_model_path, hf):
    _, tok = hf
    p = prompts(tok, 1)[0]

    async def body(replica):
        await replica.sleep()
        with pytest.raises(RuntimeError, match=r"asleep: await replica\.wake_up"):
            await replica.generate(p, SamplingParams(max_tokens=2), "a")
        await replica.wake_up()
        return await replica.generate(p, SamplingParams(max_tokens=2), "b")

    assert len(run(tiny_model_path, body).token_ids) == 2


def test_sleep_level_2_frees_the_weights_and_a_full_update_brings_them_back(tiny_model_path, hf):
    """engine_kwargs.sleep_level=2: sleep frees every parameter of the private copy; generating before a
    weight update loaded them all again fails, naming what is missing; after the update the replica
    generates exactly as before it slept."""
    _, tok = hf
    p = prompts(tok, 1)[0]
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=True)

    async def body(replica):
        before = await replica.generate(p, sp, "a")
        weights = [(n, t.detach().clone()) for n, t in replica.model.state_dict().items()]
        held = sum(t.numel() for t in replica.model.parameters())
        await replica.sleep()
        freed = sum(t.numel() for t in replica.model.parameters())
        buffers = sum(b.numel() for b in replica.model.buffers())
        await replica.wake_up()
        with pytest.raises(RuntimeError, match=r"sleep_level=2 discarded the weights .* not loaded again"):
            await replica.generate(p, sp, "b")
        await replica.update_weights(weights[:2])  # a part only: still refused
        with pytest.raises(RuntimeError, match=rf"and {len(list(replica.model.parameters())) - 2} of them"):
            await replica.generate(p, sp, "c")
        with pytest.raises(ValueError, match=r"has shape \(\d+, \d+\), got \(3,\)"):
            await replica.update_weights([(weights[2][0], torch.zeros(3))])  # the shape it had is kept
        await replica.update_weights(weights)
        after = await replica.generate(p, sp, "d")
        return before, after, held, freed, buffers

    before, after, held, freed, buffers = run(tiny_model_path, body, sleep_level=2)
    assert held > 0 and freed == 0 and buffers > 0  # the rotary tables stay
    # the same weights: the same tokens, and log-probs to float rounding (oneDNN's kernels may sum in
    # another order for buffers at other addresses: one of six differed by 1 ulp on an AVX2-only CPU)
    assert after.token_ids == before.token_ids
    assert after.log_probs == pytest.approx(before.log_probs, abs=1e-5)


def test_sleep_level_is_checked(tiny_model_path, hf):
    model, tok = hf
    with pytest.raises(ValueError, match=r"engine_kwargs\.sleep_level must be 1 or 2, got 3"):
        HFRolloutReplica(0, RolloutConfig(engine_kwargs={"sleep_level": 3}), ModelConfig())
    replica = HFRolloutReplica(0, RolloutConfig(engine_kwargs={"sleep_level": 2}), ModelConfig())
    with pytest.raises(ValueError, match="in hybrid mode the replica serves the training model's weights"):
        asyncio.run(replica.init("hybrid", model=model, tokenizer=tok))


def test_modes_and_errors(tiny_model_path):
    replica = HFRolloutReplica(0, RolloutConfig(), ModelConfig(path=tiny_model_path, dtype="float32"))
    with pytest.raises(ValueError, match="Unknown rollout mode 'remote'; expected one of: hybrid, colocated"):
        asyncio.run(replica.init("remote"))
    with pytest.raises(ValueError, match="hybrid mode serves the training worker's model"):
        asyncio.run(replica.init("hybrid"))
    no_path = HFRolloutReplica(0, RolloutConfig(), ModelConfig(dtype="float32"))
    with pytest.raises(ValueError, match=r"standalone mode loads its own weights: set model\.path"):
        asyncio.run(no_path.init("standalone"))
    with pytest.raises(RuntimeError, match="before init"):
        asyncio.run(replica.generate([1], SamplingParams(), "r"))
    assert replica.server_address is None


def test_empty_prompt_is_rejected(tiny_model_path):
    async def body(replica):
        with pytest.raises(ValueError, match="prompt_ids is empty"):
            await replica.generate([], SamplingParams(), "r7")

    run(tiny_model_path, body)


class TestHFContractColocated(RolloutReplicaContract):
    replica_name = "hf"
    replica_class = HFRolloutReplica
    mode = "colocated"


class TestHFContractHybrid(RolloutReplicaContract):
    replica_name = "hf"
    mode = "hybrid"


def test_replica_survives_a_new_event_loop(tiny_model_path, hf):
    _, tok = hf
    p = prompts(tok, 1)[0]
    replica = HFRolloutReplica(0, RolloutConfig(), ModelConfig(path=tiny_model_path, dtype="float32"))
    asyncio.run(replica.init("standalone"))
    sp = SamplingParams(temperature=0, max_tokens=4)

    async def twice():
        return await asyncio.gather(replica.generate(p, sp, "a"), replica.generate(p, sp, "b"))

    first = asyncio.run(twice())
    second = asyncio.run(twice())  # the batching task and lock of the first loop are gone
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def test_shutdown_aborts_queued_requests(tiny_model_path, hf):
    _, tok = hf
    p = prompts(tok, 1)[0]

    async def body(replica):
        async with replica._get_lock():  # hold the batch back so requests stay queued
            tasks = [
                asyncio.ensure_future(replica.generate(p, SamplingParams(logprobs=True), f"r{i}"))
                for i in range(3)
            ]
            await asyncio.sleep(0.05)
            await replica.shutdown()
        return await asyncio.gather(*tasks)

    outs = run(tiny_model_path, body)
    assert [(o.token_ids, o.log_probs, o.stop_reason) for o in outs] == [([], [], "abort")] * 3


def test_shutdown_completes_after_an_interrupt_ended_the_batch_loop(tiny_model_path, hf):
    """SIGTERM's Terminated (or Ctrl-C's KeyboardInterrupt) raised inside a batch leaves the event loop
    where it happened; the shutdown that follows (the trainer's, as it stops) completes instead of
    raising it a second time and cutting the rest of the shutdown short."""
    from trellis.utils.termination import Terminated

    _, tok = hf
    replica = HFRolloutReplica(0, RolloutConfig(seed=0), ModelConfig(path=tiny_model_path, dtype="float32"))
    asyncio.run(replica.init("colocated"))
    calls = []

    def interrupted_forward(*args, **kwargs):
        calls.append(1)
        raise Terminated

    replica.model.forward = interrupted_forward
    with pytest.raises(Terminated):
        asyncio.run(replica.generate(prompts(tok, 1)[0], SamplingParams(max_tokens=4), "r0"))
    assert calls == [1] and replica._worker is not None and replica._worker.done()
    asyncio.run(replica.shutdown())
    assert replica._worker is None
    del replica.model.forward  # the class's forward again: the replica serves a new loop's requests
    out = asyncio.run(replica.generate(prompts(tok, 1)[0], SamplingParams(temperature=0, max_tokens=3), "r1"))
    assert len(out.token_ids) == 3
    asyncio.run(replica.shutdown())


def test_hybrid_leaves_the_training_mode_of_the_shared_model(tiny_model_path, hf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).train()
    _, tok = hf

    async def body(replica):
        return await replica.generate(prompts(tok, 1)[0], SamplingParams(temperature=0, max_tokens=3), "r")

    assert len(run(tiny_model_path, body, mode="hybrid", model=model, tokenizer=tok).token_ids) == 3
    assert model.training


def teacher_forced_logits(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1 : -1].float()


def test_mixed_batch_honours_every_rows_params_in_one_generate(tiny_model_path, hf):
    model, tok = hf
    ps = prompts(tok, 6)
    params = [
        SamplingParams(temperature=0, max_tokens=5, logprobs=True),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=12, logprobs=True),
        SamplingParams(temperature=1.3, top_p=0.8, max_tokens=9, logprobs=True),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_tokens=12, seed=3, logprobs=True),
        SamplingParams(temperature=1.0, max_tokens=3, logprobs=True),
        SamplingParams(temperature=0.5, max_tokens=12),  # no log-probs asked
    ]

    async def body(replica):
        outs = await asyncio.gather(
            *(replica.generate(p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(ps, params, strict=True)))
        )
        return outs, replica.generate_calls

    outs, calls = run(tiny_model_path, body, mode="hybrid", model=model, tokenizer=tok)
    assert calls == 1  # one batched generate, every row with its own params
    for p, sp, out in zip(ps, params, outs, strict=True):
        assert 0 < len(out.token_ids) <= sp.max_tokens
        assert out.stop_reason == ("length" if len(out.token_ids) == sp.max_tokens else "stop")
        if not sp.wants_logprobs:
            assert out.log_probs is None
            continue
        expected = teacher_forced_logprobs(model, p, out.token_ids, sp.temperature)
        torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=1e-4, rtol=0)
        logits = teacher_forced_logits(model, p, out.token_ids)
        chosen = torch.tensor(out.token_ids)[:, None]
        if sp.greedy:
            assert out.token_ids == logits.argmax(-1).tolist()
            continue
        probs = torch.softmax(logits / sp.temperature, -1)
        if sp.top_k > 0:  # every token among the top k
            assert ((probs > probs.gather(1, chosen)).sum(-1) < sp.top_k).all()
        if sp.top_p < 1 and sp.top_k < 0:  # every token in the nucleus: the mass above it is below top_p
            above = (probs * (probs > probs.gather(1, chosen))).sum(-1)
            assert (above < sp.top_p).all()


def test_seeded_request_is_the_same_on_either_stopping_path(tiny_model_path, hf):
    _, tok = hf
    ps = prompts(tok, 4)
    sp = SamplingParams(temperature=1.0, max_tokens=10, seed=42, logprobs=True)

    async def body(replica):
        alone = await replica.generate(ps[0], sp, "alone")  # a uniform batch: generate's own stopping
        mixed = await asyncio.gather(  # other lengths, stop ids and strings: the per-row criterion
            replica.generate(ps[0], sp, "seeded"),
            replica.generate(ps[1], SamplingParams(temperature=0, max_tokens=4), "g"),
            replica.generate(ps[2], SamplingParams(max_tokens=10, stop_token_ids=[7, 8]), "ids"),
            replica.generate(ps[3], SamplingParams(max_tokens=6, stop="zzz"), "str"),
        )
        return alone, mixed[0]

    alone, mixed = run(tiny_model_path, body)
    assert mixed.token_ids == alone.token_ids
    assert mixed.log_probs == pytest.approx(alone.log_probs, abs=1e-5)


def test_stop_ids_of_one_row_do_not_stop_its_batch_mates(tiny_model_path, hf):
    _, tok = hf
    p = prompts(tok, 1)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=5)

    async def body(replica):
        base = await replica.generate(p, sp, "base")
        stop_id = base.token_ids[3]
        first = base.token_ids.index(stop_id)
        with_stop = SamplingParams(temperature=1.0, max_tokens=12, seed=5, stop_token_ids=[stop_id])
        differing = await asyncio.gather(replica.generate(p, with_stop, "a"), replica.generate(p, sp, "b"))
        same = await asyncio.gather(replica.generate(p, with_stop, "c"), replica.generate(p, with_stop, "d"))
        return base, first, differing, same

    base, first, (stopped, full), same = run(tiny_model_path, body)
    assert stopped.token_ids == base.token_ids[: first + 1] and stopped.stop_reason == "stop"
    assert full.token_ids == base.token_ids and full.stop_reason == "length"
    for out in same:  # equal stop ids in every row: generate's own eos check ends them
        assert out.token_ids == stopped.token_ids and out.stop_reason == "stop"


def test_unseeded_sampling_is_reproducible_from_the_replica_seed(tiny_model_path, hf):
    model, tok = hf
    ps = prompts(tok, 6)

    def sample(seed):
        async def main():
            replica = HFRolloutReplica(0, RolloutConfig(seed=seed), ModelConfig())
            await replica.init("hybrid", model=model, tokenizer=tok)
            sp = SamplingParams(temperature=1.0, max_tokens=8)
            outs = await asyncio.gather(*(replica.generate(p, sp, f"r{i}") for i, p in enumerate(ps)))
            await replica.shutdown()
            return [o.token_ids for o in outs]

        return asyncio.run(main())

    assert sample(0) == sample(0)
    assert sample(0) != sample(1)


def test_row_sampler_draws_from_each_rows_distribution():
    from trellis.rollout.hf import _RowSampler

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 4000
    groups = [
        SamplingParams(temperature=1.0, logprobs=True),
        SamplingParams(temperature=0.5, top_k=2, logprobs=True),
        SamplingParams(temperature=2.0, top_p=0.6, logprobs=True),
    ]
    params = [sp for sp in groups for _ in range(n)]
    sampler = _RowSampler(params, torch.Generator().manual_seed(0), steps=1, device=torch.device("cpu"))
    scores = logits.expand(len(params), -1).clone()
    out = sampler(torch.zeros((len(params), 1), dtype=torch.long), scores)
    chosen = out.argmax(-1)
    assert ((out == 0).sum(-1) == 1).all() and torch.isinf(out).sum() == out.numel() - len(params)
    for g, sp in enumerate(groups):
        probs = torch.softmax(logits / sp.temperature, -1)
        rows = slice(g * n, (g + 1) * n)
        torch.testing.assert_close(
            sampler.log_probs[rows, 0], probs.log()[chosen[rows]], atol=1e-5, rtol=0
        )  # before truncation
        if sp.top_k > 0:
            probs[sp.top_k :] = 0
        if sp.top_p < 1:  # 0.6 at T=2: the top two tokens hold 0.36 + 0.22 < 0.6, so three stay
            keep = (probs.cumsum(0) - probs) < sp.top_p
            probs = probs * keep
        probs /= probs.sum()
        freq = torch.bincount(chosen[rows], minlength=len(logits)).double() / n
        assert (freq[probs == 0] == 0).all()
        torch.testing.assert_close(freq, probs.double(), atol=0.03, rtol=0)


def test_model_generation_config_penalties_stay_off_the_logits(tiny_model_path, hf):
    model, tok = hf
    from transformers import AutoModelForCausalLM

    penalised = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    penalised.generation_config.repetition_penalty = 5.0
    penalised.generation_config.no_repeat_ngram_size = 1
    penalised.generation_config.min_new_tokens = 4
    p = prompts(tok, 1)[0]

    async def body(replica):
        return await replica.generate(p, SamplingParams(temperature=0, max_tokens=8, logprobs=True), "r")

    base = run(tiny_model_path, body, mode="hybrid", model=model, tokenizer=tok)
    out = run(tiny_model_path, body, mode="hybrid", model=penalised, tokenizer=tok)
    assert len(set(base.token_ids)) < len(base.token_ids)  # greedy repeats a token: the n-gram ban would bite
    assert out.token_ids == base.token_ids
    torch.testing.assert_close(
        torch.tensor(out.log_probs), teacher_forced_logprobs(model, p, out.token_ids, 0), atol=1e-4, rtol=0
    )


def test_cpu_threads_setting(tiny_model_path, hf):
    import threading

    from trellis.rollout.hf import _torch_threads

    for bad in (0, "many", True, 1.5):
        with pytest.raises(ValueError, match="cpu_threads must be"):
            HFRolloutReplica(0, RolloutConfig(engine_kwargs={"cpu_threads": bad}), ModelConfig())
    model, tok = hf

    async def threads(**engine_kwargs):
        replica = HFRolloutReplica(0, RolloutConfig(engine_kwargs=engine_kwargs), ModelConfig())
        await replica.init("hybrid", model=model, tokenizer=tok)
        return replica._intra_op_threads()

    assert asyncio.run(threads()) == 1  # "auto": the 0.1M-parameter model is under the threshold
    assert asyncio.run(threads(cpu_threads=3)) == 3
    seen = []

    def worker():
        before = torch.get_num_threads()
        with _torch_threads(before + 1):
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())
        fresh = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        fresh.start()
        fresh.join()
        seen.append(before)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    during, after, fresh, before = seen
    assert during == before + 1 and after == before and fresh == before


def test_shared_cores_mark_generation_busy_and_decode_on_the_idle_trainers_cores(
    tiny_model_path, hf, tmp_path, monkeypatch
):
    import trellis.rollout.hf as hf_module
    from trellis.device.core_share import CoreShare

    model, tok = hf
    trainer = CoreShare.create([1, 1], directory=str(tmp_path))  # the trainer's slot 0: idle
    sp = SamplingParams(temperature=0, max_tokens=24)
    ps = prompts(tok, 4)

    async def body(replica):
        replica_share = CoreShare.attach(trainer.path, 1)
        assert replica.share_cores(replica_share)
        states, threads = [], []
        real = hf_module._torch_threads

        def recording(n):  # the thread count each decoding step asks for
            threads.append(n)
            return real(n)

        monkeypatch.setattr(hf_module, "_torch_threads", recording)

        async def watch(done):
            while not done.is_set():
                states.append(trainer.others_busy()[0])
                await asyncio.sleep(0)

        async def generate():
            done = asyncio.Event()
            watcher = asyncio.create_task(watch(done))
            outs = await asyncio.gather(*(replica.generate(p, sp, f"r{i}") for i, p in enumerate(ps)))
            done.set()
            await watcher
            return outs

        try:
            outs = await generate()
            assert all(len(o.token_ids) == 24 for o in outs)
            assert True in states  # busy while decoding (the watcher runs between steps)
            assert trainer.others_busy() == [False]  # idle once the batch is served
            small = list(threads)
            threads.clear()
            # a model at or over the threshold decodes with torch's setting: then it borrows
            monkeypatch.setattr(hf_module, "AUTO_SINGLE_THREAD_PARAMS", 0)
            await generate()
            borrowing = list(threads)
            threads.clear()
            with trainer.busy():  # the trainer trains: the replica keeps to its own thread
                await generate()
            return small, borrowing, list(threads)
        finally:
            replica_share.close()

    try:
        small, borrowing, beside = run(tiny_model_path, body, mode="hybrid", model=model, tokenizer=tok)
    finally:
        trainer.close()
    assert small and set(small) == {1}  # "auto" on the 0.1M model: one thread, lent but never borrowed
    assert len(borrowing) >= 24 and set(borrowing) == {2}  # every step: own thread + the idle trainer's
    assert len(beside) >= 24 and set(beside) == {1}


def test_colocated_weights_and_tokenizer_follow_the_model_config(tiny_model_path, hf, tmp_path):
    _, tok = hf
    marked = copy.deepcopy(tok)
    marked.model_max_length = 77
    marked.save_pretrained(tmp_path / "tokenizer")

    async def load(rollout_config, model_config):
        replica = HFRolloutReplica(0, rollout_config, model_config)
        await replica.init("colocated")
        try:
            return replica.model, replica.tokenizer, replica._generator.initial_seed()
        finally:
            await replica.shutdown()

    model_config = ModelConfig(
        path=tiny_model_path,
        tokenizer_path=str(tmp_path / "tokenizer"),
        dtype="float16",
        attn_implementation="eager",
    )
    model, tokenizer, seed = asyncio.run(load(RolloutConfig(seed=4), model_config))
    assert model.dtype == torch.float16 and model.config._attn_implementation == "eager"
    assert tokenizer.model_max_length == 77 and seed == 4
    # dicts read like the sections; what they leave out is the schema's default (bfloat16 weights)
    model, tokenizer, seed = asyncio.run(load({"seed": 9}, {"path": tiny_model_path}))
    assert model.dtype == torch.bfloat16 == getattr(torch, ModelConfig().dtype)
    assert tokenizer.model_max_length != 77 and seed == 9
