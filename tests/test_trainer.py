"""The trainer end to end on the tiny model: the ``tiny`` preset, metrics, trackers, hooks, the reward
curve, resume, custom components from a file and a plugin, the CLI, and the Ray executor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import trellis
from trellis.checkpoint.training import CheckpointManager
from trellis.cli import main
from trellis.hooks import get_plugin_manager, hookimpl
from trellis.trainer.presets import digits_score, preset_overrides

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

QUICK = ["trainer.trackers=[jsonl]", "trainer.resume_mode=disable"]

REWARD_FILE = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    chars = [c for c in solution_str if not c.isspace()]
    return {"score": sum(c.isdigit() for c in chars) / max(1, len(chars)), "marker": 7.0}
"""


def run(tmp_path, *overrides, name="run"):
    return trellis.train(
        overrides=[*preset_overrides("tiny"), f"trainer.run_dir={tmp_path / name}", *overrides]
    )


def test_tiny_preset_learns_and_reports_everything(tmp_path):
    from trellis_fixture_good import hooks as fixture_hooks

    fixture_hooks.EVENTS.clear()
    seen = []

    class Recorder:
        @hookimpl
        def trellis_train_start(self, config, run_dir):
            seen.append(("train_start", run_dir))

        @hookimpl
        def trellis_validation_end(self, step, metrics):
            seen.append(("validation_end", step))

        @hookimpl
        def trellis_train_end(self, step, metrics, run_dir):
            seen.append(("train_end", step))

    recorder = Recorder()
    get_plugin_manager().register(recorder)
    try:
        result = run(
            tmp_path, "trainer.resume_mode=disable", "trainer.save_freq=6", "trainer.trackers=[console,jsonl]"
        )
    finally:
        get_plugin_manager().unregister(recorder)
    assert result.steps == 12 and len(result.history) == 12
    metrics = result.history[-1]
    for key in (
        "reward/mean", "reward/max", "reward/min", "score/mean",
        "response_length/mean", "response_length/max", "response_length/clip_ratio",
        "advantages/mean", "returns/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
        "actor/entropy", "actor/grad_norm", "actor/lr", "timing/generate", "timing/reward",
        "timing/advantage", "timing/update_actor", "timing/weight_sync",
        "timing/step", "perf/throughput", "perf/max_memory_allocated_gib", "agent/num_turns/mean",
    ):  # fmt: skip
        assert key in metrics, key
    assert metrics["actor/lr"] == pytest.approx(2e-3)
    assert metrics["response_length/max"] <= 16
    # greedy validation goes from no digits at all to only digits
    (step0, first), _, (step12, last) = result.validation
    assert (step0, step12) == (0, 12)
    assert first["val/reward/mean"] < 0.2 and last["val/reward/mean"] > 0.9
    # outputs: jsonl per step (+ the validation before training), a real PNG, checkpoints every 6 steps
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [row["step"] for row in lines] == [0, *range(1, 13)]
    with open(result.reward_curve, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert result.last_checkpoint.endswith("global_step_12")
    assert result.best_checkpoint.endswith("global_step_12")  # val reward 1.0 at steps 6 and 12: the later
    assert sorted(os.listdir(os.path.join(result.run_dir, "checkpoints"))) == [
        "global_step_12",
        "global_step_6",
        "latest_checkpointed_iteration.txt",
    ]
    # hooks fired at every lifecycle point: the installed fixture plugin's and an in-process one
    kinds = [e["hook"] for e in fixture_hooks.EVENTS]
    assert kinds.count("step_end") == 12 and kinds.count("checkpoint_saved") == 2
    assert seen == [
        ("train_start", result.run_dir),
        ("validation_end", 0),
        ("validation_end", 6),
        ("validation_end", 12),
        ("train_end", 12),
    ]


def test_resume_mid_run_continues_bit_identically(tmp_path):
    base = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.val_before_train=false"]
    base += ["trainer.test_freq=-1", "trainer.trackers=[jsonl]"]
    whole = run(tmp_path, *base, name="whole")

    class Crash:
        @hookimpl
        def trellis_step_end(self, step, metrics):
            if step == 3:
                raise RuntimeError("crash after step 3, before its checkpoint")

    pm = get_plugin_manager()
    crash = Crash()
    pm.register(crash)
    try:
        with pytest.raises(RuntimeError, match="crash after step 3"):
            run(tmp_path, *base, name="cut")
    finally:
        pm.unregister(crash)
    resumed = run(tmp_path, *base, name="cut")  # resume_mode auto: from global_step_2
    assert resumed.steps == 4 and len(resumed.history) == 2
    assert [m["reward/mean"] for m in resumed.history] == [m["reward/mean"] for m in whole.history[2:]]
    a = CheckpointManager(tmp_path / "whole" / "checkpoints").load(whole.last_checkpoint)["actor"]["model"]
    b = CheckpointManager(tmp_path / "cut" / "checkpoints").load(resumed.last_checkpoint)["actor"]["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_custom_reward_file_and_plugin_estimator(tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD_FILE)
    result = run(
        tmp_path,
        *QUICK,
        f"reward.function={reward}:score",
        "algorithm.adv_estimator=fixture_returns",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
    )
    metrics = result.history[-1]
    assert metrics["reward_extra/marker/mean"] == 7.0  # the file's function scored the responses
    assert metrics["advantages/min"] >= 0.0  # reward-to-go of non-negative rewards: no baseline
    assert metrics["advantages/max"] == pytest.approx(metrics["returns/max"])


def test_python_callable_reward(tmp_path):
    calls = []

    def score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append(solution_str)
        return digits_score(data_source, solution_str, ground_truth)

    result = trellis.train(
        overrides=[
            *preset_overrides("tiny"),
            f"trainer.run_dir={tmp_path}",
            *QUICK,
            "trainer.total_training_steps=1",
        ],
        reward_fn=score,
    )
    assert result.steps == 1
    assert len(calls) == 8 * 4 + 16 + 16  # one step of 8 prompts x 4, and two validations of 16


def test_cli_print_config_and_train(tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--print-config", "trainer.total_training_steps=3"]) == 0
    printed = capsys.readouterr().out
    assert "total_training_steps: 3" in printed and "digits_score" in printed
    args = [
        "train",
        "--preset",
        "tiny",
        f"trainer.run_dir={tmp_path}",
        *QUICK,
        "trainer.total_training_steps=2",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"Run directory: {tmp_path}" in out
    assert f"Reward curve: {tmp_path / 'reward_curve.png'}" in out
    assert "Validation reward: 0.000 at step 0" in out


def test_unknown_preset_and_local_world_size_errors(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown preset 'huge'; presets: .*tiny"):
        preset_overrides("huge")
    with pytest.raises(ValueError, match=r"trainer\.executor=local runs one worker"):
        run(tmp_path, *QUICK, "trainer.n_devices_per_node=2")


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    saved = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_ray_executor_with_two_fsdp_workers_and_custom_components(tmp_path, ray_cluster):
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD_FILE)
    common = [*QUICK, f"reward.function={reward}:score", "algorithm.adv_estimator=fixture_returns"]
    common += ["trainer.total_training_steps=3", "trainer.test_freq=3"]
    local = run(tmp_path, *common, name="local")
    remote = run(
        tmp_path,
        *common,
        "trainer.executor=ray",
        "trainer.n_devices_per_node=2",
        "actor.engine=fsdp",
        name="ray",
    )
    assert remote.steps == 3
    for metrics in remote.history:  # the file's reward ran inside the Ray workers
        assert metrics["reward_extra/marker/mean"] == 7.0
        assert metrics["timing/weight_sync"] > 0  # fsdp shards -> each worker's replica copy
    # same seeds, same data: the two-worker fsdp run generates what the one-process run does
    assert [m["reward/mean"] for m in remote.history][:1] == [m["reward/mean"] for m in local.history][:1]
    assert [step for step, _ in remote.validation] == [0, 3]
    shutil.rmtree(tmp_path / "ray", ignore_errors=True)


def test_ppo_with_critic_kl_and_rollout_correction(tmp_path):
    result = run(
        tmp_path,
        *QUICK,
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "actor.use_kl_loss=true",
        "rollout.calculate_log_probs=true",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
    )
    metrics = result.history[-1]
    # the critic trained and its values fed GAE; the reference policy fed both KL terms
    for key in ("critic/vf_loss", "critic/grad_norm", "values/mean", "actor/kl_loss", "actor/kl_ref"):
        assert key in metrics, key
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001, rel=0.5)  # adaptive, moved a bit
    # rollout and trainer log-probs agree (same model, fp32): importance weights are ~1
    assert metrics["rollout_corr/ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert not any(k.startswith("rollout_corr/rollout_corr/") for k in metrics)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-3)


def test_another_critic_free_estimator_runs(tmp_path):
    result = run(tmp_path, *QUICK, "algorithm.adv_estimator=rloo", "trainer.total_training_steps=1")
    assert result.steps == 1 and "advantages/mean" in result.history[0]


def test_on_policy_steps_skip_the_old_log_prob_pass_with_the_same_update(tmp_path):
    from trellis.config import load_config
    from trellis.trainer import Trainer
    from trellis.trainer.ppo import on_policy

    weights, timings = [], []
    for recompute in (False, True):
        overrides = [*preset_overrides("tiny"), *QUICK, f"trainer.run_dir={tmp_path / str(recompute)}"]
        overrides += [
            "trainer.total_training_steps=1",
            "trainer.save_freq=1",
            "trainer.val_before_train=false",
        ]
        config = load_config(None, overrides)
        assert on_policy(config)  # one update over the whole batch
        trainer = Trainer(config)
        assert trainer.recompute_old_log_probs is False
        trainer.recompute_old_log_probs = recompute
        result = trainer.fit()
        timings.append("timing/old_log_prob" in result.history[0])
        manager = CheckpointManager(tmp_path / str(recompute) / "checkpoints")
        weights.append(manager.load(result.last_checkpoint)["actor"]["model"])
    assert timings == [False, True]
    skipped, recomputed = weights
    for name in skipped:  # the same gradient: ratio 1 either way (to float rounding of the recomputation)
        torch.testing.assert_close(skipped[name], recomputed[name], rtol=0, atol=1e-6)
    config = load_config(None, [*preset_overrides("tiny"), "actor.ppo_epochs=2"])
    assert not on_policy(config)


def test_check_grpo_run_kit_passes_on_the_hf_replica(tmp_path):
    from trellis.testing.rollout import check_grpo_run

    result = check_grpo_run("hf", str(tmp_path / "run"), steps=2, weight_sync=False)
    assert result.steps == 2 and all(m["timing/weight_sync"] == 0 for m in result.history)  # shared module
    assert all(m["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-4) for m in result.history)


def test_replicas_with_their_own_weights_sleep_between_rollouts(tmp_path):
    from trellis.registries import rollout_replicas
    from trellis.rollout.hf import HFRolloutReplica

    calls = []

    class Recording(HFRolloutReplica):
        """The hf replica with its own copy of the weights, recording its lifecycle."""

        async def init(self, *args, **kwargs):
            calls.append("init")
            return await super().init(*args, **kwargs)

        async def generate(self, *args, **kwargs):
            calls.append("generate")
            return await super().generate(*args, **kwargs)

        async def sleep(self):
            calls.append("sleep")
            await super().sleep()

        async def wake_up(self):
            calls.append("wake_up")
            await super().wake_up()

        async def update_weights(self, named_tensors):
            calls.append("update_weights")
            await super().update_weights(named_tensors)

        async def shutdown(self):
            calls.append("shutdown")
            await super().shutdown()

    rollout_replicas.register("recording_hf", Recording)
    try:
        result = run(
            tmp_path, *QUICK, "rollout.name=recording_hf", "trainer.total_training_steps=2",
            "trainer.test_freq=2", "trainer.val_before_train=true",
        )  # fmt: skip
        collapsed = [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]
        sync = ["wake_up", "update_weights"]
        assert collapsed == [
            "init", *sync,
            "generate", "sleep",  # validation before training
            "wake_up", "generate", "sleep", *sync,  # step 1: woken for its rollout, synced after the update
            "generate", "sleep", *sync,  # step 2
            "generate", "sleep",  # validation after step 2
            "shutdown",
        ]  # fmt: skip
        assert result.steps == 2
        off = run(
            tmp_path, *QUICK, "rollout.name=recording_hf", "trainer.total_training_steps=1",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "rollout.free_cache_engine=false",
            name="no_sleep",
        )  # fmt: skip
        assert off.steps == 1 and calls.count("sleep") == 4  # the second run never slept
    finally:
        rollout_replicas.unregister("recording_hf")
