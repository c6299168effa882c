"""The sglang replica on the fake SGLang: the contract, the request/answer mapping, memory, weights, servers.

Every test here runs on the CPU: :class:`trellis_sglang.testing.FakeSGLang` stands in for the
sglang package (a Hugging Face model under SGLang's API). The same behaviour on a real engine is
checked by test_sglang_gpu.py where CUDA and sglang are present.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import re
import threading
from typing import Any, ClassVar

import pytest
import torch
from sglang_helpers import live_threads, make_replica, run
from trellis_sglang.engine import ServerEngine
from trellis_sglang.replica import SGLangRolloutReplica, to_sglang_sampling_params, to_token_output
from trellis_sglang.testing import FakeSGLang

from trellis.checkpoint.sync import WeightSyncManager
from trellis.registries import get_rollout_replica_class, rollout_replicas
from trellis.rollout import SamplingParams, TokenOutput
from trellis.testing import RolloutReplicaContract
from trellis.testing.rollout import teacher_forced_log_probs as teacher_forced_logprobs

PROMPTS = ["What is 12 + 7?", "Compute 3 * 4 - 5. First", "The quick brown fox", "system You are"]
ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]


def prompts(tok, n):
    return [tok(PROMPTS[i % 4] + " 1" * (i // 4))["input_ids"] for i in range(n)]


def hf_greedy(model, prompt, n):
    """``n`` greedy tokens of ``model`` (no eos stop), one argmax at a time."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def perturbed(state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=gen) * (v.float().std() + 0.1) for k, v in state.items()}


def control_calls(engine):
    """The engine's calls other than generation, as (method, kwargs) with update calls summarised."""
    calls = []
    for method, kwargs in engine.calls[1:]:
        if method == "async_generate":
            continue
        if method == "update_weights_from_tensor":
            kwargs = {"n": len(kwargs["names"]), "flush_cache": kwargs["flush_cache"]}
        calls.append((method, kwargs))
    return calls


# ---------------------------------------------------------------- the contract, three ways


class TestSGLangContractColocated(RolloutReplicaContract):
    replica_name = "sglang"
    replica_class = SGLangRolloutReplica
    mode = "colocated"

    @pytest.fixture(autouse=True)
    def _fake_sglang(self, fake):
        return fake


class TestSGLangContractHybrid(RolloutReplicaContract):
    replica_name = "sglang"
    mode = "hybrid"

    @pytest.fixture(autouse=True)
    def _fake_sglang(self, fake):
        return fake


class TestSGLangContractServer(RolloutReplicaContract):
    replica_name = "sglang"
    mode = "colocated"
    engine_kwargs: ClassVar[dict[str, Any]] = {"server": True}

    @pytest.fixture(autouse=True)
    def _fake_sglang(self, fake):
        return fake


def test_registry_names_the_plugin_as_provider():
    assert get_rollout_replica_class("sglang") is SGLangRolloutReplica
    (entry,) = [e for e in rollout_replicas.entries() if e.name == "sglang"]
    assert (entry.provider, entry.target) == ("trellis-sglang", "trellis_sglang.replica:SGLangRolloutReplica")


# ---------------------------------------------------------------- request and answer mapping


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (
            SamplingParams(),
            {
                "max_new_tokens": 16,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": -1,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "frequency_penalty": 0.0,
                "presence_penalty": 0.0,
                "skip_special_tokens": False,
                "no_stop_trim": True,
            },
        ),
        (
            SamplingParams(
                temperature=0,
                top_p=0.9,
                top_k=20,
                max_tokens=5,
                stop_token_ids=[7, 9],
                stop="##",
                seed=3,
                logprobs=True,
            ),
            {
                "max_new_tokens": 5,
                "temperature": 0.0,
                "top_p": 0.9,
                "top_k": 20,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "frequency_penalty": 0.0,
                "presence_penalty": 0.0,
                "skip_special_tokens": False,
                "no_stop_trim": True,
                "stop_token_ids": [7, 9],
                "stop": ["##"],
                "sampling_seed": 3,
            },
        ),
    ],
)
def test_sampling_params_map_to_sglang_names(params, expected):
    assert to_sglang_sampling_params(params) == expected


@pytest.mark.parametrize(
    ("finish", "reason"),
    [
        ({"type": "stop", "matched": 5}, "stop"),
        ({"type": "stop", "matched": "##"}, "stop"),
        ({"type": "length", "length": 3}, "length"),
        (
            {"type": "abort", "message": "Abort before prefill", "status_code": None, "err_type": None},
            "abort",
        ),
    ],
)
def test_answers_map_to_token_outputs(finish, reason):
    in_process = {  # Engine.async_generate: logprob entries are tuples
        "text": "abc",
        "output_ids": [4, 9, 5],
        "meta_info": {
            "finish_reason": finish,
            "output_token_logprobs": [(-0.5, 4, None), (-1.25, 9, None), (-2.0, 5, None)],
        },
    }
    over_http = {
        **in_process,
        "meta_info": {
            **in_process["meta_info"],
            "output_token_logprobs": [[-0.5, 4, None], [-1.25, 9, None], [-2.0, 5, None]],
        },
    }
    for answer in (in_process, over_http):
        out = to_token_output(answer, SamplingParams(logprobs=True), "r")
        assert (out.token_ids, out.log_probs, out.stop_reason) == ([4, 9, 5], [-0.5, -1.25, -2.0], reason)
        assert to_token_output(answer, SamplingParams(), "r").log_probs is None


def test_malformed_answers_raise_naming_the_request():
    good = {
        "output_ids": [4],
        "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-1.0, 4, None)]},
    }
    with pytest.raises(
        RuntimeError, match=r"request 'r3': SGLang finished with an unknown reason \{'type': 'eos'\}"
    ):
        to_token_output({**good, "meta_info": {"finish_reason": {"type": "eos"}}}, SamplingParams(), "r3")
    with pytest.raises(RuntimeError, match="request 'r3': log-probs were asked for but SGLang returned none"):
        to_token_output(
            {**good, "meta_info": {"finish_reason": {"type": "length"}}}, SamplingParams(logprobs=1), "r3"
        )
    bad = {**good, "meta_info": {**good["meta_info"], "output_token_logprobs": [(-1.0, 8, None)]}}
    with pytest.raises(RuntimeError, match=r"log-probs are for tokens \[8\], its output is \[4\]"):
        to_token_output(bad, SamplingParams(logprobs=True), "r3")


def test_generate_sends_token_ids_and_returns_the_models_greedy_tokens_and_logprobs(
    tiny_model_path, hf, fake
):
    model, tok = hf
    p = prompts(tok, 1)[0]
    sp = SamplingParams(temperature=0, max_tokens=10, logprobs=True)

    async def body(replica):
        return await replica.generate(p, sp, "r0")

    out = run(tiny_model_path, body)
    (request,) = fake.engines[0].calls_to("async_generate")
    assert request == {
        "input_ids": p,
        "sampling_params": to_sglang_sampling_params(sp),
        "return_logprob": True,
        "rid": "r0#0",
    }
    assert isinstance(out, TokenOutput) and out.stop_reason == "length"
    assert out.token_ids == hf_greedy(model, p, 10)
    torch.testing.assert_close(
        torch.tensor(out.log_probs), teacher_forced_logprobs(model, p, out.token_ids, 0)
    )


def test_sampled_logprobs_are_of_the_temperature_scaled_distribution(tiny_model_path, hf, fake):
    model, tok = hf
    ps = prompts(tok, 3)
    sp = SamplingParams(temperature=0.7, top_k=30, top_p=0.9, max_tokens=8, logprobs=True)

    async def body(replica):
        return await asyncio.gather(*(replica.generate(p, sp, f"r{i}") for i, p in enumerate(ps)))

    for p, out in zip(ps, run(tiny_model_path, body), strict=True):
        expected = teacher_forced_logprobs(model, p, out.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=1e-4, rtol=0)


def test_stop_ids_strings_and_lengths_keep_the_stop_token(tiny_model_path, hf, fake):
    _, tok = hf
    p = prompts(tok, 1)[0]

    def sp(**kw):
        return SamplingParams(**{"temperature": 1.0, "max_tokens": 12, "seed": 7, **kw})

    async def body(replica):
        base = await replica.generate(p, sp(), "base")
        assert base.stop_reason == "length" and len(base.token_ids) == 12
        stop_id = base.token_ids[4]
        first = base.token_ids.index(stop_id)
        by_id = await replica.generate(p, sp(stop_token_ids=[stop_id]), "id")
        assert (by_id.token_ids, by_id.stop_reason) == (base.token_ids[: first + 1], "stop")
        text = tok.decode(base.token_ids[5:7])
        by_str = await replica.generate(p, sp(stop=text), "str")
        assert by_str.stop_reason == "stop" and by_str.token_ids == base.token_ids[: len(by_str.token_ids)]
        assert text in tok.decode(by_str.token_ids) and text not in tok.decode(by_str.token_ids[:-1])
        short = await replica.generate(p, sp(max_tokens=3), "short")
        assert (short.token_ids, short.stop_reason) == (base.token_ids[:3], "length")
        other_seed = await replica.generate(p, sp(seed=8), "other")
        assert other_seed.token_ids != base.token_ids
        return stop_id, text

    # sampling_seed is honoured only by an engine in deterministic mode, as in SGLang
    stop_id, text = run(tiny_model_path, body, enable_deterministic_inference=True)
    requests = [r["sampling_params"] for r in fake.engines[0].calls_to("async_generate")]
    assert [r["sampling_seed"] for r in requests] == [7, 7, 7, 7, 8]
    assert (requests[1]["stop_token_ids"], requests[2]["stop"]) == ([stop_id], [text])


def test_concurrent_requests_reach_the_engine_together(tiny_model_path, hf, fake):
    _, tok = hf
    ps = prompts(tok, 8)

    async def body(replica):
        engine = fake.engines[0]
        engine.hold_requests()  # requests stay in the engine until all 8 are there
        calls = asyncio.gather(
            *(replica.generate(p, SamplingParams(max_tokens=4), f"r{i}") for i, p in enumerate(ps))
        )
        for _ in range(500):  # a replica that serialised requests would never get there
            if engine.in_flight == 8:
                break
            await asyncio.sleep(0.01)
        in_flight = engine.in_flight
        engine.release_requests()
        return in_flight, await calls

    in_flight, outs = run(tiny_model_path, body)
    assert in_flight == 8  # SGLang batches them; the replica must not serialise
    assert [len(o.token_ids) for o in outs] == [4] * 8
    assert sorted(r["rid"] for r in fake.engines[0].calls_to("async_generate")) == [
        f"r{i}#{i}" for i in range(8)
    ]


# ---------------------------------------------------------------- configuration and errors


def test_engine_args_derive_from_the_configs_and_engine_kwargs_override(tiny_model_path):
    replica = make_replica(
        tiny_model_path,
        rank=2,
        rollout={"seed": 5, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.3},
        server=True,
        server_startup_timeout_s=30,
        attention_backend="triton",
        mem_fraction_static=0.4,
    )
    assert replica.engine_args("colocated", device="cuda:1") == {
        "model_path": tiny_model_path,
        "dtype": "float32",
        "trust_remote_code": False,
        "tp_size": 2,
        "mem_fraction_static": 0.4,
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": True,
        "random_seed": 7,
        "base_gpu_id": 1,
        "attention_backend": "triton",
    }
    assert (replica.server, replica.server_startup_timeout_s) == (True, 30.0)
    hybrid = replica.engine_args("hybrid", device=torch.device("cuda", 3))
    assert (hybrid["enable_weights_cpu_backup"], hybrid["base_gpu_id"]) == (False, 3)
    keep = make_replica(tiny_model_path, rollout={"free_cache_engine": False, "seed": None})
    args = keep.engine_args("standalone")
    assert args["enable_memory_saver"] is False
    assert "enable_weights_cpu_backup" not in args and "random_seed" not in args


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"server": "yes"}, "engine_kwargs.server must be true or false, got 'yes'"),
        (
            {"server_startup_timeout_s": 0},
            "engine_kwargs.server_startup_timeout_s must be a positive number, got 0",
        ),
        (
            {"update_weights_bucket_megabytes": "big"},
            "update_weights_bucket_megabytes must be a positive number",
        ),
    ],
)
def test_bad_replica_options_are_rejected(tiny_model_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_replica(tiny_model_path, **kwargs)


def test_init_starts_sglang_with_the_engine_args(tiny_model_path, fake):
    async def body(replica):
        return replica.engine_args("standalone")

    args = run(tiny_model_path, body, mode="standalone")
    assert fake.engines[0].calls[0] == ("__init__", args)
    assert fake.engines[0].calls[-1] == ("shutdown", {})


def test_an_unknown_sglang_option_fails_as_in_sglang(tiny_model_path, fake):
    replica = make_replica(tiny_model_path, not_a_server_arg=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_a_server_arg'"):
        asyncio.run(replica.init("colocated"))


def test_request_and_lifecycle_errors(tiny_model_path, hf, fake):
    _, tok = hf
    replica = make_replica(tiny_model_path)
    with pytest.raises(RuntimeError, match=r"generate before init\(\): await replica\.init\(mode\) first"):
        asyncio.run(replica.generate([1], SamplingParams(), "r"))
    with pytest.raises(ValueError, match="hybrid mode serves the training worker's weights: pass init"):
        asyncio.run(replica.init("hybrid"))
    no_path = make_replica(None)
    with pytest.raises(
        ValueError, match=r"sglang loads its own copy of the model in every mode \(standalone too\)"
    ):
        asyncio.run(no_path.init("standalone"))
    assert fake.engines == []

    async def body(replica):
        with pytest.raises(ValueError, match="request 'r7': prompt_ids is empty"):
            await replica.generate([], SamplingParams(), "r7")
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, got dict"):
            await replica.generate([1], {"max_tokens": 2}, "r8")
        with pytest.raises(RuntimeError, match="already started"):
            await replica.init("colocated")
        await replica.sleep()
        with pytest.raises(RuntimeError, match=r"SGLangRolloutReplica is asleep: await replica\.wake_up\(\)"):
            await replica.generate(prompts(tok, 1)[0], SamplingParams(), "r9")
        await replica.shutdown()
        await replica.shutdown()  # idempotent
        with pytest.raises(RuntimeError, match=r"generate after shutdown\(\): build a new replica"):
            await replica.generate([1], SamplingParams(), "r10")
        assert replica.server_address is None

    run(tiny_model_path, body)
    assert [m for m, _ in fake.engines[0].calls].count("shutdown") == 1
    assert fake.engines[0].calls_to("async_generate") == []


@pytest.mark.parametrize("server", [False, True])
def test_every_call_may_come_from_a_new_event_loop(tiny_model_path, hf, fake, server):
    """The trainer's way: one asyncio.run per call. The engine stays on the replica's own loop."""
    from transformers import AutoModelForCausalLM

    model, tok = hf
    ps = prompts(tok, 3)
    target = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    target.load_state_dict(perturbed(target.state_dict(), seed=2))
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=True)
    threads_before = live_threads()
    replica = make_replica(tiny_model_path, server=server, update_weights_bucket_megabytes=0.05)

    asyncio.run(replica.init("colocated"))
    loop_thread = replica._loop.thread
    assert loop_thread.is_alive() and loop_thread.name == "trellis-sglang-0"

    async def generate_all(tag):
        return await asyncio.gather(*(replica.generate(p, sp, f"{tag}{i}") for i, p in enumerate(ps)))

    def in_another_thread(tag):  # a caller loop in another thread, at the same time as this one's
        return asyncio.run(generate_all(tag))

    async def concurrently():
        return await asyncio.gather(generate_all("a"), asyncio.to_thread(in_another_thread, "b"))

    first, from_thread = asyncio.run(concurrently())

    async def sleep_update_wake():
        await replica.sleep()
        await replica.wake_up()
        await replica.update_weights(target.state_dict().items())
        await replica.resume()

    asyncio.run(sleep_update_wake())
    after = asyncio.run(generate_all("c"))
    asyncio.run(replica.shutdown())

    for p, out, again in zip(ps, first, from_thread, strict=True):
        assert out.token_ids == again.token_ids == hf_greedy(model, p, 6)
        torch.testing.assert_close(
            torch.tensor(out.log_probs), teacher_forced_logprobs(model, p, out.token_ids, 0)
        )
    for p, out in zip(ps, after, strict=True):
        assert out.token_ids == hf_greedy(target, p, 6)
        torch.testing.assert_close(
            torch.tensor(out.log_probs), teacher_forced_logprobs(target, p, out.token_ids, 0)
        )
    assert [o.token_ids for o in after] != [o.token_ids for o in first]
    engine = fake.engines[0]
    if not server:  # the fake, like SGLang, would have raised had any call come from another loop
        assert engine.tokenizer_manager.event_loop is replica._loop.loop
    calls = control_calls(engine)
    assert calls[:2] == [
        ("release_memory_occupation", {"tags": ALL_TAGS}),
        ("resume_memory_occupation", {"tags": ["weights"]}),
    ]
    assert len(calls[2:-3]) > 1 and {m for m, _ in calls[2:-3]} == {"update_weights_from_tensor"}
    assert calls[-3:] == [
        ("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
        ("flush_cache", {}),
        ("shutdown", {}),
    ]
    assert len(engine.calls_to("async_generate")) == 9
    # shutdown stopped the loop thread (and, with a server, the HTTP client's threads)
    assert not loop_thread.is_alive() and not replica._loop.running
    assert not [t.name for t in threading.enumerate() if t.name.startswith("trellis-sglang")]
    if not server:  # (the fake server's own threads end in their own time)
        assert live_threads() <= threads_before  # none started here is left


def test_a_replica_dropped_without_shutdown_stops_its_thread_and_engine(tiny_model_path, fake):
    replica = make_replica(tiny_model_path)
    asyncio.run(replica.init("colocated"))
    loop_thread = replica._loop.thread
    del replica
    gc.collect()
    assert not loop_thread.is_alive()
    assert fake.engines[0].is_shut_down


def test_a_failed_start_leaves_no_thread_behind(tiny_model_path, fake):
    threads_before = live_threads()
    replica = make_replica(tiny_model_path, bogus=1)  # not a ServerArgs field: SGLang raises TypeError
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus'"):
        asyncio.run(replica.init("colocated"))
    assert live_threads() <= threads_before  # none started here is left
    asyncio.run(replica.shutdown())  # nothing to do, and no error


def test_the_replicas_thread_uses_the_callers_cuda_device(tiny_model_path, fake, monkeypatch):
    set_on = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: set_on.append((d, threading.current_thread().name))
    )
    replica = make_replica(tiny_model_path)
    asyncio.run(replica.init("colocated"))  # CUDA device is per thread: the tensors must land on 3
    asyncio.run(replica.shutdown())
    assert set_on == [(3, "trellis-sglang-0")]


def test_init_without_sglang_says_how_to_install_it(tiny_model_path):
    replica = make_replica(tiny_model_path)  # the real loader: sglang is not installed here
    with pytest.raises(
        ImportError, match=re.escape("sglang is not installed: pip install 'sglang[all]>=0.5.3'")
    ):
        asyncio.run(replica.init("colocated"))


# ---------------------------------------------------------------- memory


def test_sleep_wake_up_and_resume_release_and_restore_in_stages(tiny_model_path, hf, fake):
    _, tok = hf
    p = prompts(tok, 1)[0]
    sp = SamplingParams(temperature=0, max_tokens=6)

    async def body(replica):
        engine = fake.engines[0]
        before = await replica.generate(p, sp, "a")
        await replica.sleep()
        await replica.sleep()  # already released: nothing more to do
        assert engine.released == set(ALL_TAGS) and replica.asleep
        await replica.wake_up()
        assert engine.released == {"kv_cache", "cuda_graph"} and not replica.asleep
        await replica.resume()
        await replica.resume()  # nothing released: no call
        assert engine.released == set()
        after = await replica.generate(p, sp, "b")
        return before, after

    before, after = run(tiny_model_path, body)
    assert after.token_ids == before.token_ids
    assert control_calls(fake.engines[0]) == [
        ("release_memory_occupation", {"tags": ALL_TAGS}),
        ("resume_memory_occupation", {"tags": ["weights"]}),
        ("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
        ("flush_cache", {}),
        ("shutdown", {}),
    ]


def test_generate_after_wake_up_brings_the_kv_cache_back_itself(tiny_model_path, hf, fake):
    _, tok = hf
    ps = prompts(tok, 3)

    async def body(replica):
        await replica.sleep()
        await replica.wake_up()
        return await asyncio.gather(
            *(replica.generate(p, SamplingParams(max_tokens=3), f"r{i}") for i, p in enumerate(ps))
        )

    assert [len(o.token_ids) for o in run(tiny_model_path, body)] == [3, 3, 3]
    names = [m for m, _ in fake.engines[0].calls]
    assert names == [
        "__init__",
        "release_memory_occupation",
        "resume_memory_occupation",  # wake_up: the weights
        "resume_memory_occupation",  # the first generate: KV cache and CUDA graphs
        "flush_cache",
        *["async_generate"] * 3,
        "shutdown",
    ]


def test_without_free_cache_engine_sleep_only_marks_the_replica_asleep(tiny_model_path, hf, fake):
    _, tok = hf
    p = prompts(tok, 1)[0]

    async def body(replica):
        await replica.sleep()
        with pytest.raises(RuntimeError, match="asleep"):
            await replica.generate(p, SamplingParams(max_tokens=2), "a")
        await replica.wake_up()
        await replica.resume()
        return await replica.generate(p, SamplingParams(max_tokens=2), "b")

    assert len(run(tiny_model_path, body, rollout={"free_cache_engine": False}).token_ids) == 2
    assert fake.engines[0].server_args["enable_memory_saver"] is False
    assert [m for m, _ in fake.engines[0].calls] == ["__init__", "async_generate", "shutdown"]


def test_sleep_waits_for_running_requests_before_releasing(tiny_model_path, hf, fake):
    _, tok = hf
    ps = prompts(tok, 4)

    async def body(replica):
        running = [
            asyncio.ensure_future(replica.generate(p, SamplingParams(max_tokens=8), f"r{i}"))
            for i, p in enumerate(ps)
        ]
        await asyncio.sleep(0)  # the requests are in SGLang now
        await replica.sleep()  # the fake, like SGLang, refuses to release while one runs
        return await asyncio.gather(*running)

    outs = run(tiny_model_path, body)
    assert [len(o.token_ids) for o in outs] == [8] * 4
    names = [m for m, _ in fake.engines[0].calls]
    assert names.index("release_memory_occupation") == 5 and names.count("async_generate") == 4


def test_weights_released_without_a_cpu_copy_must_be_pushed_again(tiny_model_path, hf, fake):
    model, tok = hf
    p = prompts(tok, 1)[0]
    sp = SamplingParams(temperature=0, max_tokens=6)

    async def body(replica):
        before = await replica.generate(p, sp, "a")
        await replica.sleep()
        await replica.wake_up()  # the fake, like SGLang, gives back memory without content
        with pytest.raises(RuntimeError, match=r"without a CPU copy \(enable_weights_cpu_backup=false\)"):
            await replica.generate(p, sp, "b")
        await replica.update_weights(model.state_dict().items())
        return before, await replica.generate(p, sp, "c")

    before, after = run(tiny_model_path, body, enable_weights_cpu_backup=False)
    assert after.token_ids == before.token_ids == hf_greedy(model, p, 6)


def test_hybrid_pushes_the_training_weights_at_init_and_after_every_wake_up(tiny_model_path, hf, fake):
    from transformers import AutoModelForCausalLM

    _, tok = hf
    p = prompts(tok, 1)[0]
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    trained.load_state_dict(perturbed(trained.state_dict()))
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=True)

    async def body(replica):
        first = await replica.generate(p, sp, "a")
        await replica.sleep()
        await replica.wake_up()
        return first, await replica.generate(p, sp, "b")

    first, again = run(tiny_model_path, body, mode="hybrid", model=trained)
    expected = hf_greedy(trained, p, 6)
    assert first.token_ids == again.token_ids == expected != hf_greedy(hf[0], p, 6)
    assert again.log_probs == pytest.approx(first.log_probs, abs=1e-5)
    engine = fake.engines[0]
    assert engine.server_args["enable_weights_cpu_backup"] is False
    names = list(trained.state_dict())
    pushes = engine.calls_to("update_weights_from_tensor")
    assert [c["names"] for c in pushes] == [names, names]  # at init, and after the weights came back empty
    assert control_calls(engine) == [
        ("update_weights_from_tensor", {"n": len(names), "flush_cache": True}),
        ("release_memory_occupation", {"tags": ALL_TAGS}),
        ("resume_memory_occupation", {"tags": ["weights"]}),
        ("update_weights_from_tensor", {"n": len(names), "flush_cache": False}),
        ("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
        ("flush_cache", {}),
        ("shutdown", {}),
    ]


# ---------------------------------------------------------------- weights


def test_update_weights_sends_buckets_with_the_names_and_shapes(tiny_model_path, hf, fake):
    model, _ = hf
    state = model.state_dict()

    async def body(replica):
        await replica.update_weights(iter(state.items()))

    run(tiny_model_path, body, update_weights_bucket_megabytes=0.05)  # 52 KB buckets
    pushes = fake.engines[0].calls_to("update_weights_from_tensor")
    assert len(pushes) > 1
    assert [n for c in pushes for n in c["names"]] == list(state)
    assert [s for c in pushes for s in c["shapes"]] == [tuple(v.shape) for v in state.values()]
    assert all(
        c["tp_payloads"] == 1 and c["flush_cache"] is True and c["load_format"] is None for c in pushes
    )
    limit = int(0.05 * 2**20)
    for c in pushes[:-1]:  # each bucket closes at the first tensor that reaches the limit
        sizes = [state[n].numel() * 4 for n in c["names"]]
        assert sum(sizes) >= limit > sum(sizes[:-1])


def test_update_weights_reports_sglangs_refusal(tiny_model_path, fake):
    async def body(replica):
        with pytest.raises(
            RuntimeError, match=r"SGLang did not load the weights: .*KeyError\('nope\.weight'\)"
        ):
            await replica.update_weights([("nope.weight", torch.zeros(1))])
        with pytest.raises(
            RuntimeError, match=r"Attempted to load weight \(\(3,\)\) into parameter \(\(64,\)\)"
        ):
            await replica.update_weights([("model.norm.weight", torch.zeros(3))])

    run(tiny_model_path, body)


@pytest.mark.parametrize("server", [False, True])
def test_weight_sync_then_greedy_equals_hf_with_the_same_weights(tiny_model_path, hf, fake, server):
    from transformers import AutoModelForCausalLM

    _, tok = hf
    ps = prompts(tok, 3)
    target = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    target.load_state_dict(perturbed(target.state_dict(), seed=1))
    new_weights = {k: v.clone() for k, v in target.state_dict().items()}
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=True)

    async def body(replica):
        before = await replica.generate(ps[0], sp, "before")
        await replica.sleep()
        manager = WeightSyncManager("naive", bucket_megabytes=0.05)
        try:
            stats = await manager.sync(iter(new_weights.items()), [replica])
        finally:
            manager.close()
        outs = await asyncio.gather(*(replica.generate(p, sp, f"r{i}") for i, p in enumerate(ps)))
        return before, stats, outs

    before, stats, outs = run(tiny_model_path, body, server=server)
    assert stats.tensors == len(new_weights)
    for p, out in zip(ps, outs, strict=True):
        assert out.token_ids == hf_greedy(target, p, 8)
        torch.testing.assert_close(
            torch.tensor(out.log_probs), teacher_forced_logprobs(target, p, out.token_ids, 0)
        )
    assert outs[0].token_ids != before.token_ids
    calls = control_calls(fake.engines[0])
    assert calls[:2] == [
        ("release_memory_occupation", {"tags": ALL_TAGS}),  # sleep
        ("resume_memory_occupation", {"tags": ["weights"]}),  # wake_up
    ]
    assert calls[-3:] == [
        ("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),  # resume
        ("flush_cache", {}),
        ("shutdown", {}),
    ]
    buckets = calls[2:-3]  # one update per bucket of the sync, none flushing the released cache
    assert len(buckets) > 1
    assert all(method == "update_weights_from_tensor" and not kw["flush_cache"] for method, kw in buckets)
    assert sum(kw["n"] for _, kw in buckets) == len(new_weights)


# ---------------------------------------------------------------- server mode and shutdown


def test_server_mode_serves_over_http_on_loopback(tiny_model_path, hf, fake):
    model, tok = hf
    p = prompts(tok, 1)[0]

    async def body(replica):
        assert isinstance(replica.engine, ServerEngine)
        address = replica.server_address
        out = await replica.generate(p, SamplingParams(temperature=0, max_tokens=5, logprobs=True), "r")
        return address, out

    address, out = run(tiny_model_path, body, server=True)
    server = fake.servers[0]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address)
    assert address == f"127.0.0.1:{server.http.server_port}"
    cli = fake.launches[0]
    assert cli[:4] == ["--model-path", tiny_model_path, "--dtype", "float32"]
    assert cli[-4:] == ["--host", "127.0.0.1", "--port", address.split(":")[1]]
    assert "--enable-memory-saver" in cli and "--enable-weights-cpu-backup" in cli
    assert out.token_ids == hf_greedy(model, p, 5)
    torch.testing.assert_close(
        torch.tensor(out.log_probs), teacher_forced_logprobs(model, p, out.token_ids, 0)
    )
    assert server.poll() == 0  # shutdown stopped the server


def test_a_server_that_fails_to_start_reports_its_log(tiny_model_path, fake):
    replica = make_replica(tiny_model_path, server=True, bogus_flag=1)
    with pytest.raises(
        RuntimeError,
        match=r"exited with code 2 while starting; its log ends with:\n"
        r"launch_server: error: unrecognized arguments: --bogus-flag",
    ):
        asyncio.run(replica.init("colocated"))
    assert replica.server_address is None


@pytest.mark.parametrize("server", [False, True])
def test_shutdown_aborts_running_requests(tiny_model_path, hf, fake, server):
    _, tok = hf
    p = prompts(tok, 1)[0]

    async def main():
        replica = make_replica(tiny_model_path, server=server)
        await replica.init("colocated")
        fake.engines[0].hold_requests()  # the scheduler never answers these
        running = [
            asyncio.ensure_future(replica.generate(p, SamplingParams(logprobs=i == 0), f"r{i}"))
            for i in range(3)
        ]
        await asyncio.sleep(0.2)
        await replica.shutdown()
        await replica.shutdown()
        return await asyncio.wait_for(asyncio.gather(*running), timeout=10)

    outs = asyncio.run(main())
    assert [(o.token_ids, o.log_probs, o.stop_reason) for o in outs] == [
        ([], [], "abort"),
        ([], None, "abort"),
        ([], None, "abort"),
    ]
    assert fake.engines[0].is_shut_down
    assert fake.engines[0].in_flight == 0  # the held requests were cancelled, not left running


def test_fake_sglang_is_strict_about_its_api(tiny_model_path):
    fake = FakeSGLang()
    engine = fake.api.Engine(model_path=tiny_model_path, dtype="float32")

    async def body():
        with pytest.raises(
            TypeError, match=r"async_generate\(\) got an unexpected keyword argument 'max_tokens'"
        ):
            await engine.async_generate(input_ids=[1], max_tokens=2)
        with pytest.raises(
            TypeError, match=r"SamplingParams\.__init__\(\) got an unexpected keyword argument 'seed'"
        ):
            await engine.async_generate(input_ids=[1], sampling_params={"seed": 1})
        with pytest.raises(KeyError, match="kv_cache"):
            await engine.tokenizer_manager.resume_memory_occupation(
                fake.api.ResumeMemoryOccupationReqInput(tags=["kv_cache"])
            )

    asyncio.run(body())
    # bound to the loop of its first call, like SGLang's tokenizer manager: any other loop fails
    with pytest.raises(RuntimeError, match="tokenizer manager is bound to another event loop"):
        asyncio.run(engine.async_generate(input_ids=[1], sampling_params={"max_new_tokens": 1}))
    with pytest.raises(RuntimeError, match="tokenizer manager is bound to another event loop"):
        asyncio.run(engine.tokenizer_manager.flush_cache())
    with pytest.raises(TypeError, match=r"ServerArgs\.__init__\(\) got an unexpected keyword argument 'gpu'"):
        fake.api.Engine(model_path=tiny_model_path, gpu=0)


def test_fake_sglang_engines_start_on_the_main_thread_only_as_sglang_053_does(tiny_model_path):
    def start(fake):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(fake.api.Engine, model_path=tiny_model_path).result()

    with pytest.raises(ValueError, match="signal only works in main thread"):
        start(FakeSGLang())
    assert start(FakeSGLang(main_thread_engine=False)).server_args == {"model_path": tiny_model_path}
