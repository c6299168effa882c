"""trellis.recipes.demo: the ``demo`` preset and the runner (on the tiny model: the SmolLM2 run itself
is ``nox -s demo``)."""

from __future__ import annotations

import json
import os
import re

import pytest

from trellis.config import load_config
from trellis.recipes import demo
from trellis.recipes.arithmetic import make_problems
from trellis.recipes.demo import heldout_accuracy
from trellis.recipes.presets import preset_overrides


@pytest.fixture
def demo_cache(tmp_path, monkeypatch, tiny_model_path):
    """The demo preset writing into ``tmp_path`` and using the tiny model instead of SmolLM2."""
    monkeypatch.setenv("TRELLIS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("trellis.utils.demo_model.smollm2_path", lambda: tiny_model_path)
    return tmp_path


def test_preset_loads_into_a_valid_config(demo_cache, tiny_model_path):
    config = load_config(None, preset_overrides("demo"))
    assert config.model.path == tiny_model_path
    assert config.trainer.test_freq == config.trainer.total_training_steps > 0
    assert config.trainer.val_before_train and config.trainer.save_freq <= 0
    assert config.rollout.val_kwargs.do_sample is False  # held-out accuracy is greedy
    # whole groups per micro-batch: each prompt runs once for all its responses (model.share_prompt)
    assert config.actor.ppo_micro_batch_size_per_device % config.rollout.n == 0 and config.model.share_prompt
    (val,) = config.data.val_files
    assert str(demo_cache / "cache") in val
    with open(val, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert rows == [p.row() for p in make_problems()[1]]


@pytest.mark.parametrize(
    ("native", "dtype", "attn", "groups", "rows"),
    [(True, "bfloat16", "eager", 4, 128), (False, "float32", "sdpa", 2, 64)],
)
def test_demo_trains_in_bf16_only_where_the_cpu_computes_it_natively(
    demo_cache, monkeypatch, native, dtype, attn, groups, rows
):
    monkeypatch.setattr("trellis.recipes.presets.native_bf16", lambda: native)
    config = load_config(None, preset_overrides("demo"))
    # eager attention beat sdpa's CPU flash kernel at the demo's lengths in bf16, not in float32
    assert (config.model.dtype, config.model.attn_implementation) == (dtype, attn)
    # four groups a micro-batch fit the 5 GB peak in bf16 (4.39 GiB), two in float32, with the replica's
    # weights freed while training and the fused RMSNorm
    assert config.actor.ppo_micro_batch_size_per_device == groups * config.rollout.n
    assert config.rollout.engine_kwargs["sleep_level"] == 2 and config.model.fused_kernels == ["rms_norm"]
    # the replica's rows at once: the final validation's KV cache and activations set float32's peak at 128
    assert config.rollout.engine_kwargs["max_batch_size"] == rows


def test_heldout_accuracy_reads_the_first_and_last_validation():
    validation = [(0, {"val/pass@1": 0.2}), (5, {"val/pass@1": 0.3}), (10, {"val/pass@1": 0.45})]
    assert heldout_accuracy(validation) == (0.2, 0.45)
    with pytest.raises(ValueError, match="Need validations before and after training, got 1"):
        heldout_accuracy(validation[:1])


def test_main_trains_and_reports_on_the_tiny_model(demo_cache, capsys):
    import gc

    from trellis.hooks import get_plugin_manager, hookimpl

    frozen: list[int] = []

    class Frozen:
        @hookimpl
        def trellis_step_end(self) -> None:
            frozen.append(gc.get_freeze_count())

    get_plugin_manager().register(recorder := Frozen())
    overrides = [
        "data.max_prompt_length=512",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.trackers=[jsonl]",
        f"trainer.run_dir={demo_cache / 'run'}",
    ]
    try:
        assert demo.main(overrides) == 0
    finally:
        get_plugin_manager().unregister(recorder)
    # the start-up heap is frozen while it trains (the replica's per-step collection skips it), and
    # thawed after
    assert len(frozen) == 2 and min(frozen) > 10_000 and gc.get_freeze_count() == 0
    out = capsys.readouterr().out
    before = float(re.search(r"before training: +([\d.]+)%", out).group(1))
    after = float(re.search(r"after 2 GRPO steps: +([\d.]+)%", out).group(1))
    gain = float(re.search(r"gain: ([+-][\d.]+) points", out).group(1))
    assert 0 <= before <= 100 and 0 <= after <= 100 and gain == pytest.approx(after - before, abs=0.1)
    assert "Held-out accuracy (200 problems), greedy:" in out
    curve = re.search(r"Reward curve: (.+)", out).group(1)
    assert curve == str(demo_cache / "run" / "reward_curve.png") and os.path.getsize(curve) > 0
    assert re.search(r"Wall time: \d+ min \d\d s", out)
    # a line per step with the process's memory, and the peak in the summary
    steps = re.findall(r"^step (\d)/2: reward [\d.]+, RSS ([\d.]+) GiB, peak RSS ([\d.]+) GiB$", out, re.M)
    assert [step for step, _, _ in steps] == ["1", "2"]
    assert all(0 < float(rss) <= float(peak) + 0.01 for _, rss, peak in steps)
    peak = float(re.search(r"^Peak memory: ([\d.]+) GiB resident$", out, re.M).group(1))
    assert peak >= float(steps[-1][2]) - 0.01


def test_format_summary():
    text = demo.format_summary(
        {"before": 0.125, "after": 0.4, "heldout": 200, "steps": 30, "seconds": 605.2,
         "reward_curve": "/r/reward_curve.png", "run_dir": "/r"}
    )  # fmt: skip
    assert text.splitlines() == [
        "Held-out accuracy (200 problems), greedy:",
        "  before training:  12.5%",
        "  after 30 GRPO steps:  40.0%",
        "  gain: +27.5 points",
        "Wall time: 10 min 05 s",
        "Reward curve: /r/reward_curve.png",
        "Run directory: /r",
    ]
    with_memory = demo.format_summary(
        {"before": 0.1, "after": 0.2, "steps": 2, "seconds": 61, "peak_rss_gib": 4.234, "reward_curve": None,
         "run_dir": "/r"}
    )  # fmt: skip
    assert "Wall time: 1 min 01 s\nPeak memory: 4.23 GiB resident\nReward curve: none" in with_memory
