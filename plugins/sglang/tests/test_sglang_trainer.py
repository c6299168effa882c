"""The trainer with ``rollout.name=sglang``: three GRPO steps of the tiny preset on the fake SGLang.

The default (local) executor runs the policy worker in this process, so the fake that the ``fake``
fixture puts behind ``SGLangRolloutReplica.load_sglang`` is the engine the trainer drives: one
``asyncio.run`` for ``init``, one per weight sync, one per rollout, one for the final shutdown.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from sglang_helpers import live_threads

from trellis.utils.fs import CACHE_DIR_ENV


def test_grpo_three_steps_with_rollout_name_sglang(tmp_path, monkeypatch, fake):
    import trellis
    from trellis.trainer.presets import preset_overrides

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))  # the preset's model and data
    tiny = preset_overrides("tiny")
    threads_before = live_threads()
    result = trellis.train(
        overrides=[
            *tiny,
            "rollout.name=sglang",
            "trainer.total_training_steps=3",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.trackers=[jsonl]",
            "trainer.resume_mode=disable",
            "rollout.calculate_log_probs=true",
            "algorithm.rollout_correction.rollout_is=token",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )

    assert result.steps == 3 and len(result.history) == 3
    for metrics in result.history:
        assert metrics["timing/weight_sync"] > 0  # the engine got the new weights after every update
        assert 0 <= metrics["reward/mean"] <= 1
        assert metrics["response_length/max"] <= 16
        # the fake's sampling log-probs are the trainer's recomputation (same weights, float32)
        assert metrics["rollout_corr/ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["rollout_corr/kl_k3"] == pytest.approx(0.0, abs=1e-5)
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]

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
