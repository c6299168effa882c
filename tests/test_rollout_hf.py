"""The hf rollout replica: batching, exact greedy and log-probs, stopping, seeds, weights, lifecycle."""

from __future__ import annotations

import asyncio

import pytest
import torch

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.registries import get_rollout_replica_class
from trellis.rollout import SamplingParams, TokenOutput
from trellis.rollout.hf import HFRolloutReplica
from trellis.testing import RolloutReplicaContract

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


def teacher_forced_logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


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
    _, tok = hf
    ps = prompts(tok, 10)

    async def body(replica):
        await asyncio.gather(
            *(replica.generate(p, SamplingParams(max_tokens=3), f"r{i}") for i, p in enumerate(ps))
        )
        return replica.generate_calls

    assert run(tiny_model_path, body, max_batch_size=4) == 3


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


def test_hybrid_leaves_the_training_mode_of_the_shared_model(tiny_model_path, hf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).train()
    _, tok = hf

    async def body(replica):
        return await replica.generate(prompts(tok, 1)[0], SamplingParams(temperature=0, max_tokens=3), "r")

    assert len(run(tiny_model_path, body, mode="hybrid", model=model, tokenizer=tok).token_ids) == 3
    assert model.training
