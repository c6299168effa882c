"""The PPO / GRPO trainer: one controller driving the policy and critic worker groups.

One step (DESIGN.md's data flow), each stage a visible call of :meth:`Trainer.train_step`::

    generate (agent loops on the rollout replicas; remax: + a greedy baseline) -> rollout sleep
      -> score (reward manager + tool rewards, where reward.placement says)
      -> old log-probs (actor), reference log-probs (ref), values (critic)
      -> advantages (KL in the reward, rollout correction, the estimator with what it declares)
      -> critic update -> actor update -> weight sync -> metrics, trackers, hooks
      -> checkpoint (every save_freq steps, in fit)

The math of each stage is in :mod:`trellis.algorithms.objective`.

The same code runs with ``trainer.executor=local`` (one process) and ``ray`` (one actor per worker;
``nnodes x n_devices_per_node`` workers; by default each holds both the policy and the critic, reached
through one group per role — see :meth:`Trainer._build_workers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch

from trellis.algorithms import objective
from trellis.algorithms.kl import get_kl_controller, kl_penalty
from trellis.algorithms.masked import masked_mean
from trellis.algorithms.off_policy import behaviour_log_probs
from trellis.data.protocol import DataProto
from trellis.device.cpu import set_flush_denormal
from trellis.errors import TrellisError
from trellis.trainer import metrics as M
from trellis.trainer.profiler import StageProfiler
from trellis.trainer.workers import seed_process
from trellis.utils import fs
from trellis.utils.memory import host_memory, set_host_memory
from trellis.utils.termination import Terminated, arm_sigterm_stop, disarm_sigterm_stop, sigterm_received
from trellis.utils.timing import marked_timer
from trellis.utils.watchdog import StageWatchdog, arm_main_thread_wake, disarm_main_thread_wake

logger = logging.getLogger(__name__)

STALL_GRACE_S = 30.0
"""After a stall report, how long the run has to stop by itself before the process exits (code 3)."""


class StageTimeoutError(TrellisError, RuntimeError):
    """A stage of a step ran past its deadline (``trainer.stage_timeout_s``); the run stopped."""

    exit_code = 3


@dataclass
class TrainResult:
    """What a run produced.

    Attributes:
        run_dir: where its outputs are.
        steps: training steps done (a resumed run counts the earlier ones too).
        history: each step's metrics, in order (this process's steps only).
        validation: ``(step, metrics)`` of each validation.
        last_checkpoint / best_checkpoint: paths, or None when no checkpoint was saved.
        reward_curve: path of ``reward_curve.png``, or None when there was nothing to plot.
    """

    run_dir: str
    steps: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    validation: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    last_checkpoint: str | None = None
    best_checkpoint: str | None = None
    reward_curve: str | None = None


class Trainer:
    """PPO-family RL on a :class:`~trellis.config.TrellisConfig`.

    Args:
        config: the run's configuration (``load_config`` output).
        reward_fn: a Python scoring callable that replaces ``reward.function`` (the notebook path).
        worker_env: extra environment variables for Ray workers.
    """

    def __init__(
        self,
        config: Any,
        *,
        reward_fn: Callable[..., Any] | None = None,
        worker_env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.reward_fn = reward_fn
        self.worker_env = dict(worker_env or {})
        self.run_dir = os.path.abspath(config.trainer.run_dir)
        self.groups: list[Any] = []
        self._own_ray = False  # whether this trainer started the Ray cluster (and stops it)
        self._threads_before: int | None = None
        self.core_share: Any = None
        """The machine's core ledger shared with standalone replicas (``trainer.share_cores``), or None."""
        # before any worker, replica thread or OpenMP pool starts: they inherit the setting
        self._denormal_before = set_flush_denormal(config.trainer.flush_denormal)  # restored by _shutdown
        self._host_memory_before = set_host_memory(config.trainer.host_memory)  # likewise
        self.replicas: Any = None
        """The standalone replicas' :class:`~trellis.rollout.manager.ReplicaManager`
        (rollout.mode=standalone); None when each training worker owns its replica."""
        self.agent_workers: Any = None
        self.stream: Any = None
        """trainer.mode=async: the :class:`~trellis.trainer.streaming.RolloutStream` (while fit runs)."""
        self._stream_state: dict[str, Any] | None = None  # the stream's state from the resumed checkpoint
        self._pending_batch: Any = None  # one_step_off: the future of the next step's batch
        self._executor: Any = None
        self._pending_version = 0  # one_step_off: the policy version generating the pending batch
        self._pending_seconds = 0.0  # one_step_off: how long the last background generation took
        self._loader_state_before_pending: dict[str, Any] | None = None
        self.watchdog = StageWatchdog(
            config.trainer.stage_timeout_s,
            dict(config.trainer.stage_timeouts or {}),
            self._on_stall,
            exempt=("step",),
        )
        """Every stage's deadline (``trainer.stage_timeout_s`` / ``stage_timeouts``): :meth:`_on_stall`."""
        self._stall: Any = None  # the StageTimeoutError of a stage past its deadline
        self._terminated = False  # a SIGTERM stopped fit() (trellis.utils.termination)
        run_dir = config.trainer.run_dir
        self.profiler = StageProfiler(
            config.trainer.profile, run_dir if fs.is_non_local(run_dir) else self.run_dir
        )
        """``trainer.profile``: the stages it names, of the steps it names, run under the torch profiler
        (:meth:`_stage`)."""
        from trellis.config.needs import resolve_needs

        self.needs = resolve_needs(config)
        """What the estimator and the policy loss declare they need (critic.enable, ref.enable follow)."""
        self.behaviour_old_log_probs = config.algorithm.off_policy == "behaviour"
        """``algorithm.off_policy: behaviour``: the old log-probs are the replica's (``rollout_log_probs``),
        never recomputed."""
        self.recompute_old_log_probs = not self.behaviour_old_log_probs and not on_policy(config, self.needs)
        """False when the update is one gradient step on the whole batch: the old policy is then the
        current one, the actor loss uses its own log-probs (detached) as the old ones, and the extra
        forward pass is skipped (as TRL does); and with the behaviour's log-probs as the old ones. Set
        True to recompute them every step (``behaviour`` still takes the replica's)."""

    # ------------------------------------------------------------------ setup

    def _build_data(self) -> None:
        from trellis.data.dataset import PromptLoader, RLDataset
        from trellis.utils.tokenizer import hf_processor, hf_tokenizer

        cfg = self.config
        self.tokenizer = hf_tokenizer(cfg.model.tokenizer_path, trust_remote_code=cfg.model.trust_remote_code)
        # a vision-language model's processor (None for a text model): images and videos go through it
        self.processor = hf_processor(
            cfg.model.tokenizer_path or cfg.model.path, trust_remote_code=cfg.model.trust_remote_code
        )
        # agent loops template the messages themselves, and a reward model reads the conversation:
        # decoding the policy's templated prompt would hand it the policy's role markers as text
        needs_chat = (
            cfg.data.return_raw_chat
            or cfg.rollout.agent.default_agent_loop != "single_turn"
            or cfg.reward.model.enabled
        )
        kwargs = dict(
            prompt_key=cfg.data.prompt_key,
            max_prompt_length=cfg.data.max_prompt_length,
            filter_overlong_prompts=cfg.data.filter_overlong_prompts,
            truncation=cfg.data.truncation,
            chat_template_kwargs=cfg.data.chat_template_kwargs,
            return_raw_chat=needs_chat,
            processor=self.processor,
            image_key=cfg.data.image_key,
            video_key=cfg.data.video_key,
            image_max_pixels=cfg.data.image_max_pixels,
            image_min_pixels=cfg.data.image_min_pixels,
        )
        if not cfg.data.train_files:
            raise ValueError("data.train_files is empty: give the parquet/jsonl files of training prompts.")
        self.train_set = RLDataset(list(cfg.data.train_files), self.tokenizer, **kwargs)
        self.loader = PromptLoader(
            self.train_set,
            cfg.data.train_batch_size,
            shuffle=cfg.data.shuffle,
            seed=cfg.data.seed,
            num_workers=cfg.data.dataloader_num_workers,
        )
        self.val_set = (
            RLDataset(list(cfg.data.val_files), self.tokenizer, **kwargs) if cfg.data.val_files else None
        )
        per_epoch = len(self.loader)
        self.total_steps = cfg.trainer.total_training_steps or per_epoch * cfg.trainer.total_epochs

    def _build_workers(self) -> None:
        """The worker groups, placed role by role on resource pools: ``actor_rollout`` (actor, rollout and
        reference in one worker) and, when the run trains a value model, ``critic``. Roles on the same pool
        (the default, ``critic.placement: colocated``) share its processes: one worker per device holds
        both (``create_colocated_worker_cls``), reached through one group per role (``spawn``)."""
        from trellis.distributed import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls
        from trellis.trainer.workers import ActorRolloutRefWorker, CriticWorker

        cfg = self.config
        world = cfg.trainer.nnodes * cfg.trainer.n_devices_per_node
        if cfg.trainer.executor == "local" and world != 1:
            raise ValueError(
                f"trainer.executor=local runs one worker; nnodes x n_devices_per_node is {world}. "
                "Use trainer.executor=ray for several workers."
            )
        roles = {"actor_rollout": ClassWithInitArgs(ActorRolloutRefWorker, cfg, self.reward_fn)}
        mapping = {"actor_rollout": "global_pool"}  # role -> resource pool
        if cfg.critic.enable:
            roles["critic"] = ClassWithInitArgs(CriticWorker, cfg)
            mapping["critic"] = "global_pool" if cfg.critic.placement == "colocated" else "critic_pool"
        pools: dict[str, list[str]] = {}
        for role, pool in mapping.items():
            pools.setdefault(pool, []).append(role)

        def make_group(pool: str, cls: ClassWithInitArgs) -> Any:
            return LocalWorkerGroup(cls)

        if cfg.trainer.executor == "ray":
            from trellis.distributed import RayWorkerGroup, ResourcePoolManager

            self._start_ray()
            device = None if cfg.trainer.device in ("auto", "cpu") else cfg.trainer.device
            nodes = [cfg.trainer.n_devices_per_node] * cfg.trainer.nnodes
            manager = ResourcePoolManager({pool: nodes for pool in pools}, mapping, device_name=device)
            env = {"TRELLIS_NUM_THREADS": "1", **self.worker_env}
            if cfg.trainer.device != "auto":
                env.setdefault("TRELLIS_DEVICE", cfg.trainer.device)

            def make_group(pool: str, cls: ClassWithInitArgs) -> Any:
                group = RayWorkerGroup(manager.get_resource_pool(pools[pool][0]), cls, env=env)
                self.groups.append(group)  # the roles' views share its actors: shut down once
                return group

        groups: dict[str, Any] = {}
        for pool, pool_roles in pools.items():
            if len(pool_roles) == 1:
                groups[pool_roles[0]] = make_group(pool, roles[pool_roles[0]])
            else:
                combined = create_colocated_worker_cls({role: roles[role] for role in pool_roles})
                groups.update(make_group(pool, combined).spawn(pool_roles))
        self.actor_wg = groups["actor_rollout"]
        self.critic_wg = groups.get("critic")
        self.world_size = world
        ranks = self.actor_wg.init_model(self.total_steps)
        self.rollout_has_own_weights = not all(info["shares_weights"] for info in ranks)
        """Whether the replicas keep their own copy of the weights: then the weights are synced into them
        after every update, and they sleep through training when rollout.free_cache_engine is on."""
        if self.critic_wg is not None:
            self.critic_wg.init_model(self.total_steps)

    def _build_rollout(self) -> None:
        """``rollout.mode=standalone``: start the replicas on a pool of their own, join them and the
        policy workers in the checkpoint engine's group, start the agent workers and send the initial
        weights. Other modes: the training workers built their replicas already."""
        cfg = self.config
        if cfg.rollout.mode != "standalone":
            return
        from trellis.rollout.manager import AgentWorkerPool, ReplicaManager

        self._start_ray()
        self.replicas = ReplicaManager.start_standalone(cfg, env=self.worker_env)
        self._leave_cores_to_replicas()
        self.rollout_has_own_weights = True
        plan = self.actor_wg.plan_rollout_sync(self.replicas.world_size)[0]
        trainer_kwargs, rollout_kwargs = plan
        self.replicas.connect_weight_sync(
            rollout_kwargs, lambda: self.actor_wg.connect_rollout_sync(trainer_kwargs)
        )
        self.agent_workers = AgentWorkerPool(cfg, self.replicas, self.tokenizer, env=self.worker_env)
        self.sync_weights()

    def _leave_cores_to_replicas(self) -> None:
        """One machine, CPU training in this process (executor local, a Ray cluster this trainer
        started) beside standalone replicas of one thread each: train with the cores they leave, and,
        with ``trainer.share_cores``, also on theirs while they wait.

        torch's default is one intra-op thread per core, so training would otherwise run as many
        OpenMP threads as cores next to the replicas' threads, and oversubscribed OpenMP barriers slow
        both several-fold. ``TRELLIS_NUM_THREADS`` set in the environment wins (and shares nothing).
        Sharing (:mod:`trellis.device.core_share`): a ledger with this process's threads and one thread
        per replica; each marks itself busy while it computes, and a busy one runs the shares of those
        idle too (the trainer between decoder layers, an ``hf`` replica between decoding steps).
        """
        cfg = self.config
        if (
            cfg.trainer.executor != "local"
            or not self._own_ray
            or "TRELLIS_NUM_THREADS" in os.environ
            or cfg.trainer.device not in ("auto", "cpu")
            or (cfg.trainer.device == "auto" and torch.cuda.is_available())
        ):
            return
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        replicas = self.replicas.world_size if self.replicas is not None else 0
        threads = max(1, cores - replicas)
        if threads < torch.get_num_threads():
            logger.info(
                "Training with %d torch threads: %d of this machine's %d cores run standalone replicas "
                "(set TRELLIS_NUM_THREADS to choose).",
                threads,
                replicas,
                cores,
            )
            self._threads_before = torch.get_num_threads()  # restored by _shutdown
            torch.set_num_threads(threads)
        if cfg.trainer.share_cores and replicas:
            from trellis.device.core_share import CoreShare

            self.core_share = CoreShare.create([min(threads, 255)] + [1] * replicas)
            taking = self.replicas.share_cores(self.core_share.path)
            self.actor_wg.share_cores(self.core_share)
            if self.critic_wg is not None:
                self.critic_wg.share_cores(self.core_share)
            logger.info(
                "Sharing %d cores: training on %d threads, and on the cores of the replicas that wait "
                "(%d of %d take part; trainer.share_cores).",
                cores,
                threads,
                sum(taking),
                replicas,
            )

    def _build_trackers(self) -> None:
        from trellis.config.loader import to_dict
        from trellis.registries import trackers

        self.trackers = []
        plain = to_dict(self.config)
        for name in self.config.trainer.trackers:
            cls = trackers.get(name)
            options = {"total_steps": self.total_steps} if name == "console" else {}
            self.trackers.append(cls(run_dir=self.run_dir, config=plain, **options))

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainResult:
        """Train for ``total_steps`` (resuming per ``trainer.resume_mode``); see :class:`TrainResult`."""
        from trellis.hooks import get_plugin_manager

        cfg = self.config
        os.makedirs(self.run_dir, exist_ok=True)
        seed_process(cfg.trainer.seed)
        hooks = get_plugin_manager().hook
        self._build_data()
        self.profiler.check_run(self.total_steps, standalone=cfg.rollout.mode == "standalone")
        from trellis.trainer.judge import start_judge

        try:
            # reward.model colocated: its replica and gateway, before any reward manager is built
            self.judge = start_judge(cfg)
            self._build_workers()
            self._build_rollout()
        except BaseException:  # what started before the failure (judge, workers, replicas, Ray) stops
            self._shutdown()
            raise
        self.reward_manager = None  # reward.placement=driver: the driver scores
        if cfg.reward.placement == "driver":
            from trellis.trainer.workers import build_reward_manager

            self.reward_manager = build_reward_manager(cfg, self.tokenizer, self.reward_fn)
        self.kl_ctrl = get_kl_controller(cfg.algorithm.kl_ctrl)
        result = TrainResult(run_dir=self.run_dir)
        self.step = 0
        self._resume(result)
        self._build_trackers()
        hooks.trellis_train_start(config=cfg, run_dir=self.run_dir)
        last_metrics: dict[str, float] = {}
        arm_main_thread_wake()  # a stage past its deadline is interrupted even where SIGINT is ignored
        # SIGTERM (preemption, kill) stops the run through the finally below; armed once the workers are
        # built, so it also replaces the handler ray.init installed in this process
        sigterm_armed = arm_sigterm_stop()
        finished = self.step  # the last step whose metrics were logged (a resumed run's first)
        try:
            batches = self._batches()
            self._start_overlap(batches)
            if self.val_set is not None and cfg.trainer.val_before_train and self.step == 0:
                with self._stage("validate"):
                    self._validate(result, hooks)
            while self.step < self.total_steps:
                self.step += 1
                if self.stream is not None:
                    metrics = self.train_step_async()
                elif cfg.trainer.mode == "one_step_off":
                    metrics = self.train_step_one_step_off(batches)
                else:
                    metrics = self.train_step(next(batches))
                if (
                    self.val_set is not None
                    and cfg.trainer.test_freq > 0
                    and (self.step % cfg.trainer.test_freq == 0 or self.step == self.total_steps)
                ):
                    with self._stage("validate"):
                        metrics.update(self._validate(result, hooks, log=False))
                for tracker in self.trackers:
                    tracker.log(metrics, self.step)
                hooks.trellis_step_end(step=self.step, metrics=metrics)
                result.history.append(metrics)
                last_metrics = metrics
                finished = self.step
                if cfg.trainer.save_freq > 0 and (
                    self.step % cfg.trainer.save_freq == 0 or self.step == self.total_steps
                ):
                    with self._stage("checkpoint"):
                        path = self._save_checkpoint()
                    result.last_checkpoint = path
                    hooks.trellis_checkpoint_saved(step=self.step, path=path)
            if getattr(self, "replicas", None) is not None:
                self.replicas.wait_for_weights()  # the last async step's load: its failure is the run's
        except KeyboardInterrupt:
            if self._stall is None:
                raise
            raise self._stall from None  # the watchdog interrupted a stage past its deadline
        finally:
            self.watchdog.close()
            disarm_main_thread_wake()
            self._terminated = sigterm_armed and sigterm_received()
            if sigterm_armed:
                disarm_sigterm_stop()
            result.steps = self.step
            for tracker in getattr(self, "trackers", []):
                tracker.finish()
            hooks.trellis_train_end(step=self.step, metrics=last_metrics, run_dir=self.run_dir)
            if self._terminated:
                self._shutdown_after_sigterm(result, finished)
            self._shutdown()
        result.best_checkpoint = self._best_checkpoint(result)
        result.reward_curve = self._plot(result)
        return result

    @contextlib.contextmanager
    def _stage(self, name: str, timings: dict[str, float] | None = None) -> Iterator[None]:
        """One stage of the step: timed into ``timings`` (``timing/<name>``), a profiler range, under its
        deadline (:attr:`watchdog`), and, when ``trainer.profile`` names it and this step, profiled into
        ``run_dir/profile/step_<N>/<name>.json`` (:attr:`profiler`; the Ray workers' processes too)."""
        step = getattr(self, "step", 0)
        with (
            self.profiler.stage(name, step, self.groups),
            self.watchdog.stage(name),
            marked_timer(name, {} if timings is None else timings),
        ):
            yield

    def _on_stall(self, stage: str, elapsed_s: float, limit_s: float) -> None:
        """A stage ran past its deadline (called on the watchdog's thread): write the report — the stage,
        the step, the Python stacks of this process and of every worker process — to the log and to
        ``run_dir/stall_report.txt``, then stop the run: the main thread gets a signal
        (:func:`~trellis.utils.watchdog.interrupt_main_thread`, which also cuts short a sleep, a lock
        wait or a socket read it is stuck in), which :meth:`fit` turns into a :class:`StageTimeoutError`
        (exit code 3) after shutting down; if it is stuck where an interrupt cannot reach (a long call
        into C that does not return on a signal), the process exits with code 3 after
        :data:`STALL_GRACE_S` seconds. Checkpoints are written to a temporary folder and renamed, so
        the last one stays intact either way."""
        import threading

        from trellis.utils.watchdog import interrupt_main_thread, thread_stacks

        setting = (
            f"trainer.stage_timeouts.{stage}"
            if stage in self.watchdog.overrides
            else "trainer.stage_timeout_s"
        )
        head = (
            f"Stage {stage!r} of step {self.step} has run {elapsed_s:.0f} s, past its deadline of "
            f"{limit_s:g} s ({setting}). The run stops (exit code 3); the last checkpoint is intact. "
            "Raise the deadline if the stage is just slow."
        )
        report = "\n\n".join(
            [head, "== this process (driver) ==\n" + thread_stacks(), *self._worker_stacks()]
        )
        logger.error("%s", report)
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, "stall_report.txt"), "w", encoding="utf-8") as handle:
                handle.write(report + "\n")
        except OSError:
            logger.exception("Could not write the stall report into %s.", self.run_dir)
        self._stall = StageTimeoutError(head + f" Stacks: {os.path.join(self.run_dir, 'stall_report.txt')}")
        interrupt_main_thread()

        def last_resort() -> None:
            logger.error(
                "The run did not stop within %g s of its stall report; exiting (code 3).", STALL_GRACE_S
            )
            os._exit(3)

        timer = threading.Timer(STALL_GRACE_S, last_resort)
        timer.daemon = True
        timer.start()

    def _worker_stacks(self) -> list[str]:
        """The stacks of the worker processes of this machine (Ray groups), dumped into their logs by
        ``SIGUSR1`` and read back from the logs' ends."""
        import socket

        from trellis.utils.watchdog import signal_stack_dump, tail

        here = socket.gethostname()
        processes = []
        for group in self.groups:
            for rank, process in enumerate(getattr(group, "processes", None) or []):
                processes.append((type(group).__name__, rank, process))
        dumped = [p.get("host") == here and signal_stack_dump(int(p["pid"])) for _, _, p in processes]
        if any(dumped):
            time.sleep(1.0)  # faulthandler writes from the signal handler; give the logs a moment
        parts = []
        for (kind, rank, process), in_log in zip(processes, dumped, strict=True):
            where = f"== worker {rank} of a {kind} (pid {process.get('pid')} on {process.get('host')}) =="
            if not in_log:
                parts.append(f"{where}\n(another machine, or it could not be signalled: see its log there)")
                continue
            parts.append(f"{where}\nlast lines of {process.get('log')}:\n{tail(process.get('log', ''), 80)}")
        return parts

    def _batches(self) -> Any:
        while True:
            yield from self.loader

    # ------------------------------------------------------------------ the step, per trainer.mode

    def train_step(self, prompts: DataProto) -> dict[str, float]:
        """One sync PPO step on a batch of prompts; returns its metrics.

        Each stage is one visible call, timed where it runs (``timing/<stage>``); the objective's math
        is in :mod:`trellis.algorithms.objective`.
        """
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {"training/global_step": float(self.step)}
        with self._stage("step", timings):
            with self._stage("generate", timings):
                batch, greedy = self.generate_batch(prompts, self.step, timings)
            batch = self.train_batch(batch, greedy, metrics, timings)
            if self.rollout_has_own_weights:
                with self._stage("weight_sync", timings):
                    metrics.update(self.sync_weights())
        return self._step_metrics(batch, metrics, timings, waited=timings["generate"])

    def train_step_one_step_off(self, batches: Any) -> dict[str, float]:
        """One ``trainer.mode=one_step_off`` step: start generating the next batch (with the weights
        before this step, as the replicas hold them) in the background, train on the batch generated
        during the previous step, wait for the next batch, then sync the weights. Every batch after the
        first lags exactly one policy version (``async/staleness/mean`` 1)."""
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {"training/global_step": float(self.step)}
        with self._stage("step", timings):
            with self._stage("wait_rollout", timings):
                batch, greedy = self._pending_batch.result()
            self._pending_batch = None
            busy = self._pending_seconds
            if self.step < self.total_steps:  # the next step's batch, generated while this one trains
                self._submit_next_batch(batches, self.step + 1)
            lag = self.step - 1 - self._pending_version
            metrics.update({"async/staleness/mean": float(lag), "async/staleness/max": float(lag)})
            batch = self.train_batch(batch, greedy, metrics, timings)
            if self._pending_batch is not None:  # the sync waits: the next batch is all old weights
                with self._stage("wait_next_rollout", timings):
                    self._pending_batch.result()
            if self.rollout_has_own_weights:
                with self._stage("weight_sync", timings):
                    metrics.update(self.sync_weights())
        self._pending_version = self.step - 1 if self._pending_batch is not None else self.step
        waited = timings["wait_rollout"] + timings.get("wait_next_rollout", 0.0)
        return self._step_metrics(batch, metrics, timings, waited=waited, busy=busy)

    def _submit_next_batch(self, batches: Any, step: int) -> None:
        """one_step_off: generate step ``step``'s batch in the background (see ``train_step_one_step_off``).
        A checkpoint saved meanwhile records the loader as before this batch: a resumed run generates
        it again (with the restored weights)."""
        self._loader_state_before_pending = self.loader.state_dict()
        prompts = next(batches)

        def generate() -> tuple[DataProto, DataProto | None]:
            start = time.perf_counter()
            try:
                return self.generate_batch(prompts, step, {})
            finally:
                self._pending_seconds = time.perf_counter() - start

        self._pending_batch = self._executor.submit(generate)

    def train_step_async(self) -> dict[str, float]:
        """One ``trainer.mode=async`` step: draw ``data.train_batch_size`` groups from the replay pool
        (waiting until the stream has generated them; stale ones dropped or regenerated), train on them,
        and sync the weights, while the replicas keep generating the next groups."""
        stream = self.stream
        if stream is None:
            raise RuntimeError("train_step_async: trainer.mode is not async (no rollout stream).")
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {"training/global_step": float(self.step)}
        with self._stage("step", timings):
            with self._stage("wait_rollout", timings):
                groups, stream_metrics = stream.take(self.step)
            from trellis.rollout.agent_loop import concat_rollouts

            batch = concat_rollouts(groups)  # the stream took each group's agent metrics into its own
            metrics.update(stream_metrics)
            batch = self.train_batch(batch, None, metrics, timings)
            with self._stage("weight_sync", timings):  # the replicas load it while this step ends
                metrics.update(self.sync_weights(wait=False))
            stream.set_version(self.step)
        return self._step_metrics(batch, metrics, timings, waited=timings["wait_rollout"], idle_measured=True)

    def _start_overlap(self, batches: Any) -> None:
        """one_step_off: submit the first batch; async: build and start the rollout stream (from the
        checkpoint's stream state when resuming)."""
        cfg = self.config
        self.stream = None
        self._pending_batch = None
        mode = cfg.trainer.mode
        if mode == "sync":
            return
        if "reward_baselines" in self.needs:
            raise ValueError(
                f"trainer.mode={mode} does not generate remax's greedy baselines "
                f"(algorithm.adv_estimator={cfg.algorithm.adv_estimator}); use trainer.mode=sync."
            )
        if mode == "one_step_off":
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(1, thread_name_prefix="trellis-one-step-off")
            self._pending_version = self.step
            self._pending_seconds = 0.0
            if self.step < self.total_steps:
                self._submit_next_batch(batches, self.step + 1)
            return
        from trellis.registries import replay_pools
        from trellis.replay import UniformReplayPool
        from trellis.trainer.streaming import RolloutStream

        trainer = cfg.trainer
        size = cfg.data.train_batch_size
        replay = round(trainer.replay_ratio * size)
        pool = replay_pools.get(trainer.replay_pool)(
            trainer.replay_capacity, eviction="stalest", seed=trainer.seed
        )
        memory = (
            UniformReplayPool(trainer.replay_capacity, eviction="stalest", seed=trainer.seed)
            if replay
            else None
        )
        self.stream = RolloutStream(
            self.agent_workers.generate_async,
            batches,
            self.loader,
            group_size=cfg.rollout.n,
            batch_size=size,
            max_staleness=cfg.rollout.max_staleness,
            stale_policy=cfg.rollout.stale_policy,
            pool=pool,
            memory=memory,
            replay_count=replay,
            version=self.step,
        )
        if self._stream_state is not None:
            self.stream.load_state_dict(self._stream_state)
        self.stream.start()

    def _stop_overlap(self) -> None:
        stream, self.stream = getattr(self, "stream", None), None
        if stream is not None:
            stream.stop()
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def generate_batch(
        self, prompts: DataProto, step: int, timings: dict[str, float]
    ) -> tuple[DataProto, DataProto | None]:
        """The generate stage of step ``step``: ``rollout.n`` responses per prompt (unscored), and
        for remax the greedy baseline responses (None otherwise)."""
        prompts = self._label(prompts, f"{step}-", step)
        batch = self.generate_sequences(_numbered(prompts.repeat(self.config.rollout.n)))
        greedy = None
        if "reward_baselines" in self.needs:  # remax: one greedy response per prompt
            with self._stage("generate_baseline", timings):
                greedy = self.generate_sequences(_numbered(_greedy(prompts)))
            greedy.meta_info.pop("metrics", None)
        return batch, greedy

    def train_batch(
        self, batch: DataProto, greedy: DataProto | None, metrics: dict[str, float], timings: dict[str, float]
    ) -> DataProto:
        """Every stage of a step after generation, on a generated batch: score, old / reference
        log-probs, values, advantages, critic and actor updates (the weight sync is the caller's next
        stage). Adds the stages' metrics to ``metrics``; returns the batch with what they computed."""
        cfg = self.config
        metrics.update(_worker_mean(batch.meta_info.pop("metrics", {}) or {}))
        if self.replicas is None and self.rollout_has_own_weights and cfg.rollout.free_cache_engine:
            with self._stage("rollout_sleep", timings):
                self.actor_wg.sleep_rollout()
        with self._stage("score", timings):
            batch, reward_metrics = self.score(batch)
            if greedy is not None:
                greedy, _ = self.score(greedy)
                batch.tensors["reward_baselines"] = _baselines(greedy, cfg.rollout.n)
        metrics.update(reward_metrics)
        rows = len(batch)
        batch = _pad_to_multiple(batch, self.world_size)
        # a batch with more rows than one mini-batch (agent loops that split a prompt into several samples)
        # takes several optimizer steps, so even an on-policy config needs the old log-probs then
        if self.behaviour_old_log_probs:
            batch.tensors["old_log_probs"] = behaviour_log_probs(batch.tensors)
        elif self.recompute_old_log_probs or len(batch) > cfg.actor.ppo_mini_batch_size * cfg.rollout.n:
            with self._stage("old_log_prob", timings):
                batch = batch.union(self.actor_wg.compute_log_prob(batch))
            entropy = masked_mean(batch.tensors["entropys"], batch.tensors["response_mask"].float())
            metrics["actor/entropy_rollout"] = float(entropy)
        if cfg.ref.enable:
            with self._stage("ref", timings):
                batch = batch.union(self.actor_wg.compute_ref_log_prob(batch))
        if self.critic_wg is not None:
            with self._stage("values", timings):
                batch = batch.union(self.critic_wg.compute_values(batch))
        with self._stage("advantage", timings):
            metrics.update(self.compute_advantages(batch))
        if self.critic_wg is not None:
            with self._stage("update_critic", timings):
                metrics.update(M.mean_metrics(self.critic_wg.update_critic(batch)))
        with self._stage("update_actor", timings):
            metrics.update(M.mean_metrics(self.actor_wg.update_actor(batch)))
        return batch[:rows] if len(batch) != rows else batch

    def _step_metrics(
        self,
        batch: DataProto,
        metrics: dict[str, float],
        timings: dict[str, float],
        *,
        waited: float,
        busy: float | None = None,
        idle_measured: bool = False,
    ) -> dict[str, float]:
        """The step's closing metrics: data, timing, throughput, memory, and how much of the step the
        trainer waited for rollouts (``async/trainer_idle_fraction``) and the replicas had nothing to
        generate (``async/rollout_idle_fraction``: in sync mode all but the generate stage; in
        one_step_off all but the background generation's time; async measures it in the stream)."""
        cfg = self.config
        step_s = max(timings["step"], 1e-9)
        metrics["async/trainer_idle_fraction"] = min(1.0, waited / step_s)
        if not idle_measured:
            generating = waited if busy is None else busy
            metrics["async/rollout_idle_fraction"] = max(0.0, 1.0 - generating / step_s)
        metrics["training/samples_per_s"] = len(batch) / step_s
        if self.core_share is not None:  # trainer.share_cores: the layer passes run on lent cores
            applied, borrowed = self.core_share.take_counts()
            metrics["perf/borrowed_core_fraction"] = borrowed / applied if applied else 0.0
        metrics.update(M.compute_data_metrics(batch, cfg.data.max_response_length))
        metrics.update(M.compute_timing_metrics(timings))
        metrics.update(M.compute_throughput_metrics(batch, timings, self.world_size))
        metrics.update(M.peak_memory_metrics())
        return metrics

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The generate stage: responses to ``prompts`` from the policy workers' replicas, or, in
        standalone mode, from the agent workers over the standalone replicas (unscored). In async mode
        it runs on the rollout stream's event loop, beside the stream's own requests."""
        stream = getattr(self, "stream", None)
        if stream is not None:
            return stream.run(self.agent_workers.generate_async(prompts))
        if self.agent_workers is not None:
            return self.agent_workers.generate_sequences(prompts)
        return self.actor_wg.generate_sequences(prompts)

    def sync_weights(self, wait: bool = True) -> dict[str, float]:
        """The weight-sync stage: the actor's weights into every replica that keeps its own copy.

        Standalone replicas receive while the policy workers send (through ``rollout.checkpoint_engine``),
        as policy version ``self.step`` (the steps trained; their tokens carry it); other replicas are
        loaded by their own worker. Returns ``weight_sync/megabytes`` (what one replica received) and
        ``weight_sync/mb_per_s`` (over the stage's wall time).

        ``wait=False`` (the async trainer, standalone replicas): the stage ends once the replicas have
        read the weights, not loaded them (``ReplicaManager.update_weights``): a replica finishing rows
        in flight never holds the trainer; requests sent after the stage get the new weights.
        """
        if self.replicas is not None:
            version = int(getattr(self, "step", 0))
            stats = self.replicas.update_weights(
                self.actor_wg.send_rollout_weights, version=version, wait=wait
            )
            sent, seconds = float(stats.bytes), stats.seconds
        else:
            ranks = self.actor_wg.sync_rollout_weights()
            sent = max(float(r["bytes"]) for r in ranks)
            seconds = max(float(r["seconds"]) for r in ranks)
        return {
            "weight_sync/megabytes": sent / 1e6,
            "weight_sync/mb_per_s": sent / 1e6 / seconds if seconds > 0 else 0.0,
        }

    def score(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """The score stage: ``token_level_scores`` for ``batch``, computed where ``reward.placement``
        says (the driver, or each policy worker on its share), and the reward metrics: error and
        timeout counts summed over the workers, ``reward/tool`` (the tools' weighted reward per sample)
        and the mean of each numeric extra field a dict reward returned (``reward_extra/<field>/mean``).
        """
        from trellis.reward.scoring import score_batch, sum_counts

        if self.config.reward.placement == "driver":
            scored = score_batch(
                self.reward_manager, batch, tool_reward_weight=self.config.reward.tool_reward_weight
            )
        else:
            scored = self.actor_wg.compute_scores(batch)
        counts = sum_counts(scored.meta_info.pop("metrics", {}) or {})
        batch = batch.union(scored)
        metrics: dict[str, float] = {
            k: counts[k]
            for k in ("reward/errors", "reward/timeouts", "reward/model_errors", "reward/model_timeouts")
            if k in counts
        }
        if "reward/tool_sum" in counts:
            metrics["reward/tool"] = counts["reward/tool_sum"] / max(1.0, counts["reward/scored"])
        for key in [k for k in batch.non_tensor_batch if k.startswith("reward_extra/")]:
            values = batch.non_tensor_batch.pop(key).astype(np.float64)
            metrics[f"{key}/mean"] = float(np.nanmean(values)) if len(values) else 0.0
        return batch, metrics

    def compute_advantages(self, batch: DataProto) -> dict[str, float]:
        """The advantage stage (in place): ``token_level_rewards`` (with the KL penalty when
        ``algorithm.use_kl_in_reward``), rollout correction when configured, then ``advantages`` and
        ``returns`` from the estimator, called with exactly the inputs it declares."""
        from trellis.algorithms.rollout_correction import rollout_correction_from_config

        cfg = self.config.algorithm
        b = batch.tensors
        metrics: dict[str, float] = {}
        if cfg.use_kl_in_reward:
            beta = self.kl_ctrl.value
            b["token_level_rewards"], kl = objective.kl_in_reward(
                b["token_level_scores"],
                b["old_log_probs"],
                b["ref_log_prob"],
                b["response_mask"],
                kl_coef=beta,
                kl_penalty_kind=cfg.kl_penalty,
            )
            current = float(kl.mean())
            self.kl_ctrl.update(current, len(batch))
            metrics.update({"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta})
        else:
            b["token_level_rewards"] = b["token_level_scores"]
        mask = b["response_mask"]
        if "ref_log_prob" in b and "old_log_probs" in b:
            metrics["actor/kl_ref"] = float(
                masked_mean(kl_penalty(b["old_log_probs"], b["ref_log_prob"], "kl"), mask.float())
            )
        if cfg.rollout_correction.enabled and "rollout_log_probs" in b:
            weights, new_mask, rc_metrics = rollout_correction_from_config(
                b["old_log_probs"], b["rollout_log_probs"], mask, cfg
            )
            if weights is not None:
                b["rollout_is_weights"] = weights
            b["response_mask"] = new_mask.to(mask.dtype)
            metrics.update({k: float(v) for k, v in rc_metrics.items()})  # keys carry rollout_corr/
        if cfg.off_policy == "decoupled":
            from trellis.algorithms.off_policy import decoupled_weights

            if "rollout_log_probs" not in b:
                raise ValueError(
                    "algorithm.off_policy=decoupled: the rollout has no rollout_log_probs (the behaviour "
                    "policy's); the replica did not return log-probs although rollout.calculate_log_probs "
                    "is on."
                )
            b["rollout_is_weights"], off_metrics = decoupled_weights(
                b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], cfg.off_policy_cap
            )
            metrics.update(off_metrics)
        b["advantages"], b["returns"] = objective.compute_advantages(
            cfg.adv_estimator,
            b["token_level_rewards"],
            b["response_mask"],
            index=batch.non_tensor_batch["uid"],
            config=cfg,
            inputs={key: b[key] for key in objective.INPUT_NEEDS if key in b},
        )
        return metrics

    def _label(self, prompts: DataProto, prefix: str, step: int | None = None) -> DataProto:
        """``prompts`` with a ``uid`` per prompt (its responses' group id) and the step number
        (``step``, default the current one)."""
        prompts.non_tensor_batch["uid"] = np.array(
            [f"{prefix}{i}" for i in range(len(prompts))], dtype=object
        )
        prompts.meta_info["global_steps"] = self.step if step is None else step
        return prompts

    # ------------------------------------------------------------------ validation

    def _validate(self, result: TrainResult, hooks: Any, log: bool = True) -> dict[str, float]:
        """Generate for the validation set (``rollout.val_kwargs`` sampling), score it, and report the
        mean reward, pass@1 / pass@n and the response length; the first ``trainer.log_val_generations``
        samples (prompt, response, score) go to every tracker's ``log_generations``."""
        cfg = self.config
        val_set = self.val_set
        if val_set is None:
            raise RuntimeError("_validate: this run has no validation data (data.val_files is empty).")
        if getattr(self, "replicas", None) is not None:  # async steps leave the replicas' loads pending
            self.replicas.wait_for_weights()  # a failed load raises here, not as a wrong score
        n = cfg.rollout.val_kwargs.n
        size = cfg.data.val_batch_size or len(val_set)
        scores, groups, lengths = [], [], []
        samples: list[dict[str, Any]] = []
        for start in range(0, len(val_set), size):
            prompts = val_set.collate_fn([val_set[i] for i in range(start, min(start + size, len(val_set)))])
            prompts = self._label(prompts, f"val-{start}-")
            prompts.meta_info["validate"] = True
            out = self.generate_sequences(_numbered(prompts.repeat(n, interleave=True)))
            out.meta_info.pop("metrics", None)
            out, _ = self.score(out)
            row_scores = out.tensors["token_level_scores"].sum(-1)
            scores.append(row_scores.numpy())
            groups.append(out.non_tensor_batch["uid"])
            width = out.tensors["prompts"].shape[1]
            lengths.append(out.tensors["attention_mask"][:, width:].sum(-1).float().numpy())
            wanted = cfg.trainer.log_val_generations - len(samples)
            if wanted > 0:
                samples += self._generations(out, row_scores, wanted)
        all_scores = np.concatenate(scores)
        pass1, passn = M.pass_at_k(all_scores, np.concatenate(groups))
        metrics = {
            "val/reward/mean": float(all_scores.mean()),
            "val/pass@1": pass1,
            f"val/pass@{n}": passn,
            "val/response_length/mean": float(np.concatenate(lengths).mean()),
        }
        result.validation.append((self.step, metrics))
        for tracker in getattr(self, "trackers", []):
            if log:
                tracker.log(metrics, self.step)
            if samples and hasattr(tracker, "log_generations"):
                tracker.log_generations(samples, self.step)
        hooks.trellis_validation_end(step=self.step, metrics=metrics)
        return metrics

    def _generations(self, out: DataProto, scores: torch.Tensor, limit: int) -> list[dict[str, Any]]:
        """The first ``limit`` rows of a scored batch as ``{"prompt", "response", "score"}`` texts."""
        b = out.tensors
        width = b["prompts"].shape[1]
        rows = []
        for i in range(min(limit, len(out))):
            prompt = b["prompts"][i][b["attention_mask"][i, :width].bool()]
            response = b["responses"][i][b["attention_mask"][i, width:].bool()]
            rows.append(
                {
                    "prompt": self.tokenizer.decode(prompt.tolist(), skip_special_tokens=True),
                    "response": self.tokenizer.decode(response.tolist(), skip_special_tokens=True),
                    "score": float(scores[i]),
                }
            )
        return rows

    # ------------------------------------------------------------------ checkpoints

    def _checkpoints(self) -> Any:
        """The run's checkpoints, ``<run_dir>/checkpoints``: one resumes here only when it holds a policy
        shard (and, with a critic, a critic shard) for each of this run's workers."""
        from trellis.checkpoint.training import CheckpointManager

        parts = {"actor": self.world_size}
        if getattr(self, "critic_wg", None) is not None:
            parts["critic"] = self.world_size
        return CheckpointManager(
            os.path.join(self.run_dir, "checkpoints"),
            max_to_keep=self.config.trainer.max_actor_ckpt_to_keep,
            parts=parts,
        )

    def _save_checkpoint(self) -> str:
        """Checkpoint the run at ``self.step``; returns the folder.

        The driver opens the save; every worker writes its own shard (its engine's state and its
        process's RNG state, ``actor/rank_R.pt``, ``critic/rank_R.pt``) and returns only the shard's
        size and sha256, so no tensor of the training state passes through the driver. Once every
        worker's call has returned (the barrier across the groups), the driver writes its own state
        (step, data loader position, KL coefficient, its RNG: ``trainer/rank_0.pt``) and publishes
        the checkpoint: manifest, rename into ``global_step_<step>``, ``latest`` pointer, pruning.
        """
        from trellis.checkpoint.rng import capture_rng_state

        manager = self._checkpoints()
        manager.begin(self.step)
        self.actor_wg.save_checkpoint(manager.root, self.step)
        if self.critic_wg is not None:
            self.critic_wg.save_checkpoint(manager.root, self.step)
        loader = self.loader.state_dict()
        if self._pending_batch is not None and self._loader_state_before_pending is not None:
            loader = self._loader_state_before_pending  # one_step_off: the next batch is generated again
        trainer = {
            "step": self.step,
            "loader": loader,
            "kl_coef": float(getattr(self.kl_ctrl, "value", 0.0)),
            "rng": capture_rng_state(),
        }
        if self.stream is not None:  # async: the buffer, the memory and the prompts not yet trained
            trainer["stream"] = self.stream.state_dict()
        manager.save_shard(self.step, "trainer", 0, {"trainer": trainer})
        parts = {**(manager.parts or {}), "trainer": 1}
        return manager.publish(self.step, parts, hf_files=self._hf_files())

    def _hf_files(self) -> str | None:
        path = self.config.model.tokenizer_path or self.config.model.path
        return path if path and os.path.isdir(path) else None

    def _resume(self, result: TrainResult) -> None:
        """Continue from the checkpoint ``trainer.resume_mode`` picks, if any: the driver reads its own
        part (step, loader position, KL coefficient, RNG), each worker reads its own shard."""
        from trellis.checkpoint.rng import restore_rng_state
        from trellis.checkpoint.training import load_rank_file

        trainer = self.config.trainer
        path = self._checkpoints().resolve_resume(trainer.resume_mode, trainer.resume_from_path)
        if path is None:
            return
        saved = load_rank_file(path, 0, part="trainer")["trainer"]
        self.actor_wg.load_checkpoint(path)
        self.step = int(saved["step"])
        self.sync_weights()  # the replicas (own copies, standalone or not) generate with the restored weights
        if self.critic_wg is not None:
            self.critic_wg.load_checkpoint(path)
        self._stream_state = saved.get("stream")
        self.loader.load_state_dict(saved["loader"])
        if hasattr(self.kl_ctrl, "value"):
            self.kl_ctrl.value = float(saved["kl_coef"])
        restore_rng_state(saved["rng"])  # last: with local workers, one process holds every state
        result.last_checkpoint = path
        logger.info("Resumed from %s at step %d.", path, self.step)

    def _best_checkpoint(self, result: TrainResult) -> str | None:
        """The kept checkpoint of the step with the highest validation reward (else the last one)."""
        if result.last_checkpoint is None:
            return None
        manager = self._checkpoints()
        kept = set(manager.steps())
        scored = [(m["val/reward/mean"], step) for step, m in result.validation if step in kept]
        if not scored:
            return result.last_checkpoint
        return manager.path_of(max(scored, key=lambda item: (item[0], item[1]))[1])

    # ------------------------------------------------------------------ end of run

    def _plot(self, result: TrainResult) -> str | None:
        from trellis.trainer.plot import plot_reward_curve

        train = [
            (i + 1 + (result.steps - len(result.history)), m.get("reward/mean"))
            for i, m in enumerate(result.history)
        ]
        val = [(step, m.get("val/reward/mean")) for step, m in result.validation]
        return plot_reward_curve(os.path.join(self.run_dir, "reward_curve.png"), train, val)

    def _start_ray(self) -> None:
        """Connect to the running Ray cluster (``RAY_ADDRESS`` or a local ``ray start``), or start a
        local one sized to this machine, which :meth:`_shutdown` stops again."""
        import ray

        if ray.is_initialized():
            return
        try:
            ray.init(address="auto", log_to_driver=False)
        except ConnectionError:
            ray.init(include_dashboard=False, log_to_driver=False)
            self._own_ray = True

    def _shutdown_after_sigterm(self, result: TrainResult, finished: int) -> NoReturn:
        """Shut down, say where the run stopped (``finished``: the last step whose metrics were logged)
        and how to go on, and raise :class:`Terminated`: what reaches the caller is the stop with its exit
        status, also where a library turned the interrupted call into an error of its own (``ray.get``
        raises ``SystemExit(1)``)."""
        shut = "the workers shut down"
        try:
            self._shutdown()
        except BaseException as exc:  # a part that kept the SIGTERM's exception raised it again, or failed
            logger.error("The shutdown after SIGTERM was cut short.", exc_info=exc)
            shut = f"the shutdown was cut short ({type(exc).__name__}), so a process it started may be left"
        where = f"in step {self.step}" if finished < self.step else f"after step {finished}"
        resume = (
            f"the last checkpoint is {result.last_checkpoint}; trainer.resume_mode=auto continues from it"
            if result.last_checkpoint
            else "no checkpoint was saved (trainer.save_freq), so a new run starts from step 0"
        )
        logger.warning(
            f"Stopped by SIGTERM {where} ({finished} of {self.total_steps} steps finished, their metrics in "
            f"{self.run_dir}); the trackers were finished and {shut}; {resume}."
        )
        raise Terminated

    def _shutdown(self) -> None:
        self._stop_overlap()
        judge, self.judge = getattr(self, "judge", None), None
        if judge is not None:  # the colocated reward-model judge (trellis.trainer.judge)
            try:
                judge.stop()
            except Exception:
                logger.exception("Could not stop the reward-model judge.")
        close = getattr(getattr(self, "reward_manager", None), "close", None)
        if close is not None:  # the async manager's scoring processes (reward.placement=driver)
            close()
        for owner in ("agent_workers", "replicas"):  # standalone: processes this trainer started
            part = getattr(self, owner, None)
            setattr(self, owner, None)
            if part is not None:
                try:
                    part.shutdown()
                except Exception:
                    logger.exception("Could not shut the standalone %s down.", owner)
        actor_wg = getattr(self, "actor_wg", None)
        stalled, terminated = getattr(self, "_stall", None) is not None, getattr(self, "_terminated", False)
        interrupted = "the stall" if stalled else "SIGTERM" if terminated else None
        if actor_wg is not None and interrupted and self.config.trainer.executor != "local":
            # a worker may still be inside the interrupted stage, and a call would queue behind it (for
            # good after a stall: the run would leave only by STALL_GRACE_S's exit); it is killed below
            logger.warning(
                f"After {interrupted} the workers are killed without releasing their rollout replicas first "
                "(a worker may still be inside the interrupted stage)."
            )
        elif actor_wg is not None:  # engines of plugin replicas run processes of their own
            try:
                actor_wg.release_rollout()
            except Exception:
                logger.exception("Could not shut the rollout replicas down.")
        for group in self.groups:
            try:
                group.shutdown()
            except Exception:
                logger.exception("Could not shut a worker group down.")
        self.groups = []
        if getattr(self, "_own_ray", False):
            import ray

            ray.shutdown()
            self._own_ray = False
        share, self.core_share = getattr(self, "core_share", None), None
        if share is not None:  # after the replicas left it: the ledger's file goes
            share.close()
        if self._threads_before is not None:  # _leave_cores_to_replicas lowered them
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        set_flush_denormal(getattr(self, "_denormal_before", False))
        set_host_memory(getattr(self, "_host_memory_before", host_memory()))


def _worker_mean(metrics: dict[str, Any]) -> dict[str, float]:
    """Metrics gathered from several workers (a list per key after ``DataProto.concat``) as means."""
    return {k: float(np.mean(v)) if isinstance(v, list | tuple) else float(v) for k, v in metrics.items()}


def _pad_to_multiple(batch: DataProto, workers: int) -> DataProto:
    """``batch`` with rows appended until the workers can share it evenly: copies of its first row with
    nothing to train on (``response_mask`` and rewards 0, a uid of their own), which every loss, advantage
    and count ignores (``global_batch_info`` counts rows with a masked-in token). Unchanged when it
    divides already, as it does unless an agent loop split prompts into several samples."""
    missing = -len(batch) % workers
    if not missing:
        return batch
    pad = batch[[0] * missing]
    for key in ("response_mask", "token_level_scores", "token_level_rewards", "rm_scores"):
        if key in pad.tensors:
            pad.tensors[key] = torch.zeros_like(pad.tensors[key])
    pad.non_tensor_batch["uid"] = np.array([f"__pad__-{i}" for i in range(missing)], dtype=object)
    return DataProto.concat([batch, pad])


def _numbered(batch: DataProto) -> DataProto:
    """``batch`` with its rows numbered (``__row__``), so sampling seeds do not depend on how it is split."""
    from trellis.rollout.agent_loop import ROW_KEY

    batch.non_tensor_batch[ROW_KEY] = np.arange(len(batch), dtype=np.int64)
    return batch


def on_policy(config: Any, needs: Any = ()) -> bool:
    """Whether a step's update is exactly one optimizer step over the whole batch with nothing else
    reading the old log-probs (no KL in the reward, no rollout correction, no decoupled off-policy
    weights, no estimator or loss that declares ``old_log_probs``), so they equal the current policy's
    and need no separate forward pass."""
    actor, algorithm = config.actor, config.algorithm
    return (
        actor.ppo_epochs == 1
        and actor.ppo_mini_batch_size == config.data.train_batch_size
        and not algorithm.use_kl_in_reward
        and not algorithm.rollout_correction.enabled
        and "old_log_probs" not in needs
        and algorithm.off_policy == "none"  # decoupled: the proximal policy's log-probs are recomputed
    )


def _greedy(prompts: DataProto) -> DataProto:
    """``prompts`` (same uids) to be answered greedily: the baseline responses of ``remax``."""
    greedy = prompts[list(range(len(prompts)))]
    greedy.meta_info = {**prompts.meta_info, "greedy": True}
    return greedy


def _baselines(greedy: DataProto, n: int) -> torch.Tensor:
    """``reward_baselines`` (bs·n,): each greedy response's score, repeated for the prompt's n samples."""
    return greedy.tensors["token_level_scores"].sum(-1).repeat_interleave(n)
