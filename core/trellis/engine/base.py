"""``TrainingEngine``: what every training engine does, and the machinery they share.

An engine owns one model (and, when it trains, its optimizer and lr schedule) for one role:

- ``"actor"``: a causal LM, trained; ``forward`` gives per-token log-probs (and entropies).
- ``"critic"``: a value model (:mod:`trellis.engine.models`), trained; ``forward`` gives values.
- ``"ref"``: a frozen causal LM; forward passes only, no optimizer.

Batches (the verl convention) are a :class:`~trellis.data.protocol.DataProto` (or a dict of
tensors) whose rows are prompt + response:

- ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, L)``: the prompt left-padded, then
  the response right-padded (``position_ids`` optional: derived from the mask);
- ``responses`` ``(bs, T)``: the last ``T`` positions of ``input_ids``;
- ``response_mask`` ``(bs, T)``: 1 on tokens the loss counts (needed by ``forward_backward``);
- ``meta_info["temperature"]`` (optional): logits are divided by it before the log-softmax.

The logits at position ``p`` predict token ``p + 1``, so response token ``t`` is scored by the
logits at ``L − T + t − 1``; so are the critic's values. Outputs at response positions whose
predicting position is padding are 0.

Micro-batches: consecutive groups of ``ppo_micro_batch_size_per_device`` rows, or with
``use_dynamic_bsz`` groups of at most ``max_token_len_per_micro_batch`` real tokens
(:func:`~trellis.engine.packing.split_by_token_budget`); all data-parallel ranks run the same
number of micro-batches. With ``model.use_remove_padding`` each micro-batch runs packed
(:mod:`trellis.engine.packing`): its real tokens in one row, no compute on padding; the
result equals the padded pass (to 1e-5 in float32).

Loss functions: ``forward_backward(batch, loss_fn)`` calls, per micro-batch,
``loss_fn(outputs, micro_batch, global_batch_info) -> (loss, metrics)`` where ``outputs`` holds
that micro-batch's ``log_probs`` / ``entropy`` / ``values`` ``(mbs, T)`` with gradient,
``micro_batch`` is the DataProto of its rows (on the engine's device), and
``global_batch_info = {"dp_size", "batch_num_tokens", "global_batch_size"}`` counts the whole
global batch over all ranks (see :mod:`trellis.algorithms.aggregation`). Each micro-batch's loss
is back-propagated as is; gradients add up over micro-batches and are averaged over ranks, so a
loss built with ``agg_loss(..., **global_batch_info)`` gives the gradient of the whole batch.

Offload (the role's ``offload`` section): ``param`` keeps the parameters (and gradients) in
host memory, ``optimizer`` the optimizer state, while the engine is not computing. The engine
starts offloaded; :meth:`TrainingEngine.phase` brings in what a phase computes with and puts it
back afterwards, so callers run each stage of a step inside one::

    with engine.phase():                  # forward passes: the parameters come in
        values = engine.forward(batch)
    with engine.phase(optimizer=True):    # updates: the optimizer state comes in too
        engine.forward_backward(batch, loss_fn)
        engine.optimizer_step()           # leaving, the gradients are dropped

On a CPU compute device the host is the device: nothing moves. ``fsdp`` with ``param`` uses
FSDP's own CPU offload instead (see :mod:`trellis.engine.fsdp`).

Subclasses (``single``, ``fsdp``) supply the parallel parts: how the model is placed or
sharded, the collectives, the compute-dtype context and the sharded state.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from trellis.algorithms.logprobs import logprobs_and_entropy_from_logits, logprobs_from_logits
from trellis.config.base import ConfigValueError, schema_default
from trellis.config.schema import ActorConfig, CriticConfig, OffloadConfig, RefConfig
from trellis.data.protocol import DataProto
from trellis.device import get_device_backend
from trellis.device.core_share import CoreShare
from trellis.engine import lora, packing, sequence_parallel, shared_prompt
from trellis.engine import multimodal as multimodal_forward
from trellis.engine.fused import apply_fused_kernels
from trellis.engine.micro_batch import MetricAccumulator, global_batch_info, micro_batch_groups
from trellis.engine.models import compute_dtype, decoder_layers, densify_grads, load_model, model_setting
from trellis.engine.optim import build_lr_scheduler, build_optimizer
from trellis.errors import EngineError
from trellis.utils.memory import host_memory
from trellis.utils.settings import setting

ROLES = ("actor", "critic", "ref")
"""What an engine's model is for: a trained policy, a trained value model, a frozen reference."""

ROLE_CONFIGS: dict[str, type] = {"actor": ActorConfig, "critic": CriticConfig, "ref": RefConfig}
"""The config section of each role; its declared defaults fill what a role's config leaves out."""

BATCH_KEYS = ("input_ids", "attention_mask", "responses")
"""Tensors every batch needs (``position_ids`` is optional; ``response_mask`` for training)."""

LossFn = Callable[
    [dict[str, torch.Tensor], DataProto, dict[str, int]], tuple[torch.Tensor, Mapping[str, Any]]
]
"""``loss_fn(outputs, micro_batch, global_batch_info) -> (loss, metrics)``."""

STATE_KEYS = ("engine", "role", "dp_size", "global_step", "model", "optimizer", "lr_scheduler")

HOST = torch.device("cpu")
"""Where offloaded parameters and optimizer state wait between phases."""


class TrainingEngine:
    """One model of one role, its optimizer and lr schedule, and its forward/backward passes.

    Args:
        model_config: a ``ModelConfig``: ``path``, ``dtype`` (compute dtype; weights stay float32),
            ``attn_implementation``, ``gradient_checkpointing``, ``use_remove_padding``, ...
        role_config: the role's section, ``ActorConfig`` / ``CriticConfig`` / ``RefConfig``
            (batching, ``grad_clip``, ``optim``, ``offload``); None = that class's defaults. The
            critic's ``model_path``, when set, replaces ``model_config.path``.
        role: ``"actor"``, ``"critic"`` or ``"ref"``.
        total_steps: the number of ``optimizer_step`` calls planned; needed by the cosine
            schedule and a warm-up ratio.
        device: the compute device (``"cpu"``, ``"cuda"``, ``"cuda:1"``); None = the device
            backend's (:func:`trellis.device.get_device_name`), current index.
        process_group: the data-parallel group (``fsdp``); None = the default group.
        seed: seeds the initialisation of weights the checkpoint lacks (the critic's head).

    Raises:
        ValueError: an unknown role, a bad config value (named, with the fix); a
            :class:`~trellis.config.ConfigValueError` for an ``offload`` combination the engine
            cannot run (``ref.offload.optimizer``; see the subclass for its own).
    """

    recomputes_layers: ClassVar[bool] = False
    """Whether backward reruns each layer's forward (the ``offload`` engine): then the shared-prompt
    path is off, because a rerun would extend the KV cache a second time."""

    name: ClassVar[str] = "base"
    supports_sequence_parallel: ClassVar[bool] = False
    """Whether the engine can split sequences over ranks (``ulysses_sequence_parallel_size`` > 1)."""
    sparse_embedding_grad: bool = False
    """Whether the tied input embedding passes back only its looked-up rows
    (:func:`trellis.engine.models.sparse_tied_embedding_grad`; ``single`` only)."""

    def __init__(
        self,
        model_config: Any,
        role_config: Any = None,
        *,
        role: str = "actor",
        total_steps: int | None = None,
        device: str | torch.device | None = None,
        process_group: Any = None,
        seed: int = 0,
    ):
        if role not in ROLES:
            raise ValueError(f"Unknown engine role {role!r}; use one of {list(ROLES)}.")
        self.role = role
        self.model_config = model_config
        self.role_config = role_config if role_config is not None else _default_role_config(role)
        self.device = _resolve_device(device)
        self.dtype = compute_dtype(model_setting(model_config, "dtype"))
        self.use_remove_padding = bool(model_setting(model_config, "use_remove_padding"))
        self.micro_batch_size, self.max_tokens, self.grad_clip = _batching(role, self.role_config)
        self.sp_size = self._sp_size()
        """Ranks each sequence is split over (the role's ``ulysses_sequence_parallel_size``)."""
        self.sp_group: Any = None
        """The sequence-parallel group of this rank (set by ``_init_parallel`` when ``sp_size`` > 1)."""
        self.dp_rank, self.dp_size = self._init_parallel(process_group)
        self.offload_param, self.offload_optimizer = _offload(role, self.role_config)
        """The role's ``offload.param`` / ``offload.optimizer``: what waits in host memory between phases."""
        self._check_offload()
        self._offloaded_by_wrapper = False  # set by a _wrap_model whose library offloads by itself

        attn = model_setting(model_config, "attn_implementation")
        packable = packing.MASK_IMPLEMENTATIONS + packing.VARLEN_IMPLEMENTATIONS
        if self.use_remove_padding and attn not in packable:
            raise ValueError(
                f"model.use_remove_padding needs an attention implementation that keeps packed sequences "
                f"apart ({list(packable)}); got model.attn_implementation={attn!r}. Choose one of those or "
                "set use_remove_padding false."
            )

        path = role_setting(role, self.role_config, "model_path") if role == "critic" else None
        module = self._load_module(model_config, value_model=role == "critic", path=path, seed=seed)
        self.attn_implementation = module.config._attn_implementation
        self._logits_to_keep = "logits_to_keep" in inspect.signature(module.forward).parameters
        self.fused_kernels = apply_fused_kernels(module, model_setting(model_config, "fused_kernels"))
        """What ``model.fused_kernels`` swapped in: ``{kernel name: modules replaced}``."""
        if self.sp_size > 1:
            self._use_ulysses_attention(module)
        self.share_prompt = (
            bool(model_setting(model_config, "share_prompt"))
            and role != "critic"
            and self.sp_size == 1
            and self._logits_to_keep
            and not model_setting(model_config, "gradient_checkpointing")
            and not self.recomputes_layers
            and shared_prompt.plain_kv_cache(module)
        )
        """Whether rows of a micro-batch that share a prompt run it once (``model.share_prompt``, where
        the model allows it: :mod:`trellis.engine.shared_prompt`)."""
        self._cache_arg = shared_prompt.cache_argument(module)
        self.lora = lora.lora_settings(model_config, role)
        """The role's adapter settings (``model.lora``), or None: every weight trains (and always for ref)."""
        if self.lora is not None:
            module = lora.apply_lora(module, self.lora, role=role)
        if role == "ref":
            module.requires_grad_(False)
        elif model_setting(model_config, "gradient_checkpointing"):
            _enable_checkpointing(module)
        self.model = self._wrap_model(module)

        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if role != "ref":
            optim_config = role_setting(role, self.role_config, "optim")
            params = self._optimizer_params()
            self.optimizer = build_optimizer(params, optim_config, **self._optimizer_kwargs(params))
            self.lr_scheduler = build_lr_scheduler(self.optimizer, optim_config, total_steps)
        self.global_step = 0
        """``optimizer_step`` calls so far (skipped ones included)."""
        # where the parameters are (_wrap_model may leave them on the host), and the (empty) optimizer state
        self._model_device = self._optimizer_device = _resolve_device(next(self.model.parameters()).device)
        self._phase_depth, self._phase_updates = 0, False
        self.core_share: CoreShare | None = None
        """The machine's cores shared with other processes of the run (:meth:`share_cores`), or None."""
        self._share_hooks: list[Any] = []
        self._put_away(drop_grads=False)  # with offload on, the engine starts offloaded

    # ---------------------------------------------------------------- parallel parts (subclasses)

    def _check_offload(self) -> None:
        """Refuse an ``offload`` combination this engine cannot run (ConfigValueError naming the key)."""

    def _init_parallel(self, process_group: Any) -> tuple[int, int]:
        """Set up data parallelism; returns ``(dp_rank, dp_size)``."""
        return 0, 1

    def _load_module(self, model_config: Any, *, value_model: bool, path: str | None, seed: int) -> Any:
        """The float32 model on the host (:func:`~trellis.engine.models.load_model`); an engine that
        loads differently (FSDP: weights on rank 0 only) overrides it."""
        return load_model(model_config, value_model=value_model, path=path, seed=seed)

    def _wrap_model(self, module: torch.nn.Module) -> torch.nn.Module:
        """Place (and shard) the float32 CPU model on ``self.device`` (or keep it on the host, with
        ``offload_param``); returns the module to run."""
        raise NotImplementedError

    def _sp_size(self) -> int:
        """The role's ``ulysses_sequence_parallel_size`` (null: 1), checked against this engine."""
        size = role_setting(self.role, self.role_config, "ulysses_sequence_parallel_size")
        size = 1 if size is None else size
        key = f"{self.role}.ulysses_sequence_parallel_size"
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigValueError(key, size, "must be a whole number of ranks >= 1")
        if size > 1 and not self.supports_sequence_parallel:
            raise ConfigValueError(
                key,
                size,
                f"needs an engine that splits sequences over ranks; engine {self.name!r} runs each sequence "
                "on one device",
                hint=f" Set {self.role}.engine=fsdp.",
            )
        if size > 1 and not self.use_remove_padding:
            raise ConfigValueError(
                key, size, "needs model.use_remove_padding: true (sequences are split as packed tokens)"
            )
        return size

    def _use_ulysses_attention(self, module: Any) -> None:
        """Route the model's attention through the Ulysses wrapper of its own implementation."""
        inner = module.config._attn_implementation
        if inner not in sequence_parallel.ULYSSES_INNER:
            raise ConfigValueError(
                f"{self.role}.ulysses_sequence_parallel_size",
                self.sp_size,
                f"needs a varlen attention implementation ({list(sequence_parallel.ULYSSES_INNER)}); the "
                f"model runs {inner!r}",
                hint=" Set model.attn_implementation=sdpa (run per packed sequence) or flash_attention_2.",
            )
        heads = module.config.num_attention_heads
        try:
            sequence_parallel.check_sp_size(heads, self.sp_size)
        except ValueError as exc:
            raise ConfigValueError(
                f"{self.role}.ulysses_sequence_parallel_size", self.sp_size, str(exc)
            ) from None
        module.config._attn_implementation = sequence_parallel.register_ulysses_attention(inner)

    def _optimizer_params(self) -> list[torch.Tensor]:
        """What the optimizer steps (those that require grad): the model's parameters; the ``offload``
        engine's host FP32 masters."""
        return [param for param in self.model.parameters() if param.requires_grad]

    def _optimizer_kwargs(self, params: list[torch.Tensor]) -> dict[str, Any]:
        """Extra ``torch.optim.AdamW`` arguments for stepping ``params``: ``fused`` when every one is a
        plain tensor on the CPU (the ``single`` engine there, the ``offload`` engine's host masters),
        else torch's choice (``foreach`` on an accelerator; sharded DTensors as torch handles them).

        On the CPU torch otherwise runs AdamW one tensor and one elementwise op at a time, a pass over
        memory per op; the fused kernel makes one pass: a bare AdamW step over SmolLM2's parameters at
        one thread, 494 -> 155 ms.
        """
        plain = all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.device.type == "cpu" for p in params)
        return {"fused": True} if params and plain else {}

    def _grad_tensors(self) -> list[torch.Tensor]:
        """The optimizer's tensors that hold a gradient now (clipped, then stepped)."""
        return [param for param in self._optimizer_params() if param.grad is not None]

    def _after_optimizer_step(self) -> None:
        """Called after every ``optimizer_step`` (also a skipped one); the ``offload`` engine refreshes
        its working copies here."""

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """``tensor`` reduced over the data-parallel ranks (``op``: ``"sum"`` or ``"max"``)."""
        return tensor

    def _union_keys(self, keys: list[str]) -> list[str]:
        """The sorted union of every rank's ``keys``."""
        return sorted(keys)

    def _compute_context(self) -> contextlib.AbstractContextManager:
        """The context forward passes run in (e.g. autocast to the compute dtype)."""
        return contextlib.nullcontext()

    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a possibly sharded one (every rank must call it)."""
        return tensor

    # ---------------------------------------------------------------- forward passes

    def forward(
        self, batch: DataProto | Mapping[str, torch.Tensor], *, compute_entropy: bool = False
    ) -> dict:
        """Per-response-token outputs of the model, without gradients, in the batch's row order.

        Args:
            batch: rows of prompt + response (see the module docstring).
            compute_entropy: also return the entropy of each token's distribution (not for critics).

        Returns:
            ``{"log_probs": (bs, T)}`` (plus ``"entropy": (bs, T)``) for actor and ref,
            ``{"values": (bs, T)}`` for the critic; float32, on the batch's device.

        Raises:
            ValueError: missing keys or inconsistent shapes (named); entropy asked of a critic.
            EngineError: the model is offloaded (run it inside ``with engine.phase():``).
        """
        data = self._check_batch(batch, "forward", compute_entropy=compute_entropy)
        self._require_on_device("forward")
        groups = self._groups(data)
        self.model.eval()
        outputs: list[dict[str, torch.Tensor]] = []
        with torch.no_grad():
            for group in groups:
                if group:
                    outputs.append(self._run_micro_batch(data[group].to(self.device), compute_entropy))
                else:  # keep step with the ranks that have one more micro-batch
                    self._run_micro_batch(data[[0]].to(self.device), compute_entropy)
        order = packing.restore_order([group for group in groups if group]).to(self.device)
        home = data.tensors["input_ids"].device
        return {key: torch.cat([out[key] for out in outputs])[order].to(home) for key in outputs[0]}

    def forward_backward(
        self, batch: DataProto | Mapping[str, torch.Tensor], loss_fn: LossFn, *, compute_entropy: bool = False
    ) -> dict[str, float]:
        """Accumulate the gradient of ``loss_fn`` over the batch's micro-batches (no optimizer step).

        Args:
            batch: this rank's share of the global batch; needs ``response_mask``.
            loss_fn: ``loss_fn(outputs, micro_batch, global_batch_info) -> (loss, metrics)``
                (see the module docstring); ``loss`` a 0-d tensor carrying the gradient,
                ``metrics`` a dict of numbers or 0-d tensors (or None).
            compute_entropy: put ``entropy`` into ``outputs`` too (actor).

        Returns:
            ``{"loss": Σ micro-batch losses averaged over ranks}`` (the whole batch's loss when
            the loss is aggregated with ``global_batch_info``), plus each of ``loss_fn``'s
            metrics averaged over micro-batches and ranks, weighted by response tokens.

        Raises:
            EngineError: a ``ref`` engine (no optimizer); the model is offloaded (use ``phase()``).
            ValueError: a bad batch; a ``loss_fn`` result that is not ``(0-d tensor with grad, dict)``.
        """
        self._require_trainable("forward_backward")
        data = self._check_batch(batch, "forward_backward", compute_entropy=compute_entropy, training=True)
        self._require_on_device("forward_backward")
        info = global_batch_info(
            data.tensors["response_mask"].to(self.device), dp_size=self.dp_size, all_reduce=self._all_reduce
        )
        groups = self._groups(data)
        self.model.train()
        total_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        metrics = MetricAccumulator(self.device)
        for group in groups:
            if not group:  # a zero-weight pass, so this rank joins the others' collectives
                outputs = self._run_micro_batch(data[[0]].to(self.device), compute_entropy)
                torch.stack([out.sum() for out in outputs.values()]).sum().mul(0.0).backward()
                continue
            micro = data[group].to(self.device)
            outputs = self._run_micro_batch(micro, compute_entropy)
            loss, step_metrics = _check_loss(loss_fn(outputs, micro, info))
            loss.backward()
            total_loss += loss.detach().to(torch.float64)
            metrics.add(step_metrics, micro.tensors["response_mask"].sum())
        if self.sparse_embedding_grad:
            densify_grads(self.model)
        result = metrics.reduce(self._union_keys(list(metrics.sums)), self._all_reduce)
        result["loss"] = float(self._all_reduce(total_loss, "sum")) / self.dp_size
        return result

    def _groups(self, data: DataProto) -> list[list[int]]:
        lengths = data.tensors["attention_mask"].sum(dim=-1)
        return micro_batch_groups(
            lengths,
            micro_batch_size=self.micro_batch_size,
            max_tokens=self.max_tokens,
            all_reduce=self._all_reduce,
            device=self.device,
        )

    def _run_micro_batch(self, micro: DataProto, compute_entropy: bool) -> dict[str, torch.Tensor]:
        """The model on one micro-batch (on ``self.device``); outputs ``(mbs, T)`` per key."""
        tensors = micro.tensors
        input_ids, attention_mask = tensors["input_ids"], tensors["attention_mask"]
        responses = tensors["responses"]
        position_ids = tensors.get("position_ids", None)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        bs, length = input_ids.shape
        width = responses.shape[1]
        first = length - width - 1  # the position whose logits predict response token 0
        value_head = self.role == "critic"
        keep_kwargs: dict[str, Any] = {}
        # a vision-language batch: the rows' pixel values, and M-RoPE positions (3, bs, L) for every token
        vision = multimodal_forward.vision_inputs(self.model, micro, attention_mask)
        if self.share_prompt and vision is None and not value_head:
            shared = self._shared_prompt_outputs(micro, position_ids, compute_entropy)
            if shared is not None:
                return shared

        if self.use_remove_padding:
            packed = packing.pack(input_ids, attention_mask, position_ids)
            # packed index of each predicting position (bs, T), -1 where that position is padding
            slot = packing.unpack(torch.arange(packed.total, device=input_ids.device), packed, fill=-1)
            slot = slot[:, first : length - 1]
            valid = slot >= 0
            keep = slot[valid]
            if self.sp_group is not None:  # sp_size > 1 needs packing (checked when the engine is built)
                if vision is not None:
                    raise EngineError(
                        "Sequence parallelism (ulysses_sequence_parallel_size > 1) does not take images or "
                        "videos yet; train vision-language models with ulysses_sequence_parallel_size: 1."
                    )
                stats = self._sequence_parallel_outputs(
                    micro, packed, keep, responses[valid], compute_entropy
                )
            else:
                if self._logits_to_keep and not value_head:
                    keep_kwargs["logits_to_keep"] = keep
                inputs = packed.model_inputs(self.attn_implementation, self.dtype)
                places: Any = contextlib.nullcontext()
                with self._compute_context():
                    if vision is not None:  # vision features at the packed items' tokens, M-RoPE positions
                        places = vision.placeholders(
                            vision.token_types.reshape(-1)[packed.indices].unsqueeze(0)
                        )
                        inputs.update(vision.model_inputs())
                        inputs["position_ids"] = multimodal_forward.packed_positions(vision.positions, packed)
                    with places:
                        out = self.model(**inputs, use_cache=False, **keep_kwargs)
                logits = out.logits[0] if keep_kwargs else out.logits[0, keep]  # (n_valid, V or 1)
                stats = self._outputs(logits, responses[valid], compute_entropy, micro)
            # (n_valid,) back to (bs, T), 0 at padding
            return {
                key: value.new_zeros(bs, width).masked_scatter(valid, value) for key, value in stats.items()
            }

        if self._logits_to_keep and not value_head:
            keep_kwargs["logits_to_keep"] = width + 1  # the last T + 1 positions: first .. L - 1
        places = contextlib.nullcontext()
        encoded: dict[str, Any] = {}
        with self._compute_context():
            if vision is not None:  # M-RoPE positions, and the vision features at the items' tokens
                position_ids = vision.positions
                encoded.update(vision.model_inputs())
                places = vision.placeholders(vision.token_types)
            with places:
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=False,
                    **encoded,
                    **keep_kwargs,
                )
        logits = out.logits[:, :width] if keep_kwargs else out.logits[:, first : length - 1]
        return self._padded_outputs(logits, micro, compute_entropy)

    def _padded_outputs(
        self, logits: torch.Tensor, micro: DataProto, compute_entropy: bool
    ) -> dict[str, torch.Tensor]:
        """:meth:`_outputs` of ``(bs, T, V)`` logits at the positions that predict each response token,
        0 where that position is padding."""
        tensors = micro.tensors
        length, width = tensors["input_ids"].shape[1], tensors["responses"].shape[1]
        stats = self._outputs(logits, tensors["responses"], compute_entropy, micro)
        valid = tensors["attention_mask"][:, length - width - 1 : length - 1].bool()
        return {key: torch.where(valid, value, 0.0) for key, value in stats.items()}

    def _shared_prompt_outputs(
        self, micro: DataProto, position_ids: torch.Tensor, compute_entropy: bool
    ) -> dict[str, torch.Tensor] | None:
        """The micro-batch's outputs with one prompt pass per distinct prompt and the responses run on
        its KV cache (:mod:`trellis.engine.shared_prompt`); None when no two rows share a prompt."""
        tensors = micro.tensors
        input_ids, attention_mask, responses = (
            tensors["input_ids"],
            tensors["attention_mask"],
            tensors["responses"],
        )
        length, width = input_ids.shape[1], responses.shape[1]
        prompt = length - width
        groups = shared_prompt.prompt_groups(input_ids[:, :prompt], attention_mask[:, :prompt])
        if groups is None:
            return None
        first, inverse = groups
        with self._compute_context():
            head = self.model(
                input_ids=input_ids[first, :prompt],
                attention_mask=attention_mask[first, :prompt],
                position_ids=position_ids[first, :prompt],
                use_cache=True,
                logits_to_keep=1,
            )
            logits = head.logits.index_select(0, inverse)  # (bs, 1, V): predicts response token 0
            if width > 1:  # the last response token predicts nothing
                cache = shared_prompt.expand_cache(shared_prompt.cache_of(head), inverse)
                tail = self.model(
                    input_ids=input_ids[:, prompt : length - 1],
                    attention_mask=attention_mask[:, : length - 1],
                    position_ids=position_ids[:, prompt : length - 1],
                    use_cache=True,
                    logits_to_keep=0,
                    **{self._cache_arg: cache},
                )
                logits = torch.cat([logits, tail.logits], dim=1)
        return self._padded_outputs(logits, micro, compute_entropy)

    def _sequence_parallel_outputs(
        self,
        micro: DataProto,
        packed: packing.PackedBatch,
        keep: torch.Tensor,
        labels: torch.Tensor,
        compute_entropy: bool,
    ) -> dict[str, torch.Tensor]:
        """The outputs at the packed positions ``keep`` (whose targets are ``labels``), the packed
        tokens split over the sequence-parallel group: every rank of the group holds the same rows,
        feeds its contiguous slice and gathers the per-token outputs back
        (:mod:`trellis.engine.sequence_parallel`); attention sees the whole sequence on a share of the
        heads. Each rank computes the same loss from the gathered outputs; the gather's backward hands
        each rank its slice's gradient times ``sp_size``, so FSDP's average over all ``dp × sp`` ranks
        is the data-parallel average of each sequence's whole gradient."""
        # the label of each kept position travels with it; the other positions' labels are never read
        targets = torch.zeros_like(packed.input_ids)
        targets[0, keep] = labels
        whole = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "labels": targets}
        local, sp = sequence_parallel.slice_packed(whole, packed.cu_seqlens, self.sp_group)
        with self._compute_context():
            out = self.model(
                input_ids=local["input_ids"],
                position_ids=local["position_ids"],
                use_cache=False,
                **sequence_parallel.attention_kwargs(sp, self.sp_group),
            )
        stats = self._outputs(out.logits[0], local["labels"][0], compute_entropy, micro)  # local tokens
        return {
            key: sequence_parallel.gather_outputs(value, sp, self.sp_group, grad_scale=self.sp_size)[keep]
            for key, value in stats.items()
        }

    def _outputs(
        self, logits: torch.Tensor, labels: torch.Tensor, compute_entropy: bool, micro: DataProto
    ) -> dict[str, torch.Tensor]:
        """The critic's values, or the log-probs (and entropy) of ``labels``, from ``logits``."""
        if self.role == "critic":
            return {"values": logits[..., 0].float()}
        return self._token_stats(logits, labels, compute_entropy, micro.meta_info.get("temperature"))

    def _token_stats(
        self, logits: torch.Tensor, labels: torch.Tensor, compute_entropy: bool, temperature: Any
    ) -> dict[str, torch.Tensor]:
        if temperature is not None and float(temperature) != 1.0:
            logits = logits / float(temperature)
        # The logits are read by nothing else, so backward may overwrite them with their gradient.
        inplace = torch.is_grad_enabled() and logits.requires_grad
        if compute_entropy:
            log_probs, entropy = logprobs_and_entropy_from_logits(logits, labels, inplace_backward=inplace)
            return {"log_probs": log_probs, "entropy": entropy}
        return {"log_probs": logprobs_from_logits(logits, labels, inplace_backward=inplace)}

    # ---------------------------------------------------------------- optimizer

    def optimizer_step(self) -> dict[str, Any]:
        """Clip the gradient to ``grad_clip``, step the optimizer, then the lr schedule.

        A gradient norm that is not finite (inf/NaN: an overflow somewhere) skips the update:
        the gradients are zeroed and the parameters and optimizer state stay as they were. The
        lr schedule and ``global_step`` advance either way, so the schedule follows the calls.

        Returns:
            ``{"grad_norm": float (before clipping), "lr": float (used by this step),
            "stepped": bool (False when skipped)}``.

        Raises:
            EngineError: a ``ref`` engine; the model or optimizer state is offloaded (run it inside
                ``phase(optimizer=True)``).
        """
        optimizer, lr_scheduler = self._require_trainable("optimizer_step")
        self._require_on_device("optimizer_step", optimizer=True)
        params = self._grad_tensors()
        lr = float(optimizer.param_groups[0]["lr"])
        grad_norm = self._full(
            torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
        )
        stepped = bool(torch.isfinite(grad_norm))
        if stepped:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, grad_norm)
            optimizer.step()
        else:
            self.zero_grad()
        with warnings.catch_warnings():  # a skipped first step makes torch warn of the call order
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            lr_scheduler.step()
        self.global_step += 1
        self._after_optimizer_step()
        return {"grad_norm": float(grad_norm), "lr": lr, "stepped": stepped}

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (``set_to_none``)."""
        self.model.zero_grad(set_to_none=True)

    # ---------------------------------------------------------------- shared CPU cores

    def share_cores(self, share: CoreShare | None) -> None:
        """Compute on the cores ``share`` lends (:mod:`trellis.device.core_share`); None stops.

        Phases then mark this process busy, and the torch threads follow the ledger: set on entering a
        phase, before each decoder layer's forward and before its backward (a hook on the gradient of
        its output), and back to this process's own share when the phase ends.
        """
        for handle in self._share_hooks:
            handle.remove()
        self._share_hooks = []
        self.core_share = share
        if share is None:
            return

        def before_backward(grad: torch.Tensor) -> None:
            share.apply()

        def before_forward(module: torch.nn.Module, args: Any) -> None:
            share.apply()

        def after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(before_backward)

        for layer in decoder_layers(getattr(self.model, "module", self.model)):
            self._share_hooks.append(layer.register_forward_pre_hook(before_forward))
            self._share_hooks.append(layer.register_forward_hook(after_forward))

    @contextlib.contextmanager
    def _sharing_cores(self) -> Iterator[None]:
        share = self.core_share
        if share is None:
            yield
            return
        with share.busy():
            share.apply()
            try:
                yield
            finally:
                torch.set_num_threads(share.own)  # between phases: only this process's own cores

    # ---------------------------------------------------------------- placement

    @contextlib.contextmanager
    def phase(self, *, optimizer: bool = False) -> Iterator[None]:
        """Run a stage of the step with what it computes with on the compute device.

        Entering brings the offloaded parameters (``offload.param``) onto ``self.device``, and
        with ``optimizer=True`` (a phase that calls ``optimizer_step``) the offloaded optimizer
        state (``offload.optimizer``) too. Leaving puts them back in host memory; after a phase
        with ``optimizer=True`` the gradients are dropped when any offload is on or the compute
        device is the CPU (every update starts with ``zero_grad``, so they are never read again;
        on the CPU their memory then serves generation and validation). With both knobs off, or
        on a CPU compute device, nothing moves. Phases nest: only the outermost one moves things
        back. On a CPU compute device under ``trainer.host_memory=release``
        (:func:`trellis.utils.memory.host_memory`), entering and leaving give the memory freed
        before (by generation, in another thread's heap) and during the phase (its activations)
        back to the OS: the ``cpu`` backend's ``empty_cache``. Under ``reuse`` (the default) it stays
        in malloc's one arena for the next stage, and the next phase faults no page in again
        (docs/performance.md, "Memory").
        With a :meth:`share_cores` ledger, the outermost phase marks this process busy and runs on the
        cores the other processes leave idle.

        Raises:
            EngineError: ``optimizer=True`` on a ``ref`` engine (no optimizer).
        """
        if optimizer:
            self._require_trainable("phase(optimizer=True)")
        if self._phase_depth == 0:
            self._trim_host()  # what earlier stages freed (generation: in its own thread's malloc arena)
        sharing = self._sharing_cores() if self._phase_depth == 0 else contextlib.nullcontext()
        self._phase_depth += 1
        self._phase_updates |= optimizer
        try:
            with sharing:
                if self._moves_params:
                    self.to(self.device, model=True, optimizer=False)
                if optimizer and self._moves_optimizer:
                    self.to(self.device, model=False, optimizer=True)
                yield
        finally:
            self._phase_depth -= 1
            if self._phase_depth == 0:
                updated, self._phase_updates = self._phase_updates, False
                self._put_away(drop_grads=updated)

    def _put_away(self, *, drop_grads: bool) -> None:
        """Move what the offload knobs keep on the host there; free the device's cached memory (on a
        CPU compute device, always: malloc's free heap memory; see :meth:`phase`)."""
        if drop_grads and (self.offload_param or self.offload_optimizer or self.device.type == "cpu"):
            self.zero_grad()
        moved = False
        if self._moves_optimizer:
            moved |= not same_device(self._optimizer_device, HOST)
            self.to(HOST, model=False, optimizer=True)
        if self._moves_params:
            moved |= not same_device(self._model_device, HOST)
            self.to(HOST, model=True, optimizer=False)
        if moved and self.device.type != "cpu":  # the freed blocks go back for others (the rollout)
            torch.get_device_module(self.device.type).empty_cache()
        self._trim_host()

    def _trim_host(self) -> None:
        """On a CPU compute device under the ``release`` policy, give malloc's free heap memory back to
        the OS (see :meth:`phase`)."""
        if self.device.type == "cpu" and host_memory() == "release":
            get_device_backend("cpu").empty_cache()

    @property
    def _moves_params(self) -> bool:
        return self.offload_param and not self._offloaded_by_wrapper

    @property
    def _moves_optimizer(self) -> bool:
        return self.offload_optimizer and self.optimizer is not None and not self._offloaded_by_wrapper

    def device_bytes(self) -> dict[str, int]:
        """Bytes of this engine's tensors that sit on its compute device now (this rank's shards).

        Returns ``{"params": int, "grads": int, "optimizer": int}``: the parameters, their
        gradients and the optimizer state (AdamW's moments and step counts) on ``self.device``;
        buffers are not counted. Outside a phase, what the offload knobs keep on the host counts
        0 on an accelerator; on a CPU compute device the host is the device, so everything counts.
        """
        params = list(self.model.parameters())
        state = [] if self.optimizer is None else list(self.optimizer.state.values())
        return {
            "params": sum(self._bytes_here(param) for param in params),
            "grads": sum(self._bytes_here(param.grad) for param in params if param.grad is not None),
            "optimizer": sum(self._bytes_here(value) for entry in state for value in entry.values()),
        }

    def _bytes_here(self, tensor: Any) -> int:
        if not isinstance(tensor, torch.Tensor):
            return 0
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
        return local.numel() * local.element_size() if same_device(local.device, self.device) else 0

    def to(
        self, device: str | torch.device, *, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """Move the parameters (``model``) and the optimizer state (``optimizer``) to ``device``.

        ``to("cpu")`` offloads to host memory; ``to(<accelerator>)`` brings them back and makes
        that the compute device. The optimizer state may go to the CPU alone (optimizer
        offload), but it only comes onto an accelerator where the parameters are. ``grad``:
        gradients travel with the parameters (True) or are dropped (False, freeing memory).
        Moving to where things already are does nothing. :meth:`phase` does this for the
        ``offload`` knobs.

        Raises:
            EngineError: the optimizer state asked onto a device the parameters are not on
                without ``model=True``.
        """
        device = _resolve_device(device)
        moves_optimizer_alone = optimizer and self.optimizer is not None and not model
        if moves_optimizer_alone and device.type != "cpu" and not same_device(device, self._model_device):
            raise EngineError(
                f"{type(self).__name__}.to({str(device)!r}, model=False, optimizer=True): the optimizer "
                f"state must sit on the device of the parameters it updates, which are on "
                f"{self._model_device}. Move both: to({str(device)!r}, model=True, optimizer=True)."
            )
        if model:
            if not grad:
                self.model.zero_grad(set_to_none=True)
            self.model.to(device)
            self._model_device = device
            if device.type != "cpu" or self.device.type == "cpu":
                self.device = device
        if optimizer and self.optimizer is not None:
            self._move_optimizer_state(device)
            self._optimizer_device = device

    def _move_optimizer_state(self, device: torch.device) -> None:
        assert self.optimizer is not None  # callers check that the engine trains
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # AdamW keeps "step" on the CPU unless capturable; leave it where it is
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically: model, optimizer, lr schedule, step count.

        Tensors share memory with the engine (save it, or copy it, before training on). An
        ``fsdp`` engine returns this rank's shards; load them into an engine of the same size.
        """
        return {
            "engine": self.name,
            "role": self.role,
            "dp_size": self.dp_size,
            "global_step": self.global_step,
            "model": self._model_state() if self.lora is None else lora.adapter_state(self._model_state()),
            "optimizer": None if self.optimizer is None else self._optimizer_state(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "lora": self.lora,  # the adapters' settings and base model, for export (None: full weights)
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (of an engine of the same kind, role and data-parallel size).

        Raises:
            ValueError: missing entries, another engine kind, role or size, mismatched tensors.
        """
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"load_state_dict: the state lacks {missing}; pass what TrainingEngine.state_dict() returned."
            )
        for key, mine in (("engine", self.name), ("role", self.role), ("dp_size", self.dp_size)):
            if state[key] != mine:
                raise ValueError(
                    f"load_state_dict: the state was saved by an engine with {key}={state[key]!r}, this one "
                    f"has {key}={mine!r}; load it into an engine built the same way."
                )
        if self.lora is None:
            self._load_model_state(state["model"])
        else:  # the adapters (and the value head): the frozen base weights are the model's own
            self._load_model_state(lora.with_base_weights(state["model"], self._model_state()))
        if self.optimizer is not None:
            if state["optimizer"] is None:
                raise ValueError(
                    "load_state_dict: the state holds no optimizer state, but this engine trains."
                )
            self._load_optimizer_state(state["optimizer"])
            # loading puts the state beside the parameters; an offloaded one goes back to the host
            self._move_optimizer_state(self._optimizer_device)
            self._require_trainable("load_state_dict")[1].load_state_dict(state["lr_scheduler"])
        self.global_step = int(state["global_step"])

    def _model_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def _optimizer_state(self) -> dict[str, Any]:
        return self._require_trainable("state_dict")[0].state_dict()

    def _load_model_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state, strict=True)

    def _load_optimizer_state(self, state: Mapping[str, Any]) -> None:
        self._require_trainable("load_state_dict")[0].load_state_dict(dict(state))

    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole tensor)`` for every entry of the model's state dict, Hugging Face names.

        For weight sync to rollout replicas. Under ``fsdp`` each tensor is all-gathered: every
        rank must run the iteration to the end, in step. ``dtype``: cast each tensor (e.g. to the
        rollout's bfloat16); None keeps float32. No phase is needed: offloaded parameters are read
        where they wait (host tensors; under FSDP's CPU offload each is gathered on the device).
        """
        named = self._iter_full_state()
        if self.lora is not None:  # adapters merged into their base weights, under the model's own names
            named = lora.merged_weights(named, self.lora)
        for name, full in named:
            if dtype is not None:
                with torch.no_grad():
                    full = full.to(dtype)
            yield name, full

    def _iter_full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole tensor)`` of every :meth:`_model_state` entry (gathered under FSDP)."""
        for name, tensor in self._model_state().items():
            with torch.no_grad():  # not around the yield: the caller's grad mode stays its own
                full = self._full(tensor).detach()
            yield name, full

    # ---------------------------------------------------------------- checks

    def _check_batch(
        self, batch: Any, where: str, *, compute_entropy: bool = False, training: bool = False
    ) -> DataProto:
        if isinstance(batch, Mapping):
            batch = DataProto.from_dict(dict(batch))
        if not isinstance(batch, DataProto) or batch.batch is None:
            raise ValueError(
                f"{where}: batch must be a DataProto (or a dict of tensors) holding {list(BATCH_KEYS)}, "
                f"got {type(batch).__name__}."
            )
        needed = BATCH_KEYS + (("response_mask",) if training else ())
        present = list(batch.batch.keys())
        missing = [key for key in needed if key not in present]
        if missing:
            raise ValueError(f"{where}: the batch lacks {missing}; it has {present}.")
        if compute_entropy and self.role == "critic":
            raise ValueError(f"{where}: compute_entropy=True needs logits, but the critic has a value head.")
        input_ids, responses = batch.batch["input_ids"], batch.batch["responses"]
        if input_ids.dim() != 2 or responses.dim() != 2:
            raise ValueError(
                f"{where}: input_ids {tuple(input_ids.shape)} and responses {tuple(responses.shape)} must be "
                "(batch, seq) tensors."
            )
        if responses.shape[1] >= input_ids.shape[1]:
            raise ValueError(
                f"{where}: responses are {responses.shape[1]} tokens but input_ids only "
                f"{input_ids.shape[1]}; input_ids must be prompt (at least one token) + response."
            )
        for key in ("attention_mask", "position_ids"):
            if key in present and batch.batch[key].shape != input_ids.shape:
                raise ValueError(
                    f"{where}: {key} has shape {tuple(batch.batch[key].shape)} but input_ids "
                    f"{tuple(input_ids.shape)}; they must match."
                )
        if training and batch.batch["response_mask"].shape != responses.shape:
            raise ValueError(
                f"{where}: response_mask has shape {tuple(batch.batch['response_mask'].shape)} but responses "
                f"{tuple(responses.shape)}; they must match."
            )
        if len(batch) == 0:
            raise ValueError(f"{where}: the batch is empty; give every rank at least one row.")
        return batch

    def _require_trainable(
        self, where: str
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The optimizer and lr schedule of an engine that trains."""
        if self.optimizer is None or self.lr_scheduler is None:
            raise EngineError(
                f"{where}: this {self.role!r} engine runs forward passes only (it has no optimizer). Build "
                "it with role='actor' or role='critic' to train."
            )
        return self.optimizer, self.lr_scheduler

    def _require_on_device(self, where: str, *, optimizer: bool = False) -> None:
        if self._offloaded_by_wrapper:  # the wrapper streams them from the host itself
            return
        if not same_device(self._model_device, self.device):
            raise EngineError(
                f"{where}: the parameters are offloaded to {self._model_device}; call "
                f"engine.to({str(self.device)!r}) first, or run it inside `with engine.phase():`."
            )
        if optimizer and not same_device(self._optimizer_device, self.device):
            raise EngineError(
                f"{where}: the optimizer state is offloaded to {self._optimizer_device}; call "
                f"engine.to({str(self.device)!r}, optimizer=True) first, or run it inside "
                "`with engine.phase(optimizer=True):`."
            )


# ---------------------------------------------------------------- helpers


def _default_role_config(role: str) -> Any:
    return ROLE_CONFIGS[role]()


def _offload(role: str, config: Any) -> tuple[bool, bool]:
    """``(offload.param, offload.optimizer)`` of a role's config, checked.

    Raises:
        ConfigValueError: ``ref.offload.optimizer`` true (the reference has no optimizer).
    """
    section = role_setting(role, config, "offload")
    param, optimizer = (
        bool(setting(section, key, schema_default(OffloadConfig, key))) for key in ("param", "optimizer")
    )
    if role == "ref" and optimizer:
        raise ConfigValueError(
            "ref.offload.optimizer",
            optimizer,
            "must be false: the reference model is frozen and has no optimizer state to offload",
            hint=" Set ref.offload.param=true to keep its weights in host memory between forward passes.",
        )
    return param, optimizer


def role_setting(role: str, config: Any, key: str) -> Any:
    """``key`` of a role's config (a section, a dict or None); missing or null: the schema's default for
    that role, or the actor's where the role's section lacks the key (the ref has no batching keys)."""
    try:
        default = schema_default(ROLE_CONFIGS[role], key)
    except KeyError:
        default = schema_default(ActorConfig, key)
    return setting(config, key, default)


def _batching(role: str, config: Any) -> tuple[int, int | None, float]:
    """(rows per micro-batch, token budget per micro-batch or None, grad clip) of a role's config."""
    key = "log_prob_micro_batch_size_per_device" if role == "ref" else "ppo_micro_batch_size_per_device"
    micro_batch_size = role_setting(role, config, key)
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"{role}.{key}={micro_batch_size!r} must be a positive number of rows.")
    max_tokens = None
    if role_setting(role, config, "use_dynamic_bsz"):
        max_tokens = role_setting(role, config, "max_token_len_per_micro_batch")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(
                f"{role}.max_token_len_per_micro_batch={max_tokens!r} must be a positive number of tokens "
                "with use_dynamic_bsz."
            )
    grad_clip = float(role_setting(role, config, "grad_clip"))
    if not grad_clip > 0:
        raise ValueError(f"{role}.grad_clip={grad_clip!r} must be > 0.")
    return micro_batch_size, max_tokens, grad_clip


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch device; None = the device backend's type at its current index (plain ``cpu`` on CPU)."""
    if device is None:
        from trellis.device import get_device_id, get_device_name

        name = get_device_name()
        return torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())
    device = torch.device(device)
    if device.type not in ("cpu", "meta") and device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


def _enable_checkpointing(module: torch.nn.Module) -> None:
    """Recompute each transformer block's activations in backward (non-reentrant checkpoints)."""
    kwargs = {"use_reentrant": False}
    enable: Any = getattr(module, "activation_checkpointing_enable", None)  # transformers >= 5.2x
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        enable = getattr(module, "gradient_checkpointing_enable")  # noqa: B009 - a PreTrainedModel's
        enable(gradient_checkpointing_kwargs=kwargs)


def check_state_keys(live: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Raise ValueError naming what a model state lacks and what it has too many of, against ``live``."""
    missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
    if missing or unexpected:
        raise ValueError(
            f"load_state_dict: the model state does not match this model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}. Load a state saved by an engine of the same model."
        )


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two torch devices are the same device (an unset index is index 0)."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _check_loss(result: Any) -> tuple[torch.Tensor, Mapping[str, Any]]:
    """``(loss, metrics)`` from a loss_fn result, checked."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(
            f"loss_fn must return (loss, metrics), got {type(result).__name__}; return metrics={{}} "
            "if it has none."
        )
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
        what = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            what = "a 0-d tensor without gradient"
        raise ValueError(
            f"loss_fn must return a 0-d loss tensor computed from outputs (so it carries their gradient), "
            f"got {what}."
        )
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        raise ValueError(f"loss_fn's metrics must be a dict (or None), got {type(metrics).__name__}.")
    return loss, metrics
