"""No knob that does nothing: every key of the schema is pinned by a test that fails when the code ignores it.

``KNOBS`` maps each dotted leaf key of :class:`~trellis.config.TrellisConfig` to the tests (pytest node
ids; a parametrized test by its function name) that set it to a value other than its default and
assert a consequence. ``DEFERRED`` holds the keys another issue owns, with the reason. A key added to
the schema without an entry fails :func:`test_every_schema_key_is_pinned_or_deferred`, named.

The keys that only the trainer loop reads (``trellis/trainer/ppo.py``) are pinned here by one short
run of the tiny model (:func:`knob_run`) that sets them all, and by runs that fail on a bad name.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys

import pytest
import torch

import trellis
from trellis.config import TrellisConfig
from trellis.recipes.presets import preset_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAINER = "tests/test_trainer.py::"
OBJECTIVE = TRAINER + "test_the_objective_knobs_reach_the_objective"
"""One PPO run with every objective knob off its default, recording each objective call."""
ACTOR_LOSS = "tests/test_algorithms_objective.py::" + (
    "test_actor_loss_is_the_policy_loss_minus_the_entropy_bonus_plus_the_kl_loss"
)
POLICY = "tests/test_algorithms_policy_loss.py::"
ADVANTAGE = "tests/test_algorithms_advantage.py::"
NEEDS_CHECKED = (
    "tests/test_config.py::test_what_the_estimator_declares_it_needs_is_checked_when_the_run_is_built"
)
MULTIMODAL = "tests/test_multimodal.py::test_the_trainer_reads_the_image_settings"
WATCHDOG = "tests/test_trainer_watchdog.py::test_the_deadline_settings_reach_the_watchdog"
ENGINE = "tests/test_engine_base.py::test_every_model_and_role_setting_reaches_the_engine"
DEFAULTS = "tests/test_engine_base.py::test_missing_settings_take_the_schema_defaults"
DERIVED = "tests/test_config.py::test_null_defaults_are_derived_when_the_config_is_built"
OPTIM = "tests/test_engine_optim.py::"
AGENT = "tests/test_rollout_agent_loop.py::"
SAMPLING = AGENT + "test_sampling_params_from_config"
COLOCATED = "tests/test_rollout_hf.py::test_colocated_weights_and_tokenizer_follow_the_model_config"
RUN_DATA = "tests/test_config_knobs.py::test_run_reads_its_data_knobs"
RUN_ROLLOUT = "tests/test_config_knobs.py::test_run_generates_with_its_rollout_knobs"
RUN_TRAINER = "tests/test_config_knobs.py::test_run_length_outputs_and_checkpoints_follow_the_trainer_knobs"
BAD_NAME = "tests/test_config_knobs.py::test_a_bad_component_name_fails_the_run"
DATASET = "tests/test_data_dataset.py::"
LOADER = DATASET + "test_worker_processes_give_the_same_batches_and_resume"
TRAINER = "tests/test_trainer.py::"
WEIGHT_SYNC = "tests/test_checkpoint_sync.py::test_manager_from_config_and_overrides"
STANDALONE = "tests/test_rollout_standalone.py::"
ASYNC = "tests/test_trainer_async.py::"
ASYNC_WIRING = ASYNC + "test_async_wires_its_pool_replay_and_staleness_knobs"
DECOUPLED = ASYNC + "test_decoupled_objective_weights_tokens_by_proximal_over_behaviour"
STREAM = "tests/test_rollout_stream.py::"
HF_PARTIAL = "tests/test_rollout_hf_partial.py::"
OVERLAP_CONFIG = "tests/test_config.py::test_overlapping_modes_derive_and_check_their_settings"
REWARD_MODEL = "tests/test_reward_model.py::"
JUDGE_CONFIG = REWARD_MODEL + "test_the_prompt_template_max_tokens_and_function_come_from_the_config"
CLASSIFIER = REWARD_MODEL + "test_classifier_scores_are_the_label_0_logit_of_each_conversation"
JUDGE_PLACEMENT = REWARD_MODEL + "test_only_a_colocated_generative_judge_is_served_by_the_trainer"
COLOCATED_JUDGE = REWARD_MODEL + "test_colocated_judge_is_the_tiny_model_behind_the_gateway"
JUDGED_RUN = REWARD_MODEL + "test_a_training_step_is_scored_by_the_external_judge"
JUDGED_COLOCATED = REWARD_MODEL + "test_a_training_step_is_scored_by_a_colocated_judge"

OPENAI_AGENT = "tests/test_openai_agent.py::"
PROFILE = "tests/test_trainer_profile.py::"
PROFILED_RUN = PROFILE + "test_trellis_train_profile_writes_traces_and_prints_the_top_operators"
KNOBS: dict[str, tuple[str, ...]] = {
    # ---------------------------------------------------------------- data
    "data.train_files": (RUN_DATA,),
    "data.val_files": (RUN_DATA,),
    "data.prompt_key": (DATASET + "test_prompt_key_names_the_prompt_column", RUN_DATA),
    "data.reward_fn_key": (
        "tests/test_reward_managers.py::test_ground_truth_source_and_extra_info_reach_the_function",
    ),
    "data.max_prompt_length": (DATASET + "test_overlong_prompts_filtered_truncated_or_rejected",),
    "data.max_response_length": (RUN_DATA, DERIVED),
    "data.train_batch_size": (RUN_DATA,),
    "data.val_batch_size": (RUN_DATA,),
    "data.filter_overlong_prompts": (DATASET + "test_overlong_prompts_filtered_truncated_or_rejected",),
    "data.truncation": (DATASET + "test_overlong_prompts_filtered_truncated_or_rejected",),
    "data.shuffle": (DATASET + "test_sampler_order_is_seeded_per_epoch_and_resumable", RUN_DATA),
    "data.seed": (LOADER, DERIVED),
    "data.return_raw_chat": (
        DATASET + "test_reads_parquet_and_jsonl_and_applies_the_chat_template",
        RUN_DATA,
    ),
    "data.chat_template_kwargs": (DATASET + "test_chat_template_kwargs_reach_the_template",),
    "data.dataloader_num_workers": (LOADER,),
    "data.image_key": (MULTIMODAL,),
    "reward.memory_limit_mb": (
        "tests/test_hostile_input.py::test_reward_memory_limit_mb_reaches_the_async_manager_and_is_refused_elsewhere",
    ),
    "trainer.stage_timeout_s": (WATCHDOG,),
    "trainer.stage_timeouts": (WATCHDOG,),
    "data.video_key": (MULTIMODAL,),
    "data.image_max_pixels": (MULTIMODAL,),
    "data.image_min_pixels": (MULTIMODAL,),
    # ---------------------------------------------------------------- model
    "model.path": (ENGINE, COLOCATED),
    "model.tokenizer_path": (COLOCATED, DERIVED),
    "model.trust_remote_code": (ENGINE,),
    "model.dtype": (ENGINE, DEFAULTS, COLOCATED),
    "model.attn_implementation": (ENGINE, COLOCATED, "tests/test_engine_base.py::test_constructor_errors"),
    "model.gradient_checkpointing": (ENGINE,),
    "model.use_remove_padding": (ENGINE, DEFAULTS),
    "model.share_prompt": (
        "tests/test_engine_shared_prompt.py::test_forward_equals_the_plain_path_with_fewer_tokens",
        "tests/test_engine_shared_prompt.py::test_where_it_cannot_apply_the_engine_says_so",
    ),
    "model.override_config": (ENGINE,),
    "model.lora.rank": (
        "tests/test_lora.py::test_only_the_adapters_train_and_their_optimizer_state_is_small",
        "tests/test_lora.py::test_the_tiny_preset_learns_with_lora",
    ),
    "model.lora.alpha": ("tests/test_lora.py::test_merged_weights_give_the_engines_log_probs",),
    "model.lora.dropout": ("tests/test_lora.py::test_dropout_reaches_the_adapters",),
    "model.lora.target_modules": ("tests/test_lora.py::test_settings_defaults_and_target_modules",),
    "model.fused_kernels": (
        "tests/test_fused_rms_norm.py::test_engine_with_fused_rms_norm_gives_the_same_log_probs_and_gradients",
    ),
    # ---------------------------------------------------------------- actor
    "actor.engine": (BAD_NAME, TRAINER + "test_ray_executor_with_two_fsdp_workers_and_custom_components"),
    "actor.ppo_mini_batch_size": (
        OBJECTIVE,
        TRAINER + "test_on_policy_steps_skip_the_old_log_prob_pass_with_the_same_update",
    ),
    "actor.ppo_micro_batch_size_per_device": (
        ENGINE,
        "tests/test_engine_base.py::test_loss_fn_sees_global_counts_and_micro_batches",
    ),
    "actor.use_dynamic_bsz": (ENGINE,),
    "actor.max_token_len_per_micro_batch": (ENGINE,),
    "actor.ppo_epochs": (
        OBJECTIVE,
        TRAINER + "test_on_policy_steps_skip_the_old_log_prob_pass_with_the_same_update",
    ),
    "actor.clip_ratio": (OBJECTIVE, POLICY + "test_vanilla_hand_case_and_gradient"),
    "actor.clip_ratio_low": (
        OBJECTIVE,
        POLICY + "test_vanilla_reads_asymmetric_clip_bounds_from_a_config_object_or_dict",
    ),
    "actor.clip_ratio_high": (
        OBJECTIVE,
        POLICY + "test_vanilla_reads_asymmetric_clip_bounds_from_a_config_object_or_dict",
    ),
    "actor.clip_ratio_c": (
        OBJECTIVE,
        POLICY + "test_vanilla_dual_clip_caps_a_very_negative_advantage_with_a_large_ratio",
    ),
    "actor.loss_agg_mode": (OBJECTIVE, TRAINER + "test_every_loss_agg_mode_trains"),
    "actor.policy_loss": (OBJECTIVE, TRAINER + "test_every_builtin_policy_loss_trains"),
    "actor.policy_loss_kwargs": (OBJECTIVE, POLICY + "test_sapo_reads_tau_from_policy_loss_kwargs"),
    "actor.entropy_coeff": (OBJECTIVE, ACTOR_LOSS),
    "actor.use_kl_loss": (OBJECTIVE, TRAINER + "test_every_loss_agg_mode_trains"),
    "actor.kl_loss_coef": (OBJECTIVE, ACTOR_LOSS),
    "actor.kl_loss_type": (OBJECTIVE, ACTOR_LOSS),
    "actor.grad_clip": (ENGINE, DEFAULTS),
    "actor.shuffle": (OBJECTIVE,),
    "actor.optim.name": (OPTIM + "test_errors_name_the_fix",),
    "actor.optim.lr": (OPTIM + "test_adamw_settings", ENGINE),
    "actor.optim.betas": (OPTIM + "test_adamw_settings", ENGINE),
    "actor.optim.weight_decay": (OPTIM + "test_adamw_settings", ENGINE),
    "actor.optim.lr_warmup_steps_ratio": (OPTIM + "test_warmup_ratio_and_constant",),
    "actor.optim.lr_warmup_steps": (OPTIM + "test_warmup_then_cosine_to_min_lr_ratio", ENGINE),
    "actor.optim.lr_scheduler": (OPTIM + "test_warmup_then_cosine_to_min_lr_ratio", ENGINE),
    "actor.optim.min_lr_ratio": (OPTIM + "test_warmup_then_cosine_to_min_lr_ratio", ENGINE),
    "actor.offload.param": (
        "tests/test_engine_offload.py::test_the_offload_knobs_reach_every_role",
        "tests/test_engine_offload.py::test_each_phase_moves_exactly_what_its_knobs_offload",
        "tests/test_engine_offload.py::test_fsdp_offload_param_installs_fsdps_cpu_offload",
        "tests/test_engine_offload.py::test_cuda_each_phase_brings_in_and_puts_back_the_offloaded_bytes",
    ),
    "actor.ulysses_sequence_parallel_size": (
        "tests/test_engine_sequence_parallel.py::test_sequence_parallel_matches_one_process",
        "tests/test_engine_sequence_parallel.py::test_the_tiny_preset_trains_with_sequence_parallel_ray_workers",
        "tests/test_engine_sequence_parallel.py::test_sequence_parallel_needs_fsdp_packing_and_divisible_heads",
    ),
    "actor.offload.resident_layers": (
        "tests/test_engine_offload_layers.py::test_prefetch_runs_ahead_with_two_resident_layers",
        "tests/test_engine_offload_layers.py::test_residency_and_peak_stay_within_the_budget",
    ),
    "actor.offload.optimizer": (
        "tests/test_engine_offload.py::test_the_offload_knobs_reach_every_role",
        "tests/test_engine_offload.py::test_each_phase_moves_exactly_what_its_knobs_offload",
        "tests/test_engine_offload.py::test_an_update_phase_drops_the_gradients_when_offloading_or_on_cpu",
        "tests/test_engine_offload.py::test_fsdp_offload_param_installs_fsdps_cpu_offload",
        "tests/test_engine_offload.py::test_cuda_each_phase_brings_in_and_puts_back_the_offloaded_bytes",
    ),
    # ---------------------------------------------------------------- critic
    "critic.enable": (NEEDS_CHECKED, DERIVED),
    "critic.engine": (BAD_NAME,),
    "critic.placement": (
        "tests/test_trainer_placement.py::"
        "test_critic_on_a_separate_pool_starts_its_own_actors_and_trains_the_same",
    ),
    "critic.model_path": (ENGINE, DERIVED),
    "critic.ppo_mini_batch_size": (OBJECTIVE,),
    "critic.ppo_micro_batch_size_per_device": (ENGINE,),
    "critic.use_dynamic_bsz": (ENGINE,),
    "critic.max_token_len_per_micro_batch": (ENGINE,),
    "critic.ppo_epochs": (OBJECTIVE,),
    "critic.cliprange_value": (
        OBJECTIVE,
        "tests/test_algorithms_objective.py::test_critic_loss_is_the_clipped_value_loss_with_its_metrics",
    ),
    "critic.loss_agg_mode": (OBJECTIVE,),
    "critic.grad_clip": (ENGINE, DEFAULTS),
    "critic.shuffle": (OBJECTIVE,),
    # the engine hands the critic's whole optim section to the optimizer (ENGINE, DEFAULTS: its lr)
    "critic.optim.name": (OPTIM + "test_errors_name_the_fix", ENGINE),
    "critic.optim.lr": (OPTIM + "test_adamw_settings", ENGINE, DEFAULTS),
    "critic.optim.betas": (OPTIM + "test_adamw_settings", ENGINE),
    "critic.optim.weight_decay": (OPTIM + "test_adamw_settings", ENGINE),
    "critic.optim.lr_warmup_steps_ratio": (OPTIM + "test_warmup_ratio_and_constant", ENGINE),
    "critic.optim.lr_warmup_steps": (OPTIM + "test_warmup_then_cosine_to_min_lr_ratio", ENGINE),
    "critic.optim.lr_scheduler": (OPTIM + "test_warmup_then_cosine_to_min_lr_ratio", ENGINE),
    "critic.optim.min_lr_ratio": (OPTIM + "test_warmup_then_cosine_to_min_lr_ratio", ENGINE),
    "critic.offload.param": (
        "tests/test_engine_offload.py::test_the_offload_knobs_reach_every_role",
        "tests/test_engine_offload.py::test_each_phase_moves_exactly_what_its_knobs_offload",
        "tests/test_engine_offload.py::test_fsdp_offload_param_without_optimizer_is_refused_with_the_fix",
    ),
    "critic.ulysses_sequence_parallel_size": (
        "tests/test_engine_sequence_parallel.py::test_sequence_parallel_matches_one_process",
        "tests/test_engine_sequence_parallel.py::test_sequence_parallel_needs_fsdp_packing_and_divisible_heads",
    ),
    "critic.offload.resident_layers": (
        "tests/test_engine_offload_layers.py::test_prefetch_runs_ahead_with_two_resident_layers",
        "tests/test_engine_offload_layers.py::test_residency_and_peak_stay_within_the_budget",
    ),
    "critic.offload.optimizer": (
        "tests/test_engine_offload.py::test_the_offload_knobs_reach_every_role",
        "tests/test_engine_offload.py::test_each_phase_moves_exactly_what_its_knobs_offload",
    ),
    # ---------------------------------------------------------------- ref
    "ref.enable": ("tests/test_config.py::test_cross_field_rules", DERIVED),
    "ref.engine": (BAD_NAME,),
    "ref.log_prob_micro_batch_size_per_device": (ENGINE, DEFAULTS),
    "ref.offload.param": (
        "tests/test_engine_offload.py::test_the_offload_knobs_reach_every_role",
        "tests/test_engine_offload.py::test_each_phase_moves_exactly_what_its_knobs_offload",
        "tests/test_engine_offload.py::test_fsdp_offload_param_installs_fsdps_cpu_offload",
    ),
    "ref.ulysses_sequence_parallel_size": (
        "tests/test_engine_sequence_parallel.py::test_sequence_parallel_matches_one_process",
        "tests/test_engine_sequence_parallel.py::test_the_reference_follows_the_actors_size",
    ),
    "ref.offload.resident_layers": (
        "tests/test_engine_offload_layers.py::test_prefetch_runs_ahead_with_two_resident_layers",
        "tests/test_engine_offload_layers.py::test_residency_and_peak_stay_within_the_budget",
    ),
    "ref.offload.optimizer": (
        "tests/test_engine_offload.py::test_ref_offload_optimizer_is_refused_with_the_fix",
    ),
    # ---------------------------------------------------------------- rollout
    "rollout.name": (TRAINER + "test_replicas_with_their_own_weights_sleep_between_rollouts",),
    "rollout.mode": (RUN_ROLLOUT, STANDALONE + "test_standalone_replica_trains_like_colocated_through_shm"),
    "rollout.nnodes": (
        STANDALONE + "test_standalone_settings_are_checked",
        STANDALONE + "test_standalone_replicas_are_placed_per_node_with_their_tensor_parallel_devices",
    ),
    "rollout.n_devices_per_node": (
        STANDALONE + "test_two_fsdp_workers_two_replicas_two_agent_workers_over_gloo",
        STANDALONE + "test_manager_starts_routes_sleeps_and_wakes_replicas",
    ),
    "rollout.agent.num_workers": (
        STANDALONE + "test_a_blocking_tool_stalls_only_its_own_agent_worker",
        STANDALONE + "test_two_fsdp_workers_two_replicas_two_agent_workers_over_gloo",
    ),
    "rollout.n": (RUN_ROLLOUT,),
    "rollout.max_staleness": (
        STREAM + "test_the_gate_runs_at_most_max_staleness_versions_ahead",
        ASYNC + "test_async_with_staleness_zero_is_sync_bit_for_bit",
        ASYNC_WIRING,
    ),
    "rollout.stale_policy": (
        STREAM + "test_a_group_staler_than_the_bound_is_dropped_or_regenerated",
        ASYNC_WIRING,
    ),
    "rollout.partial_rollout": (
        HF_PARTIAL + "test_partial_rollout_resumes_the_response_with_the_new_weights",
        HF_PARTIAL + "test_without_partial_rollout_the_update_waits_for_the_batch",
        OVERLAP_CONFIG,
    ),
    "rollout.temperature": (SAMPLING, RUN_ROLLOUT),
    "rollout.top_p": (SAMPLING, RUN_ROLLOUT),
    "rollout.top_k": (SAMPLING, RUN_ROLLOUT),
    "rollout.max_tokens": (SAMPLING, RUN_ROLLOUT, DERIVED),
    "rollout.do_sample": (SAMPLING,),
    "rollout.seed": (
        AGENT + "test_seeds_per_sample_are_stable_and_distinct",
        "tests/test_rollout_hf.py::test_unseeded_sampling_is_reproducible_from_the_replica_seed",
        COLOCATED,
        DERIVED,
    ),
    "rollout.tensor_parallel_size": (
        "plugins/sglang/tests/test_sglang_replica.py::test_engine_args_derive_from_the_configs_and_engine_kwargs_override",
    ),
    "rollout.gpu_memory_utilization": (
        "plugins/vllm/tests/test_plugin.py::test_engine_args_follow_the_trellis_config",
    ),
    "rollout.free_cache_engine": (TRAINER + "test_replicas_with_their_own_weights_sleep_between_rollouts",),
    "rollout.calculate_log_probs": (SAMPLING, RUN_ROLLOUT),
    "rollout.val_kwargs.n": (RUN_ROLLOUT,),
    "rollout.val_kwargs.temperature": (AGENT + "test_validation_sampling_follows_val_kwargs", RUN_ROLLOUT),
    "rollout.val_kwargs.top_p": (AGENT + "test_validation_sampling_follows_val_kwargs", RUN_ROLLOUT),
    "rollout.val_kwargs.top_k": (AGENT + "test_validation_sampling_follows_val_kwargs", RUN_ROLLOUT),
    "rollout.val_kwargs.do_sample": (AGENT + "test_validation_sampling_follows_val_kwargs", RUN_ROLLOUT),
    "rollout.agent.default_agent_loop": (AGENT + "test_default_agent_loop_runs_samples_that_name_none",),
    "rollout.agent.max_turns": (AGENT + "test_max_turns_and_length_budget_end_the_loop",),
    "rollout.agent.tool_config_path": (AGENT + "test_tools_load_from_the_configured_yaml",),
    "rollout.agent.tool_parser": (
        AGENT + "test_tool_parser_is_the_configured_one",
        "tests/test_openai_agent.py::test_the_gateway_reads_calls_with_the_configured_tool_parser",
    ),
    "rollout.agent.max_parallel_calls": (AGENT + "test_calls_beyond_max_parallel_calls_are_ignored",),
    "rollout.agent.max_tool_response_length": (
        AGENT + "test_tool_state_truncation_and_release",
        AGENT + "test_tool_responses_are_truncated_on_the_configured_side",
    ),
    "rollout.agent.tool_response_truncate_side": (
        AGENT + "test_tool_responses_are_truncated_on_the_configured_side",
    ),
    "rollout.agent.tool_timeout_s": (AGENT + "test_tool_failures_reach_the_model_as_errors_and_metrics",),
    "rollout.agent.function": (
        OPENAI_AGENT + "test_an_openai_sdk_agent_with_a_python_tool_trains_on_exact_tokens",
    ),
    "rollout.agent.function_timeout_s": (
        OPENAI_AGENT + "test_failures_and_timeouts_end_their_sample_with_reward_zero",
    ),
    "rollout.agent.function_concurrency": (
        OPENAI_AGENT + "test_function_concurrency_bounds_the_calls_at_once",
    ),
    "rollout.engine_kwargs": (
        "tests/test_rollout_hf.py::test_max_batch_size_splits_batches",
        "tests/test_rollout_hf.py::test_cpu_threads_setting",
    ),
    "rollout.checkpoint_engine.name": (WEIGHT_SYNC, OVERLAP_CONFIG),
    "rollout.checkpoint_engine.update_weights_bucket_megabytes": (WEIGHT_SYNC,),
    # ---------------------------------------------------------------- reward
    "reward.manager": (OBJECTIVE,),
    "reward.function": (TRAINER + "test_custom_reward_file_and_plugin_estimator",),
    "reward.function_kwargs": (OBJECTIVE,),
    "reward.placement": (TRAINER + "test_tool_rewards_enter_the_score_where_the_placement_says",),
    "reward.timeout_seconds": (
        TRAINER + "test_a_hanging_reward_times_out_and_the_step_goes_on",
        "tests/test_reward_managers.py::test_naive_enforces_the_timeout_on_plain_scorers",
    ),
    "reward.num_workers": (
        OBJECTIVE,
        "tests/test_reward_managers.py::test_async_manager_times_out_kills_and_replaces_the_pool",
    ),
    "reward.tool_reward_weight": (
        TRAINER + "test_tool_rewards_enter_the_score_where_the_placement_says",
        "tests/test_reward_scoring.py::test_tool_rewards_are_weighted_onto_the_last_model_token",
    ),
    "reward.model.path": (JUDGE_CONFIG, CLASSIFIER, COLOCATED_JUDGE, JUDGED_COLOCATED),
    "reward.model.kind": (CLASSIFIER, JUDGE_PLACEMENT),
    "reward.model.placement": (JUDGE_PLACEMENT, JUDGED_RUN, JUDGED_COLOCATED),
    "reward.model.base_url": (
        REWARD_MODEL + "test_failures_and_timeouts_score_zero_and_are_counted",
        JUDGED_RUN,
    ),
    "reward.model.replica": (JUDGE_PLACEMENT,),
    "reward.model.prompt_template": (JUDGE_CONFIG,),
    "reward.model.function": (
        JUDGE_CONFIG,
        REWARD_MODEL + "test_an_unknown_judge_function_fails_when_the_manager_is_built",
    ),
    "reward.model.timeout_seconds": (REWARD_MODEL + "test_failures_and_timeouts_score_zero_and_are_counted",),
    "reward.model.max_concurrency": (REWARD_MODEL + "test_requests_are_concurrent_up_to_max_concurrency",),
    "reward.model.micro_batch_size": (CLASSIFIER,),
    "reward.model.max_tokens": (JUDGE_CONFIG, COLOCATED_JUDGE),
    # ---------------------------------------------------------------- algorithm
    "algorithm.adv_estimator": (TRAINER + "test_every_builtin_estimator_trains", OBJECTIVE),
    "algorithm.gamma": (OBJECTIVE, ADVANTAGE + "test_gae_hand_computed_with_a_tool_hole"),
    "algorithm.lam": (OBJECTIVE, ADVANTAGE + "test_gae_hand_computed_with_a_tool_hole"),
    "algorithm.norm_adv_by_std_in_grpo": (OBJECTIVE, ADVANTAGE + "test_dr_grpo_is_score_minus_group_mean"),
    "algorithm.use_kl_in_reward": (OBJECTIVE, TRAINER + "test_ppo_with_critic_kl_and_rollout_correction"),
    "algorithm.kl_penalty": (
        OBJECTIVE,
        "tests/test_algorithms_objective.py::test_kl_in_reward_subtracts_beta_times_the_kl_on_the_mask",
    ),
    "algorithm.kl_ctrl.type": (
        OBJECTIVE,
        "tests/test_algorithms_kl.py::test_get_kl_controller_from_config_dict_and_object",
    ),
    "algorithm.kl_ctrl.kl_coef": (
        OBJECTIVE,
        "tests/test_algorithms_kl.py::test_get_kl_controller_from_config_dict_and_object",
    ),
    "algorithm.kl_ctrl.target_kl": (
        OBJECTIVE,
        "tests/test_algorithms_kl.py::test_adaptive_controller_over_two_updates",
    ),
    "algorithm.kl_ctrl.horizon": (
        OBJECTIVE,
        "tests/test_algorithms_kl.py::test_adaptive_controller_over_two_updates",
    ),
    "algorithm.off_policy": (
        DECOUPLED,
        ASYNC + "test_behaviour_objective_takes_the_replicas_log_probs_as_the_old_ones",
        "tests/test_algorithms_off_policy.py::test_weights_are_proximal_over_behaviour_zero_off_the_mask_and_above_the_cap",
        OVERLAP_CONFIG,
    ),
    "algorithm.off_policy_cap": (
        DECOUPLED,
        "tests/test_algorithms_off_policy.py::test_weights_are_proximal_over_behaviour_zero_off_the_mask_and_above_the_cap",
    ),
    "algorithm.rollout_correction.rollout_is": (
        OBJECTIVE,
        "tests/test_algorithms_rollout_correction.py::test_from_config_matches_the_function_for_every_config_form",
    ),
    "algorithm.rollout_correction.rollout_is_threshold": (
        OBJECTIVE,
        "tests/test_algorithms_rollout_correction.py::test_from_config_matches_the_function_for_every_config_form",
    ),
    "algorithm.rollout_correction.rollout_is_batch_normalize": (
        OBJECTIVE,
        "tests/test_algorithms_rollout_correction.py::test_from_config_matches_the_function_for_every_config_form",
    ),
    "algorithm.rollout_correction.rollout_rs": (
        OBJECTIVE,
        "tests/test_algorithms_rollout_correction.py::test_from_config_matches_the_function_for_every_config_form",
    ),
    "algorithm.rollout_correction.rollout_rs_threshold": (
        OBJECTIVE,
        "tests/test_algorithms_rollout_correction.py::test_from_config_matches_the_function_for_every_config_form",
    ),
    # ---------------------------------------------------------------- trainer
    "trainer.project_name": (
        "tests/test_trackers_external.py::test_wandb_tracker_calls",
        "tests/test_trackers_external.py::test_mlflow_tracker_calls",
    ),
    "trainer.experiment_name": (
        "tests/test_trackers_external.py::test_wandb_tracker_calls",
        "tests/test_trackers_external.py::test_mlflow_tracker_calls",
    ),
    "trainer.run_dir": (RUN_TRAINER, DERIVED),
    "trainer.total_epochs": (RUN_TRAINER,),
    "trainer.total_training_steps": (TRAINER + "test_python_callable_reward",),
    "trainer.device": (BAD_NAME,),
    "trainer.host_memory": (
        TRAINER + "test_host_memory_holds_while_the_run_trains_and_is_restored_after",
        TRAINER + "test_worker_and_replica_processes_set_host_memory_from_the_config",
        "tests/test_engine_base.py::test_a_cpu_phase_leaves_freed_memory_to_malloc_under_the_reuse_policy",
        "tests/test_utils_memory.py::test_reuse_keeps_freed_memory_for_the_next_allocation_and_release_gives_it_back",
    ),
    "trainer.flush_denormal": (
        TRAINER + "test_flush_denormal_holds_while_the_run_trains_and_is_restored_after",
        TRAINER + "test_worker_and_replica_processes_set_flush_denormal_from_the_config",
    ),
    "trainer.executor": (
        TRAINER + "test_ray_executor_with_two_fsdp_workers_and_custom_components",
        TRAINER + "test_unknown_preset_and_local_world_size_errors",
    ),
    "trainer.share_cores": (ASYNC + "test_share_cores_trains_on_the_waiting_replicas_core",),
    "trainer.nnodes": ("tests/test_config.py::test_cross_field_rules",),
    "trainer.n_devices_per_node": (TRAINER + "test_unknown_preset_and_local_world_size_errors",),
    "trainer.trackers": (RUN_TRAINER,),
    "trainer.save_freq": (RUN_TRAINER,),
    "trainer.test_freq": (TRAINER + "test_tiny_preset_learns_and_reports_everything",),
    "trainer.val_before_train": (
        TRAINER + "test_tiny_preset_learns_and_reports_everything",
        TRAINER + "test_every_builtin_estimator_trains",
    ),
    "trainer.resume_mode": (
        "tests/test_checkpoint_training.py::test_resolve_resume",
        TRAINER + "test_resume_mid_run_continues_bit_identically",
    ),
    "trainer.resume_from_path": ("tests/test_checkpoint_training.py::test_resolve_resume",),
    "trainer.max_actor_ckpt_to_keep": (RUN_TRAINER, "tests/test_checkpoint_training.py::test_from_config"),
    "trainer.seed": (DERIVED,),
    "trainer.log_val_generations": (TRAINER + "test_log_val_generations_sends_samples_to_every_tracker",),
    "trainer.mode": (
        ASYNC + "test_async_with_staleness_zero_is_sync_bit_for_bit",
        ASYNC + "test_one_step_off_is_sync_generating_one_version_behind",
        OVERLAP_CONFIG,
    ),
    "trainer.replay_pool": (ASYNC_WIRING,),
    "trainer.replay_capacity": (ASYNC_WIRING, OVERLAP_CONFIG, DERIVED),
    "trainer.replay_ratio": (ASYNC_WIRING, STREAM + "test_replay_draws_trained_groups_again", OVERLAP_CONFIG),
    "trainer.profile.steps": (
        PROFILED_RUN,
        PROFILE + "test_only_the_chosen_stages_of_the_chosen_steps_are_profiled",
    ),
    "trainer.profile.stages": (
        PROFILE + "test_only_the_chosen_stages_of_the_chosen_steps_are_profiled",
        PROFILE + "test_profile_settings_are_checked_when_the_config_is_built",
    ),
    "trainer.profile.top_k": (
        PROFILED_RUN,
        PROFILE + "test_top_k_and_record_shapes_shape_the_table_and_the_trace",
    ),
    "trainer.profile.record_shapes": (
        PROFILE + "test_top_k_and_record_shapes_shape_the_table_and_the_trace",
    ),
}

_ACROSS_PROCESSES = "belongs to the issue on running the trainer across processes"
DEFERRED: dict[str, str] = {}


def schema_keys(cls: type = TrellisConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of config dataclass ``cls``, in declaration order."""
    keys = []
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            keys += schema_keys(f.metadata["section"][0], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def test_every_schema_key_is_pinned_or_deferred():
    keys = set(schema_keys())
    assert not set(KNOBS) & set(DEFERRED), "a key is both pinned and deferred"
    unpinned = sorted(keys - set(KNOBS) - set(DEFERRED))
    assert not unpinned, f"schema keys without a pinning test (add them to KNOBS): {unpinned}"
    stale = sorted((set(KNOBS) | set(DEFERRED)) - keys)
    assert not stale, f"KNOBS/DEFERRED name keys the schema no longer has: {stale}"


def _test_module(path: str):
    """The module of test file ``path`` (relative to the repository), imported as pytest's default
    ``prepend`` mode does: its folder on ``sys.path``, its file name as the module name."""
    file = os.path.join(ROOT, path)
    if not os.path.isfile(file):
        raise FileNotFoundError(path)
    name = os.path.splitext(os.path.basename(file))[0]
    module = sys.modules.get(name)
    if module is not None and os.path.abspath(getattr(module, "__file__", "")) == file:
        return module
    folder = os.path.dirname(file)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def test_every_named_test_exists():
    """Each node id in KNOBS names a test function of an importable test file."""
    missing = []
    for key, node_ids in KNOBS.items():
        if not node_ids:
            missing.append(f"{key}: no tests named")
        for node_id in node_ids:
            path, *names = node_id.split("::")
            try:
                obj = _test_module(path)
            except (ImportError, FileNotFoundError, pytest.skip.Exception) as exc:
                missing.append(f"{key}: {node_id} ({type(exc).__name__}: {exc})")
                continue
            for name in names:
                obj = getattr(obj, name, None)
            if not names or not names[-1].startswith("test") or not callable(obj):
                missing.append(f"{key}: {node_id}")
    assert not missing, "KNOBS names tests that do not exist:\n  " + "\n  ".join(missing)


# ---------------------------------------------------------------- the trainer loop's own keys


class _Recorder:
    """What one run's rollout replica and reward manager saw."""

    def __init__(self):
        self.init_modes: list[str] = []
        self.params: list[object] = []
        self.batches: list[dict[str, object]] = []


@pytest.fixture(scope="module")
def knob_run(tmp_path_factory):
    """One run of the tiny model, 8 prompts x 2 epochs of 2 steps, with every trainer-loop key set to a
    value other than its default; the replica's requests and the scored batches are recorded."""
    from trellis.registries import reward_managers
    from trellis.reward.managers import NaiveRewardManager
    from trellis.rollout.hf import HFRolloutReplica

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("knob_run")
    seen = _Recorder()

    def rows(n: int, start: int) -> str:
        path = root / f"rows_{start}.jsonl"
        path.write_text(
            "".join(
                json.dumps(
                    {
                        "question": [{"role": "user", "content": f"Write digits: {i}"}],
                        "data_source": "digits",
                        "reward_model": {"ground_truth": "digits"},
                    }
                )
                + "\n"
                for i in range(start, start + n)
            )
        )
        return str(path)

    class Recording(NaiveRewardManager):
        def __call__(self, data, return_dict=False):
            b = data.batch
            width = b["prompts"].shape[1]
            seen.batches.append(
                {
                    "rows": len(data),
                    "validate": any(str(uid).startswith("val") for uid in data.non_tensor_batch["uid"]),
                    "index": sorted(set(data.non_tensor_batch["index"].tolist())),
                    "raw_prompt": "raw_prompt" in data.non_tensor_batch,
                    "longest": int(b["attention_mask"][:, width:].sum(-1).max()),
                }
            )
            return super().__call__(data, return_dict)

    generate, init = HFRolloutReplica.generate, HFRolloutReplica.init

    async def recording_generate(self, prompt_ids, sampling_params, request_id):
        seen.params.append(sampling_params)
        return await generate(self, prompt_ids, sampling_params, request_id)

    async def recording_init(self, mode="hybrid", **kwargs):
        seen.init_modes.append(mode)
        return await init(self, mode, **kwargs)

    overrides = [
        *preset_overrides("tiny"),
        f"trainer.run_dir={root / 'run'}",
        f"data.train_files=[{rows(8, 0)}]",
        f"data.val_files=[{rows(3, 100)}]",
        "data.prompt_key=question",
        "data.shuffle=false",
        "data.return_raw_chat=true",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "data.val_batch_size=2",
        "rollout.n=3",
        "rollout.mode=colocated",
        "rollout.max_tokens=6",
        "rollout.temperature=0.9",
        "rollout.top_p=0.95",
        "rollout.top_k=50",
        "rollout.calculate_log_probs=true",
        "rollout.val_kwargs.n=2",
        "rollout.val_kwargs.do_sample=true",
        "rollout.val_kwargs.temperature=0.7",
        "rollout.val_kwargs.top_p=0.8",
        "rollout.val_kwargs.top_k=7",
        "reward.manager=knob_recording",
        "trainer.total_training_steps=null",
        "trainer.total_epochs=2",
        "trainer.save_freq=2",
        "trainer.max_actor_ckpt_to_keep=1",
        "trainer.trackers=[]",
        "trainer.test_freq=-1",
        "trainer.resume_mode=disable",
    ]
    reward_managers.register("knob_recording", Recording)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(HFRolloutReplica, "generate", recording_generate)
            patch.setattr(HFRolloutReplica, "init", recording_init)
            result = trellis.train(overrides=overrides)
    finally:
        reward_managers.unregister("knob_recording")
    return root, result, seen


def test_run_reads_its_data_knobs(knob_run):
    _, result, seen = knob_run
    train = [b for b in seen.batches if not b["validate"]]
    val = [b for b in seen.batches if b["validate"]]
    # the 8 rows of data.train_files, read from column "question", in file order (no shuffle), 4 a step
    assert [b["index"] for b in train] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    # the 3 rows of data.val_files in batches of data.val_batch_size = 2 prompts (x val_kwargs.n = 2)
    assert [(b["rows"], b["index"]) for b in val] == [(4, [0, 1]), (2, [2])]
    assert all(b["raw_prompt"] for b in seen.batches)  # data.return_raw_chat
    # responses run up to rollout.max_tokens (6), so none is clipped at data.max_response_length (16)
    assert max(b["longest"] for b in seen.batches) == 6
    assert [m["response_length/clip_ratio"] for m in result.history] == [0.0] * 4
    assert result.validation and result.validation[0][0] == 0


def test_run_generates_with_its_rollout_knobs(knob_run):
    _, result, seen = knob_run
    assert seen.init_modes == ["colocated"]  # rollout.mode: the replica keeps its own weights
    assert {b["rows"] for b in seen.batches if not b["validate"]} == {4 * 3}  # rollout.n
    requests = {(p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) for p in seen.params}
    assert requests == {(0.9, 0.95, 50, 6, True), (0.7, 0.8, 7, 6, True)}  # training, validation
    assert "val/pass@2" in result.validation[0][1]  # rollout.val_kwargs.n


def test_run_length_outputs_and_checkpoints_follow_the_trainer_knobs(knob_run):
    root, result, _ = knob_run
    assert result.run_dir == str(root / "run")
    assert result.steps == 4 == len(result.history)  # total_epochs 2 x 2 steps, total_training_steps null
    assert not os.path.exists(os.path.join(result.run_dir, "metrics.jsonl"))  # trackers: none
    # saved at steps 2 and 4 (save_freq), only the last kept (max_actor_ckpt_to_keep)
    assert sorted(os.listdir(os.path.join(result.run_dir, "checkpoints"))) == [
        "global_step_4",
        "latest_checkpointed_iteration.txt",
    ]


@pytest.mark.parametrize(
    ("overrides", "kind"),
    [
        (["trainer.device=nowhere"], "device backend"),
        (["actor.engine=nowhere"], "training engine"),
        (["ref.engine=nowhere", "actor.use_kl_loss=true"], "training engine"),
        (["critic.engine=nowhere", "algorithm.adv_estimator=gae"], "training engine"),
    ],
)
def test_a_bad_component_name_fails_the_run(tmp_path, overrides, kind):
    """The names a run builds its device backend and each role's engine from are looked up, not ignored."""
    from trellis.errors import UnknownComponentError

    torch.set_num_threads(1)
    base = [*preset_overrides("tiny"), f"trainer.run_dir={tmp_path}", "trainer.trackers=[]"]
    with pytest.raises(UnknownComponentError, match=f"Unknown {kind} 'nowhere'"):
        trellis.train(overrides=[*base, "trainer.resume_mode=disable", *overrides])
