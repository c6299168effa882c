"""The workers the trainer drives: the policy (actor + rollout + reference) and the critic.

Both run unchanged in a :class:`~trellis.distributed.LocalWorkerGroup` (one process) or a
:class:`~trellis.distributed.RayWorkerGroup` (one actor per device; ``torch.distributed`` joined in
``init_model``). Batches arrive split over the data-parallel ranks (``DP_COMPUTE_PROTO``); rollouts
are gathered re-padded to the widest shard (``ROLLOUT_DISPATCH``). Each method is one stage of the
trainer's step: generating, sleeping the replica, scoring, log-probs, values, updates and the weight
sync are separate calls, so none hides inside another.

Generation: every rank owns one rollout replica and runs the agent loops for its share of the
prompts. With the ``single`` engine and the ``hf`` replica in hybrid mode, the replica serves the
training module itself, so no weights move between training and generation; otherwise the replica
keeps its own copy and :meth:`ActorRolloutRefWorker.sync_rollout_weights` streams the actor's
weights into it through the configured checkpoint engine after each update.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trellis.algorithms import objective
from trellis.algorithms.aggregation import GlobalBatchInfo
from trellis.data.protocol import DataProto
from trellis.distributed import Dispatch, Worker, register
from trellis.distributed.dispatch import get_dispatch_mode

if TYPE_CHECKING:
    from trellis.checkpoint.sync import WeightSyncManager


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


class _Role(Worker):
    def __init__(self, config: Any, reward_fn: Any = None) -> None:
        self.config = config
        self.reward_fn = reward_fn
        torch.set_num_threads(int(os.environ.get("TRELLIS_NUM_THREADS", torch.get_num_threads())))

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
        for epoch in range(epochs):
            parts = mini_batches(
                data, mini_size, shuffle=shuffle, seed=self.config.trainer.seed + step + epoch
            )
            for part in parts:
                engine.zero_grad()
                metrics = dict(engine.forward_backward(part, loss_fn, compute_entropy=self._needs_entropy()))
                metrics.update({k: v for k, v in engine.optimizer_step().items() if k != "stepped"})
                for key, value in metrics.items():
                    key = key if "/" in key else f"{engine.role}/{key}"  # grad_norm -> actor/grad_norm
                    totals.setdefault(key, []).append(float(value))
        return {key: float(np.mean(values)) for key, values in totals.items()}

    def _needs_entropy(self) -> bool:
        return False


class ActorRolloutRefWorker(_Role):
    """The policy's worker: trains the actor, generates with its rollout replica, scores with the ref."""

    _weight_sync: WeightSyncManager | None = None  # built by the first weight sync, kept for the run

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_steps: int | None = None) -> dict[str, Any]:
        """Build the actor (and ref) engines, the rollout replica and the agent-loop manager."""
        from trellis.registries import rollout_replicas
        from trellis.rollout.agent_loop import AgentLoopManager
        from trellis.utils.tokenizer import hf_tokenizer

        cfg = self.config
        self.actor = self._engine("actor", cfg.actor, total_steps)
        self.ref = self._engine("ref", cfg.ref, None) if cfg.ref.enable else None
        tokenizer_path = cfg.model.tokenizer_path or cfg.model.path
        self.tokenizer = hf_tokenizer(tokenizer_path, trust_remote_code=cfg.model.trust_remote_code)
        replica_cls = rollout_replicas.get(cfg.rollout.name)
        self.replica = replica_cls(self.rank, cfg.rollout, cfg.model)
        module = getattr(self.actor.model, "module", self.actor.model)
        self.shares_weights = (
            cfg.rollout.name == "hf" and cfg.rollout.mode == "hybrid" and self.actor.name == "single"
        )
        self._rollout_asleep = False  # set after a rollout when the replica sleeps through training
        if self.shares_weights:
            asyncio.run(self.replica.init("hybrid", model=module, tokenizer=self.tokenizer))
        else:  # own copy of the weights, refreshed after every update
            asyncio.run(self.replica.init("colocated", tokenizer=self.tokenizer))
            self.sync_rollout_weights()
        self.agents = AgentLoopManager(
            cfg.rollout, [self.replica], self.tokenizer, response_length=cfg.data.max_response_length
        )
        self.reward_manager = None
        if cfg.reward.placement == "workers":
            self.reward_manager = build_reward_manager(cfg, self.tokenizer, self.reward_fn)
        from trellis.registries import get_policy_loss_fn

        self.policy_loss = get_policy_loss_fn(cfg.actor.policy_loss)
        return {"shares_weights": self.shares_weights, "rank": self.rank}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> float:
        """Stream the actor's weights into this rank's replica; seconds taken (0 when shared)."""
        if getattr(self, "shares_weights", False):
            return 0.0
        from trellis.checkpoint.sync import WeightSyncManager

        start = time.perf_counter()
        if self._weight_sync is None:  # one engine pair for the whole run
            self._weight_sync = WeightSyncManager(self.config.rollout.checkpoint_engine)
        # the sync wakes the replica (weights first), loads every bucket, then resumes it
        asyncio.run(self._weight_sync.sync(self.actor.iter_full_params(), [self.replica]))
        self._rollout_asleep = False
        return time.perf_counter() - start

    def _sleeps_between_rollouts(self) -> bool:
        """Whether the replica releases memory while training runs (own weights and free_cache_engine)."""
        return not getattr(self, "shares_weights", False) and bool(self.config.rollout.free_cache_engine)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def release_rollout(self) -> None:
        """Shut this rank's replica down (a backend's engine process, server, ...) and the sync engines."""
        replica, self.replica = getattr(self, "replica", None), None
        sync, self._weight_sync = self._weight_sync, None
        if sync is not None:
            sync.close()
        shutdown = getattr(replica, "shutdown", None)
        if shutdown is not None:
            asyncio.run(shutdown())

    @register(dispatch_mode=ROLLOUT_DISPATCH)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses to this rank's prompts (agent loops over its replica), unscored.

        Wakes the replica first when :meth:`sleep_rollout` put it to sleep (e.g. a validation right
        after a training rollout). The agent loops' metrics are in ``meta_info["metrics"]``.
        """
        if self._rollout_asleep:
            asyncio.run(_wake(self.replica))
            self._rollout_asleep = False
        return self.agents.generate_sequences(prompts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep_rollout(self) -> bool:
        """Put the replica to sleep when it holds its own weights and ``rollout.free_cache_engine`` is on
        (its KV cache, and on GPUs its weights, go back to training); the next weight sync wakes it.
        Returns whether it sleeps."""
        if self._sleeps_between_rollouts() and not self._rollout_asleep:
            asyncio.run(self.replica.sleep())
            self._rollout_asleep = True
        return self._rollout_asleep

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
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

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropys`` of the responses under the current actor."""
        data.meta_info.setdefault("temperature", self.config.rollout.temperature)
        out = self.actor.forward(data, compute_entropy=True)
        return DataProto.from_dict(tensors={"old_log_probs": out["log_probs"], "entropys": out["entropy"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` of the responses under the frozen reference policy."""
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob: this run has no reference model (ref.enable is false).")
        data.meta_info.setdefault("temperature", self.config.rollout.temperature)
        out = self.ref.forward(data)
        return DataProto.from_dict(tensors={"ref_log_prob": out["log_probs"]})

    def _needs_entropy(self) -> bool:
        return True  # the entropy is logged every step, and entropy_coeff may use it

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO epochs of the policy loss over this rank's share of the batch (no weight sync: that is
        the trainer's next stage, :meth:`sync_rollout_weights`)."""
        cfg = self.config
        data.meta_info.setdefault("temperature", cfg.rollout.temperature)
        mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // self.world_size
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
    def state_dict(self) -> dict[str, Any]:
        """This rank's actor engine state (for a training checkpoint)."""
        return self.actor.state_dict()

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's actor state (the trainer then syncs the replica's weights)."""
        self.actor.load_state_dict(state)

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

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (bs, T) of the responses under the current critic."""
        return DataProto.from_dict(tensors={"values": self.critic.forward(data)["values"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """PPO epochs of the clipped value loss over this rank's share of the batch."""
        cfg = self.config
        epochs = cfg.critic.ppo_epochs or cfg.actor.ppo_epochs
        mini = (
            (cfg.critic.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size)
            * cfg.rollout.n
            // self.world_size
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
    def state_dict(self) -> dict[str, Any]:
        return self.critic.state_dict()

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.critic.load_state_dict(state)


def build_reward_manager(config: Any, tokenizer: Any, reward_fn: Any = None) -> Any:
    """The reward manager ``reward.manager`` names, built from the run's config (driver or worker)."""
    from trellis.registries import reward_managers

    return reward_managers.get(config.reward.manager)(
        tokenizer,
        compute_score=reward_fn if reward_fn is not None else config.reward.function,
        reward_fn_key=config.data.reward_fn_key,
        timeout_seconds=config.reward.timeout_seconds,
        num_workers=config.reward.num_workers,
        **dict(config.reward.function_kwargs or {}),
    )


async def _wake(replica: Any) -> None:
    """Wake ``replica`` and let it serve again (``resume`` where the backend stages its wake-up).

    A module function, not a worker method: a Ray actor with any ``async def`` method becomes an
    async actor, whose methods run inside an event loop where ``asyncio.run`` is refused.
    """
    await replica.wake_up()
    resume = getattr(replica, "resume", None)
    if resume is not None:
        await resume()
