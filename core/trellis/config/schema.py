# ruff: noqa: RUF009 - knob() and section() return dataclasses.field(...) objects, as field() does
"""The configuration of a Trellis run: one dataclass per section, every knob documented.

``TrellisConfig`` is the whole tree (``data``, ``model``, ``actor``, ``critic``, ``ref``,
``rollout``, ``reward``, ``algorithm``, ``trainer``). Section and field names are a contract
the subsystems build on. Each field's doc says what it is, its unit and why its default;
``defaults/trellis.yaml`` is generated from these docs and defaults (see ``render.py``).

A ``null`` default that means "derive it" (``rollout.max_tokens``, ``ref.enable``, ...) is
filled when the config is built, so code reading a built config sees the value in effect.
Names that select a component (``actor.engine``, ``rollout.name``, ``reward.manager``, ...)
are registry names or references; they are looked up when the run is built, not here.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Literal

from trellis.config.base import BaseConfig, ConfigValueError, closest_hint, knob, section

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal[
    "k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "kl+", "k3+", "low_var_kl+"
]  # = trellis.algorithms.kl.KL_KINDS


# ---------------------------------------------------------------- data and model


@dataclass
class DataConfig(BaseConfig):
    """Where prompts come from and how long prompts and responses may be."""

    train_files: list[str] = knob(
        [], "Training data: parquet or jsonl files, as local paths or fsspec URLs. No default data set."
    )
    val_files: list[str] = knob(
        [], "Validation data, in the same forms as train_files. Empty = no validation."
    )
    prompt_key: str = knob("prompt", "Column holding each prompt: a list of chat messages, or a string.")
    reward_fn_key: str = knob(
        "data_source",
        "Column naming each sample's source; with reward.function null, it picks the scoring function.",
    )
    max_prompt_length: int = knob(
        512, "Longest prompt, in tokens after the chat template. 512 fits math word problems.", ge=1
    )
    max_response_length: int = knob(
        512,
        "Longest response in tokens, all turns of an agent loop together. 512 fits short reasoning chains.",
        ge=1,
    )
    train_batch_size: int = knob(
        32,
        "Prompts per training step; each is sampled rollout.n times. 32 keeps a CPU step short; "
        "GPU recipes use 256-1024.",
        ge=1,
    )
    val_batch_size: int | None = knob(
        None, "Prompts per validation batch. null = the whole validation set as one batch.", ge=1
    )
    filter_overlong_prompts: bool = knob(
        False,
        "Drop prompts longer than max_prompt_length when the data loads (instead of applying truncation). "
        "Off: it shrinks the data set silently.",
    )
    truncation: Literal["error", "left", "right"] = knob(
        "error",
        "A prompt longer than max_prompt_length: error (an overlong prompt is usually a data bug), "
        "left (keep its last tokens) or right (keep its first tokens).",
    )
    shuffle: bool = knob(
        True, "Shuffle the training set every epoch; on, since neighbouring rows often correlate."
    )
    seed: int | None = knob(None, "Seed of the shuffle. null = trainer.seed.")
    return_raw_chat: bool = knob(
        False,
        "Also keep each prompt's chat messages untokenized in the batch, for agent loops that apply the "
        "chat template themselves. Off to keep batches small; the trainer keeps them anyway for an agent "
        "loop other than single_turn and for a reward model (reward.model), which reads the messages.",
    )
    chat_template_kwargs: dict[str, Any] = knob(
        {}, "Extra keyword arguments of tokenizer.apply_chat_template, e.g. {enable_thinking: false}."
    )
    dataloader_num_workers: int = knob(
        0,
        "Data-loader worker processes. 0 = load in the training process: starts fastest, enough for text.",
        ge=0,
    )
    image_key: str = knob(
        "images",
        "Column holding each row's images (a list; bytes, {bytes, path} structs, paths, URLs or PIL images). "
        "Read only for a vision-language model (one with a multimodal processor).",
    )
    video_key: str = knob(
        "videos",
        "Column holding each row's videos (a list; each a list of frames, a (T, H, W, 3) array or an "
        "animated image). Video processors need torchvision.",
    )
    image_max_pixels: int | None = knob(
        None,
        "Resize larger images and video frames (aspect ratio kept) to at most this many pixels. null = no "
        "limit beyond the processor's own.",
        ge=1,
    )
    image_min_pixels: int | None = knob(
        None, "Resize smaller images and video frames up to at least this many pixels. null = no limit.", ge=1
    )


@dataclass
class LoraConfig(BaseConfig):
    """Low-rank adapters (LoRA, through ``peft``): train small matrices beside frozen weights.

    With ``rank`` > 0 the actor and critic train only the adapters (and the critic's value head);
    the optimizer holds only their state, training checkpoints store only them, and weight sync
    and ``trellis export`` send / write the merged weights under the model's own names. The
    reference model stays the base model without adapters.
    """

    rank: int = knob(
        0, "Adapter rank r; 0 = off (full fine-tuning). 8-64 are usual for RL on 1B-70B models.", ge=0
    )
    alpha: float = knob(
        16.0, "Adapter scale numerator: the update is (alpha / rank) * B @ A; peft's default.", gt=0
    )
    dropout: float = knob(
        0.0, "Dropout on the adapters' input; 0 keeps the rollout and training passes equal.", ge=0, lt=1
    )
    target_modules: list[str] = knob(
        ["all-linear"],
        "Module names that get adapters (e.g. [q_proj, v_proj]); [all-linear] = every linear layer but "
        "the output head, as peft and verl default.",
    )

    def finalize(self) -> None:
        if not self.target_modules or not all(isinstance(name, str) and name for name in self.target_modules):
            raise ConfigValueError(
                "target_modules",
                self.target_modules,
                "must be a non-empty list of module names, or [all-linear]",
            )


@dataclass
class ModelConfig(BaseConfig):
    """The policy model: its weights, tokenizer and how its forward pass runs."""

    path: str | None = knob(
        None,
        "Policy model: a Hugging Face hub id or a local folder. Required to train; no default, so "
        "nothing downloads unless you name a model.",
    )
    tokenizer_path: str | None = knob(None, "Tokenizer, in the same forms as path. null = model.path.")
    trust_remote_code: bool = knob(
        False,
        "Allow model and tokenizer code from the hub repository to run. Off: it executes downloaded code.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = knob(
        "bfloat16",
        "Compute dtype of forward and backward passes (mixed precision). bfloat16 halves activation "
        "memory without float16's overflow.",
    )
    attn_implementation: str = knob(
        "sdpa",
        "Attention kernel, as transformers names it (eager, sdpa, flash_attention_2, ...). sdpa runs on "
        "every device with nothing extra installed; with use_remove_padding it runs per packed sequence "
        "(trellis_varlen_sdpa). eager on a model with grouped key/value heads runs as trellis_eager: eager's "
        "math without repeating each key/value head per query head (less memory kept for backward).",
    )
    gradient_checkpointing: bool = knob(
        False,
        "Recompute activations during backward to save memory (about a third more compute). Off: small "
        "models fit without it.",
    )
    use_remove_padding: bool = knob(
        True,
        "Pack sequences without pad tokens in forward passes where the model allows it; RL batches of "
        "uneven length otherwise spend much of their compute on padding.",
    )
    share_prompt: bool = knob(
        True,
        "Rows of a micro-batch with the same prompt (the rollout.n responses to it) run the prompt through "
        "the model once and their responses on its KV cache: the same log-probs and gradients for fewer "
        "tokens. Where the model's cache is plain full attention and gradient_checkpointing is off; not "
        "for the critic, the offload engine, images or sequence parallelism.",
    )
    override_config: dict[str, Any] = knob(
        {}, "Entries that override the model's Hugging Face config, e.g. {attention_dropout: 0.0}."
    )
    fused_kernels: list[str] = knob(
        [],
        "Fused kernels swapped into the model in every engine: rms_norm (the RMSNorm of Llama, Qwen2 and "
        "Qwen3; a Triton kernel on CUDA, torch elsewhere). Empty: the model's own modules.",
    )
    lora: LoraConfig = section(LoraConfig, "Low-rank adapters; rank 0 (the default) trains every weight.")


# ---------------------------------------------------------------- training roles


@dataclass
class OptimConfig(BaseConfig):
    """Optimizer and learning-rate schedule of one trained model."""

    name: str = knob("adamw", "Optimizer. AdamW is what published RL-for-LLM recipes use.")
    lr: float = knob(
        1e-6, "Peak learning rate. 1e-6 is the usual stable value for full fine-tuning of a policy.", gt=0
    )
    betas: list[float] = knob(
        [0.9, 0.999],
        "Adam's [beta1, beta2]: decay rates of the gradient mean and variance; PyTorch's defaults.",
    )
    weight_decay: float = knob(
        0.01, "AdamW's decoupled weight decay; 0.01 is the usual light regularisation.", ge=0
    )
    lr_warmup_steps_ratio: float = knob(
        0.0,
        "Linear warm-up from 0 to lr over this fraction of the training steps. 0: RL starts from a "
        "trained model, which needs no warm-up.",
        ge=0,
        le=1,
    )
    lr_warmup_steps: int | None = knob(
        None, "Warm-up length in steps; when set, it replaces lr_warmup_steps_ratio.", ge=0
    )
    lr_scheduler: Literal["constant", "cosine"] = knob(
        "constant",
        "Learning rate after warm-up: constant, or cosine decay to min_lr_ratio × lr at the last step. "
        "Constant is the usual RL choice.",
    )
    min_lr_ratio: float = knob(
        0.0, "Final learning rate of the cosine schedule, as a fraction of lr.", ge=0, le=1
    )

    def finalize(self) -> None:
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigValueError("betas", self.betas, "must be two numbers in [0, 1), [beta1, beta2]")


@dataclass
class OffloadConfig(BaseConfig):
    """What a model keeps in host memory between uses, trading transfer time for device memory.

    The engine brings what a stage of the step computes with onto the device and puts it back after
    (:meth:`trellis.engine.base.TrainingEngine.phase`); on a CPU device nothing moves. The ``fsdp``
    engine offloads ``param`` with FSDP's own CPU offload, which keeps the optimizer state on the host
    too, so there ``param`` needs ``optimizer``. The reference has no optimizer: its ``optimizer`` must
    stay false. A combination that cannot work fails when the engine is built, naming the key.
    """

    param: bool = knob(
        False,
        "Keep parameters (and gradients) in host memory while the model is not computing. With "
        "engine fsdp: FSDP's CPU offload, which streams them per block and needs optimizer: true.",
    )
    optimizer: bool = knob(
        False, "Keep optimizer state in host memory between updates. Must stay false for ref (no optimizer)."
    )
    resident_layers: int = knob(
        2,
        "Engine offload only: how many decoder layers' low-precision working copies may be on the device "
        "at once (the one computing, the next being copied in). More overlaps transfers better.",
        ge=1,
    )


@dataclass
class ActorConfig(BaseConfig):
    """The trained policy: its engine, batching and PPO objective.

    Batch units: ``ppo_mini_batch_size`` counts prompts (a mini-batch holds
    ``ppo_mini_batch_size × rollout.n`` responses); micro-batch sizes count responses.
    """

    engine: str = knob(
        "single",
        "Training engine, a name in trellis.training_engines: single (one process), fsdp (FSDP2 over "
        "torch.distributed) or offload (FP32 state on the host, layers streamed through the device). "
        "single runs anywhere.",
    )
    ulysses_sequence_parallel_size: int = knob(
        1,
        "Ulysses sequence parallelism: each sequence is split over this many ranks (attention exchanges "
        "heads with an all-to-all), for sequences whose activations do not fit one device. Needs engine "
        "fsdp, use_remove_padding and a head count it divides; 1 = off.",
        ge=1,
    )
    ppo_mini_batch_size: int = knob(
        8,
        "Prompts per optimizer step (× rollout.n responses). 8 of 32 prompts gives 4 updates per step.",
        ge=1,
    )
    ppo_micro_batch_size_per_device: int = knob(
        4,
        "Responses per forward/backward pass on one device; gradients accumulate over the mini-batch. "
        "Bounds activation memory; unused with use_dynamic_bsz.",
        ge=1,
    )
    use_dynamic_bsz: bool = knob(
        False,
        "Form micro-batches by token count (max_token_len_per_micro_batch) instead of response count; "
        "faster when lengths vary.",
    )
    max_token_len_per_micro_batch: int = knob(
        16384,
        "With use_dynamic_bsz: tokens (prompt + response) per micro-batch on one device. Must hold one "
        "full-length sample.",
        ge=1,
    )
    ppo_epochs: int = knob(1, "Passes over each step's responses. 1 keeps every update on-policy.", ge=1)
    clip_ratio: float = knob(
        0.2, "PPO clip ε: the probability ratio is clipped to [1 - ε, 1 + ε]. 0.2 as in the PPO paper.", gt=0
    )
    clip_ratio_low: float | None = knob(
        None, "Lower clip ε_low (ratio >= 1 - ε_low). null = clip_ratio.", gt=0
    )
    clip_ratio_high: float | None = knob(
        None,
        "Upper clip ε_high (ratio <= 1 + ε_high). null = clip_ratio; DAPO's clip-higher uses 0.28.",
        gt=0,
    )
    clip_ratio_c: float = knob(
        3.0,
        "Dual-clip bound c: for negative advantages the loss is capped at c × |A|. Must exceed 1; 3 as in "
        "the dual-clip paper.",
        gt=1,
    )
    loss_agg_mode: LossAggMode = knob(
        "token-mean",
        "How per-token losses become one number: token-mean (over all tokens of the mini-batch; no "
        "length bias), seq-mean-token-sum, seq-mean-token-mean, or seq-mean-token-sum-norm (sums divided "
        "by max_response_length, as in Dr. GRPO).",
    )
    policy_loss: str = knob(
        "vanilla", "Policy loss, a name in trellis.policy_losses or a reference. vanilla is clipped PPO."
    )
    policy_loss_kwargs: dict[str, Any] = knob(
        {},
        "Extra settings of the chosen policy loss, e.g. {clip_cov_ratio: 0.0002} for clip_cov or "
        "{tau_pos: 1.0, tau_neg: 1.05} for sapo; each loss documents its own.",
    )
    entropy_coeff: float = knob(
        0.0, "Weight of the entropy bonus. 0: an entropy bonus tends to destabilise LLM training.", ge=0
    )
    use_kl_loss: bool = knob(
        False, "Add a KL(actor || reference) term to the loss, as GRPO does. Needs the reference model."
    )
    kl_loss_coef: float = knob(0.001, "Weight of the KL loss; 0.001 as in the GRPO paper.", ge=0)
    kl_loss_type: KLEstimator = knob(
        "low_var_kl",
        "Estimator of the KL loss: kl (k1), abs, mse (k2), low_var_kl (k3: low variance, never negative), "
        "or k1+ / k3+ (k1 / k3 values with k2's gradient).",
    )
    grad_clip: float = knob(1.0, "Clip the global gradient norm to this before each optimizer step.", gt=0)
    shuffle: bool = knob(False, "Shuffle a step's responses before splitting them into mini-batches.")
    optim: OptimConfig = section(OptimConfig, "Optimizer and learning-rate schedule of the actor.")
    offload: OffloadConfig = section(OffloadConfig, "Host-memory offload of the actor.")

    def finalize(self) -> None:
        if self.clip_ratio_low is None:
            self.clip_ratio_low = self.clip_ratio
        if self.clip_ratio_high is None:
            self.clip_ratio_high = self.clip_ratio


@dataclass
class CriticConfig(BaseConfig):
    """The value model, trained alongside the actor when the advantage estimator needs values."""

    enable: bool | None = knob(
        None,
        "Train a value model. null = on exactly when algorithm.adv_estimator or actor.policy_loss declares "
        "it needs values (gae).",
    )
    engine: str = knob("single", "Training engine, a name in trellis.training_engines (see actor.engine).")
    ulysses_sequence_parallel_size: int = knob(
        1, "Ranks each sequence is split over in the critic (see actor.ulysses_sequence_parallel_size).", ge=1
    )
    placement: Literal["colocated", "separate"] = knob(
        "colocated",
        "Where the critic's workers run. colocated: in the policy's worker processes (one per device, "
        "holding both roles, which take turns on it). separate: a resource pool of its own, "
        "trainer.nnodes × n_devices_per_node more workers (with executor=ray: twice the devices, for "
        "models too large to share one).",
    )
    model_path: str | None = knob(
        None, "Initial weights (hub id or folder) under the value head. null = model.path."
    )
    ppo_mini_batch_size: int | None = knob(
        None,
        "Prompts per critic optimizer step (× rollout.n responses). null = actor.ppo_mini_batch_size.",
        ge=1,
    )
    ppo_micro_batch_size_per_device: int = knob(
        4, "Responses per forward/backward pass on one device; unused with use_dynamic_bsz.", ge=1
    )
    use_dynamic_bsz: bool = knob(False, "Form micro-batches by token count instead of response count.")
    max_token_len_per_micro_batch: int = knob(
        32768,
        "With use_dynamic_bsz: tokens per micro-batch on one device. Twice the actor's: a value head "
        "keeps no vocabulary-sized logits.",
        ge=1,
    )
    ppo_epochs: int | None = knob(None, "Passes over each step's responses. null = actor.ppo_epochs.", ge=1)
    cliprange_value: float = knob(
        0.5, "New values are clipped to within this of the old ones in the value loss; 0.5 is common.", gt=0
    )
    loss_agg_mode: LossAggMode = knob(
        "token-mean", "How per-token value losses become one number (see actor)."
    )
    grad_clip: float = knob(1.0, "Clip the global gradient norm to this before each optimizer step.", gt=0)
    shuffle: bool = knob(False, "Shuffle a step's responses before splitting them into mini-batches.")
    optim: OptimConfig = section(
        OptimConfig,
        "Optimizer of the critic; its lr is 1e-5, since a fresh value head must learn fast.",
        lr=1e-5,
    )
    offload: OffloadConfig = section(OffloadConfig, "Host-memory offload of the critic.")


@dataclass
class RefConfig(BaseConfig):
    """The frozen reference policy (the initial model), used by KL terms."""

    enable: bool | None = knob(
        None,
        "Compute reference log-probs. null = on exactly when a KL term needs them "
        "(actor.use_kl_loss or algorithm.use_kl_in_reward) or the estimator or policy loss declares it does.",
    )
    engine: str = knob("single", "Training engine that runs its forward passes (see actor.engine).")
    ulysses_sequence_parallel_size: int | None = knob(
        None,
        "Ranks each sequence is split over in reference passes. null = the actor's; the reference runs "
        "on the actor's workers, so any other value is refused.",
    )
    log_prob_micro_batch_size_per_device: int = knob(
        4, "Responses per reference forward pass on one device.", ge=1
    )
    offload: OffloadConfig = section(
        OffloadConfig, "Host-memory offload of the reference (param only: it has no optimizer)."
    )


# ---------------------------------------------------------------- rollout


@dataclass
class ValidationSamplingConfig(BaseConfig):
    """Sampling for validation: greedy by default, so scores are comparable between runs."""

    n: int = knob(1, "Responses per validation prompt.", ge=1)
    temperature: float = knob(0.0, "Sampling temperature; 0 with do_sample false = greedy.", ge=0)
    top_p: float = knob(1.0, "Nucleus sampling mass; 1.0 = off.", gt=0, le=1)
    top_k: int = knob(-1, "Sample among the k most likely tokens; -1 = off.", ge=-1)
    do_sample: bool = knob(False, "Sample (true) or decode greedily (false).")

    def finalize(self) -> None:
        _check_sampling(self)


@dataclass
class AgentConfig(BaseConfig):
    """Agent loops: how a prompt becomes a (possibly multi-turn, tool-using) response."""

    default_agent_loop: str = knob(
        "single_turn",
        "Agent loop of samples whose data names none, a name in trellis.agent_loops. single_turn "
        "generates one response.",
    )
    num_workers: int = knob(
        1,
        "Processes running agent loops, each with its own event loop, so a loop that blocks stalls only "
        "its worker. 1 = the trainer's process. More than 1 needs rollout.mode=standalone.",
        ge=1,
    )
    max_turns: int | None = knob(
        None, "Most assistant turns per sample. null = bounded only by rollout.max_tokens.", ge=1
    )
    tool_config_path: str | None = knob(None, "YAML file of the tools agent loops may call. null = no tools.")
    tool_parser: str = knob(
        "hermes",
        "Format of tool calls in model output. hermes is the <tool_call> JSON format of Qwen and Hermes "
        "models.",
    )
    max_parallel_calls: int = knob(
        1, "Most tool calls run from one assistant turn; further calls in that turn are ignored.", ge=1
    )
    max_tool_response_length: int = knob(
        256, "Longest tool response shown to the model, in characters; longer ones are truncated.", ge=1
    )
    tool_response_truncate_side: Literal["left", "right", "middle"] = knob(
        "middle",
        "Which part of an over-long tool response is dropped: left keeps the end, right keeps the start, "
        "middle keeps both ends.",
    )
    tool_timeout_s: float = knob(
        30.0, "Seconds one tool call may run before the model is told it timed out.", gt=0
    )
    function: str | None = knob(
        None,
        "The openai_agent loop's agent: 'package.module:fn' or './file.py:fn', called as fn(base_url, "
        "sample) (async or not) with an OpenAI base URL that captures the sample's tokens; it returns "
        "the reward, a dict with 'reward' and other metrics, or None to let reward.function score it.",
    )
    function_timeout_s: float = knob(
        300.0,
        "Seconds one agent function call may run; one that overruns or raises ends its sample with reward "
        "0 (counted in agent/function_timeouts, agent/function_errors), never the run.",
        gt=0,
    )
    function_concurrency: int = knob(
        64,
        "Agent function calls running at once per agent worker, each in a thread of its own (so blocking "
        "clients such as openai.OpenAI work).",
        ge=1,
    )


@dataclass
class CheckpointEngineConfig(BaseConfig):
    """How actor weights reach the rollout replicas after each step."""

    name: str | None = knob(
        None,
        "Checkpoint engine, a name in trellis.checkpoint_engines: naive (hands tensors over in-process), "
        "shm (shared memory, one machine), gloo, nccl. null = naive for replicas in the training "
        "process, shm for standalone replicas on one machine, gloo across machines.",
    )
    update_weights_bucket_megabytes: int = knob(
        512, "Weights travel in buckets of this many MiB: larger = fewer transfers, more peak memory.", ge=1
    )


@dataclass
class RolloutConfig(BaseConfig):
    """Response generation: the replica backend, where it runs and how it samples."""

    name: str = knob(
        "hf",
        "Rollout replica, a name in trellis.rollout_replicas: hf (transformers generate; runs anywhere) or "
        "a plugin's (vllm, sglang).",
    )
    mode: Literal["hybrid", "colocated", "standalone"] = knob(
        "hybrid",
        "Where replicas run: hybrid (inside the training workers, serving their weights where the engine "
        "allows), colocated (inside the training workers, with a copy of the weights synced after each "
        "update) or standalone (processes of their own on rollout.nnodes x rollout.n_devices_per_node "
        "devices, weights sent through rollout.checkpoint_engine). hybrid needs no extra devices.",
    )
    nnodes: int = knob(1, "Machines the standalone replicas run on (rollout.mode=standalone only).", ge=1)
    n_devices_per_node: int = knob(
        1,
        "Devices the standalone replicas use on each machine (cpu: processes); one replica per "
        "rollout.tensor_parallel_size of them (rollout.mode=standalone only).",
        ge=1,
    )
    n: int = knob(
        4,
        "Responses sampled per prompt. Group estimators (grpo) need at least 2; 4 is a small useful group.",
        ge=1,
    )
    temperature: float = knob(
        1.0, "Sampling temperature. 1.0 samples the policy itself, which on-policy RL assumes.", ge=0
    )
    top_p: float = knob(1.0, "Nucleus sampling mass; 1.0 = off, keeping samples on-policy.", gt=0, le=1)
    top_k: int = knob(
        -1, "Sample among the k most likely tokens; -1 = off, keeping samples on-policy.", ge=-1
    )
    max_tokens: int | None = knob(
        None, "Most tokens generated per response. null = data.max_response_length.", ge=1
    )
    do_sample: bool = knob(
        True, "Sample (true) or decode greedily (false). Training needs sampling to explore."
    )
    seed: int | None = knob(None, "Seed of sampling. null = trainer.seed.")
    tensor_parallel_size: int = knob(
        1, "Devices one replica shards its model over (backends that support it).", ge=1
    )
    gpu_memory_utilization: float = knob(
        0.5,
        "Fraction of device memory a replica may take for weights and KV cache (vllm, sglang). 0.5 leaves "
        "room for training in hybrid mode.",
        gt=0,
        le=1,
    )
    free_cache_engine: bool = knob(
        True,
        "Put the replica to sleep after each rollout, giving its KV cache (and, where the backend "
        "can, its weights) to training; the next weight sync wakes it. Replicas with their own "
        "weights only (vllm, sglang, hf colocated).",
    )
    calculate_log_probs: bool = knob(
        False,
        "Return each sampled token's log-prob under the replica; algorithm.rollout_correction needs them.",
    )
    val_kwargs: ValidationSamplingConfig = section(ValidationSamplingConfig, "Sampling during validation.")
    agent: AgentConfig = section(AgentConfig, "Agent loops and tools.")
    engine_kwargs: dict[str, Any] = knob(
        {}, "Backend options passed unchanged to the replica, e.g. {enforce_eager: true} for vllm."
    )
    checkpoint_engine: CheckpointEngineConfig = section(
        CheckpointEngineConfig, "Weight transfer to the replicas."
    )
    max_staleness: int = knob(
        1,
        "trainer.mode=async: how many policy versions a trained sample may lag the weights it is trained "
        "on (0 = on-policy, as sync). The replicas generate at most this far ahead; groups beyond it when "
        "drawn are handled by stale_policy.",
        ge=0,
    )
    stale_policy: Literal["drop", "regenerate"] = knob(
        "drop",
        "trainer.mode=async: a group staler than max_staleness when drawn is dropped (counted, its prompt "
        "not trained) or regenerated (its prompt goes back to the replicas first in line).",
    )
    partial_rollout: bool = knob(
        False,
        "trainer.mode=async: a weight update interrupts the requests in flight and the replica resumes "
        "the same sequences with the new weights (each token keeps the version that generated it), so "
        "a long response never holds an update back. false: the update waits for the batch in flight.",
    )

    def finalize(self) -> None:
        _check_sampling(self)
        if self.checkpoint_engine.name is None:
            standalone, several = self.mode == "standalone", self.nnodes > 1
            self.checkpoint_engine.name = ("gloo" if several else "shm") if standalone else "naive"
        if self.mode != "standalone":
            for key in ("nnodes", "n_devices_per_node"):
                if getattr(self, key) != 1:
                    raise ConfigValueError(
                        key,
                        getattr(self, key),
                        "places standalone replicas only; set {p}mode=standalone or leave it at 1 "
                        "(hybrid and colocated replicas run in the training workers)",
                    )
            if self.agent.num_workers != 1:
                raise ConfigValueError(
                    "agent.num_workers",
                    self.agent.num_workers,
                    "needs {p}mode=standalone: agent workers reach the replicas across processes, while "
                    "hybrid and colocated replicas live inside each training worker, whose loops run there",
                )
        elif self.checkpoint_engine.name == "naive":
            raise ConfigValueError(
                "checkpoint_engine.name",
                "naive",
                "hands tensors over within one process, but {p}mode=standalone replicas run in processes "
                "of their own",
                hint=" Use shm (one machine), gloo or nccl.",
            )
        elif self.n_devices_per_node % self.tensor_parallel_size:
            raise ConfigValueError(
                "n_devices_per_node",
                self.n_devices_per_node,
                f"must be a multiple of {{p}}tensor_parallel_size ({self.tensor_parallel_size}): each "
                "standalone replica takes that many devices of one machine",
            )


def _check_sampling(cfg: RolloutConfig | ValidationSamplingConfig) -> None:
    if cfg.top_k == 0:
        raise ConfigValueError("top_k", 0, "must be -1 (off) or a positive integer")
    if cfg.do_sample and cfg.temperature == 0:
        raise ConfigValueError(
            "temperature",
            0.0,
            "must be > 0 when {p}do_sample is true",
            hint=" For greedy decoding set do_sample=false.",
        )


# ---------------------------------------------------------------- reward and algorithm


DEFAULT_JUDGE_TEMPLATE = (
    "You are grading a response to a task.\n\n"
    "Task:\n{prompt}\n\n"
    "Response:\n{response}\n\n"
    "Reference answer (may be empty):\n{ground_truth}\n\n"
    "Rate the response from 0 (wrong or useless) to 10 (correct and complete). "
    "End your reply with a line of the form 'Score: <0-10>'."
)
"""The default ``reward.model.prompt_template``: asks the judge for a final ``Score: N`` (0-10) line,
which the ``judge_score`` reward function reads."""


@dataclass
class RewardModelConfig(BaseConfig):
    """A reward model that scores responses: a judge LLM reached over an OpenAI-compatible API
    (``kind: generative``) or a sequence classifier (``kind: classifier``). Off while both ``path`` and
    ``base_url`` are null. With ``reward.function`` null the model's score is the reward; with both set,
    the two scores are added."""

    path: str | None = knob(
        None,
        "The reward model, a Hugging Face hub id or a local folder. generative colocated: the judge the "
        "trainer serves; generative external: the model name sent with each request (null = the server's "
        "first listed model); classifier: an AutoModelForSequenceClassification. null (and base_url null) "
        "= no reward model.",
    )
    kind: Literal["generative", "classifier"] = knob(
        "generative",
        "generative: a judge LLM writes a verdict that reward.model.function turns into the score. "
        "classifier: the score is the logit of label 0 of a sequence-classification model, run in the "
        "process that scores (see reward.placement).",
    )
    placement: Literal["colocated", "external"] = knob(
        "colocated",
        "Where a generative judge runs: colocated (a replica in the trainer's process, served by the "
        "Trellis gateway on 127.0.0.1) or external (an OpenAI-compatible server already running at "
        "base_url). A classifier always runs where reward.placement scores.",
    )
    base_url: str | None = knob(
        None,
        "external: the server's OpenAI-compatible API root, e.g. http://judge-host:8000/v1 (requests go "
        "to {base_url}/chat/completions). colocated: leave null; it holds the gateway's address while "
        "the run is on.",
    )
    replica: str = knob(
        "hf",
        "colocated: the rollout replica that serves the judge, a name in trellis.rollout_replicas. hf "
        "runs anywhere.",
    )
    prompt_template: str = knob(
        DEFAULT_JUDGE_TEMPLATE,
        "The judge's prompt, one user message: a Python format string with {prompt}, {response} and "
        "{ground_truth} (write literal braces as {{ }}). The default asks for a final 'Score: <0-10>'.",
    )
    function: str = knob(
        "judge_score",
        "Turns the judge's reply into the score: a name in trellis.reward_functions or a reference, "
        "called as fn(data_source, solution_str=<the reply>, ground_truth, extra_info). judge_score "
        "reads the last 'Score: N' (else the last number) and maps 0-10 to 0-1.",
    )
    timeout_seconds: float = knob(
        60.0,
        "Longest one judge request may take, in seconds; past it the sample scores 0 and counts in "
        "reward/model_timeouts. 60 allows a long verdict from a busy server.",
        gt=0,
    )
    max_concurrency: int = knob(
        16,
        "Judge requests in flight at once. 16 keeps a server's batch full without queueing a whole step.",
        ge=1,
    )
    micro_batch_size: int = knob(
        8, "classifier: responses per forward pass. 8 bounds memory for long responses.", ge=1
    )
    max_tokens: int = knob(
        256, "Longest judge reply, in tokens. 256 leaves room for a short rationale before the score.", ge=1
    )

    @property
    def enabled(self) -> bool:
        """Whether a reward model scores the run: ``path`` or ``base_url`` is set."""
        return self.path is not None or self.base_url is not None

    def finalize(self) -> None:
        for key in ("path", "base_url", "replica", "function"):
            value = getattr(self, key)
            if value is not None and not value.strip():
                unset = " Use null to leave it unset." if key in ("path", "base_url") else ""
                raise ConfigValueError(key, value, "must not be empty", hint=unset)
        if self.kind == "classifier":
            if self.placement == "external" or self.base_url is not None:
                key = "placement" if self.placement == "external" else "base_url"
                raise ConfigValueError(
                    key,
                    getattr(self, key),
                    "is for generative judges: a classifier ({p}kind=classifier) runs in the process "
                    "that scores",
                    hint=" Leave reward.model.placement at colocated and base_url null, and set path.",
                )
        elif self.placement == "colocated" and self.base_url is not None:
            raise ConfigValueError(
                "base_url",
                self.base_url,
                "must be null with {p}placement=colocated: the trainer serves that judge itself",
                hint=" To use a server already running, set reward.model.placement=external.",
            )
        elif self.placement == "external" and self.enabled and self.base_url is None:
            raise ConfigValueError(
                "base_url",
                None,
                "must be set with {p}placement=external: the address of the judge's OpenAI-compatible API",
                hint=" E.g. reward.model.base_url=http://127.0.0.1:8000/v1, or placement=colocated.",
            )
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ConfigValueError(
                "base_url", self.base_url, "must be an http:// or https:// URL, e.g. http://host:8000/v1"
            )
        try:
            parsed = string.Formatter().parse(self.prompt_template)
            fields = {name or "{}" for _, name, _, _ in parsed if name is not None}
            problem = None
        except ValueError as exc:  # a lone brace
            fields, problem = set(), f"does not parse ({exc})"
        unknown = sorted(fields - {"prompt", "response", "ground_truth"})
        if problem is None and unknown:
            problem = f"names {', '.join(unknown)}"
        elif problem is None and "response" not in fields:
            problem = "lacks {response}"
        if problem is not None:
            raise ConfigValueError(
                "prompt_template",
                self.prompt_template,
                f"must be a format string with {{response}} (the text to judge) and optionally {{prompt}} "
                f"and {{ground_truth}}, but it {problem}",
                hint=" Write literal braces as {{ and }}.",
            )


@dataclass
class RewardConfig(BaseConfig):
    """How responses are scored."""

    manager: str = knob(
        "naive",
        "Reward manager, a name in trellis.reward_managers. naive scores each response once and puts "
        "the score on its last token.",
    )
    function: str | None = knob(
        None,
        "Scoring function: a name in trellis.reward_functions, 'package.module:fn' or './file.py:fn'. "
        "null = chosen per sample by its data.reward_fn_key column.",
    )
    function_kwargs: dict[str, Any] = knob({}, "Extra keyword arguments passed to the scoring function.")
    placement: Literal["workers", "driver"] = knob(
        "workers",
        "Where scoring runs: workers (each policy worker scores its own share of the batch, next to the "
        "samples, all in parallel) or driver (the trainer process scores the whole batch).",
    )
    timeout_seconds: float | None = knob(
        60.0,
        "Longest one score may take, in seconds; a call past it scores 0 and counts in reward/timeouts. "
        "null = no limit. 60 allows sandboxed code runs.",
        gt=0,
    )
    num_workers: int = knob(
        1,
        "Processes the async manager scores in, in parallel (naive and batch score in the process that holds "
        "the batch).",
        ge=1,
    )
    memory_limit_mb: int | None = knob(
        None,
        "Address-space limit of each async-manager scoring process, in MiB: a reward function that leaks or "
        "balloons past it fails that call (scored 0, counted in reward/errors) instead of exhausting the "
        "machine. Needs reward.manager=async. null = no limit.",
        ge=64,
    )
    tool_reward_weight: float = knob(
        1.0,
        "Weight of the tools' rewards (step rewards plus calc_reward at the end of a trajectory) added to "
        "each sample's score, on its last model token; logged as reward/tool. 0 = tools only inform.",
    )
    model: RewardModelConfig = section(
        RewardModelConfig, "A reward model (LLM judge or classifier) scoring responses; off by default."
    )


@dataclass
class KLControlConfig(BaseConfig):
    """Coefficient of the in-reward KL penalty (algorithm.use_kl_in_reward)."""

    type: Literal["fixed", "adaptive"] = knob(
        "fixed", "fixed keeps kl_coef; adaptive steers it toward target_kl (Ziegler et al., 2019)."
    )
    kl_coef: float = knob(0.001, "Weight of the KL penalty (adaptive: its initial value).", ge=0)
    target_kl: float = knob(0.1, "adaptive: the KL per response the controller aims at, in nats.", gt=0)
    horizon: int = knob(
        10000, "adaptive: responses over which the coefficient adapts; larger = slower.", ge=1
    )


@dataclass
class RolloutCorrectionConfig(BaseConfig):
    """Correction for the rollout backend's numerics differing from the trainer's: importance
    weights on ρ = π_train / π_rollout and rejection of tokens or responses that diverge too much.
    The fields mirror the arguments of
    ``trellis.algorithms.rollout_correction.compute_rollout_correction_and_rejection_mask``.
    Enabling either part needs ``rollout.calculate_log_probs``.

    The option grammar (criteria names, threshold forms) is parsed here, without torch, by the
    ``parse_*`` static methods, which the algorithm calls too. Each takes ``error``, a factory
    ``error(key, value, requirement, hint=...)`` of the exception to raise (default: a plain
    ``ValueError`` reading ``<key> <requirement>; got <value>.<hint>``).
    """

    IS_LEVELS = ("token", "sequence")
    RS_CRITERIA = (
        "token_k1",
        "token_k2",
        "token_k3",
        "seq_sum_k1",
        "seq_sum_k2",
        "seq_sum_k3",
        "seq_mean_k1",
        "seq_mean_k2",
        "seq_mean_k3",
        "seq_max_k1",
        "seq_max_k2",
        "seq_max_k3",
    )

    rollout_is: Literal["token", "sequence"] | None = knob(
        None,
        "Importance weights: token (w_t = ρ_t), sequence (w = Π_t ρ_t over the response, on each of its "
        "tokens) or null = none.",
    )
    rollout_is_threshold: float | str | list[float] | None = knob(
        2.0,
        "A number C truncates weights to at most C (truncated IS). A band 'lower_upper' (e.g. '0.5_2.0'; "
        "write decimal points: YAML reads 1_2 as 12) or [lower, upper] zeroes weights outside it (IcePop). "
        "null = neither. 2.0 bounds the variance.",
    )
    rollout_is_batch_normalize: bool = knob(
        False, "Rescale weights so their mean over the batch (tokens, or responses in sequence mode) is 1."
    )
    rollout_rs: str | None = knob(
        None,
        "Rejection criteria joined by commas, e.g. 'token_k1' or 'seq_mean_k3,seq_max_k1': token_kN drops "
        "tokens, seq_{sum,mean,max}_kN drops responses whose divergence kN (k1 = |log ρ|, k2 = ½(log ρ)², "
        "k3 = ρ−1−log ρ) exceeds its threshold. null = reject nothing.",
    )
    rollout_rs_threshold: float | str | list[float] | None = knob(
        None,
        "Rejection thresholds, > 0: one number for all criteria, or one per criterion ('0.1,2.0' or a "
        "list). Required with rollout_rs.",
    )

    @property
    def enabled(self) -> bool:
        """Whether any correction (weights or rejection) is on."""
        return self.rollout_is is not None or self.rollout_rs is not None

    def finalize(self) -> None:
        self.parse_is_threshold(self.rollout_is_threshold, error=ConfigValueError)
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ConfigValueError(
                "rollout_is_batch_normalize",
                True,
                "must be false when {p}rollout_is is null",
                hint=" There are no weights to normalise: set rollout_is too.",
            )
        if self.rollout_rs is not None:
            criteria = self.parse_rs(self.rollout_rs, error=ConfigValueError)
            self.parse_rs_thresholds(
                self.rollout_rs_threshold, criteria, rs_spec=self.rollout_rs, error=ConfigValueError
            )

    # -- the option grammar, shared with trellis.algorithms.rollout_correction

    @staticmethod
    def argument_error(key: str, value: Any, requirement: str, hint: str = "") -> ValueError:
        """A ``ValueError`` about function argument ``key``, worded like a :class:`ConfigValueError`."""
        return ValueError(f"{key} {requirement.replace('{p}', '')}; got {value!r}.{hint}")

    @staticmethod
    def parse_is_threshold(value: Any, *, error: Any = None) -> tuple[float | None, float | None]:
        """``(lower, upper)`` from a ``rollout_is_threshold``: a number (or a string of one) C gives
        ``(None, C)`` (truncate at C); ``"lower_upper"`` or a ``(lower, upper)`` pair gives the band
        ``(lower, upper)`` (zero outside it); ``None`` gives ``(None, None)`` (neither).

        Raises (through ``error``): not one of these forms, a bound not > 0, or lower >= upper.
        """
        error = error or RolloutCorrectionConfig.argument_error
        key = "rollout_is_threshold"
        forms = "a number > 0, a band 'lower_upper' such as '0.5_2.0', a (lower, upper) pair or null"
        if value is None:
            return None, None
        if isinstance(value, str):
            parts: Any = value.split("_") if "_" in value else [value]
        elif isinstance(value, (list, tuple)):
            if len(value) != 2:
                raise error(key, value, f"must be {forms}", hint=f" A band has 2 bounds, not {len(value)}.")
            parts = list(value)
        else:
            parts = [value]
        numbers = [RolloutCorrectionConfig._number(part) for part in parts]
        bounds = [bound for bound in numbers if bound is not None]
        if len(bounds) > 2 or len(bounds) != len(numbers):
            raise error(key, value, f"must be {forms}")
        if any(not bound > 0 for bound in bounds):  # `not > 0` also catches NaN
            raise error(key, value, "must hold bounds > 0 (weights are ratios of probabilities)")
        if len(bounds) == 1:
            return None, bounds[0]
        lower, upper = bounds
        if lower >= upper:
            raise error(
                key,
                value,
                "must name a band with lower < upper",
                hint=" Write 'lower_upper', e.g. '0.5_2.0'.",
            )
        return lower, upper

    @staticmethod
    def parse_rs(spec: Any, *, error: Any = None) -> list[str]:
        """The criteria named by a ``rollout_rs`` string (``"seq_mean_k3,seq_max_k1"``), in order.

        Raises (through ``error``): not a string, an empty name, an unknown or repeated criterion.
        """
        error = error or RolloutCorrectionConfig.argument_error
        valid = RolloutCorrectionConfig.RS_CRITERIA
        requirement = "must be criteria joined by commas, each one of " + ", ".join(valid)
        if not isinstance(spec, str):
            raise error("rollout_rs", spec, requirement + ", or null")
        criteria = [name.strip() for name in spec.split(",")]
        for name in criteria:
            if name not in valid:
                hint = " An empty name." if not name else f" Unknown criterion {name!r}."
                raise error("rollout_rs", spec, requirement, hint=hint)
        repeated = sorted({name for name in criteria if criteria.count(name) > 1})
        if repeated:
            raise error(
                "rollout_rs", spec, "must name each criterion once", hint=f" Repeated: {repeated[0]!r}."
            )
        return criteria

    @staticmethod
    def parse_rs_thresholds(
        value: Any, criteria: list[str], *, rs_spec: Any = None, error: Any = None
    ) -> list[float]:
        """One threshold per criterion from a ``rollout_rs_threshold``: a number (for all criteria), a
        comma-separated string of numbers or a list of them (one, or one per criterion).

        Raises (through ``error``): missing, not numbers, a count other than 1 or ``len(criteria)``,
        or a number not > 0.
        """
        error = error or RolloutCorrectionConfig.argument_error
        key, count = "rollout_rs_threshold", len(criteria)
        named = f"{{p}}rollout_rs {rs_spec if rs_spec is not None else ','.join(criteria)!r}"
        forms = "a number, a comma-separated string of numbers or a list of numbers"
        if value is None:
            raise error(
                key, value, f"must be set when {named} is set: {forms}, one per criterion or one for all"
            )
        if isinstance(value, str):
            parts: Any = value.split(",")
        elif isinstance(value, (list, tuple)):
            parts = list(value)
        else:
            parts = [value]
        numbers = [RolloutCorrectionConfig._number(part) for part in parts]
        thresholds = [threshold for threshold in numbers if threshold is not None]
        if not thresholds or len(thresholds) != len(numbers):
            raise error(key, value, f"must be {forms}")
        if len(thresholds) not in (1, count):
            raise error(
                key,
                value,
                f"must give 1 number (for all criteria) or {count} (one per criterion of {named})",
                hint=f" It gives {len(thresholds)}.",
            )
        if any(not threshold > 0 for threshold in thresholds):  # `not > 0` also catches NaN
            raise error(key, value, "must hold numbers > 0 (divergences above them are rejected)")
        return thresholds * count if len(thresholds) == 1 else thresholds

    @staticmethod
    def _number(value: Any) -> float | None:
        """``value`` as a float (a number, or a string holding one), else ``None``."""
        if isinstance(value, bool):
            return None
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                return None
        return None


@dataclass
class AlgorithmConfig(BaseConfig):
    """Advantages and the in-reward KL penalty."""

    adv_estimator: str = knob(
        "grpo",
        "Advantage estimator, a name in trellis.advantage_estimators: grpo (rewards normalised within "
        "each prompt's group; no critic), gae (needs a critic), or a plugin's.",
    )
    gamma: float = knob(1.0, "Discount per token. 1.0: the reward arrives once, at the end.", ge=0, le=1)
    lam: float = knob(1.0, "GAE λ (bias-variance trade-off); 1.0 = Monte-Carlo returns.", ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = knob(
        True, "grpo: divide by the group's standard deviation, as in the paper; false = Dr. GRPO."
    )
    use_kl_in_reward: bool = knob(
        False, "Subtract kl_ctrl.kl_coef × KL(actor || reference) from token rewards. Needs the reference."
    )
    kl_penalty: KLEstimator = knob("kl", "Estimator of the in-reward KL (see actor.kl_loss_type).")
    kl_ctrl: KLControlConfig = section(KLControlConfig, "Coefficient of the in-reward KL penalty.")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "Correction for rollout/trainer log-prob mismatch."
    )
    off_policy: Literal["none", "decoupled", "behaviour"] = knob(
        "none",
        "none: a stale sample is trained as if the current weights generated it (rollout_correction may "
        "still weight it). decoupled: the proximal policy is the weights at the start of the step (the "
        "clip is around it; old log-probs are always recomputed) and each token is weighted by "
        "π_prox / π_behaviour, the behaviour being the weights that generated it. behaviour: the old "
        "log-probs are the replica's, so the PPO ratio is π / π_behaviour and its clip bounds the step "
        "from the weights that generated each token; no old-log-prob forward pass (verl's bypass mode). "
        "decoupled and behaviour need rollout.calculate_log_probs.",
    )
    off_policy_cap: float | None = knob(
        5.0,
        "decoupled: tokens whose π_prox / π_behaviour exceeds this are left out of the loss (their weight "
        "is 0); null = no cap.",
        gt=0,
    )


# ---------------------------------------------------------------- trainer

STAGES = (
    "step",
    "generate",
    "generate_baseline",
    "wait_rollout",
    "rollout_sleep",
    "score",
    "old_log_prob",
    "ref",
    "values",
    "advantage",
    "update_critic",
    "update_actor",
    "wait_next_rollout",
    "weight_sync",
    "validate",
    "checkpoint",
)
"""The stages of a training step, as ``trellis.trainer.ppo`` names them (``timing/<stage>``,
``trainer.stage_timeouts``, ``trainer.profile.stages``), in the order they run. ``step`` encloses every
other stage but ``validate`` and ``checkpoint`` (which follow it), ``generate`` encloses
``generate_baseline``."""


@dataclass
class ProfileConfig(BaseConfig):
    """The torch profiler on chosen stages of chosen steps (``trellis train --profile``): each profiled
    stage writes ``run_dir/profile/step_<N>/<stage>.json`` (a Chrome trace for Perfetto or
    chrome://tracing) and ``<stage>.txt`` (its top operators, also logged). With ``trainer.executor=ray``
    every worker writes ``<stage>.rank<R>.json`` / ``.txt`` beside the driver's."""

    steps: list[int] = knob(
        [],
        "Global steps whose stages are profiled (1 = the first step; 0 = the validation before training). "
        "[] = off. Steps past the end of the run are skipped with a warning.",
    )
    stages: list[str] | None = knob(
        None,
        "Stages to profile, each into its own trace: generate, score, old_log_prob, ref, values, advantage, "
        "update_critic, update_actor, weight_sync, validate, checkpoint, ... (see docs/training.md). "
        "null = every stage but step. step encloses the others (torch runs one profiler at a time), so it "
        "can only be profiled alone: [step] gives one trace of the whole step.",
    )
    top_k: int = knob(15, "Operators in each stage's table (by self CPU time, and self device time).", ge=1)
    record_shapes: bool = knob(
        False,
        "Record each operator's input shapes: in the trace (args 'Input Dims'), and the table has a row "
        "per operator and shape. Costs time and trace size.",
    )

    def finalize(self) -> None:
        for i, step in enumerate(self.steps):
            if step < 0:
                raise ConfigValueError(
                    "steps", self.steps, "must hold global step numbers >= 0", hint=f" Item {i} is {step}."
                )
        if self.stages is None:
            return
        for name in self.stages:
            if name not in STAGES:
                raise ConfigValueError(
                    "stages",
                    self.stages,
                    "must name stages of a step, each one of " + ", ".join(STAGES),
                    hint=f" Unknown stage {name!r}.{closest_hint(name, STAGES)}",
                )
        if "step" in self.stages and len(set(self.stages)) > 1:
            raise ConfigValueError(
                "stages",
                self.stages,
                "must not name step together with other stages: step encloses them and torch runs one "
                "profiler at a time",
                hint=" Profile [step] alone (its trace shows the other stages as ranges), or drop step.",
            )

    def profiled_stages(self) -> tuple[str, ...]:
        """The stages profiled: ``stages``, or, when it is null, every stage but ``step``."""
        if self.stages is None:
            return tuple(name for name in STAGES if name != "step")
        return tuple(self.stages)


@dataclass
class TrainerConfig(BaseConfig):
    """The run: its name and outputs, length, devices, logging, checkpoints and resumption."""

    project_name: str = knob("trellis", "Project name, shown by trackers; groups experiments.")
    experiment_name: str = knob("default", "Name of this run within the project.")
    run_dir: str | None = knob(
        None,
        "Where checkpoints, logs and metrics go (a local path or fsspec URL). "
        "null = runs/<project_name>/<experiment_name>.",
    )
    total_epochs: int = knob(1, "Passes over the training set.", ge=1)
    total_training_steps: int | None = knob(
        None, "Stop after this many steps. null = total_epochs × steps per epoch.", ge=1
    )
    device: str = knob(
        "auto",
        "Device backend, a name in trellis.device_backends (cpu, cuda, ...), or auto = the best one "
        "available on the machine.",
    )
    flush_denormal: bool = knob(
        True,
        "Flush denormal floats (under 1.2e-38) to zero in the CPU computations of every process of the run "
        "(x86 FTZ/DAZ). A softmax over a large vocabulary makes millions of them and x86 cores compute "
        "them ~100x slower: a SmolLM2 update took 30 s instead of 17. false keeps IEEE gradual underflow.",
    )
    host_memory: Literal["reuse", "release"] = knob(
        "reuse",
        "What every process of the run does with CPU memory torch frees. reuse: malloc keeps it for the next "
        "stage (one arena for all threads, no mmap per large block, no trimming), so no page is faulted in "
        "and zeroed twice; the resident set stays at the run's high-water mark. release: given back to the "
        "OS whenever an engine phase starts and ends (lower resident set between stages); the demo's "
        "update then spent 10-20 s a step re-faulting 1.8 million pages.",
    )
    executor: Literal["local", "ray"] = knob(
        "local",
        "How workers run: local (in this process) or ray (Ray actors: several processes, devices or nodes).",
    )
    share_cores: bool = knob(
        True,
        "CPU training in this process beside standalone replicas on the same machine (executor local, a Ray "
        "cluster the trainer starts, no TRELLIS_NUM_THREADS): whoever computes also runs on the cores of "
        "those waiting. The trainer trains on the replicas' cores while they have nothing to generate, and "
        "an hf replica decodes on the trainer's while it waits (validation, rollouts). false: a fixed "
        "split, one thread per replica and the rest for training.",
    )
    nnodes: int = knob(1, "Machines in the run; more than 1 needs executor=ray.", ge=1)
    n_devices_per_node: int = knob(1, "Accelerators used on each machine (cpu: worker processes).", ge=1)
    trackers: list[str] = knob(
        ["console", "jsonl"],
        "Metric trackers, names in trellis.trackers. console prints each step; jsonl writes metrics into "
        "run_dir.",
    )
    save_freq: int = knob(-1, "Save a training checkpoint every this many steps; 0 or -1 = never.", ge=-1)
    stage_timeout_s: float | None = knob(
        3600.0,
        "Deadline of every stage of a step (generate, score, update_actor, weight_sync, checkpoint, "
        "validate, ...): past it the run reports the stage and every worker's Python stacks "
        "(run_dir/stall_report.txt) and stops with exit code 3, the last checkpoint intact. null = none.",
        gt=0,
    )
    stage_timeouts: dict[str, float | None] = knob(
        {},
        "Per-stage deadlines in seconds overriding stage_timeout_s, e.g. {score: 600, generate: 7200}; "
        "null for a stage = no deadline. The whole step has none unless named here (step: ...).",
    )
    test_freq: int = knob(
        -1, "Validate every this many steps; 0 or -1 = never (see val_before_train).", ge=-1
    )
    val_before_train: bool = knob(True, "Validate before the first step, as the baseline to compare against.")
    resume_mode: Literal["auto", "disable", "resume_path"] = knob(
        "auto",
        "auto: continue from the latest checkpoint in run_dir, if any; disable: start fresh; "
        "resume_path: continue from resume_from_path.",
    )
    resume_from_path: str | None = knob(
        None, "Checkpoint directory to continue from (resume_mode=resume_path)."
    )
    max_actor_ckpt_to_keep: int | None = knob(
        None, "Keep only this many latest checkpoints. null = all.", ge=1
    )
    seed: int = knob(1, "Seed of the run; data.seed and rollout.seed default to it.")
    log_val_generations: int = knob(
        0, "Validation samples (prompt, response, score) sent to the trackers per validation.", ge=0
    )
    mode: Literal["sync", "one_step_off", "async"] = knob(
        "sync",
        "sync: generate, then train, each waiting for the other. one_step_off: batch k+1 is generated "
        "(with the weights before step k) while step k trains. async: the replicas generate prompt "
        "groups continuously into the replay pool and each step trains as soon as "
        "data.train_batch_size groups are ready (rollout.max_staleness bounds their lag). Both overlapping "
        "modes need rollout.mode=standalone.",
    )
    replay_pool: str = knob(
        "fifo",
        "trainer.mode=async: the buffer of finished groups, a name in trellis.replay_pools (fifo: oldest "
        "first; uniform; prioritized). A step draws its groups from it.",
    )
    replay_capacity: int | None = knob(
        None,
        "trainer.mode=async: the most groups the buffer holds (the stalest go first beyond it). "
        "null = (rollout.max_staleness + 2) × data.train_batch_size, which never evicts.",
        ge=1,
    )
    replay_ratio: float = knob(
        0.0,
        "trainer.mode=async: the fraction of each step's groups drawn again from groups already trained "
        "(kept while no staler than rollout.max_staleness); 0 = every sample is trained once.",
        ge=0,
        lt=1,
    )
    profile: ProfileConfig = section(
        ProfileConfig,
        "The torch profiler on chosen stages of chosen steps (trellis train --profile): a Chrome trace and a "
        "top-operator table per stage in run_dir/profile/step_<N>/. Off by default.",
    )

    def finalize(self) -> None:
        if self.run_dir is None:
            self.run_dir = f"runs/{self.project_name}/{self.experiment_name}"
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ConfigValueError(
                "resume_from_path",
                self.resume_from_path,
                "must name a checkpoint directory when {p}resume_mode is 'resume_path'",
            )
        if self.nnodes > 1 and self.executor != "ray":
            raise ConfigValueError(
                "executor",
                self.executor,
                f"must be 'ray' when {{p}}nnodes is {self.nnodes} (local runs on one machine)",
            )


# ---------------------------------------------------------------- the whole run


@dataclass
class TrellisConfig(BaseConfig):
    """The configuration of one PPO/GRPO run."""

    data: DataConfig = section(DataConfig, "Training and validation data.")
    model: ModelConfig = section(ModelConfig, "The policy model.")
    actor: ActorConfig = section(ActorConfig, "The trained policy.")
    critic: CriticConfig = section(CriticConfig, "The value model (PPO with gae).")
    ref: RefConfig = section(RefConfig, "The frozen reference policy, for KL terms.")
    rollout: RolloutConfig = section(RolloutConfig, "Response generation.")
    reward: RewardConfig = section(RewardConfig, "Scoring of responses.")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "Advantage estimation and the in-reward KL.")
    trainer: TrainerConfig = section(
        TrainerConfig, "The run: outputs, length, devices, logging, checkpoints."
    )

    def finalize(self) -> None:
        data, model, actor, critic, ref = self.data, self.model, self.actor, self.critic, self.ref
        rollout, algorithm, trainer = self.rollout, self.algorithm, self.trainer

        # "null = derive it" fields
        if model.tokenizer_path is None:
            model.tokenizer_path = model.path
        if data.seed is None:
            data.seed = trainer.seed
        if rollout.seed is None:
            rollout.seed = trainer.seed
        if rollout.max_tokens is None:
            rollout.max_tokens = data.max_response_length
        uses_kl = actor.use_kl_loss or algorithm.use_kl_in_reward
        if ref.enable is None and uses_kl:
            ref.enable = True
        # critic.enable (and ref.enable without a KL term) follow what the estimator and the policy loss
        # declare they need: trellis.config.needs.resolve_needs settles them when the run is built.
        if critic.model_path is None:
            critic.model_path = model.path
        if critic.ppo_mini_batch_size is None:
            critic.ppo_mini_batch_size = actor.ppo_mini_batch_size
        if critic.ppo_epochs is None:
            critic.ppo_epochs = actor.ppo_epochs
        if ref.ulysses_sequence_parallel_size is None:
            ref.ulysses_sequence_parallel_size = actor.ulysses_sequence_parallel_size
        if ref.ulysses_sequence_parallel_size != actor.ulysses_sequence_parallel_size:
            raise ConfigValueError(
                "ref.ulysses_sequence_parallel_size",
                ref.ulysses_sequence_parallel_size,
                f"must equal actor.ulysses_sequence_parallel_size ({actor.ulysses_sequence_parallel_size}): "
                "the reference runs on the actor's workers and splits its batches as the actor's mesh does",
                hint=" Leave it null to follow the actor.",
            )

        # relations between sections
        if rollout.max_tokens > data.max_response_length:
            raise ConfigValueError(
                "rollout.max_tokens",
                rollout.max_tokens,
                f"must be <= data.max_response_length ({data.max_response_length}), "
                "the length responses are padded to",
            )
        if uses_kl and not ref.enable:
            which = "actor.use_kl_loss" if actor.use_kl_loss else "algorithm.use_kl_in_reward"
            raise ConfigValueError(
                "ref.enable",
                False,
                f"must be true (or null) when {which} is true: the KL term needs reference log-probs",
            )
        if trainer.mode != "sync" and rollout.mode != "standalone":
            raise ConfigValueError(
                "trainer.mode",
                trainer.mode,
                f"needs rollout.mode=standalone (got {rollout.mode!r}): generation overlaps training only "
                "when the replicas hold their own weights in processes of their own",
            )
        for key, value, neutral in (
            ("rollout.partial_rollout", rollout.partial_rollout, False),
            ("trainer.replay_ratio", trainer.replay_ratio, 0.0),
        ):
            if value != neutral and trainer.mode != "async":
                raise ConfigValueError(
                    key,
                    value,
                    f"acts only with trainer.mode=async (got {trainer.mode!r}): set trainer.mode=async or "
                    f"leave it at {neutral}",
                )
        replayed = round(trainer.replay_ratio * data.train_batch_size)
        if trainer.replay_ratio and replayed >= data.train_batch_size:
            raise ConfigValueError(
                "trainer.replay_ratio",
                trainer.replay_ratio,
                f"leaves no fresh group in a step of data.train_batch_size={data.train_batch_size} groups; "
                "lower it",
            )
        if trainer.replay_capacity is None:
            trainer.replay_capacity = (rollout.max_staleness + 2) * data.train_batch_size
        if algorithm.off_policy != "none" and not rollout.calculate_log_probs:
            raise ConfigValueError(
                "rollout.calculate_log_probs",
                False,
                f"must be true when algorithm.off_policy is {algorithm.off_policy!r}: the behaviour "
                "policy's log-probs come from the replica",
            )
        if algorithm.off_policy == "decoupled" and algorithm.rollout_correction.rollout_is is not None:
            raise ConfigValueError(
                "algorithm.rollout_correction.rollout_is",
                algorithm.rollout_correction.rollout_is,
                "must be null when algorithm.off_policy is 'decoupled', which already weights each "
                "token by π_prox / π_behaviour",
            )
        correction = algorithm.rollout_correction
        part = "rollout_is" if correction.rollout_is is not None else "rollout_rs"  # the one that is on
        if algorithm.off_policy == "behaviour" and correction.enabled:
            raise ConfigValueError(
                f"algorithm.rollout_correction.{part}",
                correction[part],
                "must be null when algorithm.off_policy is 'behaviour': the old log-probs are then the "
                "rollout's own, so π_old / π_rollout is 1 on every token and the correction would do "
                "nothing; use algorithm.off_policy=decoupled to correct against recomputed log-probs",
            )
        if correction.enabled and not rollout.calculate_log_probs:
            raise ConfigValueError(
                "rollout.calculate_log_probs",
                False,
                f"must be true when algorithm.rollout_correction.{part} is {correction[part]!r}, "
                "which compares the trainer's log-probs with the rollout's",
            )
        self.check_batches("actor", actor)
        if critic.enable:
            self.check_batches("critic", critic)

    def check_batches(self, role: str, cfg: ActorConfig | CriticConfig) -> None:
        """Check that ``role``'s mini- and micro-batches fit the step's batch and devices.

        Raises:
            ConfigValueError: the offending key, its value and the relation it breaks.
        """
        # One step's prompts split into whole mini-batches; one mini-batch's responses split evenly
        # over the data-parallel devices; with dynamic batching, one full-length sample must fit.
        mini, n, prompts = cfg.ppo_mini_batch_size, self.rollout.n, self.data.train_batch_size
        if mini is None:  # the critic's is derived from the actor's in finalize, before this runs
            raise ConfigValueError(f"{role}.ppo_mini_batch_size", mini, "must be set")
        if prompts % mini:
            raise ConfigValueError(
                f"{role}.ppo_mini_batch_size",
                mini,
                f"must divide data.train_batch_size ({prompts}): a step's prompts form whole mini-batches",
            )
        devices = self.trainer.nnodes * self.trainer.n_devices_per_node
        if (mini * n) % devices:
            raise ConfigValueError(
                f"{role}.ppo_mini_batch_size",
                mini,
                f"× rollout.n ({n}) = {mini * n} responses must split evenly over the {devices} devices "
                "(trainer.nnodes × trainer.n_devices_per_node)",
            )
        longest = self.data.max_prompt_length + self.data.max_response_length
        if cfg.use_dynamic_bsz and cfg.max_token_len_per_micro_batch < longest:
            raise ConfigValueError(
                f"{role}.max_token_len_per_micro_batch",
                cfg.max_token_len_per_micro_batch,
                f"must be >= data.max_prompt_length + data.max_response_length ({longest}) so one "
                "full-length sample fits",
            )
