"""The workers the trainer drives: the policy (actor + rollout + reference) and the critic.

Both run unchanged in a :class:`~trellis.distributed.LocalWorkerGroup` (one process) or a
:class:`~trellis.distributed.RayWorkerGroup` (one actor per device; ``torch.distributed`` joined in
``init_model``); the trainer puts both roles in the same processes by default (``critic.placement``).
Batches arrive split over the data-parallel ranks of the role's mesh (``"actor"`` or ``"critic"``,
each worker registering its dp rank at construction; ``make_nd_compute_*_dispatch_fn``); rollouts
are gathered re-padded to the widest shard (``ROLLOUT_DISPATCH``). Each method is one stage of the
trainer's step: generating, sleeping the replica, scoring, log-probs, values, updates and the weight
sync are separate calls, so none hides inside another.

Generation (``rollout.mode`` hybrid / colocated): every rank owns one rollout replica (through a
:class:`~trellis.rollout.manager.ReplicaManager`) and runs the agent loops for its share of the
prompts. With the ``single`` engine and the ``hf`` replica in hybrid mode, the replica serves the
training module itself, so no weights move between training and generation; otherwise the replica
keeps its own copy and :meth:`ActorRolloutRefWorker.sync_rollout_weights` streams the actor's
weights into it through the configured checkpoint engine after each update. With ``standalone``
replicas (processes of their own, owned by the trainer's manager) the ranks hold no replica: they are
the sending half of the weight sync (``plan_rollout_sync``, ``connect_rollout_sync``,
``send_rollout_weights``).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trellis.algorithms import objective
from trellis.algorithms.aggregation import GlobalBatchInfo
from trellis.config.base import ConfigValueError
from trellis.data.protocol import DataProto
from trellis.distributed import (
    Dispatch,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    make_nd_compute_metric_dispatch_fn,
    register,
)
from trellis.distributed.dispatch import get_dispatch_mode
from trellis.distributed.worker import mesh_names
from trellis.rollout.remote import set_process_cpu

if TYPE_CHECKING:
    from trellis.checkpoint.sync import WeightSyncManager
    from trellis.rollout.manager import ReplicaManager


def _join_process_group(rank: int, world_size: int) -> None:
    """Join ``torch.distributed`` (once) when the group has several workers."""
    import torch.distributed as dist

    if world_size > 1 and not dist.is_initialized():
        from trellis.device import get_communication_backend

        dist.init_process_group(get_communication_backend(), rank=rank, world_size=world_size)


def _device(config: Any) -> str:
    from trellis.device import get_device_backend

    backend = get_device_backend(config.trainer.device)
    if backend.device_type == "cpu":
        return "cpu"
    return f"{backend.device_type}:{backend.current_device()}"


def seed_process(seed: int) -> None:
    """Seed this process's global generators (Python, numpy, torch): the driver's, or a worker's own."""
    import random

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def mini_batches(data: DataProto, size: int, *, shuffle: bool, seed: int) -> list[DataProto]:
    """``data`` cut into mini-batches of ``size`` rows (the last may be shorter), optionally shuffled."""
    order = np.arange(len(data))
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(data))
    return [data[order[i : i + size].tolist()] for i in range(0, len(data), size)]


def _collect_rollouts(group: Any, outputs: list[DataProto]) -> DataProto:
    from trellis.rollout.agent_loop import concat_rollouts

    return concat_rollouts(outputs)


ROLLOUT_DISPATCH = {
    "dispatch_fn": get_dispatch_mode(Dispatch.DP_COMPUTE_PROTO)[0],
    "collect_fn": _collect_rollouts,
}
"""Prompts split over the workers like ``DP_COMPUTE_PROTO``; their rollouts, each padded to its own
longest prompt and response, re-padded to the widest before they are joined."""


def _sp_size(config: Any, mesh: str) -> int:
    """The ``ulysses_sequence_parallel_size`` of the role that mesh ``mesh`` dispatches to."""
    section = getattr(config, "critic" if mesh == "critic" else "actor", None)  # a partial config: 1
    return int(getattr(section, "ulysses_sequence_parallel_size", None) or 1)


class _Role(Worker):
    def __init__(self, config: Any, reward_fn: Any = None) -> None:
        self.config = config
        self.reward_fn = reward_fn
        set_process_cpu(config)
        if "RANK" in os.environ:  # a process of its own (a Ray actor): seed its global generators, which
            seed_process(config.trainer.seed + self.rank)  # the driver's seeding never reached
        # each worker's data-parallel rank on each mesh the methods are dispatched over ("actor" for the
        # policy and reference, "critic"): the ranks of a sequence-parallel group (consecutive workers,
        # as the fsdp engine groups them) share one dp rank and its rows; the first of them is collected
        for mesh in mesh_names(type(self)):
            sp = _sp_size(config, mesh)
            self._register_dispatch_collect_info(
                mesh, dp_rank=self.rank // sp, is_collect=self.rank % sp == 0
            )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def share_cores(self, share: Any) -> None:
        """Compute on the cores the machine's ledger ``share`` lends: a
        :class:`~trellis.device.core_share.CoreShare` of this process (executor ``local``), given to
        every engine of the worker (:meth:`~trellis.engine.base.TrainingEngine.share_cores`)."""
        for role in ("actor", "ref", "critic"):
            engine = getattr(self, role, None)
            if engine is not None:
                engine.share_cores(share)

    def _engine(self, role: str, role_config: Any, total_steps: int | None) -> Any:
        from trellis.registries import training_engines

        _join_process_group(self.rank, self.world_size)
        engine_cls = training_engines.get(role_config.engine)
        return engine_cls(
            self.config.model,
            role_config,
            role=role,
            total_steps=total_steps,
            device=_device(self.config),
            seed=self.config.trainer.seed,
        )

    def _update(
        self, engine: Any, data: DataProto, loss_fn: Any, role_config: Any, epochs: int, mini_size: int
    ) -> dict[str, float]:
        """PPO epochs over mini-batches: one optimizer step per mini-batch; metrics averaged."""
        totals: dict[str, list[float]] = {}
        shuffle = bool(role_config.shuffle)
        step = engine.global_step
        with engine.phase(optimizer=True):  # offloaded weights and optimizer state come in, then go back
            for epoch in range(epochs):
                parts = mini_batches(
                    data, mini_size, shuffle=shuffle, seed=self.config.trainer.seed + step + epoch
                )
                for part in parts:
                    engine.zero_grad()
                    metrics = dict(
                        engine.forward_backward(part, loss_fn, compute_entropy=self._needs_entropy())
                    )
                    metrics.update({k: v for k, v in engine.optimizer_step().items() if k != "stepped"})
                    for key, value in metrics.items():
                        key = key if "/" in key else f"{engine.role}/{key}"  # grad_norm -> actor/grad_norm
                        totals.setdefault(key, []).append(float(value))
        return {key: float(np.mean(values)) for key, values in totals.items()}

    def _needs_entropy(self) -> bool:
        return False


class ActorRolloutRefWorker(_Role):
    """The policy's worker: trains the actor, generates with its rollout replica, scores with the ref."""

    replicas: ReplicaManager | None = None  # this rank's replica (not in standalone mode)
    _weight_sync: WeightSyncManager | None = None  # standalone: the sender's side of the sync
    _sync_engine: Any = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_steps: int | None = None) -> dict[str, Any]:
        """Build the actor (and ref) engines and, unless the replicas are standalone (processes of their
        own, started by the trainer), this rank's rollout replica and agent-loop manager."""
        from trellis.registries import rollout_replicas
        from trellis.rollout.agent_loop import AgentLoopManager
        from trellis.rollout.manager import ReplicaManager
        from trellis.utils.tokenizer import hf_processor, hf_tokenizer

        cfg = self.config
        self.actor = self._engine("actor", cfg.actor, total_steps)
        self.ref = self._engine("ref", cfg.ref, None) if cfg.ref.enable else None
        tokenizer_path = cfg.model.tokenizer_path or cfg.model.path
        self.tokenizer = hf_tokenizer(tokenizer_path, trust_remote_code=cfg.model.trust_remote_code)
        self.shares_weights = (
            cfg.rollout.name == "hf" and cfg.rollout.mode == "hybrid" and self.actor.name == "single"
        )
        self.agents = None
        if cfg.rollout.mode != "standalone":
            replica = rollout_replicas.get(cfg.rollout.name)(self.rank, cfg.rollout, cfg.model)
            if self.shares_weights:
                module = getattr(self.actor.model, "module", self.actor.model)
                asyncio.run(replica.init("hybrid", model=module, tokenizer=self.tokenizer))
            else:  # own copy of the weights, refreshed after every update
                asyncio.run(replica.init("colocated", tokenizer=self.tokenizer))
            self.replicas = ReplicaManager([replica], checkpoint_engine=cfg.rollout.checkpoint_engine)
            if not self.shares_weights:
                self.sync_rollout_weights()
            length = cfg.data.max_response_length
            processor = hf_processor(tokenizer_path, trust_remote_code=cfg.model.trust_remote_code)
            self.agents = AgentLoopManager(
                cfg.rollout,
                self.replicas.replicas,
                self.tokenizer,
                response_length=length,
                processor=processor,
            )
        self.reward_manager = None
        if cfg.reward.placement == "workers":
            self.reward_manager = build_reward_manager(cfg, self.tokenizer, self.reward_fn)
        from trellis.registries import get_policy_loss_fn

        self.policy_loss = get_policy_loss_fn(cfg.actor.policy_loss)
        return {"shares_weights": self.shares_weights, "rank": self.rank}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> dict[str, float]:
        """Stream the actor's weights into this rank's replica through the checkpoint engine (it is woken
        first and resumed after); ``{"bytes", "seconds"}`` moved (zeros when the replica shares them)."""
        if self.shares_weights or self.replicas is None:
            return {"bytes": 0.0, "seconds": 0.0}
        stats = self.replicas.update_weights(self.actor.iter_full_params())
        return {"bytes": float(stats.bytes), "seconds": stats.seconds}

    # -- standalone replicas: this group's ranks are the sending half of the weight sync

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def plan_rollout_sync(self, rollout_world_size: int) -> Any:
        """Rank 0: prepare the sending engine and return every rank's ``init_process_group`` kwargs,
        ``(trainer_kwargs, rollout_kwargs)``; other ranks return None."""
        from trellis.checkpoint.sync import WeightSyncManager

        # the replicas serve in model.dtype: the weights travel in it (bf16 halves what moves)
        self._weight_sync = WeightSyncManager(self.config.rollout.checkpoint_engine, dtype=self.actor.dtype)
        if self.rank != 0:
            return None
        self._sync_engine, trainer_kwargs, rollout_kwargs = self._weight_sync.plan(
            self.world_size, rollout_world_size
        )
        return trainer_kwargs, rollout_kwargs

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def connect_rollout_sync(self, trainer_kwargs: list[dict[str, Any]]) -> None:
        """Join the weight-sync group with this rank's part of the plan (blocks until the replicas join)."""
        if self._weight_sync is None:
            raise RuntimeError("connect_rollout_sync before plan_rollout_sync; the trainer plans first.")
        if self._sync_engine is None:
            self._sync_engine = self._weight_sync.create_engine()
        self._sync_engine.init_process_group(**trainer_kwargs[self.rank])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_rollout_weights(self) -> dict[str, float]:
        """The sending half of one sync to the standalone replicas: every rank gathers the full weights
        (fsdp), rank 0 streams them through the engine; ``{"tensors", "bytes", "seconds"}``."""
        if self._weight_sync is None or self._sync_engine is None:
            raise RuntimeError(
                "send_rollout_weights before connect_rollout_sync; the trainer connects first."
            )
        stats = asyncio.run(self._weight_sync.send(self._sync_engine, self.actor.iter_full_params()))
        return {"tensors": float(stats.tensors), "bytes": float(stats.bytes), "seconds": stats.seconds}

    def _sleeps_between_rollouts(self) -> bool:
        """Whether the replica releases memory while training runs (own weights and free_cache_engine)."""
        return not self.shares_weights and bool(self.config.rollout.free_cache_engine)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def release_rollout(self) -> None:
        """Shut this rank's replica down (a backend's engine process, server, ...) and the sync engines."""
        replicas, self.replicas = self.replicas, None
        engine, self._sync_engine = self._sync_engine, None
        self._weight_sync = None
        if engine is not None:
            engine.finalize()
        if replicas is not None:
            replicas.shutdown()

    @register(dispatch_mode=ROLLOUT_DISPATCH)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses to this rank's prompts (agent loops over its replica), unscored.

        Wakes the replica first when :meth:`sleep_rollout` put it to sleep (e.g. a validation right
        after a training rollout). The agent loops' metrics are in ``meta_info["metrics"]``.
        """
        if self.agents is None or self.replicas is None:
            raise RuntimeError(
                "generate_sequences: with rollout.mode=standalone the replicas run in processes of their "
                "own and the trainer's agent workers generate; the training workers hold no replica."
            )
        self.replicas.wake_up_all()  # after sleep_rollout (e.g. a validation right after a rollout)
        if self.shares_weights:  # the replica serves the actor's module: on the device while it runs
            with self.actor.phase():
                return self.agents.generate_sequences(prompts)
        return self.agents.generate_sequences(prompts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep_rollout(self) -> bool:
        """Put the replica to sleep when it holds its own weights and ``rollout.free_cache_engine`` is on
        (its KV cache, and on GPUs its weights, go back to training); the next weight sync wakes it.
        Returns whether it sleeps."""
        if self.replicas is None:
            return False
        if self._sleeps_between_rollouts():
            self.replicas.sleep_all()
        return all(replica.asleep for replica in self.replicas.replicas)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("actor"))
    def compute_scores(self, batch: DataProto) -> DataProto:
        """``token_level_scores`` of this rank's responses (``reward.placement: workers``); see
        :func:`trellis.reward.scoring.score_batch`. The counts in ``meta_info["metrics"]`` are this
        rank's: the driver adds them up."""
        from trellis.reward.scoring import score_batch

        if self.reward_manager is None:
            raise RuntimeError(
                "compute_scores runs on the workers only with reward.placement=workers; this run scores "
                "in the driver."
            )
        return score_batch(
            self.reward_manager, batch, tool_reward_weight=self.config.reward.tool_reward_weight
        )

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("actor"))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropys`` of the responses under the current actor."""
        data.meta_info.setdefault("temperature", self.config.rollout.temperature)
        with self.actor.phase():
            out = self.actor.forward(data, compute_entropy=True)
        return DataProto.from_dict(tensors={"old_log_probs": out["log_probs"], "entropys": out["entropy"]})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("actor"))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` of the responses under the frozen reference policy."""
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob: this run has no reference model (ref.enable is false).")
        data.meta_info.setdefault("temperature", self.config.rollout.temperature)
        with self.ref.phase():
            out = self.ref.forward(data)
        return DataProto.from_dict(tensors={"ref_log_prob": out["log_probs"]})

    def _needs_entropy(self) -> bool:
        return True  # the entropy is logged every step, and entropy_coeff may use it

    @register(dispatch_mode=make_nd_compute_metric_dispatch_fn("actor"))
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO epochs of the policy loss over this rank's share of the batch (no weight sync: that is
        the trainer's next stage, :meth:`sync_rollout_weights`)."""
        cfg = self.config
        data.meta_info.setdefault("temperature", cfg.rollout.temperature)
        mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // self.actor.dp_size  # rows of this dp rank
        return self._update(self.actor, data, self._actor_loss, cfg.actor, cfg.actor.ppo_epochs, max(1, mini))

    def _actor_loss(self, outputs: dict[str, torch.Tensor], micro: DataProto, info: GlobalBatchInfo) -> Any:
        """The objective's actor loss on one micro-batch (``objective.actor_loss``)."""
        cfg = self.config.actor
        batch = micro.tensors
        return objective.actor_loss(
            outputs["log_probs"],
            batch.get("old_log_probs", None),  # absent on an on-policy step: π_old is the current policy
            batch["advantages"],
            batch["response_mask"],
            policy_loss=self.policy_loss,
            loss_agg_mode=cfg.loss_agg_mode,
            global_batch_info=info,
            config=cfg,
            entropy=outputs.get("entropy"),
            entropy_coeff=cfg.entropy_coeff,
            ref_log_prob=batch.get("ref_log_prob", None),
            kl_loss_coef=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0,
            kl_loss_type=cfg.kl_loss_type,
            rollout_is_weights=batch.get("rollout_is_weights", None),
            inputs={key: batch[key] for key in objective.INPUT_NEEDS if key in batch},
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, step: int) -> dict[str, Any]:
        """Write this rank's shard of the checkpoint of ``step`` under ``root`` (the driver opened the
        save): ``actor/rank_<rank>.pt``, the actor engine's state and this process's RNG state.
        Returns the shard's manifest entry (file, size, sha256): no tensor goes back to the driver.
        Every rank calls it; none returns before every rank of the group has written."""
        return _save_shard(root, step, "actor", self.actor, self.rank, self.world_size, _device(self.config))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore this rank's actor state and RNG state from its own shard of checkpoint ``path``
        (the trainer then syncs the replica's weights)."""
        _load_shard(path, "actor", self.actor, self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole actor state dict (Hugging Face names; every rank must call it)."""
        return {name: tensor.clone() for name, tensor in self.actor.iter_full_params()}


class CriticWorker(_Role):
    """The value model's worker (PPO with ``gae``)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_steps: int | None = None) -> dict[str, Any]:
        self.critic = self._engine("critic", self.config.critic, total_steps)
        return {"rank": self.rank}

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("critic"))
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (bs, T) of the responses under the current critic."""
        with self.critic.phase():
            values = self.critic.forward(data)["values"]
        return DataProto.from_dict(tensors={"values": values})

    @register(dispatch_mode=make_nd_compute_metric_dispatch_fn("critic"))
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """PPO epochs of the clipped value loss over this rank's share of the batch."""
        cfg = self.config
        epochs = cfg.critic.ppo_epochs or cfg.actor.ppo_epochs
        mini = (
            (cfg.critic.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size)
            * cfg.rollout.n
            // self.critic.dp_size
        )
        return self._update(self.critic, data, self._critic_loss, cfg.critic, epochs, max(1, mini))

    def _critic_loss(self, outputs: dict[str, torch.Tensor], micro: DataProto, info: GlobalBatchInfo) -> Any:
        """The objective's critic loss on one micro-batch (``objective.critic_loss``)."""
        cfg = self.config.critic
        batch = micro.tensors
        return objective.critic_loss(
            outputs["values"],
            batch["returns"],
            batch["values"],
            batch["response_mask"],
            cliprange_value=cfg.cliprange_value,
            loss_agg_mode=cfg.loss_agg_mode,
            global_batch_info=info,
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, step: int) -> dict[str, Any]:
        """Write this rank's shard of the checkpoint of ``step``: ``critic/rank_<rank>.pt``, the critic
        engine's state and this process's RNG state; returns its manifest entry (no tensors). Every
        rank calls it; none returns before every rank of the group has written."""
        return _save_shard(
            root, step, "critic", self.critic, self.rank, self.world_size, _device(self.config)
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore this rank's critic state and RNG state from its own shard of checkpoint ``path``."""
        _load_shard(path, "critic", self.critic, self.rank)


def _save_shard(
    root: str, step: int, role: str, engine: Any, rank: int, world_size: int, device: str
) -> dict[str, Any]:
    """Write ``{role: engine state, "rng": this process's RNG state}`` as rank ``rank``'s shard of part
    ``role`` into the open save of ``step`` under ``root``; returns its manifest entry.

    Then the group's barrier: the ranks of one ``torch.distributed`` group (Ray workers) wait for each
    other and agree whether every one wrote its shard, so a rank that failed fails them all at once
    instead of leaving the others waiting. (The driver publishes only after every call returned.)
    """
    import torch.distributed as dist

    from trellis.checkpoint.rng import capture_rng_state
    from trellis.checkpoint.training import CheckpointManager
    from trellis.errors import CheckpointError

    entry: dict[str, Any] = {}
    error: Exception | None = None
    try:
        states = {role: engine.state_dict(), "rng": capture_rng_state()}
        entry = CheckpointManager(root).save_shard(step, role, rank, states)
    except Exception as exc:  # re-raised below, after the barrier the other ranks are waiting in
        error = exc
    if world_size > 1 and dist.is_initialized():
        written = torch.tensor([0 if error is not None else 1], device=device)
        dist.all_reduce(written, op=dist.ReduceOp.MIN)
        if error is None and int(written.item()) == 0:
            raise CheckpointError(
                f"Rank {rank} wrote its {role} shard of step {step} under {root!r}, but another rank of the "
                "group failed to write its own (its error is the one to read); the save is not published."
            )
    if error is not None:
        raise error
    return entry


def _load_shard(path: str, role: str, engine: Any, rank: int) -> None:
    """Load rank ``rank``'s shard of part ``role`` of checkpoint ``path`` into ``engine``, and restore
    the RNG state it holds (a checkpoint of a Trellis before parts holds the driver's only)."""
    from trellis.checkpoint.rng import restore_rng_state
    from trellis.checkpoint.training import load_rank_file
    from trellis.errors import CheckpointError

    states = load_rank_file(path, rank, part=role)
    if role not in states:
        raise CheckpointError(
            f"Checkpoint {path!r}: rank {rank}'s shard holds no {role!r} state (it holds {sorted(states)}); "
            f"resume from a checkpoint of a run with a {role}, or start afresh (trainer.resume_mode=disable)."
        )
    engine.load_state_dict(states[role])
    if "rng" in states:
        restore_rng_state(states["rng"])


def build_reward_manager(config: Any, tokenizer: Any, reward_fn: Any = None) -> Any:
    """The reward manager ``reward.manager`` names, built from the run's config (driver or worker).

    With ``reward.model`` on, a :class:`~trellis.reward.model.ModelRewardManager`: the model's score
    alone when neither ``reward.function`` nor ``reward_fn`` is set, else the sum of both."""
    from trellis.registries import reward_managers

    model = getattr(config.reward, "model", None)
    with_model = model is not None and model.enabled
    rule = None
    if not with_model or reward_fn is not None or config.reward.function is not None:
        manager_cls = reward_managers.get(config.reward.manager)
        limits: dict[str, Any] = {}
        if config.reward.memory_limit_mb is not None:
            if "memory_limit_mb" not in inspect.signature(manager_cls).parameters:
                raise ConfigValueError(
                    "reward.memory_limit_mb",
                    config.reward.memory_limit_mb,
                    "needs a manager that scores in processes of its own (reward.manager=async); "
                    f"{config.reward.manager!r} scores in the trainer's process, which a limit would cap too",
                )
            limits["memory_limit_mb"] = config.reward.memory_limit_mb
        rule = manager_cls(
            tokenizer,
            compute_score=reward_fn if reward_fn is not None else config.reward.function,
            reward_fn_key=config.data.reward_fn_key,
            timeout_seconds=config.reward.timeout_seconds,
            num_workers=config.reward.num_workers,
            **limits,
            **dict(config.reward.function_kwargs or {}),
        )
    if not with_model:
        return rule
    from trellis.reward.model import build_model_reward_manager

    trust = bool(config.model.trust_remote_code)
    return build_model_reward_manager(model, tokenizer, rule, device=_device(config), trust_remote_code=trust)
