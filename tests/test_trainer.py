"""The trainer end to end on the tiny model: the ``tiny`` preset, metrics, trackers, hooks, the reward
curve, resume, custom components from a file and a plugin, the CLI, and the Ray executor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import trellis
from trellis.checkpoint.training import load_rank_file
from trellis.cli import main
from trellis.hooks import get_plugin_manager, hookimpl
from trellis.recipes.presets import digits_score, preset_overrides

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
        "actor/entropy", "actor/grad_norm", "actor/lr", "timing/generate", "timing/score",
        "timing/advantage", "timing/update_actor",
        "timing/step", "perf/throughput", "perf/max_memory_allocated_gib", "agent/num_turns/mean",
    ):  # fmt: skip
        assert key in metrics, key
    assert metrics["actor/lr"] == pytest.approx(2e-3)
    # the hybrid replica serves the training module: no weight sync, nothing to put to sleep
    assert "timing/weight_sync" not in metrics and "timing/rollout_sleep" not in metrics
    # each stage is timed where it runs, and the stages account for the step
    stages = [v for k, v in metrics.items() if k.startswith("timing/") and k != "timing/step"]
    assert 0.8 * metrics["timing/step"] <= sum(stages) <= metrics["timing/step"]
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
    a = load_rank_file(whole.last_checkpoint, 0, part="actor")["actor"]["model"]
    b = load_rank_file(resumed.last_checkpoint, 0, part="actor")["actor"]["model"]
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
    assert "\n  enable: false\n" in printed.split("\ncritic:\n")[1]  # resolved from grpo's declaration
    assert main(["train", "--preset", "tiny", "--print-config", "algorithm.adv_estimator=gae"]) == 0
    assert "\n  enable: true\n" in capsys.readouterr().out.split("\ncritic:\n")[1]  # gae needs values
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


@pytest.mark.distributed  # two FSDP Ray workers (~25 s)
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
        weights.append(load_rank_file(result.last_checkpoint, 0, part="actor")["actor"]["model"])
    assert timings == [False, True]
    skipped, recomputed = weights
    for name in skipped:  # the same gradient: ratio 1 either way (to float rounding of the recomputation)
        torch.testing.assert_close(skipped[name], recomputed[name], rtol=0, atol=1e-6)
    config = load_config(None, [*preset_overrides("tiny"), "actor.ppo_epochs=2"])
    assert not on_policy(config)


def test_check_grpo_run_kit_passes_on_the_hf_replica(tmp_path):
    from trellis.testing.rollout import check_grpo_run

    result = check_grpo_run("hf", str(tmp_path / "run"), steps=2, weight_sync=False)
    # the replica serves the training module itself: no weight sync, no sleep
    assert result.steps == 2 and not any("timing/weight_sync" in m for m in result.history)
    assert not any("timing/rollout_sleep" in m for m in result.history)
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
            "generate",  # validation before training, then step 1's rollout (no sleep between them)
            "sleep", *sync,  # step 1: asleep through the update, woken by the weight sync
            "generate", "sleep", *sync,  # step 2
            "generate",  # validation after step 2
            "shutdown",
        ]  # fmt: skip
        assert result.steps == 2
        off = run(
            tmp_path, *QUICK, "rollout.name=recording_hf", "trainer.total_training_steps=1",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "rollout.free_cache_engine=false",
            name="no_sleep",
        )  # fmt: skip
        assert off.steps == 1 and calls.count("sleep") == 2  # the second run never slept
    finally:
        rollout_replicas.unregister("recording_hf")


# ---------------------------------------------------------------- every built-in trains


def _core_names(group):
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group=f"trellis.{group}") if ep.value.startswith("trellis.")}


ESTIMATORS = sorted(_core_names("advantage_estimators"))
POLICY_LOSSES = sorted(_core_names("policy_losses"))
LOSS_AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def tiny_weights():
    """The tiny preset's initial policy weights (what two steps of training must change)."""
    from transformers import AutoModelForCausalLM

    path = next(o.split("=", 1)[1] for o in preset_overrides("tiny") if o.startswith("model.path="))
    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}


def _train_two_steps_with_the_cli(tmp_path, *overrides):
    run_dir = tmp_path / "run"
    argv = [
        "train",
        "--preset",
        "tiny",
        *QUICK,
        f"trainer.run_dir={run_dir}",
        "trainer.total_training_steps=2",
    ]
    argv += ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=2", *overrides]
    assert main(argv) == 0
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    trained = load_rank_file(run_dir / "checkpoints" / "global_step_2", 0, part="actor")["actor"]["model"]
    return rows, trained


def _assert_trained(rows, trained, initial, *loss_keys):
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", *loss_keys):
            assert isinstance(row[key], float) and torch.isfinite(torch.tensor(row[key])), (key, row[key])
    moved = max(float((trained[name].float() - weight).abs().max()) for name, weight in initial.items())
    assert moved > 1e-6  # two optimizer steps changed the policy


def test_the_builtins_are_the_registered_names():
    assert ESTIMATORS == [
        "gae", "gpg", "grpo", "grpo_passk", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
        "remax", "rloo",
    ]  # fmt: skip
    assert POLICY_LOSSES == ["cispo", "clip_cov", "geo_mean", "gpg", "gspo", "kl_cov", "sapo", "vanilla"]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_builtin_estimator_trains(tmp_path, tiny_weights, estimator):
    rows, trained = _train_two_steps_with_the_cli(tmp_path, f"algorithm.adv_estimator={estimator}")
    critic_keys = ("critic/vf_loss",) if estimator == "gae" else ()  # gae declares values: a critic
    _assert_trained(rows, trained, tiny_weights, *critic_keys)
    if estimator == "remax":  # the greedy baseline was generated and scored every step
        assert all(row["timing/generate_baseline"] > 0 for row in rows)


@pytest.mark.parametrize("loss", POLICY_LOSSES)
def test_every_builtin_policy_loss_trains(tmp_path, tiny_weights, loss):
    rows, trained = _train_two_steps_with_the_cli(tmp_path, f"actor.policy_loss={loss}")
    _assert_trained(rows, trained, tiny_weights)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_agg_mode_trains(tmp_path, tiny_weights, mode):
    rows, trained = _train_two_steps_with_the_cli(
        tmp_path, f"actor.loss_agg_mode={mode}", "actor.use_kl_loss=true", "actor.entropy_coeff=0.01"
    )
    _assert_trained(rows, trained, tiny_weights, "actor/kl_loss")


# ---------------------------------------------------------------- the step, stage by stage

STAGES = (
    "generate_sequences", "sleep_rollout", "compute_scores", "compute_log_prob", "compute_ref_log_prob",
    "compute_values", "update_critic", "update_actor", "sync_rollout_weights",
)  # fmt: skip


class _Recorder:
    """A worker group whose stage calls are written to ``calls`` as ``role.method``."""

    def __init__(self, group, role, calls):
        self._group, self._role, self._calls = group, role, calls

    def __getattr__(self, name):
        attr = getattr(self._group, name)
        if name not in STAGES:
            return attr

        def record(*args, **kwargs):
            self._calls.append(f"{self._role}.{name}")
            return attr(*args, **kwargs)

        return record


def _recording_trainer(calls):
    from trellis.trainer import Trainer

    class Recording(Trainer):
        def _build_workers(self):
            super()._build_workers()
            self.actor_wg = _Recorder(self.actor_wg, "actor", calls)
            if self.critic_wg is not None:
                self.critic_wg = _Recorder(self.critic_wg, "critic", calls)

    return Recording


def test_the_step_is_its_stages_in_order_each_one_visible(tmp_path):
    from trellis.config import load_config

    calls = []
    overrides = [
        *preset_overrides("tiny"),
        *QUICK,
        f"trainer.run_dir={tmp_path}",
        "trainer.total_training_steps=1",
    ]
    overrides += ["trainer.val_before_train=false", "trainer.test_freq=-1", "rollout.mode=colocated"]
    overrides += ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "actor.ppo_epochs=2"]
    result = _recording_trainer(calls)(load_config(None, overrides)).fit()
    step = calls[calls.index("actor.generate_sequences") :]
    assert step == [
        "actor.generate_sequences",  # generate (agent loops on the replicas)
        "actor.sleep_rollout",  # the replica, with its own weights, gives its memory to training
        "actor.compute_scores",  # score (reward.placement: workers)
        "actor.compute_log_prob", "actor.compute_ref_log_prob", "critic.compute_values",
        "critic.update_critic", "actor.update_actor",
        "actor.sync_rollout_weights",  # weight sync: its own stage, after the update
    ]  # fmt: skip
    metrics = result.history[0]
    for stage in ("generate", "rollout_sleep", "score", "old_log_prob", "ref", "values", "advantage",
                  "update_critic", "update_actor", "weight_sync"):  # fmt: skip
        assert metrics[f"timing/{stage}"] > 0, stage


def test_a_replica_at_sleep_level_2_holds_no_weights_while_training_and_trains_the_same(tmp_path):
    """rollout.engine_kwargs.sleep_level=2 on the colocated hf replica: its weights are freed from the
    rollout_sleep stage to the weight sync (the update runs without them), and the run's rewards and
    validations equal sleep_level 1's exactly."""
    from trellis.config import load_config

    def fit(level):
        held = []

        class Probe:
            def __init__(self, group):
                self._group = group

            def __getattr__(self, name):
                attr = getattr(self._group, name)
                if name != "update_actor":
                    return attr

                def update(*args, **kwargs):
                    replica = self._group.workers[0].replicas.replicas[0]
                    held.append(sum(p.numel() for p in replica.model.parameters()))
                    return attr(*args, **kwargs)

                return update

        from trellis.trainer import Trainer

        class Probed(Trainer):
            def _build_workers(self):
                super()._build_workers()
                self.actor_wg = Probe(self.actor_wg)

        overrides = [*preset_overrides("tiny"), *QUICK, f"trainer.run_dir={tmp_path / str(level)}"]
        overrides += ["trainer.total_training_steps=3", "trainer.test_freq=2", "rollout.mode=colocated"]
        overrides += [f"rollout.engine_kwargs.sleep_level={level}"]
        history = Probed(load_config(None, overrides)).fit().history
        return held, [
            {k: v for k, v in m.items() if k.startswith(("val/", "reward/", "score/"))} for m in history
        ]

    held_1, history_1 = fit(1)
    held_2, history_2 = fit(2)
    assert len(held_1) == len(held_2) == 3
    assert min(held_1) > 0 and held_2 == [0, 0, 0]
    assert any("val/reward/mean" in m for m in history_2)
    assert history_2 == history_1


@pytest.mark.parametrize("placement", ["workers", "driver"])
def test_tool_rewards_enter_the_score_where_the_placement_says(tmp_path, placement):
    from trellis.registries import agent_loops
    from trellis.rollout.single_turn import SingleTurnAgentLoop

    class ToolRewarded(SingleTurnAgentLoop):
        async def run(self, sampling_params, **sample):
            out = await super().run(sampling_params, **sample)
            out.tool_reward = 1.0  # as if the sample's tools had rewarded it
            return out

    calls = []
    agent_loops.register("test_tool_rewarded", ToolRewarded)
    try:
        from trellis.config import load_config

        overrides = [*preset_overrides("tiny"), *QUICK, f"trainer.run_dir={tmp_path}"]
        overrides += [
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
        ]
        overrides += ["rollout.agent.default_agent_loop=test_tool_rewarded", "reward.tool_reward_weight=0.5"]
        overrides += [f"reward.placement={placement}", "reward.function=tests_zero_reward"]
        from trellis.registries import reward_functions

        reward_functions.register("tests_zero_reward", lambda **_: 0.0, replace=True)
        trainer = _recording_trainer(calls)(load_config(None, overrides))
        result = trainer.fit()
    finally:
        agent_loops.unregister("test_tool_rewarded")
        reward_functions.unregister("tests_zero_reward")
    metrics = result.history[0]
    assert metrics["reward/tool"] == 0.5 and metrics["score/mean"] == 0.5  # 0 + 0.5 × 1.0, every sample
    assert metrics["reward/errors"] == 0.0
    assert ("actor.compute_scores" in calls) == (placement == "workers")
    assert (trainer.reward_manager is not None) == (placement == "driver")


def test_a_third_party_estimator_that_declares_values_gets_a_critic_and_its_values(tmp_path):
    from trellis.registries import advantage_estimators, register_adv_est

    seen = []

    @register_adv_est("tests_value_baseline", requires=("values",))
    def value_baseline(token_level_rewards, response_mask, *, index=None, config=None, **extra):
        """A = G − V: Monte-Carlo return minus the critic's value."""
        seen.append(sorted(extra))
        values = extra["values"]
        assert values.shape == token_level_rewards.shape
        returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1) * response_mask
        return (returns - values) * response_mask, returns

    try:
        result = run(
            tmp_path, *QUICK, "algorithm.adv_estimator=tests_value_baseline",
            "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
        )  # fmt: skip
    finally:
        advantage_estimators.unregister("tests_value_baseline")
    assert seen == [["values"], ["values"]]  # exactly what it declared, every step
    assert all("critic/vf_loss" in m and "values/mean" in m for m in result.history)  # a critic trained


def test_log_val_generations_sends_samples_to_every_tracker(tmp_path, capsys):
    result = run(
        tmp_path, "trainer.trackers=[console,jsonl]", "trainer.resume_mode=disable",
        "trainer.total_training_steps=1", "trainer.test_freq=1", "trainer.log_val_generations=3",
    )  # fmt: skip
    with open(os.path.join(result.run_dir, "val_generations.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == [0, 0, 0, 1, 1, 1]  # before training and after step 1
    assert all(set(row) == {"step", "prompt", "response", "score"} for row in rows)
    assert rows[0]["prompt"].startswith("user\nWrite digits:") and isinstance(rows[0]["score"], float)
    printed = capsys.readouterr().err  # the console tracker writes to stderr
    assert "Validation samples, step 1" in printed and rows[3]["prompt"].splitlines()[1][:12] in printed
    off = run(tmp_path, *QUICK, "trainer.total_training_steps=1", "trainer.test_freq=1", name="off")
    assert not os.path.exists(os.path.join(off.run_dir, "val_generations.jsonl"))  # 0 = none


HANGING_REWARD = """
import time

CALLS = []


def score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append(1)
    if len(CALLS) == 3:  # one call of the step hangs
        time.sleep(60)
    return 1.0
"""


@pytest.mark.parametrize("placement", ["driver", "workers"])
def test_a_hanging_reward_times_out_and_the_step_goes_on(tmp_path, placement):
    reward = tmp_path / "hang.py"
    reward.write_text(HANGING_REWARD)
    result = run(
        tmp_path, *QUICK, f"reward.function={reward}:score", "reward.timeout_seconds=0.5",
        f"reward.placement={placement}", "trainer.total_training_steps=1", "trainer.val_before_train=false",
        "trainer.test_freq=-1",
    )  # fmt: skip
    metrics = result.history[0]
    assert metrics["reward/timeouts"] == 1.0 and metrics["reward/errors"] == 1.0
    assert metrics["score/min"] == 0.0 and metrics["score/max"] == 1.0  # the hung one scored 0
    assert metrics["timing/score"] < 5.0  # the 0.5 s limit, not the 60 s sleep


# ---------------------------------------------------------------- every objective knob reaches the objective

BONUS_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return bonus
"""


def test_the_objective_knobs_reach_the_objective(tmp_path, monkeypatch):
    """One short PPO run with every objective knob off its default; each stage's call is recorded."""
    from trellis.algorithms import objective, rollout_correction
    from trellis.algorithms.kl import AdaptiveKLController
    from trellis.algorithms.policy_loss import compute_policy_loss_cispo
    from trellis.reward.managers import BatchRewardManager
    from trellis.trainer import Trainer, workers

    calls = {}

    def record(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.setdefault(name, []).append((args, kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for name in ("actor_loss", "critic_loss", "compute_advantages", "kl_in_reward"):
        record(objective, name)
    record(workers, "mini_batches")
    record(rollout_correction, "rollout_correction_from_config")
    reward = tmp_path / "bonus.py"
    reward.write_text(BONUS_REWARD)
    from trellis.config import load_config

    overrides = [*preset_overrides("tiny"), *QUICK, f"trainer.run_dir={tmp_path / 'run'}"]
    overrides += ["trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    overrides += [
        "algorithm.adv_estimator=gae", "algorithm.gamma=0.9", "algorithm.lam=0.8",
        "algorithm.norm_adv_by_std_in_grpo=false", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=abs",
        "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05",
        "algorithm.kl_ctrl.target_kl=0.2", "algorithm.kl_ctrl.horizon=500",
        "rollout.calculate_log_probs=true", "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=3.0",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=5.0",
        "actor.ppo_epochs=2", "actor.ppo_mini_batch_size=4", "actor.shuffle=true", "actor.clip_ratio=0.3",
        "actor.clip_ratio_low=0.1", "actor.clip_ratio_high=0.4", "actor.clip_ratio_c=5.0",
        "actor.loss_agg_mode=seq-mean-token-sum", "actor.policy_loss=cispo",
        "actor.policy_loss_kwargs={tau_pos: 2.0}", "actor.entropy_coeff=0.5", "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.25", "actor.kl_loss_type=k2",
        "critic.ppo_epochs=3", "critic.ppo_mini_batch_size=2", "critic.shuffle=true",
        "critic.cliprange_value=0.3", "critic.loss_agg_mode=seq-mean-token-mean",
        "reward.manager=batch", f"reward.function={reward}:score", "reward.function_kwargs={bonus: 0.5}",
        "reward.placement=driver", "reward.num_workers=2",
    ]  # fmt: skip
    trainer = Trainer(load_config(None, overrides))
    metrics = trainer.fit().history[0]

    actor_args, actor = calls["actor_loss"][0]
    assert (
        actor["policy_loss"] is compute_policy_loss_cispo and actor["loss_agg_mode"] == "seq-mean-token-sum"
    )
    assert (actor["entropy_coeff"], actor["kl_loss_coef"], actor["kl_loss_type"]) == (0.5, 0.25, "k2")
    settings = actor["config"]
    assert (settings.clip_ratio, settings.clip_ratio_low, settings.clip_ratio_high) == (0.3, 0.1, 0.4)
    assert settings.clip_ratio_c == 5.0 and settings.policy_loss_kwargs == {"tau_pos": 2.0}
    assert actor["ref_log_prob"] is not None and actor_args[1] is not None  # ref on; 2 epochs: old log-probs
    critic = calls["critic_loss"][0][1]
    assert (critic["cliprange_value"], critic["loss_agg_mode"]) == (0.3, "seq-mean-token-mean")
    estimator, advantage = calls["compute_advantages"][0]
    assert estimator[0] == "gae" and "values" in advantage["inputs"]
    algorithm = advantage["config"]
    assert (algorithm.gamma, algorithm.lam, algorithm.norm_adv_by_std_in_grpo) == (0.9, 0.8, False)
    assert calls["kl_in_reward"][0][1] == {"kl_coef": 0.05, "kl_penalty_kind": "abs"}
    assert isinstance(trainer.kl_ctrl, AdaptiveKLController)
    assert (trainer.kl_ctrl.target, trainer.kl_ctrl.horizon) == (0.2, 500)
    # mini-batches: the critic's 3 epochs of 2 prompts × 4 responses, then the actor's 2 of 4 × 4, shuffled
    cut = [(args[1], kwargs["shuffle"]) for args, kwargs in calls["mini_batches"]]
    assert cut == [(8, True)] * 3 + [(16, True)] * 2
    rc = calls["rollout_correction_from_config"][0][0][3].rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize) == ("token", 3.0, True)
    assert (rc.rollout_rs, rc.rollout_rs_threshold) == ("token_k1", 5.0)
    assert "rollout_corr/is_weight_mean" in metrics
    assert isinstance(trainer.reward_manager, BatchRewardManager) and trainer.reward_manager.num_workers == 2
    assert metrics["score/mean"] == 0.5  # function_kwargs reached the reward function
    assert metrics["timing/ref"] > 0 and metrics["timing/values"] > 0


def _uneven_prompts(tmp_path):
    """A data set whose prompts differ in length by up to ~30 tokens, so every worker's shard pads
    to its own width."""
    rows = []
    for i in range(12):
        words = " ".join(["more"] * ((i * 7) % 13))
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"Write digits: {i} {words}"}],
                "data_source": "digits",
                "reward_model": {"ground_truth": "digits"},
            }
        )
    path = tmp_path / "uneven.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.distributed  # 2 and 3 Ray workers for more than an epoch (~25 s each)
@pytest.mark.parametrize("workers", [2, 3])
def test_ray_workers_gather_shards_of_uneven_width_for_more_than_an_epoch(tmp_path, ray_cluster, workers):
    data = _uneven_prompts(tmp_path)
    common = [*QUICK, f"data.train_files=[{data}]", "data.train_batch_size=6", "actor.ppo_mini_batch_size=6"]
    common += ["trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    common += [
        "data.shuffle=false",
        "data.max_prompt_length=96",
    ]  # 2 steps an epoch: step 3 starts the second
    local = run(tmp_path, *common, name="local")
    remote = run(
        tmp_path, *common, "trainer.executor=ray", f"trainer.n_devices_per_node={workers}",
        "actor.engine=fsdp", name=f"ray{workers}",
    )  # fmt: skip
    assert remote.steps == 3
    first = remote.history[0]
    assert first["prompt_length/max"] - first["prompt_length/min"] >= 8
    # the same prompts, seeds and (up to float rounding) weights: the same responses and rewards
    assert [m["reward/mean"] for m in remote.history] == pytest.approx(
        [m["reward/mean"] for m in local.history], abs=1e-6
    )
    shutil.rmtree(tmp_path / f"ray{workers}", ignore_errors=True)


@pytest.mark.parametrize("flush", [True, False])
def test_flush_denormal_holds_while_the_run_trains_and_is_restored_after(tmp_path, flush):
    from trellis.device.cpu import flushes_denormal, set_flush_denormal
    from trellis.hooks import get_plugin_manager, hookimpl

    torch.set_num_threads(1)
    seen = []

    class Probe:
        @hookimpl
        def trellis_step_end(self, step: int) -> None:
            seen.append(flushes_denormal())

    probe = Probe()
    before = set_flush_denormal(not flush)  # the run must change it, then put it back
    get_plugin_manager().register(probe)
    try:
        setting = f"trainer.flush_denormal={str(flush).lower()}"
        run(tmp_path, *QUICK, "trainer.total_training_steps=2", setting)
        assert seen == [flush, flush]
        assert flushes_denormal() is (not flush)
    finally:
        get_plugin_manager().unregister(probe)
        set_flush_denormal(before)


@pytest.mark.parametrize("policy", ["reuse", "release"])
def test_host_memory_holds_while_the_run_trains_and_is_restored_after(tmp_path, policy):
    from trellis.hooks import get_plugin_manager, hookimpl
    from trellis.utils.memory import host_memory, set_host_memory

    torch.set_num_threads(1)
    seen = []

    class Probe:
        @hookimpl
        def trellis_step_end(self, step: int) -> None:
            seen.append(host_memory())

    probe = Probe()
    other = "release" if policy == "reuse" else "reuse"
    set_host_memory(other)  # the run must change it, then put it back (the conftest restores the rest)
    get_plugin_manager().register(probe)
    try:
        run(tmp_path, *QUICK, "trainer.total_training_steps=2", f"trainer.host_memory={policy}")
        assert seen == [policy, policy]
        assert host_memory() == other
    finally:
        get_plugin_manager().unregister(probe)


@pytest.mark.parametrize("policy", ["reuse", "release"])
def test_worker_and_replica_processes_set_host_memory_from_the_config(policy):
    from trellis.config import load_config
    from trellis.rollout.remote import set_process_cpu
    from trellis.trainer.workers import ActorRolloutRefWorker
    from trellis.utils.memory import host_memory, set_host_memory

    config = load_config(None, [*preset_overrides("tiny"), f"trainer.host_memory={policy}"])
    other = "release" if policy == "reuse" else "reuse"
    set_host_memory(other)
    ActorRolloutRefWorker(config)
    assert host_memory() == policy
    set_host_memory(other)
    set_process_cpu(config)
    assert host_memory() == policy


def test_an_unknown_host_memory_policy_is_refused_by_the_config():
    from trellis.config import load_config

    with pytest.raises(Exception, match=r"host_memory[\s\S]*keep"):
        load_config(None, [*preset_overrides("tiny"), "trainer.host_memory=keep"])


@pytest.mark.parametrize("flush", [True, False])
def test_worker_and_replica_processes_set_flush_denormal_from_the_config(flush):
    # a Ray actor is a process of its own: the driver's setting never reaches it
    from trellis.config import load_config
    from trellis.device.cpu import flushes_denormal, set_flush_denormal
    from trellis.rollout.remote import set_process_cpu
    from trellis.trainer.workers import ActorRolloutRefWorker

    config = load_config(None, [*preset_overrides("tiny"), f"trainer.flush_denormal={str(flush).lower()}"])
    before = set_flush_denormal(not flush)
    try:
        ActorRolloutRefWorker(config)
        assert flushes_denormal() is flush
        set_flush_denormal(not flush)
        set_process_cpu(config)
        assert flushes_denormal() is flush
    finally:
        set_flush_denormal(before)
