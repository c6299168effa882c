"""transformers' Hub kernels stay off in every model Trellis loads (``load_pretrained``).

transformers 5 kernelizes each loaded model when the ``kernels`` package is installed, and again at
every ``train()`` / ``eval()`` that changes the mode: on an accelerator that fetches layer kernels
from the Hub mid-step and runs other kernels in training than in forward-only passes. These tests
count transformers' ``kernelize`` calls that would swap kernels in (a reset, with an empty mapping,
is not one) around the load paths of the engine, the ``hf`` replica and the reward model, and a
whole training run.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.engine.models import load_model
from trellis.recipes.presets import preset_overrides
from trellis.utils.auto_model import without_hub_kernels

modeling_utils = pytest.importorskip("transformers.modeling_utils")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def kernelizations(monkeypatch, tiny_model_path):
    """``kernelize`` calls that swap kernels in (``kernel_config`` None); skips where transformers
    does not kernelize what it loads."""
    from transformers import AutoModelForCausalLM

    if not hasattr(modeling_utils, "kernelize"):
        pytest.skip("this transformers has no Hub kernels")
    if not AutoModelForCausalLM.from_pretrained(tiny_model_path).use_kernels:
        pytest.skip("transformers does not kernelize loaded models here (no kernels, or USE_HUB_KERNELS=0)")
    calls: list[str] = []
    real = modeling_utils.kernelize

    def spy(model, *args, **kwargs):
        if kwargs.get("kernel_config") is None:
            calls.append(f"{type(model).__name__} {'training' if model.training else 'inference'}")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "kernelize", spy)
    return calls


def toggled(model):
    """The model after a train/eval round trip (each switch kernelizes a kernelized model)."""
    model.train()
    model.eval()
    model.train()
    return model


def test_a_plain_load_is_kernelized_at_each_mode_switch(kernelizations, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    kernelizations.clear()
    toggled(model)
    assert kernelizations == [f"LlamaForCausalLM {mode}" for mode in ("training", "inference", "training")]
    without_hub_kernels(model)
    kernelizations.clear()
    toggled(model)
    assert kernelizations == [] and model.use_kernels is False


def test_the_engine_model_has_no_hub_kernels(kernelizations, tiny_model_path):
    model = load_model(ModelConfig(path=tiny_model_path))
    assert model.use_kernels is False
    toggled(model)
    assert kernelizations == []


def test_the_hf_replica_model_has_no_hub_kernels(kernelizations, tiny_model_path):
    from trellis.rollout.hf import HFRolloutReplica

    async def main():
        model_config = ModelConfig(path=tiny_model_path, dtype="float32")
        replica = HFRolloutReplica(0, RolloutConfig(seed=0), model_config)
        await replica.init("colocated")
        try:
            return replica.model.use_kernels
        finally:
            await replica.shutdown()

    assert asyncio.run(main()) is False
    assert kernelizations == []


def test_the_reward_model_has_no_hub_kernels(kernelizations, tmp_path):
    from test_reward_model import save_tiny_classifier

    from trellis.reward.model import ClassifierRewardModel

    scorer = ClassifierRewardModel(save_tiny_classifier(tmp_path / "rm"))
    assert scorer.model.use_kernels is False
    toggled(scorer.model)
    assert kernelizations == []


def test_a_training_run_never_kernelizes(kernelizations, tmp_path):
    import trellis

    result = trellis.train(
        overrides=[
            *preset_overrides("tiny"),
            f"trainer.run_dir={tmp_path}",
            "trainer.trackers=[]",
            "trainer.resume_mode=disable",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "ref.enable=true",  # an eval-mode forward of a second model between the actor's updates
        ]
    )
    losses = torch.tensor([m["actor/loss"] for m in result.history])
    assert losses.shape == (2,) and bool(torch.isfinite(losses).all())
    assert kernelizations == []
