"""``offload``: train a model whose FP32 training state is many times the device's memory.

Full fine-tuning with AdamW holds 16 bytes a parameter in FP32 (weights, gradients, two moments)
before one activation. This engine keeps all of that in host memory and lets only the working
set visit the device:

- **ParameterState** (one per parameter): the FP32 master and the FP32 gradient accumulator on
  the host (pinned where the backend pins), and a working copy in ``model.dtype`` that exists on
  the device only while its layer computes. ``to(device)`` copies the working copy in,
  ``cpu()`` drops the device copy (the host copy stays), ``zero_grad()`` clears the accumulator.
- **Layer residency.** At most ``offload.resident_layers`` decoder layers have their working
  copies on the device. While layer ``i`` computes, layer ``i + 1`` (``i − 1`` in backward) is
  copied in on a side stream of the selected device backend (:mod:`trellis.device`
  ``Stream``/``Event``), and the compute stream waits on that copy's event only when it reaches
  the layer. Layers a pass has finished with are evicted first. The embeddings, the final norm
  and the head (everything outside the decoder layers) stay on the device through a phase.
- **Backward, layer by layer.** In training each decoder layer runs without saving activations
  (only its input); backward recomputes it, back-propagates through it, and copies each
  parameter's gradient to its host accumulator on a second stream as soon as it is accumulated.
- **Optimizer on the host.** ``torch.optim.AdamW`` (``fused``, as the ``single`` engine's on the CPU)
  steps the FP32 masters on the CPU; the low-precision copies are then refreshed from the masters.

With ``model.dtype: float32`` the losses and updated weights equal the ``single`` engine's (the
same FP32 arithmetic in the same order); with bfloat16 the working copies are bfloat16 (no
autocast: the weights are already in the compute dtype) and the results agree within bf16
tolerance.

Accounting. The engine counts the bytes of its working copies and gradients on the device, so
:meth:`OffloadEngine.resident_bytes` and its peak are real on a CPU too, where the "device"
copies are separate allocations from the host masters. :meth:`OffloadEngine.where` says where a
layer's working copy is now.

Limits: one process (no data parallelism; use ``fsdp`` with ``offload.param`` across ranks).
Checkpoints, weight sync and export see the FP32 masters under the model's own names, exactly as
from ``single``: a checkpoint of one engine resumes in the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from trellis.config.base import schema_default
from trellis.config.schema import OffloadConfig
from trellis.device.base import DeviceBackend, DeviceEvent, DeviceStream
from trellis.engine.base import HOST, TrainingEngine, check_state_keys, role_setting, same_device
from trellis.engine.models import decoder_layers
from trellis.errors import EngineError
from trellis.utils.settings import setting

__all__ = ["LayerResidency", "OffloadEngine", "ParameterState"]


class ParameterState:
    """One parameter of the :class:`OffloadEngine`: host master and gradient, a movable working copy.

    Args:
        name: the parameter's name in the model (for messages).
        param: the module's parameter; its ``.data`` is set to the working copy wherever it is now.
        dtype: the working copy's dtype (``model.dtype``).
        pin: allocate the host tensors in pinned memory (fast, asynchronous copies to an accelerator).
        trainable: keep an FP32 gradient accumulator (False for frozen weights: LoRA's base, the ref).

    Attributes:
        master: the FP32 weights on the host; the optimizer steps them (``master.grad is grad``).
        grad: the FP32 gradient accumulator on the host, or None when not trainable.
        host_copy: the working copy at rest on the host (``master`` itself when ``dtype`` is float32).
        device_copy: the working copy on the compute device, or None when it is not there.
    """

    def __init__(
        self, name: str, param: torch.nn.Parameter, *, dtype: torch.dtype, pin: bool, trainable: bool
    ):
        self.name = name
        self.param = param
        self.dtype = dtype
        with torch.no_grad():
            self.master = _host_tensor(param.detach().to(HOST, torch.float32), pin)
            self.host_copy = (
                self.master if dtype == torch.float32 else _host_tensor(self.master.to(dtype), pin)
            )
        self.trainable = trainable
        self.grad: torch.Tensor | None = None
        if trainable:
            self.master.requires_grad_(True)
            self.grad = _host_tensor(torch.zeros_like(self.master, requires_grad=False), pin)
            self.master.grad = self.grad
        self.device_copy: torch.Tensor | None = None
        self.staging: torch.Tensor | None = None  # pinned host buffer an asynchronous gradient copy lands in
        param.data = self.host_copy
        param.grad = None

    @property
    def nbytes(self) -> int:
        """Bytes of one working copy."""
        return self.host_copy.numel() * self.host_copy.element_size()

    def to(self, device: torch.device) -> torch.Tensor:
        """Bring the working copy onto ``device`` (a separate allocation, also on a CPU device); the
        module's parameter points at it. Returns the device copy."""
        if self.device_copy is None:
            copy = torch.empty_like(self.host_copy, device=device)  # allocated on the current stream
            copy.copy_(self.host_copy)
            self.device_copy = copy
        self.param.data = self.device_copy
        return self.device_copy

    def cpu(self) -> None:
        """Point the parameter back at the host copy and free the device copy."""
        self.param.data = self.host_copy
        self.device_copy = None

    def zero_grad(self) -> None:
        """Clear the accumulated gradient (and any device gradient not yet copied)."""
        if self.grad is not None:
            self.grad.zero_()
        self.param.grad = None

    def refresh(self) -> None:
        """Copy the masters into the working copies (after an optimizer step or a load)."""
        with torch.no_grad():
            if self.host_copy is not self.master:
                self.host_copy.copy_(self.master)
            if self.device_copy is not None:
                self.device_copy.copy_(self.host_copy)


class LayerResidency:
    """Which decoder layers have their working copies on the device, and the copies in flight.

    Args:
        layers: each decoder layer's :class:`ParameterState` list, in model order.
        budget: at most this many layers resident at once (``offload.resident_layers``).
        device: the compute device.
        backend: the device backend whose streams and events order the copies.
        on_change: called with the change in resident bytes after every move.
        asynchronous: copy on a side stream, ordered by events (an accelerator); False: copy in line.
    """

    def __init__(
        self,
        layers: list[list[ParameterState]],
        budget: int,
        device: torch.device,
        backend: DeviceBackend,
        on_change: Callable[[int], None],
        asynchronous: bool,
    ):
        self.layers = layers
        self.budget = budget
        self.device = device
        self.backend = backend
        self.on_change = on_change
        self.asynchronous = asynchronous
        self.copy_stream: DeviceStream | None = backend.Stream() if self.asynchronous else None
        self.resident: dict[int, DeviceEvent | None] = {}
        """Resident layer -> the event its copy-in completes at (None: ready)."""
        self.fetches = 0
        """Copies of a layer onto the device so far (prefetched or not)."""
        self.waited = 0
        """Layers the compute reached before they were resident (fetched in line, not ahead)."""

    def where(self, layer: int) -> torch.device:
        return self.device if layer in self.resident else HOST

    def acquire(self, layer: int, direction: int) -> None:
        """Make ``layer`` ready to compute (waiting for its copy only now), then start copying the
        next layer in ``direction`` (+1 forward, −1 backward) if the budget leaves room."""
        if layer not in self.resident:
            self.waited += 1
            self._copy_in(layer, direction, current=None)
        event = self.resident[layer]
        if event is not None:
            self.backend.current_stream().wait_event(event)
            self.resident[layer] = None
        following = layer + direction
        ahead = 0 <= following < len(self.layers) and following not in self.resident
        if ahead and (
            len(self.resident) < self.budget or self._evictable(direction, current=layer, target=following)
        ):
            self._copy_in(following, direction, current=layer)

    def release_all(self) -> None:
        for layer in list(self.resident):
            self._evict(layer)

    def _copy_in(self, layer: int, direction: int, current: int | None) -> None:
        while len(self.resident) >= self.budget:
            victim = self._evictable(direction, current=current, target=layer)
            if victim is None:  # pragma: no cover - budget >= 1 always leaves a victim
                raise EngineError(f"offload: no layer can leave the device to make room for layer {layer}.")
            self._evict(victim)
        states = self.layers[layer]
        if self.asynchronous:
            assert self.copy_stream is not None
            # the copy may reuse memory the compute stream has just freed: start it after that work
            self.copy_stream.wait_stream(self.backend.current_stream())
            copies = [torch.empty_like(state.host_copy, device=self.device) for state in states]
            with self.backend.stream(self.copy_stream):
                for state, copy in zip(states, copies, strict=True):
                    copy.copy_(state.host_copy, non_blocking=True)
                    state.device_copy = copy
                    state.param.data = copy
            event = self.backend.Event()
            event.record(self.copy_stream)
            self.resident[layer] = event
        else:
            for state in states:
                state.to(self.device)
            self.resident[layer] = None
        self.fetches += 1
        self.on_change(sum(state.nbytes for state in states))

    def _evictable(self, direction: int, *, current: int | None, target: int) -> int | None:
        """The resident layer to drop: one the pass has finished with (behind it), else the one it
        needs last; never ``current``."""
        candidates = [layer for layer in self.resident if layer != current]
        if not candidates:
            return None
        anchor = target if current is None else current
        behind = [layer for layer in candidates if (layer - anchor) * direction < 0]
        if behind:
            return min(behind, key=lambda layer: layer * direction)  # the furthest behind
        if current is not None:  # prefetching: never push out a layer the pass needs before the target
            return None
        return max(candidates, key=lambda layer: layer * direction)  # the one needed last

    def _evict(self, layer: int) -> None:
        event = self.resident.pop(layer)
        if event is not None:  # a prefetch never used: let it land before its memory is reused
            event.synchronize()
        states = self.layers[layer]
        for state in states:
            state.cpu()
        self.on_change(-sum(state.nbytes for state in states))


class _Layer(torch.autograd.Function):
    """One decoder layer run without keeping its activations: backward recomputes it."""

    @staticmethod
    def forward(
        ctx: Any,
        engine: OffloadEngine,
        index: int,
        run: Callable,
        hidden: torch.Tensor,
        _anchor: torch.Tensor,
    ) -> Any:
        ctx.engine, ctx.index, ctx.run = engine, index, run
        ctx.hidden_requires_grad = hidden.requires_grad
        ctx.rng = engine._rng_state()
        ctx.save_for_backward(hidden)
        with torch.no_grad():
            out = run(hidden)
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        engine, index = ctx.engine, ctx.index
        (hidden,) = ctx.saved_tensors
        engine._residency.acquire(index, -1)
        with torch.enable_grad(), engine._restored_rng(ctx.rng):
            detached = hidden.detach().requires_grad_(ctx.hidden_requires_grad)
            out = ctx.run(detached)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [
            (o, g)
            for o, g in zip(outs, grad_outputs, strict=False)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        engine._layer_done(index)
        return None, None, None, detached.grad if ctx.hidden_requires_grad else None, None


class OffloadEngine(TrainingEngine):
    """A :class:`~trellis.engine.base.TrainingEngine` whose training state lives on the host
    (registered as ``offload``); see the module docstring.

    ``OffloadEngine(model_config, role_config, role="actor", total_steps=None, device=None, seed=0)``;
    ``role_config.offload.resident_layers`` bounds the decoder layers on the device.

    Raises:
        ConfigValueError: ``offload.resident_layers`` < 1.
        EngineError: a model without recognisable decoder layers; a data-parallel group of more
            than one rank.
    """

    recomputes_layers: ClassVar[bool] = True  # backward reruns each layer: no shared prompts

    name = "offload"
    streams_on_cpu: ClassVar[bool] = False
    """Take the side-stream path (copies ordered by events, gradients landing later) on a CPU device
    too, where it runs in order; tests set it to cover that path without an accelerator."""

    def _init_parallel(self, process_group: Any) -> tuple[int, int]:
        if process_group is not None and torch.distributed.is_initialized():
            size = torch.distributed.get_world_size(process_group)
            if size > 1:
                raise EngineError(
                    f"engine 'offload' runs in one process, but it was given a group of {size} ranks; use "
                    "engine 'fsdp' with offload.param: true to shard across ranks."
                )
        return 0, 1

    def _wrap_model(self, module: torch.nn.Module) -> torch.nn.Module:
        from trellis.config.base import ConfigValueError

        section = role_setting(self.role, self.role_config, "offload")
        budget = setting(section, "resident_layers", schema_default(OffloadConfig, "resident_layers"))
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ConfigValueError(
                f"{self.role}.offload.resident_layers",
                budget,
                "must be a whole number of decoder layers >= 1",
            )
        self.resident_layers = budget
        self._offloaded_by_wrapper = True  # the base engine's phase moves nothing: this engine streams
        self.backend = _backend_for(self.device)
        layers = decoder_layers(module)
        if not layers:
            raise EngineError(
                f"engine 'offload' streams decoder layers, but {type(module).__name__} lists none in "
                "_no_split_modules; use engine 'single' or 'fsdp' for this model."
            )
        self._states: dict[int, ParameterState] = {}
        self._layer_states: list[list[ParameterState]] = []
        self._outer_states: list[ParameterState] = []
        self._resident_bytes = self._peak_resident_bytes = 0
        self._pending: list[tuple[DeviceEvent, ParameterState, torch.Tensor]] = []
        # the stream path on an accelerator (or, for its tests, on the CPU where streams are in order)
        self._asynchronous = self.device.type != "cpu" or self.streams_on_cpu
        self._pin = self.device.type != "cpu" and _can_pin()
        self._grad_stream: DeviceStream | None = self.backend.Stream() if self._asynchronous else None
        self._anchor = torch.zeros((), requires_grad=True)  # gives every layer's output a backward node
        self._build_states(module, layers, pin=self._pin)
        return module

    # ---------------------------------------------------------------- states

    def _build_states(self, module: torch.nn.Module, layers: list[torch.nn.Module], *, pin: bool) -> None:
        """A :class:`ParameterState` per parameter (masters from the float32 weights as loaded), the
        buffers onto the device, and each decoder layer's forward routed through the residency."""
        layer_of: dict[int, int] = {}
        for index, layer in enumerate(layers):
            for param in layer.parameters():
                layer_of[id(param)] = index
        self._layer_states = [[] for _ in layers]
        for name, param in module.named_parameters():
            trainable = param.requires_grad and self.role != "ref"
            state = ParameterState(name, param, dtype=self.dtype, pin=pin, trainable=trainable)
            self._states[id(param)] = state
            if id(param) in layer_of:
                self._layer_states[layer_of[id(param)]].append(state)
            else:
                self._outer_states.append(state)
            if trainable:
                param.register_post_accumulate_grad_hook(self._grad_ready)
        for owner in module.modules():  # buffers (rotary frequencies, ...) are small: they live on the device
            for key, buffer in list(owner._buffers.items()):
                if buffer is not None:
                    owner._buffers[key] = buffer.to(self.device)
        self._residency = LayerResidency(
            self._layer_states,
            self.resident_layers,
            self.device,
            self.backend,
            self._count,
            self._asynchronous,
        )
        for index, layer in enumerate(layers):
            if hasattr(layer, "gradient_checkpointing"):  # this engine recomputes each layer itself
                setattr(layer, "gradient_checkpointing", False)  # noqa: B010 - not a declared attribute
            layer.forward = self._layer_forward(index, layer.forward)

    def _layer_forward(self, index: int, forward: Callable) -> Callable:
        def run_layer(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            def run(hidden: torch.Tensor) -> Any:
                return forward(hidden, *args, **kwargs)

            self._residency.acquire(index, +1)
            if torch.is_grad_enabled() and self.model.training and self.optimizer is not None:
                return _Layer.apply(self, index, run, hidden_states, self._anchor)
            return run(hidden_states)

        return run_layer

    def _optimizer_params(self) -> list[torch.Tensor]:
        return [state.master for state in self._states.values() if state.trainable]

    # ---------------------------------------------------------------- residency and accounting

    def _count(self, delta: int) -> None:
        self._resident_bytes += delta
        self._peak_resident_bytes = max(self._peak_resident_bytes, self._resident_bytes)

    def where(self, layer_id: int) -> torch.device:
        """The device decoder layer ``layer_id``'s working copy is on now: the compute device while
        resident (or being copied in), else the host (``cpu``; on a CPU compute device use
        :meth:`is_resident` to tell the two apart)."""
        self._check_layer(layer_id)
        return self._residency.where(layer_id)

    def is_resident(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id``'s working copy is on the compute device now."""
        self._check_layer(layer_id)
        return layer_id in self._residency.resident

    def resident_bytes(self) -> int:
        """Bytes this engine holds on the compute device now: working copies (resident layers, the
        embeddings, final norm and head while in use) and gradients not yet copied to the host."""
        return self._resident_bytes

    @property
    def peak_resident_bytes(self) -> int:
        """The most :meth:`resident_bytes` reached since the engine was built or the last
        :meth:`reset_peak_resident_bytes`."""
        return self._peak_resident_bytes

    def reset_peak_resident_bytes(self) -> None:
        self._peak_resident_bytes = self._resident_bytes

    def host_bytes(self) -> dict[str, int]:
        """Bytes of this engine's host state: FP32 masters, gradient accumulators, low-precision
        host copies (none when the working dtype is float32) and optimizer state."""
        states = list(self._states.values())
        optimizer = [] if self.optimizer is None else list(self.optimizer.state.values())
        return {
            "masters": sum(_nbytes(state.master) for state in states),
            "grads": sum(_nbytes(state.grad) for state in states if state.grad is not None),
            "working": sum(state.nbytes for state in states if state.host_copy is not state.master),
            "optimizer": sum(
                _nbytes(v) for entry in optimizer for v in entry.values() if isinstance(v, torch.Tensor)
            ),
        }

    def device_bytes(self) -> dict[str, int]:
        """``{"params", "grads", "optimizer"}`` on the compute device now, by this engine's accounting
        (the optimizer state is always on the host: 0)."""
        pending = sum(_nbytes(grad) for _, _, grad in self._pending)
        return {"params": self._resident_bytes - pending, "grads": pending, "optimizer": 0}

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < len(self._layer_states):
            raise IndexError(
                f"layer_id {layer_id} is out of range: the model has {len(self._layer_states)} decoder "
                "layers."
            )

    def _bring_in_outer(self) -> None:
        """The parameters outside the decoder layers onto the device (they stay through the phase)."""
        for state in self._outer_states:
            if state.device_copy is None:
                state.to(self.device)
                self._count(state.nbytes)

    def _release_all(self) -> None:
        self._drain()
        self._residency.release_all()
        for state in self._outer_states:
            if state.device_copy is not None:
                state.cpu()
                self._count(-state.nbytes)
        if self.device.type != "cpu":
            self.backend.empty_cache()

    # ---------------------------------------------------------------- gradients to the host

    def _grad_ready(self, param: torch.Tensor) -> None:
        """A parameter's gradient is complete on the device: send it to its host accumulator."""
        state = self._states[id(param)]
        grad = param.grad
        param.grad = None
        if grad is None or state.grad is None:
            return
        if self._grad_stream is None:  # a CPU device: the add is the copy
            state.grad.add_(grad)
            return
        self._finish(state)  # its staging buffer is reused: the previous copy must have landed
        if state.staging is None:
            state.staging = _host_tensor(torch.empty_like(grad, device=HOST), self._pin)
        self._grad_stream.wait_stream(self.backend.current_stream())
        with self.backend.stream(self._grad_stream):
            state.staging.copy_(grad, non_blocking=True)
        event = self.backend.Event()
        event.record(self._grad_stream)
        self._pending.append((event, state, grad))  # keeps the device gradient alive until copied
        self._count(_nbytes(grad))

    def _layer_done(self, index: int) -> None:
        """Backward of a layer is done: land the copies that have finished."""
        still = []
        for event, state, grad in self._pending:
            if event.query():
                self._land(state, grad)
            else:
                still.append((event, state, grad))
        self._pending = still

    def _finish(self, state: ParameterState) -> None:
        for entry in [entry for entry in self._pending if entry[1] is state]:
            entry[0].synchronize()
            self._land(state, entry[2])
            self._pending.remove(entry)

    def _land(self, state: ParameterState, grad: torch.Tensor) -> None:
        assert state.grad is not None and state.staging is not None
        state.grad.add_(state.staging)
        self._count(-_nbytes(grad))

    def _drain(self) -> None:
        for event, state, grad in self._pending:
            event.synchronize()
            self._land(state, grad)
        self._pending = []

    # ---------------------------------------------------------------- the engine's calls

    def forward(self, batch: Any, *, compute_entropy: bool = False) -> dict:
        self._bring_in_outer()
        return super().forward(batch, compute_entropy=compute_entropy)

    def forward_backward(
        self, batch: Any, loss_fn: Any, *, compute_entropy: bool = False
    ) -> dict[str, float]:
        self._bring_in_outer()
        result = super().forward_backward(batch, loss_fn, compute_entropy=compute_entropy)
        self._drain()
        return result

    def optimizer_step(self) -> dict[str, Any]:
        self._drain()
        return super().optimizer_step()

    def _after_optimizer_step(self) -> None:
        for state in self._states.values():
            state.refresh()

    def zero_grad(self) -> None:
        self._drain()
        for state in self._states.values():
            state.zero_grad()

    def _compute_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the working copies are already in the compute dtype

    def _put_away(self, *, drop_grads: bool) -> None:
        self._release_all()

    def to(
        self, device: str | torch.device, *, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """``to("cpu")`` drops every working copy from the device (the state is always on the host);
        ``to(<device>)`` makes ``device`` the compute device (copies come in as layers run)."""
        device = torch.device(device)
        if model and device.type == "cpu":
            self._release_all()
        elif model and device.type != "cpu" and not same_device(device, self.device):
            self._release_all()
            self.device = device
            self._residency.device = device

    # ---------------------------------------------------------------- state

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The module's state dict with every parameter's FP32 master in place of its working copy."""
        by_tensor = {id(state.param): state.master for state in self._states.values()}
        named = dict(self.model.named_parameters(remove_duplicate=False))
        state_dict = {}
        for name, tensor in self.model.state_dict().items():
            param = named.get(name)
            state_dict[name] = by_tensor[id(param)] if param is not None else tensor
        return state_dict

    def _load_model_state(self, state: Mapping[str, torch.Tensor]) -> None:
        mine = self._model_state()
        check_state_keys(mine, state)
        with torch.no_grad():
            for name, tensor in state.items():
                if mine[name].shape != tensor.shape:
                    raise ValueError(
                        f"load_state_dict: {name} has shape {tuple(tensor.shape)}, the model's is "
                        f"{tuple(mine[name].shape)}."
                    )
                mine[name].copy_(tensor)
        for param_state in self._states.values():
            param_state.refresh()

    def _rng_state(self) -> tuple[torch.Tensor, Any]:
        device_state = None
        if self.device.type != "cpu":
            device_state = torch.get_device_module(self.device.type).get_rng_state(self.device)
        return torch.get_rng_state(), device_state

    @contextlib.contextmanager
    def _restored_rng(self, saved: tuple[torch.Tensor, Any]) -> Iterator[None]:
        """Run with the random state a layer's forward saw, so dropout recomputes the same masks."""
        devices = [] if self.device.type == "cpu" else [self.device.index or 0]
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(saved[0])
            if saved[1] is not None:
                torch.get_device_module(self.device.type).set_rng_state(saved[1], self.device)
            yield


# ---------------------------------------------------------------- helpers


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _can_pin() -> bool:
    try:
        return bool(torch.empty(1, pin_memory=True).is_pinned())
    except RuntimeError:  # no accelerator runtime to pin through
        return False


def _host_tensor(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    return tensor.pin_memory() if pin and not tensor.is_pinned() else tensor


def _backend_for(device: torch.device) -> DeviceBackend:
    """The device backend that drives ``device``: the cpu backend for a CPU device, else the
    selected backend (which must be of that device type)."""
    from trellis.device import get_device_backend
    from trellis.device.cpu import CPUBackend

    if device.type == "cpu":
        return CPUBackend()
    backend = get_device_backend()
    if backend.device_type != device.type:
        raise EngineError(
            f"engine 'offload' computes on {device}, but the selected device backend {backend.name!r} drives "
            f"{backend.device_type!r} devices; set trainer.device to the backend for {device.type!r}."
        )
    return backend
