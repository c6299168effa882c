"""Rollout replicas and agent loops in processes of their own (``rollout.mode=standalone``).

:class:`ReplicaActor` hosts one registered replica (``hf``, ``vllm``, a plugin's) in a Ray actor on
its own devices; :class:`RemoteReplica` is the trainer-side handle on it, a
:class:`~trellis.rollout.RolloutReplica` whose calls cross the process boundary, so agent loops and
the router use it like an in-process replica. Weights reach a replica actor only through its
checkpoint engine (:meth:`ReplicaActor.connect_weight_sync`, then :meth:`ReplicaActor.receive_weights`
each step, while the trainer's ranks send). :class:`AgentWorker` runs agent loops in a process of its
own, over remote replicas (``rollout.agent.num_workers``).

Ray is imported only by the code that starts these actors (:mod:`trellis.rollout.manager`): the classes
here are plain classes that Ray wraps.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from typing import Any

from trellis.data.protocol import DataProto
from trellis.errors import RolloutReplicaError
from trellis.rollout.base import RolloutReplica, has_items
from trellis.rollout.sampling import SamplingParams, TokenOutput


def set_process_cpu(config: Any) -> None:
    """The CPU settings of a worker's or replica's process: its torch threads (``TRELLIS_NUM_THREADS``),
    whether its CPU computations flush denormals (``trainer.flush_denormal``) and what malloc does with
    freed memory (``trainer.host_memory``); a config without a ``trainer`` section takes the defaults.
    A Ray actor is a process of its own: the driver's settings never reach it."""
    import torch

    from trellis.device.cpu import set_flush_denormal
    from trellis.utils.memory import set_host_memory

    trainer = getattr(config, "trainer", None)
    set_host_memory(str(getattr(trainer, "host_memory", "reuse")))  # before the threads below allocate
    torch.set_num_threads(int(os.environ.get("TRELLIS_NUM_THREADS", torch.get_num_threads())))
    set_flush_denormal(bool(getattr(trainer, "flush_denormal", True)))


async def wake_and_resume(replica: Any) -> None:
    """Wake ``replica`` and let it serve again (``resume`` where the backend stages its wake-up)."""
    await replica.wake_up()
    resume = getattr(replica, "resume", None)
    if resume is not None:
        await resume()


class ReplicaActor:
    """One rollout replica in its own process: built from the run's config, served over Ray.

    Every method is ``async`` (Ray runs them on one event loop), so concurrent ``generate`` calls
    reach the replica together and it batches them as it would in process.

    Args:
        replica_rank: the replica's index among the run's replicas.
        config: the run's :class:`~trellis.config.TrellisConfig` (``rollout``, ``model``).
    """

    def __init__(self, replica_rank: int, config: Any) -> None:
        from trellis.registries import rollout_replicas

        set_process_cpu(config)
        self.config = config
        self.replica_rank = replica_rank
        self.replica = rollout_replicas.get(config.rollout.name)(replica_rank, config.rollout, config.model)
        self._sync: Any = None  # the WeightSyncManager and the connected engine, once connected
        self._engine: Any = None
        self._core_share: Any = None  # this process's slot in the machine's core ledger, once shared

    async def init(self) -> dict[str, Any]:
        """Load the model (``model.path``) and start serving; the process id and server address."""
        from trellis.utils.tokenizer import hf_tokenizer

        model = self.config.model
        tokenizer = hf_tokenizer(
            model.tokenizer_path or model.path, trust_remote_code=model.trust_remote_code
        )
        await self.replica.init("standalone", tokenizer=tokenizer)
        return {"pid": os.getpid(), "server_address": self.replica.server_address}

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> TokenOutput:
        if multi_modal_data:
            return await self.replica.generate(
                prompt_ids, sampling_params, request_id, multi_modal_data=multi_modal_data
            )
        return await self.replica.generate(prompt_ids, sampling_params, request_id)

    async def sleep(self) -> None:
        await self.replica.sleep()

    async def wake_up(self) -> None:
        await wake_and_resume(self.replica)

    async def ping(self) -> int:
        """This process's id (a health check that the actor answers)."""
        return os.getpid()

    async def weight_version(self) -> int:
        """The policy version of the replica's weights."""
        return int(self.replica.weight_version)

    async def connect_weight_sync(self, kwargs: dict[str, Any]) -> None:
        """Join the weight-sync group as a receiver, with the kwargs the trainer's plan gave this rank.

        Blocks (in a thread) until the trainer's ranks join too; they call concurrently.
        """
        from trellis.checkpoint.sync import WeightSyncManager

        self._sync = WeightSyncManager(self.config.rollout.checkpoint_engine)
        engine = self._sync.create_engine()
        try:
            await asyncio.to_thread(engine.init_process_group, **kwargs)
        except BaseException:
            engine.finalize()
            raise
        self._engine = engine

    async def receive_weights(self, version: int | None = None, staged: bool = False) -> dict[str, float]:
        """The receiving half of one weight sync: wake the replica, load every bucket (policy version
        ``version``), resume it. Generation in flight waits, or with ``rollout.partial_rollout`` is
        interrupted and resumed with the new weights. ``staged``: read every bucket before that wait
        (:meth:`~trellis.checkpoint.sync.WeightSyncManager.receive`), so the sender is released first.

        Returns ``{"tensors", "bytes", "seconds"}`` as loaded.
        """
        if self._engine is None:
            raise RolloutReplicaError(
                f"rollout replica {self.replica_rank}: receive_weights before connect_weight_sync; the "
                "replica manager connects the checkpoint engine first."
            )
        stats = await self._sync.receive(self._engine, [self.replica], version=version, staged=staged)
        return {"tensors": float(stats.tensors), "bytes": float(stats.bytes), "seconds": stats.seconds}

    async def share_cores(self, path: str, slot: int) -> bool:
        """Join the trainer's core ledger at ``path`` as participant ``slot``
        (:mod:`trellis.device.core_share`), if the replica takes part (its ``share_cores(share)``
        returns True); whether it does. One that does not leaves its slot busy: its cores are never lent.
        """
        from trellis.device.core_share import CoreShare

        take = getattr(self.replica, "share_cores", None)
        if take is None:
            return False
        share = CoreShare.attach(path, slot)
        if not take(share):
            share.close()
            return False
        self._core_share = share
        return True

    async def shutdown(self) -> None:
        """Finalize the checkpoint engine, shut the replica's engine down and leave the core ledger."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.finalize()
        share, self._core_share = self._core_share, None
        if share is not None:
            share.close()
        shutdown = getattr(self.replica, "shutdown", None)
        if shutdown is not None:
            await shutdown()


class RemoteReplica(RolloutReplica):
    """The trainer's handle on a :class:`ReplicaActor`: a replica whose calls run in another process.

    ``init`` and weight updates go through the :class:`~trellis.rollout.manager.ReplicaManager`
    (the actor loads its own model; weights arrive through the checkpoint engine), so calling them here
    is an error that says so. A call to a dead actor raises :class:`RolloutReplicaError` naming it.
    """

    def __init__(self, actor: Any, replica_rank: int, rollout_config: Any, model_config: Any) -> None:
        super().__init__(replica_rank, rollout_config, model_config)
        self.actor = actor
        self.mode = "standalone"
        self.pid: int | None = None
        self._address: str | None = None

    def describe(self) -> str:
        """``rollout replica <rank> (pid <pid>)``, as error messages name it."""
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        return f"rollout replica {self.replica_rank}{pid}"

    async def _call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError

        try:
            return await getattr(self.actor, method).remote(*args)
        except RayActorError as exc:
            raise RolloutReplicaError(
                f"{self.describe()} is dead ({type(exc).__name__}) during {method}; its process exited. "
                "Check its log (ray logs) and restart the run, which resumes from the last checkpoint."
            ) from exc

    async def init(
        self, mode: str = "standalone", *, model: Any = None, tokenizer: Any = None, device: Any = None
    ) -> None:
        raise RolloutReplicaError(
            f"{self.describe()} is started by its ReplicaManager (ReplicaManager.start_standalone), "
            "not through init()."
        )

    supports_multi_modal = True  # passed on: the replica in the actor's process refuses them if it must

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> TokenOutput:
        self.check_request(prompt_ids, sampling_params, request_id)
        if has_items(multi_modal_data):
            return await self._call(
                "generate", list(prompt_ids), sampling_params, request_id, multi_modal_data
            )
        return await self._call("generate", list(prompt_ids), sampling_params, request_id)

    async def sleep(self) -> None:
        await self._call("sleep")
        self.asleep = True

    async def wake_up(self) -> None:
        await self._call("wake_up")
        self.asleep = False

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        raise RolloutReplicaError(
            f"{self.describe()} runs in its own process: its weights arrive through the checkpoint "
            "engine (ReplicaManager.update_weights with the trainer's send), not as tensors passed here."
        )

    @property
    def server_address(self) -> str | None:
        return self._address


class AgentWorker:
    """Agent loops in a process of their own, over the run's remote replicas (a Ray actor).

    ``rollout.agent.num_workers`` of them split each batch of prompts; each runs its share's loops on
    its own event loop, so a loop that blocks (a slow synchronous tool) stalls only its worker.

    Args:
        config: the run's :class:`~trellis.config.TrellisConfig`.
        replicas: ``(replica_rank, actor handle, pid)`` of every replica.
    """

    def __init__(self, config: Any, replicas: list[tuple[int, Any, int | None]]) -> None:
        from trellis.rollout.agent_loop import AgentLoopManager
        from trellis.utils.tokenizer import hf_processor, hf_tokenizer

        set_process_cpu(config)
        self.config = config
        handles = []
        for rank, actor, pid in replicas:
            handle = RemoteReplica(actor, rank, config.rollout, config.model)
            handle.pid = pid
            handles.append(handle)
        model = config.model
        path = model.tokenizer_path or model.path
        tokenizer = hf_tokenizer(path, trust_remote_code=model.trust_remote_code)
        self.agents = AgentLoopManager(
            config.rollout,
            handles,
            tokenizer,
            response_length=config.data.max_response_length,
            processor=hf_processor(path, trust_remote_code=model.trust_remote_code),
        )

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """This worker's share of a batch, generated (see ``AgentLoopManager.generate_sequences``)."""
        return self.agents.generate_sequences(prompts)

    def ping(self) -> int:
        return os.getpid()
