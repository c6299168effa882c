"""trellis.config: defaults, merging, overrides, typed conversion, dict-like access and errors."""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass, field

import pytest
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import trellis.config.render as render
from trellis.config import (
    DEFAULTS_YAML,
    ActorConfig,
    BaseConfig,
    ConfigValueError,
    OptimConfig,
    RolloutConfig,
    TrellisConfig,
    default_dict,
    field_doc,
    knob,
    load_config,
    omega_conf_to_dataclass,
    render_defaults_yaml,
    section,
    to_dict,
    to_yaml,
)
from trellis.config.needs import resolve_needs
from trellis.errors import ConfigError, TrellisError


def error_of(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert isinstance(info.value, TrellisError) and isinstance(info.value, ValueError)
    return str(info.value)


def write(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------- defaults


def test_load_config_without_arguments_gives_the_defaults():
    config = load_config()
    assert isinstance(config, TrellisConfig)
    assert config == TrellisConfig()
    assert config.actor.optim.lr == 1e-6 and config.critic.optim.lr == 1e-5
    assert config.actor.optim.betas == [0.9, 0.999]
    assert (config.actor.engine, config.rollout.name, config.reward.manager) == ("single", "hf", "naive")
    assert (config.algorithm.adv_estimator, config.rollout.n, config.data.train_batch_size) == ("grpo", 4, 32)
    assert config.trainer.trackers == ["console", "jsonl"]
    assert (config.trainer.device, config.trainer.executor) == ("auto", "local")
    assert config.rollout.checkpoint_engine.name == "naive"
    assert config.rollout.agent.default_agent_loop == "single_turn"
    assert config.model.path is None and config.data.train_files == []


def test_null_defaults_are_derived_when_the_config_is_built():
    config = load_config()
    assert config.rollout.max_tokens == config.data.max_response_length == 512
    assert config.actor.clip_ratio_low == config.actor.clip_ratio_high == 0.2
    assert config.data.seed == config.rollout.seed == config.trainer.seed == 1
    # no KL term: whether a reference or a critic runs follows what the estimator and the loss declare
    assert config.ref.enable is None and config.critic.enable is None
    resolve_needs(config)
    assert config.ref.enable is False and config.critic.enable is False  # grpo and vanilla need neither
    assert config.critic.ppo_mini_batch_size == config.actor.ppo_mini_batch_size == 8
    assert config.critic.ppo_epochs == 1
    assert config.trainer.run_dir == "runs/trellis/default"
    assert config.rollout.checkpoint_engine.name == "naive"  # the replica lives in the training process
    assert config.trainer.replay_capacity == (1 + 2) * 32  # (max_staleness + 2) x train_batch_size

    config = load_config(
        overrides=[
            "model.path=org/model",
            "data.max_response_length=256",
            "actor.clip_ratio=0.3",
            "actor.clip_ratio_high=0.28",
            "actor.use_kl_loss=true",
            "algorithm.adv_estimator=gae",
            "trainer.experiment_name=exp1",
            "trainer.seed=7",
        ]
    )
    assert config.rollout.max_tokens == 256
    assert (config.actor.clip_ratio_low, config.actor.clip_ratio_high) == (0.3, 0.28)
    assert config.ref.enable is True and config.critic.enable is None  # the KL loss needs the reference
    assert resolve_needs(config).estimator == {"values"} and config.critic.enable is True  # gae: values
    assert config.model.tokenizer_path == config.critic.model_path == "org/model"
    assert config.data.seed == config.rollout.seed == 7
    assert config.trainer.run_dir == "runs/trellis/exp1"
    # Values given explicitly are kept.
    config = load_config(
        overrides=["rollout.max_tokens=100", "model.tokenizer_path=tok", "trainer.run_dir=/out"]
    )
    assert (config.rollout.max_tokens, config.model.tokenizer_path, config.trainer.run_dir) == (
        100,
        "tok",
        "/out",
    )


def test_shipped_defaults_yaml_is_the_rendering_of_the_dataclasses():
    text = DEFAULTS_YAML.read_text(encoding="utf-8")
    assert text == render_defaults_yaml(), "defaults/trellis.yaml is stale: run `python -m trellis.config`"
    declared = default_dict(TrellisConfig)
    assert yaml.safe_load(text) == declared
    assert OmegaConf.to_container(OmegaConf.load(DEFAULTS_YAML)) == declared
    assert omega_conf_to_dataclass(OmegaConf.load(DEFAULTS_YAML), TrellisConfig) == TrellisConfig()
    assert declared["critic"]["optim"]["lr"] == 1e-5  # a section's own default override shows
    assert declared["rollout"]["max_tokens"] is None  # declared, not derived
    assert "\n    # Peak learning rate." in text and "\n    lr: 1.0e-06\n" in text


def test_default_dict_matches_a_built_config_except_derived_fields():
    declared, built = default_dict(TrellisConfig), to_dict(TrellisConfig())
    differences = {
        f"{name}.{key}"
        for name in declared
        for key in declared[name]
        if declared[name][key] != built[name][key]
    }
    assert differences == {
        "data.seed",
        "actor.clip_ratio_low",
        "actor.clip_ratio_high",
        "critic.ppo_mini_batch_size",
        "critic.ppo_epochs",
        "ref.ulysses_sequence_parallel_size",
        "rollout.max_tokens",
        "rollout.seed",
        "rollout.checkpoint_engine",  # its name
        "trainer.run_dir",
        "trainer.replay_capacity",
    }


def _all_sections(cls):
    yield cls
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            yield from _all_sections(f.metadata["section"][0])


def test_every_field_is_documented():
    for cls in _all_sections(TrellisConfig):
        assert cls.__doc__, cls
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("doc", "")) > 10, f"{cls.__name__}.{f.name} has no doc"
    assert field_doc(OptimConfig, "lr").startswith("Peak learning rate.")
    assert field_doc(OptimConfig, "nope") == ""


def test_render_main_writes_the_defaults_file(tmp_path, monkeypatch, capsys):
    target = tmp_path / "trellis.yaml"
    monkeypatch.setattr(render, "DEFAULTS_YAML", target)
    render.main()
    assert target.read_text() == render_defaults_yaml()
    assert capsys.readouterr().out == f"wrote {target}\n"


# ---------------------------------------------------------------- merging: file and overrides


def test_user_file_is_merged_over_the_defaults(tmp_path):
    path = write(
        tmp_path,
        """
        data:
          train_files: [train.parquet, s3://bucket/more.parquet]
          max_response_length: 1024
        actor:
          optim:
            lr: 1e-5          # no dot: still a float
            lr_scheduler: cosine
        rollout:
          n: 8
          engine_kwargs: {enforce_eager: true, max_num_seqs: 64}
        trainer:
          experiment_name: gsm8k
          run_dir: /tmp/out/${trainer.experiment_name}
          trackers: [console]
        """,
    )
    config = load_config(path)
    assert config.data.train_files == ["train.parquet", "s3://bucket/more.parquet"]
    assert config.actor.optim.lr == 1e-5 and isinstance(config.actor.optim.lr, float)
    assert config.actor.optim.lr_scheduler == "cosine"
    assert config.actor.optim.weight_decay == 0.01  # untouched keys keep their defaults
    assert config.rollout.n == 8 and config.rollout.max_tokens == 1024
    assert config.rollout.engine_kwargs == {"enforce_eager": True, "max_num_seqs": 64}
    assert config.trainer.run_dir == "/tmp/out/gsm8k"
    assert config.trainer.trackers == ["console"]
    assert load_config(str(path)) == config  # str or Path


def test_empty_or_comment_only_file_changes_nothing(tmp_path):
    assert load_config(write(tmp_path, "# nothing here\n")) == TrellisConfig()


def test_overrides_nested_lists_mappings_and_null():
    config = load_config(
        overrides=[
            "actor.optim.lr=3e-6",
            "actor.optim.betas=[0.9,0.95]",
            "data.train_files=[a.parquet,b.jsonl]",
            "rollout.val_kwargs.n=4",
            "rollout.engine_kwargs.enforce_eager=true",
            "+rollout.engine_kwargs.sampler={seed: 3}",
            "++reward.function_kwargs.k=2",
            "reward.timeout_seconds=null",
            "actor.optim.weight_decay=0",  # an int where a float is expected becomes a float
            "reward.function=./my_reward.py:score",
            "trainer.project_name=a=b",  # only the first '=' separates
        ]
    )
    assert config.actor.optim.lr == 3e-6 and config.actor.optim.betas == [0.9, 0.95]
    assert config.data.train_files == ["a.parquet", "b.jsonl"]
    assert config.rollout.val_kwargs.n == 4
    assert config.rollout.engine_kwargs == {"enforce_eager": True, "sampler": {"seed": 3}}
    assert config.reward.function_kwargs == {"k": 2}
    assert config.reward.timeout_seconds is None
    assert config.actor.optim.weight_decay == 0.0 and isinstance(config.actor.optim.weight_decay, float)
    assert config.reward.function == "./my_reward.py:score"
    assert config.trainer.project_name == "a=b"


def test_precedence_defaults_then_file_then_overrides_in_order(tmp_path):
    path = write(tmp_path, "rollout:\n  n: 8\n  temperature: 0.7\n")
    config = load_config(path, ["rollout.n=16", "rollout.n=6"])
    assert config.rollout.n == 6  # the last override wins
    assert config.rollout.temperature == 0.7  # from the file
    assert config.rollout.top_p == 1.0  # from the defaults
    # An override replaces a list as a whole.
    assert load_config(path, ["trainer.trackers=[jsonl]"]).trainer.trackers == ["jsonl"]


def test_interpolations_resolve_across_layers(tmp_path):
    path = write(tmp_path, "rollout:\n  max_tokens: ${data.max_prompt_length}\n")
    config = load_config(path, ["data.max_prompt_length=128", "data.max_response_length=256"])
    assert config.rollout.max_tokens == 128


# ---------------------------------------------------------------- errors: keys


def test_unknown_key_in_an_override_names_key_closest_key_and_value():
    message = error_of(["actor.optim.learning_rate=1e-5"])
    assert message.startswith(
        "Unknown config key 'actor.optim.learning_rate'. Closest valid key: 'actor.optim.lr'."
    )
    assert "Keys of 'actor.optim': name, lr, betas," in message
    assert message.endswith("It was set to 1e-05 by override 'actor.optim.learning_rate=1e-5'.")


@pytest.mark.parametrize(
    ("override", "unknown", "closest"),
    [
        ("actor.lr=1e-5", "actor.lr", "actor.optim.lr"),  # a key in the wrong sub-section
        ("rollout.adv_estimator=gae", "rollout.adv_estimator", "algorithm.adv_estimator"),  # wrong section
        ("actor.strategy=fsdp", "actor.strategy", "actor.engine"),  # verl's name
        ("trainer.n_gpus_per_node=2", "trainer.n_gpus_per_node", "trainer.n_devices_per_node"),
        ("actor.param_offload=true", "actor.param_offload", "actor.offload.param"),
        ("trainer.total_steps=3", "trainer.total_steps", "trainer.total_training_steps"),
        ("actor.clip_ration=0.3", "actor.clip_ration", "actor.clip_ratio"),  # a typo
        ("actor.loss-agg-mode=token-mean", "actor.loss-agg-mode", "actor.loss_agg_mode"),
        ("actr.clip_ratio=0.3", "actr", "actor"),  # a section name
    ],
)
def test_unknown_key_suggestions(override, unknown, closest):
    assert error_of([override]).startswith(f"Unknown config key '{unknown}'. Closest valid key: '{closest}'.")


def test_unknown_key_in_a_file_names_the_file(tmp_path):
    path = write(tmp_path, "trainer:\n  total_epoch: 3\n")
    message = error_of(path=path)
    assert message.startswith(
        "Unknown config key 'trainer.total_epoch'. Closest valid key: 'trainer.total_epochs'."
    )
    assert message.endswith(f"It was set to 3 by file '{path}'.")


def test_keys_may_be_added_only_inside_free_form_mappings():
    assert load_config(overrides=["+model.override_config.rope_theta=10000"]).model.override_config == {
        "rope_theta": 10000
    }
    assert error_of(["+actor.new_knob=1"]).startswith("Unknown config key 'actor.new_knob'.")


# ---------------------------------------------------------------- errors: values


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("actor.optim.lr=fast", "Config key 'actor.optim.lr' must be a number; got 'fast' (str)."),
        ("rollout.n=2.5", "Config key 'rollout.n' must be an integer; got 2.5 (float)."),
        ("rollout.n=true", "Config key 'rollout.n' must be an integer; got True (bool)."),
        ("rollout.do_sample=1", "Config key 'rollout.do_sample' must be true or false; got 1 (int)."),
        ("model.path=[a]", "Config key 'model.path' must be a string or null; got ['a'] (list)."),
        ("trainer.trackers=[console,3]", "Config key 'trainer.trackers[1]' must be a string; got 3 (int)."),
        (
            "trainer.trackers=console",
            "Config key 'trainer.trackers' must be a list of strings; got 'console' (str).",
        ),
        (
            "rollout.engine_kwargs=[1]",
            "Config key 'rollout.engine_kwargs' must be a mapping; got [1] (list).",
        ),
        ("actor.optim=5", "Config key 'actor.optim' must be a mapping (section OptimConfig); got 5 (int)."),
        (
            "actor.optim.betas=[0.9]",
            "Config key 'actor.optim.betas' must be two numbers in [0, 1), [beta1, beta2]",
        ),
    ],
)
def test_wrong_types_name_key_value_and_expected_type(override, expected):
    assert error_of([override]).startswith(expected)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "actor.loss_agg_mode=token_mean",
            "Config key 'actor.loss_agg_mode' must be one of 'token-mean', 'seq-mean-token-sum', "
            "'seq-mean-token-mean', 'seq-mean-token-sum-norm'; got 'token_mean'. Closest: 'token-mean'.",
        ),
        (
            "model.dtype=fp16",
            "Config key 'model.dtype' must be one of 'float32', 'bfloat16', 'float16'; got 'fp16'.",
        ),
        (
            "rollout.mode=async",
            "Config key 'rollout.mode' must be one of 'hybrid', 'colocated', 'standalone'; got 'async'.",
        ),
        (
            "data.truncation=middle",
            "Config key 'data.truncation' must be one of 'error', 'left', 'right'; got 'middle'.",
        ),
        (
            "algorithm.kl_penalty=k4",
            "Config key 'algorithm.kl_penalty' must be one of 'k1', 'kl', 'abs', 'k2',",
        ),
        (
            "trainer.executor=Ray",
            "Config key 'trainer.executor' must be one of 'local', 'ray'; got 'Ray'. Closest: 'ray'.",
        ),
        (
            "algorithm.kl_ctrl.type=pid",
            "Config key 'algorithm.kl_ctrl.type' must be one of 'fixed', 'adaptive'",
        ),
    ],
)
def test_enumerated_fields_list_the_allowed_values(override, expected):
    assert error_of([override]).startswith(expected)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.n=0", "Config key 'rollout.n' must be >= 1; got 0."),
        ("rollout.temperature=-0.1", "Config key 'rollout.temperature' must be >= 0; got -0.1."),
        (
            "rollout.gpu_memory_utilization=1.5",
            "Config key 'rollout.gpu_memory_utilization' must be > 0 and <= 1; got 1.5.",
        ),
        (
            "rollout.gpu_memory_utilization=0",
            "Config key 'rollout.gpu_memory_utilization' must be > 0 and <= 1; got 0.",
        ),
        ("rollout.top_p=0", "Config key 'rollout.top_p' must be > 0 and <= 1; got 0."),
        ("rollout.top_k=-2", "Config key 'rollout.top_k' must be >= -1; got -2."),
        ("rollout.top_k=0", "Config key 'rollout.top_k' must be -1 (off) or a positive integer; got 0."),
        ("actor.clip_ratio=0", "Config key 'actor.clip_ratio' must be > 0; got 0."),
        ("actor.clip_ratio_high=-0.2", "Config key 'actor.clip_ratio_high' must be > 0; got -0.2."),
        ("actor.clip_ratio_c=1", "Config key 'actor.clip_ratio_c' must be > 1; got 1."),
        ("actor.optim.lr=0", "Config key 'actor.optim.lr' must be > 0; got 0."),
        (
            "critic.optim.min_lr_ratio=2",
            "Config key 'critic.optim.min_lr_ratio' must be >= 0 and <= 1; got 2.",
        ),
        ("data.train_batch_size=0", "Config key 'data.train_batch_size' must be >= 1; got 0."),
        ("data.val_batch_size=0", "Config key 'data.val_batch_size' must be >= 1; got 0."),
        (
            "actor.ppo_micro_batch_size_per_device=0",
            "Config key 'actor.ppo_micro_batch_size_per_device' must be >= 1",
        ),
        ("algorithm.gamma=1.1", "Config key 'algorithm.gamma' must be >= 0 and <= 1; got 1.1."),
        (
            "algorithm.rollout_correction.rollout_is_threshold=0",
            "Config key 'algorithm.rollout_correction.rollout_is_threshold' must hold bounds > 0 "
            "(weights are ratios of probabilities); got 0.0.",
        ),
        ("reward.timeout_seconds=0", "Config key 'reward.timeout_seconds' must be > 0; got 0."),
    ],
)
def test_out_of_range_values_are_rejected(override, expected):
    assert error_of([override]).startswith(expected)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["actor.ppo_mini_batch_size=5"],
            "Config key 'actor.ppo_mini_batch_size' must divide data.train_batch_size (32): a step's prompts "
            "form whole mini-batches; got 5.",
        ),
        (
            ["critic.enable=true", "critic.ppo_mini_batch_size=3"],
            "Config key 'critic.ppo_mini_batch_size' must divide data.train_batch_size (32)",
        ),
        (
            [
                "actor.ppo_mini_batch_size=1",
                "rollout.n=3",
                "trainer.executor=ray",
                "trainer.n_devices_per_node=2",
            ],
            "Config key 'actor.ppo_mini_batch_size' × rollout.n (3) = 3 responses must split evenly over "
            "the 2 devices (trainer.nnodes × trainer.n_devices_per_node); got 1.",
        ),
        (
            ["actor.use_dynamic_bsz=true", "actor.max_token_len_per_micro_batch=1000"],
            "Config key 'actor.max_token_len_per_micro_batch' must be >= data.max_prompt_length + "
            "data.max_response_length (1024) so one full-length sample fits; got 1000.",
        ),
        (
            ["rollout.max_tokens=1024"],
            "Config key 'rollout.max_tokens' must be <= data.max_response_length (512)",
        ),
        (
            ["actor.use_kl_loss=true", "ref.enable=false"],
            "Config key 'ref.enable' must be true (or null) when actor.use_kl_loss is true",
        ),
        (
            ["algorithm.use_kl_in_reward=true", "ref.enable=false"],
            "Config key 'ref.enable' must be true (or null) when algorithm.use_kl_in_reward is true",
        ),
        (
            ["algorithm.rollout_correction.rollout_is=sequence"],
            "Config key 'rollout.calculate_log_probs' must be true when "
            "algorithm.rollout_correction.rollout_is is 'sequence', which compares the trainer's log-probs "
            "with the rollout's; got False (bool).",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2",
            ],
            "Config key 'rollout.calculate_log_probs' must be true when "
            "algorithm.rollout_correction.rollout_rs is 'token_k1', which compares",
        ),
        (
            ["algorithm.rollout_correction.rollout_rs=token_k1"],
            "Config key 'algorithm.rollout_correction.rollout_rs_threshold' must be set when "
            "algorithm.rollout_correction.rollout_rs 'token_k1' is set: a number, a comma-separated "
            "string of numbers or a list of numbers, one per criterion or one for all; got None.",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k1,seq_sum_k2",
                "algorithm.rollout_correction.rollout_rs_threshold='1,2,3'",
            ],
            "Config key 'algorithm.rollout_correction.rollout_rs_threshold' must give 1 number (for all "
            "criteria) or 2 (one per criterion of algorithm.rollout_correction.rollout_rs "
            "'token_k1,seq_sum_k2'); got '1,2,3'. It gives 3.",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=seq_avg_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2",
            ],
            "Config key 'algorithm.rollout_correction.rollout_rs' must be criteria joined by commas, each "
            "one of token_k1, token_k2, token_k3, seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, "
            "seq_mean_k2, seq_mean_k3, seq_max_k1, seq_max_k2, seq_max_k3; got 'seq_avg_k1'. Unknown "
            "criterion 'seq_avg_k1'.",
        ),
        (
            ["algorithm.rollout_correction.rollout_is_threshold=2.0_0.5"],
            "Config key 'algorithm.rollout_correction.rollout_is_threshold' must name a band with "
            "lower < upper; got '2.0_0.5'. Write 'lower_upper', e.g. '0.5_2.0'.",
        ),
        (
            ["algorithm.rollout_correction.rollout_is_batch_normalize=true"],
            "Config key 'algorithm.rollout_correction.rollout_is_batch_normalize' must be false when "
            "algorithm.rollout_correction.rollout_is is null; got True. There are no weights to normalise: "
            "set rollout_is too.",
        ),
        (
            ["rollout.temperature=0"],
            "Config key 'rollout.temperature' must be > 0 when rollout.do_sample is true; got 0.0. "
            "For greedy decoding set do_sample=false.",
        ),
        (
            ["rollout.val_kwargs.do_sample=true"],
            "Config key 'rollout.val_kwargs.temperature' must be > 0 when rollout.val_kwargs.do_sample "
            "is true",
        ),
        (
            ["trainer.resume_mode=resume_path"],
            "Config key 'trainer.resume_from_path' must name a checkpoint directory when "
            "trainer.resume_mode is 'resume_path'; got None.",
        ),
        (
            ["trainer.nnodes=2"],
            "Config key 'trainer.executor' must be 'ray' when trainer.nnodes is 2 "
            "(local runs on one machine); got 'local'.",
        ),
    ],
)
def test_cross_field_rules(overrides, expected):
    assert error_of(overrides).startswith(expected)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["algorithm.adv_estimator=gae", "critic.enable=false"],
            "Config key 'critic.enable' must be true (or null) with algorithm.adv_estimator 'gae', which "
            "needs values; got False (bool).",
        ),
        (
            ["rollout.n=1"],
            "Config key 'rollout.n' must be >= 2 with algorithm.adv_estimator 'grpo', which compares the "
            "responses to one prompt; got 1.",
        ),
        (
            ["algorithm.adv_estimator=rloo", "rollout.n=1"],
            "Config key 'rollout.n' must be >= 2 with algorithm.adv_estimator 'rloo'",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.enable=null", "critic.ppo_mini_batch_size=3"],
            "Config key 'critic.ppo_mini_batch_size' must divide data.train_batch_size (32)",
        ),
    ],
)
def test_what_the_estimator_declares_it_needs_is_checked_when_the_run_is_built(overrides, expected):
    config = load_config(None, overrides)  # nothing is imported to read declarations yet
    with pytest.raises(ConfigValueError) as info:
        resolve_needs(config)
    assert str(info.value).startswith(expected)


def test_reinforce_plus_plus_needs_no_groups_and_remax_needs_its_baselines():
    config = load_config(None, ["algorithm.adv_estimator=reinforce_plus_plus", "rollout.n=1"])
    assert resolve_needs(config).estimator == frozenset()
    config = load_config(None, ["algorithm.adv_estimator=remax", "rollout.n=1"])
    assert resolve_needs(config).estimator == {"reward_baselines"} and not config.critic.enable


def test_cross_field_rules_accept_consistent_values():
    config = load_config(
        overrides=[
            "actor.ppo_mini_batch_size=4",
            "rollout.n=3",
            "trainer.executor=ray",
            "trainer.nnodes=2",
            "trainer.n_devices_per_node=2",  # 4 prompts × 3 = 12 responses over 4 devices
            "rollout.temperature=0",
            "rollout.do_sample=false",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=[0.5,2.0]",
            "algorithm.rollout_correction.rollout_rs=seq_mean_k3,token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold='0.01,2'",
            "rollout.calculate_log_probs=true",
            "trainer.resume_mode=resume_path",
            "trainer.resume_from_path=/ckpt/step_10",
        ]
    )
    assert config.rollout.temperature == 0.0 and config.algorithm.rollout_correction.rollout_is == "token"
    assert config.algorithm.rollout_correction.rollout_is_threshold == [0.5, 2.0]
    assert config.algorithm.rollout_correction.rollout_rs_threshold == "0.01,2"
    assert load_config(overrides=["algorithm.adv_estimator=reinforce", "rollout.n=1"]).rollout.n == 1


def test_value_errors_carry_the_key_and_value():
    with pytest.raises(ConfigValueError) as info:
        load_config(overrides=["rollout.agent.max_turns=0"])
    assert (info.value.key, info.value.value) == ("rollout.agent.max_turns", 0)
    assert str(info.value) == "Config key 'rollout.agent.max_turns' must be >= 1; got 0."


# ---------------------------------------------------------------- errors: files and overrides


def test_missing_file_names_the_path(tmp_path):
    message = error_of(path=tmp_path / "nope.yaml")
    assert message.startswith(f"Config file '{tmp_path / 'nope.yaml'}' does not exist (looked at '")
    assert error_of(path=tmp_path).startswith(f"Config file '{tmp_path}' is a directory, not a file")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "actor:\n  clip_ratio: 0.2\n optim: {lr: 1}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"YAML syntax error in config file '{path}', line 3, column 2:")
    assert "expected <block end>, but found '<block mapping start>'." in str(info.value)
    assert isinstance(info.value.__cause__, yaml.YAMLError)


def test_duplicate_keys_in_a_file_are_an_error(tmp_path):
    path = write(tmp_path, "rollout:\n  n: 4\n  n: 8\n")
    assert error_of(path=path) == (
        f"YAML syntax error in config file '{path}', line 3, column 3: found duplicate key 'n'."
    )


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list: ['a', 'b']"), ("5\n", "int: 5")])
def test_file_whose_top_level_is_not_a_mapping(tmp_path, text, kind):
    path = write(tmp_path, text)
    assert error_of(path=path) == (
        f"Config file '{path}' must hold a mapping of sections (data:, model:, actor:, ...) at its top "
        f"level; it holds a {kind}."
    )


@pytest.mark.parametrize("bad", ["actor.optim.lr", "", 5])
def test_override_without_equals_shows_the_form(bad):
    assert error_of([bad]).startswith(f"Override {bad!r} is not of the form key=value")
    assert "e.g. 'actor.optim.lr=1e-5'" in error_of([bad])


def test_malformed_override_key_and_value():
    assert error_of(["actor..lr=1"]).startswith("Override 'actor..lr=1' has a malformed key 'actor..lr'")
    assert error_of(["=1"]).startswith("Override '=1' has a malformed key ''")
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["rollout.n=[1,"])
    assert str(info.value) == (
        "Override 'rollout.n=[1,': the value '[1,' is not valid YAML: while parsing a flow node did not find "
        "expected node content."
    )
    assert info.value.__cause__ is not None


def test_overrides_must_be_a_list_not_a_string():
    assert error_of("rollout.n=8") == (
        "Overrides must be a list of 'key=value' strings, got one string 'rollout.n=8'; pass ['rollout.n=8']."
    )


def test_unresolvable_interpolation_is_wrapped_with_its_key():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["trainer.run_dir=${trainer.nope}"])
    assert str(info.value) == (
        "Config key 'trainer.run_dir' could not be resolved: Interpolation key 'trainer.nope' not found"
    )
    assert isinstance(info.value.__cause__, OmegaConfBaseException)


def test_required_marker_is_reported_with_its_key(tmp_path):
    # A file can mark a key as required ('???'); a later override may then supply it.
    path = write(tmp_path, "model:\n  path: ???\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        "Config key 'model.path' is required but has no value ('???'); set it in the config file or with an "
        "override model.path=..."
    )
    assert isinstance(info.value.__cause__, OmegaConfBaseException)
    assert load_config(path, ["model.path=org/m"]).model.path == "org/m"


# ---------------------------------------------------------------- BaseConfig


def test_get_and_dict_like_access():
    config = load_config(overrides=["rollout.engine_kwargs.enforce_eager=true"])
    actor = config.actor
    assert actor.get("clip_ratio") == 0.2 and actor["clip_ratio"] == 0.2
    assert actor.get("optim.lr") == 1e-6 and config["actor.optim.lr"] == 1e-6
    assert config.get("rollout.engine_kwargs.enforce_eager") is True  # into a free-form mapping
    assert actor.get("nope") is None and actor.get("nope", 3) == 3 and actor.get("optim.nope", "x") == "x"
    assert "clip_ratio" in actor and "optim.lr" in actor and "nope" not in actor and 3 not in actor
    assert list(config) == config.keys() == [
        "data", "model", "actor", "critic", "ref", "rollout", "reward", "algorithm", "trainer"
    ]  # fmt: skip
    assert len(config) == 9
    assert config.values()[2] is actor and dict(config.items())["actor"] is actor
    assert dict(actor.optim) == {name: getattr(actor.optim, name) for name in actor.optim}
    assert {**actor.offload} == {"param": False, "optimizer": False, "resident_layers": 2}
    with pytest.raises(KeyError, match=r"OptimConfig has no key 'learning_rate'. Keys: name, lr, betas"):
        actor.optim["learning_rate"]


def test_sections_check_their_fields_when_built_in_python():
    optim = OptimConfig(lr=1, betas=[0, 0.5])
    assert optim.lr == 1.0 and isinstance(optim.lr, float) and optim.betas == [0.0, 0.5]
    assert ActorConfig(clip_ratio=0.25).clip_ratio_low == 0.25
    with pytest.raises(ConfigValueError, match=r"^Config key 'clip_ratio' must be > 0; got -1\.$"):
        ActorConfig(clip_ratio=-1)
    with pytest.raises(ConfigValueError, match=r"^Config key 'n' must be an integer; got '4' \(str\)\.$"):
        RolloutConfig(n="4")
    with pytest.raises(
        ConfigValueError, match=r"Config key 'actor' must be a mapping \(section ActorConfig\)"
    ):
        TrellisConfig(actor={"clip_ratio": 0.3})
    # A whole config built in Python gets the same cross-section checks.
    with pytest.raises(ConfigValueError, match=r"^Config key 'rollout.max_tokens' must be <= data"):
        TrellisConfig(rollout=RolloutConfig(max_tokens=1024))


def test_configs_are_plain_mutable_dataclasses():
    config = TrellisConfig()
    config.actor.optim.lr = 2e-6
    assert config.actor.optim.lr == 2e-6
    assert TrellisConfig().actor.optim.lr == 1e-6  # instances share nothing
    assert TrellisConfig().trainer.trackers is not config.trainer.trackers


# ---------------------------------------------------------------- omega_conf_to_dataclass


@dataclass
class Schedule:
    """A plain dataclass (no BaseConfig): still converted and type-checked."""

    kind: str = "constant"
    warmup: int = 0


@dataclass
class Job(BaseConfig):
    """A test config with a required field, a nested section and a plain nested dataclass."""

    name: str
    optim: OptimConfig = section(OptimConfig, "Optimizer.", lr=1e-4)  # noqa: RUF009
    schedule: Schedule = field(default_factory=Schedule)
    tags: list[str] = knob([], "Tags.")  # noqa: RUF009


@dataclass
class FastOptim(OptimConfig):
    """A subclass that a nested ``_target_`` may select."""

    fused: bool = knob(True, "Use a fused kernel.")


def test_omega_conf_to_dataclass_with_an_explicit_type():
    cfg = OmegaConf.create({"name": "a", "optim": {"lr": 3}, "schedule": {"warmup": 5}, "tags": ["x"]})
    job = omega_conf_to_dataclass(cfg, Job)
    assert job == Job(name="a", optim=OptimConfig(lr=3.0), schedule=Schedule(warmup=5), tags=["x"])
    assert isinstance(job.optim, OptimConfig) and isinstance(job.schedule, Schedule)
    assert job.optim.lr == 3.0 and isinstance(job.optim.lr, float)
    # A plain dict works too; missing keys take the defaults, including a section's own overrides.
    assert omega_conf_to_dataclass({"name": "b"}, Job).optim.lr == 1e-4
    # A sub-node of a larger config, with interpolations into the rest of it.
    root = OmegaConf.create({"base_lr": 2e-5, "actor": {"optim": {"lr": "${base_lr}"}}})
    assert omega_conf_to_dataclass(root.actor.optim, OptimConfig).lr == 2e-5
    # An instance of the type is returned as it is.
    assert omega_conf_to_dataclass(job, Job) is job and omega_conf_to_dataclass(job) is job


@pytest.mark.parametrize(
    "target", ["test_config:Job", "test_config.Job", "trellis.config.schema.OptimConfig"]
)
def test_omega_conf_to_dataclass_with_target_in_both_forms(target):
    data = {"_target_": target, "name": "t"} if "Job" in target else {"_target_": target, "lr": 5e-6}
    obj = omega_conf_to_dataclass(OmegaConf.create(data))
    if "Job" in target:
        assert type(obj) is Job and obj.name == "t" and obj.optim == OptimConfig(lr=1e-4)
    else:
        assert obj == OptimConfig(lr=5e-6)


def test_target_from_a_file_reference(tmp_path, monkeypatch):
    (tmp_path / "my_cfg.py").write_text(
        "from dataclasses import dataclass\n\n\n"
        "@dataclass\nclass Mine:\n    size: int = 1\n    label: str = 'x'\n"
    )
    monkeypatch.chdir(tmp_path)
    obj = omega_conf_to_dataclass({"_target_": "./my_cfg.py:Mine", "size": 3})
    assert (type(obj).__name__, obj.size, obj.label) == ("Mine", 3, "x")
    with pytest.raises(
        ConfigValueError, match=r"^Config key 'size' must be an integer; got 'big' \(str\)\.$"
    ):
        omega_conf_to_dataclass({"_target_": "./my_cfg.py:Mine", "size": "big"})


def test_nested_target_selects_a_subclass():
    job = omega_conf_to_dataclass(
        {"name": "n", "optim": {"_target_": "test_config:FastOptim", "fused": False}}, Job
    )
    assert type(job.optim) is FastOptim and job.optim.fused is False
    with pytest.raises(ConfigError) as info:
        omega_conf_to_dataclass({"name": "n", "optim": {"_target_": "test_config:Schedule"}}, Job)
    assert str(info.value) == (
        "Config key 'optim._target_' names test_config.Schedule, which is not a subclass of OptimConfig, "
        "the type of 'optim'."
    )


def test_omega_conf_to_dataclass_errors():
    with pytest.raises(
        ConfigError, match=r"^Unknown config key 'optim.learning_rate'. Closest valid key: 'optim.lr'\."
    ):
        omega_conf_to_dataclass({"name": "a", "optim": {"learning_rate": 1}}, Job)
    with pytest.raises(ConfigValueError, match=r"^Config key 'schedule.warmup' must be an integer; got 'x'"):
        omega_conf_to_dataclass({"name": "a", "schedule": {"warmup": "x"}}, Job)
    with pytest.raises(ConfigValueError, match=r"^Config key 'optim.lr' must be > 0; got -1\.$"):
        omega_conf_to_dataclass({"name": "a", "optim": {"lr": -1}}, Job)
    with pytest.raises(ConfigError, match=r"^Config key 'name' is required; set it"):
        omega_conf_to_dataclass({}, Job)
    with pytest.raises(ConfigError, match=r"^Cannot tell which dataclass to build: pass dataclass_type"):
        omega_conf_to_dataclass({"lr": 1})
    with pytest.raises(ConfigError) as info:
        omega_conf_to_dataclass({"_target_": "trellis_no_such_pkg.Thing"})
    assert str(info.value).startswith(
        "Config key '_target_' names 'trellis_no_such_pkg.Thing', which could not be imported: Reference "
        "'trellis_no_such_pkg:Thing': no module named 'trellis_no_such_pkg'"
    )
    assert info.value.__cause__ is not None
    with pytest.raises(
        ConfigError, match=r"^Config key '_target_' names 'os.path:join', which is not a dataclass"
    ):
        omega_conf_to_dataclass({"_target_": "os.path:join"})
    with pytest.raises(ConfigValueError, match=r"^Config key '_target_' must be a string naming a class"):
        omega_conf_to_dataclass({"_target_": 3})
    with pytest.raises(TypeError, match=r"dataclass_type must be a dataclass type, got <class 'dict'>"):
        omega_conf_to_dataclass({}, dict)
    with pytest.raises(TypeError, match=r"Expected a DictConfig or a mapping, got list"):
        omega_conf_to_dataclass([1, 2], Job)


# ---------------------------------------------------------------- to_dict / to_yaml


def test_to_dict_gives_plain_containers():
    config = load_config(overrides=["rollout.engine_kwargs.a=1"])
    data = to_dict(config)
    assert type(data) is dict and type(data["actor"]["optim"]) is dict
    assert data["actor"]["optim"]["lr"] == 1e-6 and data["rollout"]["engine_kwargs"] == {"a": 1}
    assert omega_conf_to_dataclass(data, TrellisConfig) == config
    assert to_dict(OmegaConf.create({"a": 1, "b": "${a}"})) == {"a": 1, "b": 1}
    with pytest.raises(TypeError, match="Expected a config dataclass or a DictConfig, got int"):
        to_dict(3)


def test_to_yaml_round_trips_through_load_config(tmp_path):
    config = load_config(
        overrides=[
            "actor.optim.lr=3e-6",
            "data.train_files=[a.parquet]",
            "trainer.project_name='null'",  # strings that read as null or a number unless quoted
            "trainer.experiment_name='1'",
            "rollout.engine_kwargs.nested={x: [1, 2]}",
        ]
    )
    assert config.trainer.project_name == "null" and config.trainer.experiment_name == "1"
    text = to_yaml(config)
    assert text.startswith("data:\n  train_files: [a.parquet]\n")
    assert "#" not in text
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert load_config(path) == config
    commented = to_yaml(config, comments=True)
    assert "\n    # Peak learning rate." in commented and "\n    lr: 3.0e-06\n" in commented
    assert yaml.safe_load(commented) == yaml.safe_load(text)


# ---------------------------------------------------------------- cheap import


def test_config_does_not_import_torch(python):
    done = python(
        "import sys, trellis.config\n"
        "trellis.config.load_config(overrides=['rollout.n=8'])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n"


def test_schema_default_is_the_declared_default():
    from trellis.config import CriticConfig, ModelConfig, schema_default

    assert schema_default(ModelConfig, "use_remove_padding") is True
    assert schema_default(TrellisConfig, "rollout.agent.tool_parser") == "hermes"
    assert schema_default(CriticConfig, "optim.lr") == 1e-5  # a section's own override
    assert schema_default(TrellisConfig, "rollout.max_tokens") is None  # declared, not derived
    betas = schema_default(OptimConfig, "betas")
    betas.append(0.5)  # a copy: the next caller gets the declared list
    assert schema_default(OptimConfig, "betas") == [0.9, 0.999]
    with pytest.raises(
        KeyError, match=r"ModelConfig has no key 'nope'; keys at 'nope': path, tokenizer_path"
    ):
        schema_default(ModelConfig, "nope")
    with pytest.raises(KeyError, match=r"keys at 'x': \(none: a value, not a section\)"):
        schema_default(OptimConfig, "lr.x")


def test_overlapping_modes_derive_and_check_their_settings():
    standalone = ["rollout.mode=standalone"]
    assert load_config(overrides=standalone).rollout.checkpoint_engine.name == "shm"
    several = [*standalone, "rollout.nnodes=2"]
    assert load_config(overrides=several).rollout.checkpoint_engine.name == "gloo"
    config = load_config(overrides=[*standalone, "trainer.mode=async", "rollout.max_staleness=3"])
    assert config.trainer.replay_capacity == 5 * 32
    assert load_config(overrides=[*standalone, "trainer.replay_capacity=3"]).trainer.replay_capacity == 3

    def refused(*overrides):
        with pytest.raises(ConfigValueError) as info:
            load_config(overrides=list(overrides))
        return str(info.value)

    assert "trainer.mode" in refused("trainer.mode=async") and "rollout.mode=standalone" in refused(
        "trainer.mode=one_step_off"
    )
    assert "rollout.partial_rollout" in refused(*standalone, "rollout.partial_rollout=true")
    assert "trainer.replay_ratio" in refused(*standalone, "trainer.replay_ratio=0.5")
    message = refused(*standalone, "trainer.mode=async", "trainer.replay_ratio=0.99")
    assert "no fresh group" in message and "train_batch_size=32" in message
    assert "naive" in refused(*standalone, "rollout.checkpoint_engine.name=naive")
    assert "rollout.calculate_log_probs" in refused("algorithm.off_policy=decoupled")
    message = refused(
        "algorithm.off_policy=decoupled",
        "rollout.calculate_log_probs=true",
        "algorithm.rollout_correction.rollout_is=token",
    )
    assert "algorithm.rollout_correction.rollout_is" in message
    message = refused("algorithm.off_policy=behaviour")
    assert "rollout.calculate_log_probs" in message and "'behaviour'" in message
    behaviour = ["algorithm.off_policy=behaviour", "rollout.calculate_log_probs=true"]
    message = refused(
        *behaviour,
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=2",
    )
    assert "algorithm.rollout_correction.rollout_rs" in message and "is 1 on every token" in message
    assert "rollout_correction.rollout_is" in refused(
        *behaviour, "algorithm.rollout_correction.rollout_is=token"
    )
    load_config(overrides=behaviour)  # accepted
    assert "ge" in refused("rollout.max_staleness=-1") or "-1" in refused("rollout.max_staleness=-1")
    assert "drop" in refused("rollout.stale_policy=sometimes")
    assert "sync" in refused("trainer.mode=eventually")
