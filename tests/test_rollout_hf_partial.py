"""The hf rollout replica across weight updates: weight versions, update sessions, partial rollout."""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest
import torch

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.rollout import SamplingParams
from trellis.rollout.hf import HFRolloutReplica
from trellis.testing.rollout import teacher_forced_log_probs

PAUSE_AT = 10  # the embedding call (= generated token) of the first batch during which the update begins


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(tiny_model_path):
    """The tiny model with an eos id outside its vocabulary (never generated: responses run to
    max_tokens), its tokenizer and a prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = model.config.vocab_size
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    return model, tok, tok("The quick brown fox")["input_ids"]


def perturbed(model):
    g = torch.Generator().manual_seed(0)
    return {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def with_weights(model, state):
    other = copy.deepcopy(model)
    other.load_state_dict(state)
    return other


def run(model, tok, body, partial=False, seed=0, decode_thread="worker"):
    """``body(replica)`` on a hybrid replica; it decodes in a worker thread, which :class:`Pause` can hold
    mid-step (``decode_thread="loop"``: on the loop's thread, between whose steps the test moves)."""

    async def main():
        replica = HFRolloutReplica(
            0,
            RolloutConfig(seed=seed, partial_rollout=partial, engine_kwargs={"decode_thread": decode_thread}),
            ModelConfig(dtype="float32"),
        )
        await replica.init("hybrid", model=model, tokenizer=tok)
        try:
            return await asyncio.wait_for(body(replica), 20)
        finally:
            await replica.shutdown()

    return asyncio.run(main())


def generate(model, tok, prompt, sp):
    async def body(replica):
        return await replica.generate(prompt, sp, "ref")

    return run(model, tok, body)


class Pause:
    """Holds the generation thread in the ``at``-th call of ``model``'s input embedding (one per forward
    pass or lean decoding step) until released; on the loop's thread, lets the loop run the test's next
    move once that step ends."""

    def __init__(self, model, at=PAUSE_AT):
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.reached = asyncio.Event()
        self.release = threading.Event()
        self.at, self.calls = at, 0
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1
        if self.calls == self.at and threading.get_ident() == self.loop_thread:
            # decoding on the loop's thread (decode_thread "loop"): the test's next move comes after this step
            self.reached.set()
        elif self.calls == self.at:
            self.loop.call_soon_threadsafe(self.reached.set)
            if not self.release.wait(timeout=30):
                raise RuntimeError("Pause was never released")


async def begin_while_paused(replica, pause):
    """Begin a weight update while the batch is in its PAUSE_AT-th step, then let the batch go on."""
    await pause.reached.wait()
    begin = asyncio.ensure_future(replica.begin_weight_update())
    await asyncio.sleep(0)  # begin runs first: it signals the interrupt, then waits for the lock
    pause.release.set()
    await begin
    pause.handle.remove()


def test_tokens_carry_the_version_of_the_weights_that_generated_them(base):
    model, tok, prompt = base
    sp = SamplingParams(temperature=0, max_tokens=8)

    async def body(replica):
        before = await replica.generate(prompt, sp, "a")
        await replica.begin_weight_update()
        await replica.update_weights(perturbed(model).items())  # in the session: no second lock
        await replica.update_weights([])  # several buckets
        await replica.end_weight_update(7)
        after = await replica.generate(prompt, sp, "b")
        await replica.update_weights(model.state_dict().items())  # alone: takes the lock itself
        await replica.end_weight_update()  # no begin: only counts one more
        counted = await replica.generate(prompt, sp, "c")
        return before, after, counted, replica.weight_version

    before, after, counted, version = run(copy.deepcopy(model), tok, body)
    assert before.weight_versions == [0] * 8 and len(before.token_ids) == 8
    assert after.weight_versions == [7] * 8 and after.token_ids != before.token_ids
    assert counted.weight_versions == [8] * 8 and counted.token_ids == before.token_ids
    assert version == 8


@pytest.mark.parametrize("decode_thread", ["worker", "loop"])
def test_partial_rollout_resumes_the_response_with_the_new_weights(base, decode_thread):
    model, tok, prompt = base
    new = perturbed(model)
    sp = SamplingParams(temperature=0, max_tokens=64, logprobs=True)
    short = SamplingParams(temperature=0, max_tokens=5, logprobs=True)

    async def body(replica):
        pause = Pause(replica.model)
        long_task = asyncio.ensure_future(replica.generate(prompt, sp, "long"))
        short_task = asyncio.ensure_future(replica.generate(prompt[:3], short, "short"))
        await begin_while_paused(replica, pause)
        await replica.update_weights(new.items())
        await replica.end_weight_update(1)
        return await long_task, await short_task, replica.generate_calls

    out, short_out, calls = run(copy.deepcopy(model), tok, body, partial=True, decode_thread=decode_thread)
    # in a worker thread the update begins during step PAUSE_AT; on the loop's thread the decoder's next
    # step runs before the test's begin_weight_update task does, so one more token has the old weights
    k = PAUSE_AT if decode_thread == "worker" else PAUSE_AT + 1
    assert calls == 2  # the interrupted batch, then the resumed row alone
    assert len(out.token_ids) == 64 and len(out.log_probs) == 64 and out.stop_reason == "length"
    assert out.weight_versions == [0] * k + [1] * (64 - k)
    prefix, rest = out.token_ids[:k], out.token_ids[k:]
    old = generate(model, tok, prompt, sp)  # the same request, uninterrupted, with the old weights
    assert prefix == old.token_ids[:k] and rest != old.token_ids[k:]
    new_model = with_weights(model, new)
    resumed = generate(new_model, tok, prompt + prefix, SamplingParams(temperature=0, max_tokens=64 - k))
    assert rest == resumed.token_ids
    torch.testing.assert_close(
        torch.tensor(out.log_probs[:k]), teacher_forced_log_probs(model, prompt, prefix, 0), atol=1e-4, rtol=0
    )
    # 54 cached decode steps on the perturbed weights against one teacher-forced pass: fp32 rounding
    # reached 1.05e-4 on one token with transformers 5.25 (below 1e-4 with 5.24)
    torch.testing.assert_close(
        torch.tensor(out.log_probs[k:]),
        teacher_forced_log_probs(new_model, prompt + prefix, rest, 0),
        atol=2e-4,
        rtol=0,
    )
    # the row that had finished when the batch was interrupted is resolved as it was
    assert short_out.weight_versions == [0] * 5 and short_out.stop_reason == "length"
    assert short_out.token_ids == generate(model, tok, prompt[:3], short).token_ids


def test_without_partial_rollout_the_update_waits_for_the_batch(base):
    model, tok, prompt = base
    new = perturbed(model)
    sp = SamplingParams(temperature=0, max_tokens=64, logprobs=True)

    async def body(replica):
        pause = Pause(replica.model)
        during = asyncio.ensure_future(replica.generate(prompt, sp, "during"))
        await begin_while_paused(replica, pause)
        await replica.update_weights(new.items())
        await replica.end_weight_update(1)
        after = await replica.generate(prompt, sp, "after")
        return await during, after, replica.generate_calls

    during, after, calls = run(copy.deepcopy(model), tok, body)
    assert calls == 2
    assert during.weight_versions == [0] * 64 and during.stop_reason == "length"
    assert during.token_ids == generate(model, tok, prompt, sp).token_ids  # old weights throughout
    assert after.weight_versions == [1] * 64
    assert after.token_ids == generate(with_weights(model, new), tok, prompt, sp).token_ids


def seeded_interrupted_and_not(model, tok, prompt, sp):
    """``sp``'s response uninterrupted, then interrupted by an update that loads the same weights."""

    async def body(replica):
        plain = await replica.generate(prompt, sp, "plain")
        pause = Pause(replica.model)
        task = asyncio.ensure_future(replica.generate(prompt, sp, "interrupted"))
        await begin_while_paused(replica, pause)
        await replica.update_weights({k: v.clone() for k, v in replica.model.state_dict().items()}.items())
        await replica.end_weight_update(1)
        return plain, await task

    return run(copy.deepcopy(model), tok, body, partial=True)


def test_seeded_response_continues_the_same_random_stream(base):
    model, tok, prompt = base
    sp = SamplingParams(temperature=1.0, max_tokens=40, seed=1234, logprobs=True)
    plain, interrupted = seeded_interrupted_and_not(model, tok, prompt, sp)
    assert plain.weight_versions == [0] * 40
    assert interrupted.weight_versions == [0] * PAUSE_AT + [1] * (40 - PAUSE_AT)
    assert interrupted.token_ids == plain.token_ids and interrupted.stop_reason == "length"
    assert interrupted.log_probs == pytest.approx(plain.log_probs, abs=1e-5)
    # and it is a sampled response: another seed gives other tokens
    other = generate(model, tok, prompt, SamplingParams(temperature=1.0, max_tokens=40, seed=1))
    assert other.token_ids != plain.token_ids


def test_stop_string_spanning_the_interruption_is_found(base):
    model, tok, prompt = base
    k = PAUSE_AT
    for seed in range(20):  # a response whose text after token k + 1 starts anew at token k
        full = generate(model, tok, prompt, SamplingParams(temperature=1.0, max_tokens=40, seed=seed))
        head, upto = tok.decode(full.token_ids[:k]), tok.decode(full.token_ids[: k + 1])
        stop = upto[len(head) - 1 :]  # the last character of the prefix and the next token's text
        if upto.startswith(head) and stop not in head and stop not in tok.decode(full.token_ids[k:]):
            break
    else:
        pytest.fail("no seed gives a stop string that only the whole response contains")
    sp = SamplingParams(temperature=1.0, max_tokens=40, seed=seed, stop=stop)
    plain, interrupted = seeded_interrupted_and_not(model, tok, prompt, sp)
    assert plain.token_ids == full.token_ids[: k + 1] and plain.stop_reason == "stop"
    assert interrupted.token_ids == plain.token_ids and interrupted.stop_reason == "stop"
    assert interrupted.weight_versions == [0] * k + [1]


@pytest.mark.parametrize("partial", [True, False])
def test_batch_waiting_for_the_lock_when_an_update_begins(base, partial):
    """Partial rollout: the waiting batch lets the update load first; else it runs first."""
    model, tok, prompt = base
    new = perturbed(model)
    sp = SamplingParams(temperature=0, max_tokens=8)

    async def body(replica):
        lock = replica._get_lock()
        await lock.acquire()  # e.g. a sleep() in progress
        task = asyncio.ensure_future(replica.generate(prompt, sp, "r"))
        await asyncio.sleep(0.05)  # the batching task took the request and waits for the lock
        begin = asyncio.ensure_future(replica.begin_weight_update())
        await asyncio.sleep(0)
        lock.release()
        await begin
        await replica.update_weights(new.items())
        await replica.end_weight_update(3)
        return await task, replica.generate_calls

    out, calls = run(copy.deepcopy(model), tok, body, partial=partial)
    assert calls == 1
    served_by = with_weights(model, new) if partial else model
    assert out.weight_versions == [3 if partial else 0] * 8
    assert out.token_ids == generate(served_by, tok, prompt, sp).token_ids


def test_shutdown_aborts_interrupted_and_queued_requests(base):
    model, tok, prompt = base
    sp = SamplingParams(temperature=0, max_tokens=64, logprobs=True)

    async def body(replica):
        pause = Pause(replica.model)
        interrupted = asyncio.ensure_future(replica.generate(prompt, sp, "interrupted"))
        await begin_while_paused(replica, pause)  # the interrupted request now waits to resume
        late = asyncio.ensure_future(replica.generate(prompt, sp, "late"))
        await asyncio.sleep(0.01)
        await replica.shutdown()
        outs = await asyncio.gather(interrupted, late)
        await replica.end_weight_update(1)
        return outs, replica.generate_calls, replica.weight_version

    outs, calls, version = run(copy.deepcopy(model), tok, body, partial=True)
    assert calls == 1 and version == 1
    assert [(o.token_ids, o.log_probs, o.weight_versions, o.stop_reason) for o in outs] == [
        ([], [], [], "abort")
    ] * 2


def test_partial_rollout_must_be_a_bool():
    with pytest.raises(ValueError, match="partial_rollout must be true or false, got 'yes'"):
        HFRolloutReplica(0, {"partial_rollout": "yes"}, ModelConfig())
