"""The trainer with ``rollout.name=sglang``: three GRPO steps of the tiny preset on the fake SGLang.

The default (local) executor runs the policy worker in this process, so the fake that the ``fake``
fixture puts behind ``SGLangRolloutReplica.load_sglang`` is the engine the trainer drives: one
``asyncio.run`` for ``init``, one per weight sync, one per rollout, one for the final shutdown.
"""

from __future__ import annotations

import threading

import pytest
import torch
from sglang_helpers import live_threads

from trellis.utils.fs import CACHE_DIR_ENV


def test_grpo_three_steps_with_rollout_name_sglang(tmp_path, monkeypatch, fake):
    from trellis.testing.rollout import check_grpo_run

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))  # the preset's model and data
    threads_before = live_threads()
    # 3 steps; weight sync each step; the fake's log-probs equal the trainer's (same fp32 weights)
    result = check_grpo_run("sglang", str(tmp_path / "run"))
    # checked before this test loads a model itself (transformers' loading threads linger a moment)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("trellis-sglang")]
    assert live_threads() <= threads_before  # none the run started is left
    for metrics in result.history:
        assert metrics["rollout_corr/kl_k3"] == pytest.approx(0.0, abs=1e-5)

    (engine,) = fake.engines  # one replica, in process, built on this (the main) thread
    assert engine.server_args["enable_memory_saver"] and engine.server_args["enable_weights_cpu_backup"]
    assert engine.server_args["dtype"] == "float32"
    # per step: the rollout (8 prompts x 4 samples, one request each) between two weight syncs
    # (after init, then after every actor update); memory release/resume calls, if the trainer
    # makes them, are left out here (the fake refuses a request on released memory by itself)
    phases = _phases(engine.calls)
    assert [(name, len(calls)) if name == "async_generate" else name for name, calls in phases] == [
        "__init__",
        "sync",
        ("async_generate", 32),
        "sync",
        ("async_generate", 32),
        "sync",
        ("async_generate", 32),
        "sync",
        "shutdown",  # release_rollout shut the replica down
    ]
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(engine.server_args["model_path"], dtype=torch.float32)
    state = start.state_dict()
    for name, calls in phases:
        if name == "sync":  # every weight of the model, with its shape
            pushed = {n: s for call in calls for n, s in zip(call["names"], call["shapes"], strict=True)}
            assert pushed == {k: tuple(v.shape) for k, v in state.items()}
    # the engine ends with the trained weights, not those it loaded from model.path
    served = dict(engine.model.named_parameters())
    assert any(not torch.equal(served[k], v) for k, v in start.named_parameters())
    assert engine.is_shut_down


def _phases(calls):
    """The engine's calls as consecutive runs: ("sync", update calls), ("async_generate", requests), ..."""
    phases = []
    for method, kwargs in calls:
        if method in ("release_memory_occupation", "resume_memory_occupation", "flush_cache"):
            continue
        name = "sync" if method == "update_weights_from_tensor" else method
        if phases and phases[-1][0] == name:
            phases[-1][1].append(kwargs)
        else:
            phases.append((name, [kwargs]))
    return phases


FAKE_BACKED = """
import os

from trellis_sglang.replica import SGLangRolloutReplica
from trellis_sglang.testing import FakeSGLang

# this module is imported inside the replica's own process: the fake lives there, with the engine
FAKE = FakeSGLang(main_thread_engine=False)  # an actor's event loop is not its main thread


class FakeBackedSGLang(SGLangRolloutReplica):
    load_sglang = staticmethod(lambda: FAKE.api)

    async def generate(self, prompt_ids, sampling_params, request_id):
        with open(CALLS, "a") as log:  # which process served which request
            log.write(f"{os.getpid()} {request_id}\\n")
        return await super().generate(prompt_ids, sampling_params, request_id)
"""


@pytest.mark.distributed  # the replica in a process of its own (~30 s)
def test_standalone_sglang_replica_in_its_own_process_trains_through_shm(tmp_path, monkeypatch):
    """rollout.mode=standalone with the SGLang replica (on the fake) in a Ray actor of its own: weights
    arrive through the shm checkpoint engine, log-probs still equal the trainer's."""
    import os

    pytest.importorskip("ray")
    from trellis.testing.rollout import check_grpo_run

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every Ray process on 127.0.0.1
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    calls = tmp_path / "calls.txt"
    replica = tmp_path / "fake_backed.py"
    replica.write_text(f"CALLS = {str(calls)!r}\n" + FAKE_BACKED)
    overrides = ["rollout.mode=standalone", "rollout.checkpoint_engine.name=shm"]
    result = check_grpo_run(f"{replica}:FakeBackedSGLang", str(tmp_path / "run"), overrides=overrides)
    for metrics in result.history:  # the replica generates with the weights the trainer sent it
        assert metrics["rollout_corr/kl_k3"] == pytest.approx(0.0, abs=1e-5)
        assert metrics["weight_sync/megabytes"] > 0.4
    served = [line.split() for line in calls.read_text().splitlines()]
    assert len(served) == 3 * 32  # 3 steps of 8 prompts x 4 samples
    assert {pid for pid, _ in served} != {str(os.getpid())} and len({pid for pid, _ in served}) == 1
