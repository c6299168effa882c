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
    # and the replica's loop thread is gone with it
    assert not [t.name for t in threading.enumerate() if t.name.startswith("trellis-sglang")]
    assert live_threads() <= threads_before  # none started here is left


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
