"""``fsdp``: data-parallel training with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Every rank of the process group runs one engine on its share of the global batch. The model is
sharded per transformer block (the classes the model lists in ``_no_split_modules``) plus the
root (embeddings, final norm, heads): each rank keeps 1/``dp_size`` of every parameter, of its
gradient and of the optimizer state, and a block's weights are all-gathered just for its
forward and backward. Gradients are reduce-scattered as averages over the ranks, which is the
convention of :mod:`trellis.algorithms.aggregation` (each rank's loss carries a ``× dp_size``).

A vision-language model's vision tower is a unit of its own too (its blocks inside it): the engine
computes the vision features before the model's forward (:mod:`trellis.engine.multimodal`), so the
tower gathers its weights when called, as the blocks do.

Mixed precision: parameters are float32; with ``model.dtype`` bfloat16/float16 FSDP casts them
for compute and reduces gradients in float32.

The caller initialises ``torch.distributed`` first (every rank: ``init_process_group`` with
``gloo`` on CPU, ``nccl`` on CUDA — :func:`trellis.device.get_communication_backend` — and, on
an accelerator, sets the rank's device). Building an engine and everything it does on a batch
involve collectives: all ranks must construct it and call the same methods in the same order
(``forward``, ``forward_backward``, ``optimizer_step``, ``iter_full_params`` to its end), with
batches of at least one row each.

Loading: only rank 0 of the process group reads the checkpoint (the float32 model in its host
memory); the other ranks build the same model on the meta device, without storage
(:func:`~trellis.engine.models.build_meta_model`). After sharding, their shards are allocated and
every parameter is scattered from rank 0 (each rank receives only its shard), and every buffer
(non-persistent ones such as rotary ``inv_freq`` included) is broadcast from it, so all ranks hold
exactly rank 0's weights: the critic's seeded value head included, tied weights still tied. The
whole model is in memory on rank 0's host alone, and only until the engine is built.

Offload: ``offload.param`` uses FSDP's own CPU offload (``CPUOffloadPolicy``): each rank's shards
of the parameters, of their gradients and of the optimizer state live in host memory (pinned on
an accelerator); a block's shards are copied in just for its all-gather, gradients are copied out
as they are reduced, and the optimizer step runs on the CPU. Because the optimizer state then
lives on the host too, ``offload.param`` needs ``offload.optimizer`` (a ConfigValueError says
so). ``offload.optimizer`` alone moves this rank's optimizer state shards between host memory and
the device at the edges of each :meth:`~trellis.engine.base.TrainingEngine.phase`. On a CPU device
the host is the device: the policy is installed, nothing moves.

``state_dict()`` holds this rank's shards as plain tensors (``torch.save`` one file per rank);
``load_state_dict`` takes them back into an engine with the same ``dp_size``. For a full
checkpoint (any size, or Hugging Face format) use ``iter_full_params``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from trellis.config.base import ConfigValueError
from trellis.engine.base import HOST, EngineError, TrainingEngine, check_state_keys
from trellis.engine.models import build_meta_model, decoder_layers, load_model
from trellis.engine.multimodal import vision_tower

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class FSDPEngine(TrainingEngine):
    """A :class:`~trellis.engine.base.TrainingEngine` sharded with FSDP2 (registered as ``fsdp``).

    ``FSDPEngine(model_config, role_config, role="actor", total_steps=None, device=None,
    process_group=None, seed=0)``: ``process_group`` is the data-parallel group, None = the
    default group.

    Raises:
        EngineError: ``torch.distributed`` is not initialised.
        ConfigValueError: ``offload.param`` without ``offload.optimizer`` (actor, critic).
    """

    name = "fsdp"
    supports_sequence_parallel = True

    def _init_parallel(self, process_group: Any) -> tuple[int, int]:
        if not (dist.is_available() and dist.is_initialized()):
            raise EngineError(
                "The fsdp engine needs torch.distributed: call torch.distributed.init_process_group(backend, "
                "...) in every rank first (backend: trellis.device.get_communication_backend(), gloo on "
                "CPU), or use the 'single' engine for one process."
            )
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None  # WORLD is set once torch.distributed is initialized: checked above
        self.process_group = group
        self.mesh = DeviceMesh.from_group(group, self.device.type)  # FSDP shards over every rank
        self.group_rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.dp_group = group
        if self.sp_size == 1:
            return self.group_rank, world
        # a (dp x sp) layout: ranks r*sp .. r*sp + sp - 1 split the sequences of data-parallel rank r
        if world % self.sp_size:
            raise ConfigValueError(
                f"{self.role}.ulysses_sequence_parallel_size",
                self.sp_size,
                f"must divide the {world} ranks of the engine's group into sequence-parallel groups",
            )
        ranks = dist.get_process_group_ranks(group)
        dp_size = world // self.sp_size
        # every rank creates every group, in the same order (new_group is collective)
        sp_groups = [dist.new_group(ranks[i * self.sp_size : (i + 1) * self.sp_size]) for i in range(dp_size)]
        dp_groups = [dist.new_group(ranks[j :: self.sp_size]) for j in range(self.sp_size)]
        self.sp_group = sp_groups[self.group_rank // self.sp_size]
        self.dp_group = dp_groups[self.group_rank % self.sp_size]
        return self.group_rank // self.sp_size, dp_size

    def _check_offload(self) -> None:
        if self.role != "ref" and self.offload_param and not self.offload_optimizer:
            raise ConfigValueError(
                f"{self.role}.offload.optimizer",
                False,
                f"must be true when {self.role}.offload.param is true with the fsdp engine: FSDP's CPU "
                "offload keeps the optimizer state in host memory beside the parameters and steps it there",
                hint=f" Set {self.role}.offload.optimizer=true as well, or {self.role}.offload.param=false "
                "to offload the optimizer state alone.",
            )

    def _load_module(self, model_config: Any, *, value_model: bool, path: str | None, seed: int) -> Any:
        module, failure = None, None
        try:
            if self.group_rank == 0:
                module = load_model(model_config, value_model=value_model, path=path, seed=seed)
            else:
                module = build_meta_model(model_config, value_model=value_model, path=path)
        except Exception as exc:
            failure = exc
        # Every rank learns of a failure here; else the others would wait out the collective
        # timeout for weights that never come from rank 0.
        failed = torch.tensor(float(failure is not None), device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.process_group)  # every rank, sp peers too
        if failed.item():
            if failure is not None:
                raise failure
            raise EngineError(
                f"fsdp rank {self.group_rank}: another rank of the process group failed to build the "
                f"{self.role} model; its error says why."
            )
        return module

    def _wrap_model(self, module: torch.nn.Module) -> torch.nn.Module:
        # Rank 0's whole weights, sent after sharding: detached views keep the host copies alive
        # (fully_shard moves the parameters themselves onto the device, block by block).
        source: dict[str, torch.Tensor] = {}
        if self.group_rank == 0:
            source = {name: param.detach() for name, param in module.named_parameters()}
        if self.dtype == torch.float32:
            policy = MixedPrecisionPolicy()
        else:
            policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        offload = OffloadPolicy()
        if self.offload_param:  # pinned host memory overlaps the copies with compute (accelerators only)
            offload = CPUOffloadPolicy(pin_memory=self.device.type != "cpu")
            self._offloaded_by_wrapper = True
        # No module.to(device) first: fully_shard moves one block at a time, so the whole model is
        # never on the device unsharded.
        for layer in decoder_layers(module):
            fully_shard(layer, mesh=self.mesh, mp_policy=policy, offload_policy=offload)
        tower = vision_tower(module)
        if tower is not None:  # a unit of its own: the engine runs it before the model's forward
            fully_shard(tower, mesh=self.mesh, mp_policy=policy, offload_policy=offload)
        fully_shard(module, mesh=self.mesh, mp_policy=policy, offload_policy=offload)
        if self.group_rank != 0:  # storage for the meta shards: in host memory under FSDP's CPU offload
            module.to_empty(device=HOST if self.offload_param else self.device)
            for buffer in module.buffers():  # buffers (unsharded) stay on the device, as FSDP puts them
                if buffer.device != self.device:
                    buffer.data = torch.empty_like(buffer, device=self.device)
        self._copy_from_rank0(module, source)
        return module

    @torch.no_grad()
    def _copy_from_rank0(self, module: torch.nn.Module, source: Mapping[str, torch.Tensor]) -> None:
        """Give every rank rank 0's values: each parameter's shard scattered from ``source`` (rank 0's
        whole tensors; empty on the other ranks), each buffer broadcast. One tensor at a time, so
        the only whole copy beyond rank 0's host is one tensor on the device."""
        for name, param in module.named_parameters():
            full = source.get(name)
            if full is None:  # a receiving rank: distribute_tensor reads only the shape here
                full = torch.empty(param.shape, dtype=param.dtype, device=self.device)
            if isinstance(param, DTensor):  # mesh rank 0 (this group's rank 0) is the source
                shard = distribute_tensor(full, param.device_mesh, param.placements).to_local()
                param.to_local().copy_(shard)
            else:
                param.copy_(self._broadcast(full))
        for buffer in module.buffers():
            buffer.copy_(self._broadcast(buffer))

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as this group's rank 0 holds it (a copy on the device)."""
        tensor = tensor.detach().to(self.device, copy=True)
        dist.broadcast(tensor, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        return tensor

    def to(
        self, device: str | torch.device, *, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """As :meth:`TrainingEngine.to`; with FSDP's CPU offload (``offload.param``) the parameters and
        optimizer state stay in host memory, so ``to("cpu")`` only drops the gradients (``grad=False``).

        Raises:
            EngineError: a move onto an accelerator under FSDP's CPU offload.
        """
        if not self._offloaded_by_wrapper:
            super().to(device, model=model, optimizer=optimizer, grad=grad)
            return
        target = torch.device(device)
        if target.type != "cpu":
            raise EngineError(
                f"FSDPEngine.to({str(target)!r}): with {self.role}.offload.param=true FSDP keeps the "
                f"parameters and optimizer state in host memory and streams them to {self.device} block "
                f"by block; they cannot be moved. Set {self.role}.offload.param=false to keep them on the "
                "device."
            )
        if model and not grad:
            self.model.zero_grad(set_to_none=True)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Over the data-parallel ranks (the ranks of a sequence-parallel group hold the same rows)."""
        tensor = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(tensor, op=_OPS[op], group=self.dp_group)
        return tensor

    def _union_keys(self, keys: list[str]) -> list[str]:
        gathered: list[Any] = [None] * self.dp_size
        dist.all_gather_object(gathered, sorted(keys), group=self.dp_group)
        return sorted({key for rank_keys in gathered for key in rank_keys})

    def _compute_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # FSDP's MixedPrecisionPolicy casts the parameters

    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, DTensor):
            return tensor
        if tensor.device.type != self.device.type:  # a host shard (CPU offload): gather on the device
            return cast(DTensor, tensor.to(self.device)).full_tensor()
        return tensor.full_tensor()

    # ---------------------------------------------------------------- sharded state

    def _model_state(self) -> dict[str, torch.Tensor]:
        return {key: _local(value) for key, value in self.model.state_dict().items()}

    def _iter_full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():  # DTensors (not _model_state's shards)
            with torch.no_grad():  # not around the yield: the caller's grad mode stays its own
                full = self._full(tensor).detach()
            yield name, full

    def _optimizer_state(self) -> dict[str, Any]:
        assert self.optimizer is not None  # state_dict() asks only an engine that trains
        state = self.optimizer.state_dict()
        return {
            "state": {
                index: {key: _local(value) for key, value in entry.items()}
                for index, entry in state["state"].items()
            },
            "param_groups": state["param_groups"],
        }

    def _load_model_state(self, state: Mapping[str, torch.Tensor]) -> None:
        live = self.model.state_dict()
        check_state_keys(live, state)
        with torch.no_grad():
            for key, value in state.items():
                target = _local(live[key])
                if target.shape != value.shape:
                    raise ValueError(
                        f"load_state_dict: shard {key!r} has shape {tuple(value.shape)} in the state but "
                        f"{tuple(target.shape)} here; load each rank's own state into an engine of the same "
                        "dp_size."
                    )
                target.copy_(value)

    def _load_optimizer_state(self, state: Mapping[str, Any]) -> None:
        assert self.optimizer is not None  # load_state_dict() calls this only for an engine that trains
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        entries = {}
        for index, entry in state["state"].items():
            param = params[int(index)]
            # tensors shaped like the parameter's shard (Adam's moments) become DTensors like it
            entries[index] = {key: _like(value, param, key) for key, value in entry.items()}
        self.optimizer.load_state_dict({"state": entries, "param_groups": state["param_groups"]})


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _like(value: Any, param: torch.Tensor, key: str) -> Any:
    """``value`` (a local shard) as a DTensor sharded like ``param``; scalars and non-tensors as they are."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or not isinstance(param, DTensor):
        return value
    local = param.to_local()
    if value.shape != local.shape:
        raise ValueError(
            f"load_state_dict: optimizer state {key!r} has shape {tuple(value.shape)} but this rank's "
            f"parameter shard is {tuple(local.shape)}; load each rank's own state into an engine of the "
            "same dp_size."
        )
    return DTensor.from_local(
        value.to(local.device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
