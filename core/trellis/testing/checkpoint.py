"""Contract tests for a checkpoint engine (registry ``trellis.checkpoint_engines``), and the harness
that moves weights between real peers to run them.

    from trellis.testing import CheckpointEngineContract

    class TestHcclEngine(CheckpointEngineContract):
        engine_name = "hccl"          # resolved through the registry
        device = "npu"

        def peer_devices(self, count):          # one device per peer
            return [f"npu:{i}" for i in range(count)]

Every round trip runs a real sender and real receivers: by default each peer is a thread of the
test process with its own event loop (``peers = "threads"``); ``peers = "processes"`` spawns one
process per peer (multiprocessing ``spawn``). Override :meth:`CheckpointEngineContract.transfer`
to place peers any other way. :func:`run_weight_transfer` is the harness itself, usable on its own.

Importing this module does not import torch.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trellis.testing.registry import RegistryEntryContract

__all__ = [
    "CheckpointEngineContract",
    "RecordingReplica",
    "TransferReport",
    "assert_bit_identical",
    "contract_state_dict",
    "ordering_state_dict",
    "run_weight_transfer",
]

CONTRACT_STATE = "trellis.testing.checkpoint:contract_state_dict"
ORDERING_STATE = "trellis.testing.checkpoint:ordering_state_dict"
_POLL_S = 0.05
_LATE_REPORT_S = 1.0  # how long a peer found ended may still take to deliver its last report


def _skip(reason: str) -> None:
    import pytest

    pytest.skip(reason)


# ---------------------------------------------------------------- state dicts


def contract_state_dict(step: int = 0, device: str = "cpu") -> dict[str, Any]:
    """A small state dict of mixed dtypes and shapes, different for each ``step`` (deterministic).

    Holds float32 / bfloat16 / float16 / float64 / int64 / int8 / bool tensors, a 0-d float and a
    0-d int, two non-contiguous tensors (a transpose and a strided slice), an empty tensor, and
    float specials (±0, ±inf, NaN, a subnormal). The largest tensor is
    ``model.embed_tokens.weight`` (7680 bytes); the whole dict is about 36 KB.
    """
    import torch

    g = torch.Generator().manual_seed(1234 + step)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.5, 2.0**100])
    state = {
        "model.embed_tokens.weight": randn(48, 40),
        "model.layers.0.self_attn.q_proj.weight": randn(40, 40),
        "model.layers.0.self_attn.k_proj.bias": randn(40).to(torch.float16),
        "model.layers.0.mlp.up_proj.weight": randn(40, 24).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": randn(40, 24).t(),  # non-contiguous (24, 40)
        "model.layers.0.input_layernorm.weight": specials * (step + 1),
        "model.rotary_emb.inv_freq": randn(8).double(),
        "model.layers.0.self_attn.scale": torch.tensor(0.125 * (step + 1)),  # 0-d
        "model.num_batches_tracked": torch.tensor(7 + step, dtype=torch.int64),  # 0-d int
        "model.token_type_ids": torch.randint(-(2**40), 2**40, (13,), generator=g, dtype=torch.int64),
        "model.layers.0.mask": torch.rand(5, 3, generator=g) > 0.5,
        "model.layers.0.quant_codes": torch.randint(-128, 127, (11,), generator=g, dtype=torch.int8),
        "model.empty_buffer": torch.zeros(0, 4),
        "lm_head.weight": randn(48, 40)[:, ::2],  # non-contiguous (48, 20)
    }
    return {name: tensor.to(device) for name, tensor in state.items()}


def ordering_state_dict(step: int = 0, device: str = "cpu") -> dict[str, Any]:
    """Forty small tensors whose names are neither sorted nor in any natural order."""
    import torch

    g = torch.Generator().manual_seed(99 + step)
    order = torch.randperm(40, generator=g).tolist()
    return {
        f"{'zyxwv'[i % 5]}.{i}.weight": torch.full((i % 7 + 1,), float(i + step), device=device)
        for i in order
    }


def _resolve(reference: Any) -> Any:
    """A class or function from itself, a registry name, or a ``module:attr`` reference."""
    if not isinstance(reference, str):
        return reference
    from trellis.registry import is_reference, load_reference

    if is_reference(reference):
        return load_reference(reference)
    from trellis.registries import checkpoint_engines

    return checkpoint_engines.get(reference)


def expected_after_cast(tensor: Any, dtype: Any) -> Any:
    """What a receiver must get for ``tensor`` sent with ``dtype``: floating tensors cast, others as is."""
    if dtype is not None and tensor.is_floating_point():
        return tensor.to(dtype)
    return tensor


def assert_bit_identical(
    expected: dict[str, Any], received: list[tuple[str, Any]], *, dtype: Any = None
) -> None:
    """Assert ``received`` is ``expected`` in order, each tensor with the same dtype, shape and bytes.

    ``dtype``: the engine's cast; floating tensors of ``expected`` are cast to it first.
    """
    import torch

    from trellis.checkpoint.base import resolve_dtype

    dtype = resolve_dtype(dtype)
    names = [name for name, _ in received]
    assert names == list(expected), (
        f"names differ or are out of send order:\n sent {list(expected)}\n got  {names}"
    )
    for name, tensor in received:
        want = expected_after_cast(expected[name], dtype).detach().cpu().contiguous()
        got = tensor.detach().cpu()
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}"
        assert tuple(got.shape) == tuple(want.shape), (
            f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        )
        got_bytes = got.contiguous().reshape(-1).view(torch.uint8)
        want_bytes = want.reshape(-1).view(torch.uint8)
        assert torch.equal(got_bytes, want_bytes), f"{name}: the bytes differ from those sent"


# ---------------------------------------------------------------- a replica that records


class RecordingReplica:
    """A stand-in rollout replica that records what weight sync does to it.

    ``events`` lists ``"wake_up"``, ``"update_weights"`` and ``"resume"`` in call order; ``calls``
    holds each ``update_weights`` call's ``(name, tensor)`` pairs (copied).
    """

    def __init__(self) -> None:
        self.events: list[str] = []
        self.calls: list[list[tuple[str, Any]]] = []

    async def wake_up(self) -> None:
        self.events.append("wake_up")

    async def sleep(self) -> None:
        self.events.append("sleep")

    async def resume(self) -> None:
        self.events.append("resume")

    async def update_weights(self, named_tensors: Any) -> None:
        self.events.append("update_weights")
        self.calls.append([(name, tensor.clone()) for name, tensor in named_tensors])

    @property
    def loaded(self) -> list[tuple[str, Any]]:
        """Every pair loaded, in order."""
        return [pair for call in self.calls for pair in call]


# ---------------------------------------------------------------- the harness


@dataclass
class TransferReport:
    """What :func:`run_weight_transfer` saw.

    ``received[case][receiver][step]`` is the list of ``(name, tensor)`` a receiver got (CPU
    tensors); ``calls`` has the same layout and, in manager mode, holds each step's
    ``update_weights`` calls as lists of names; ``events`` the replica's events. ``errors`` maps
    a peer (``"sender"``, ``"receiver 0"``, ...) to ``(exception type name, message, traceback)``;
    a peer that died without a word has type ``"exit <code>"``.
    """

    received: list[list[list[list[tuple[str, Any]]]]] = field(default_factory=list)
    calls: list[list[list[list[list[str]]]]] = field(default_factory=list)
    events: list[list[list[list[str]]]] = field(default_factory=list)
    errors: dict[str, tuple[str, str, str]] = field(default_factory=dict)

    def check(self) -> TransferReport:
        """``self``, or ``AssertionError`` listing every peer's error with its traceback."""
        if self.errors:
            lines = [f"{peer}: {kind}: {message}\n{tb}" for peer, (kind, message, tb) in self.errors.items()]
            raise AssertionError("weight transfer failed:\n" + "\n".join(lines))
        return self


CASE_OPTIONS = ("engine", "via_manager")
"""Keys of a :func:`run_weight_transfer` case that are options of the run, not constructor kwargs."""


def run_weight_transfer(
    engine: Any,
    cases: list[dict[str, Any]],
    *,
    receivers: int = 1,
    steps: int = 1,
    peers: str | list[str] = "threads",
    state: Any = CONTRACT_STATE,
    devices: list[str] | None = None,
    via_manager: bool = False,
    die: tuple[str, int] | None = None,
    timeout_s: float = 120.0,
) -> TransferReport:
    """Send ``steps`` state dicts from one sender to ``receivers`` receivers, once per case.

    For each case every peer builds its engine; the sender calls ``prepare()``, this function
    calls ``build_topology(1, receivers, metadata)`` and hands each peer its kwargs; all call
    ``init_process_group`` and then transfer ``steps`` times (step ``s`` sends
    ``state(s, device)``); all finalize once everyone is done. The same peers serve every case.

    Args:
        engine: an engine class, a registry name or a ``module:Class`` reference (processes
            need a name or reference).
        cases: one transfer per entry: the engine's constructor kwargs, plus optionally
            ``"engine"`` and ``"via_manager"`` to override the run's for that case. A failing case
            stops the run.
        receivers: how many rollout ranks receive.
        steps: state dicts sent per case (the engines are reused across steps).
        peers: ``"threads"`` (one thread and event loop per peer, in this process),
            ``"processes"`` (one multiprocessing ``spawn`` process per peer; all are reaped, even
            on failure), or a list of ``"thread"`` / ``"process"`` per peer, sender first.
        state: ``fn(step, device) -> dict`` or its ``module:fn`` reference (processes need one).
        devices: the device of each peer, sender first (default all ``"cpu"``).
        via_manager: go through :class:`~trellis.checkpoint.sync.WeightSyncManager` ``send`` /
            ``receive`` into a :class:`RecordingReplica` instead of the bare engine methods.
        die: ``("sender", n)`` or ``("receiver", n)``: that peer (every receiver) exits abruptly
            (``os._exit``) after ``n`` tensors of its first step; such peers must be processes.
        timeout_s: the most this function waits on the peers of one phase before giving up on them.

    Returns:
        A :class:`TransferReport`; call ``.check()`` to fail on any peer's error.
    """
    labels = ["sender"] + [f"receiver {i}" for i in range(receivers)]
    kinds = _peer_kinds(peers, len(labels))
    if die is not None and any(
        kind != "process"
        for label, kind in zip(labels, kinds, strict=True)
        if (label == "sender") == (die[0] == "sender")
    ):
        raise ValueError(f"die={die!r} needs the {die[0]} to be a process (a thread cannot die alone)")
    devices = list(devices or ["cpu"] * (receivers + 1))
    if len(devices) != receivers + 1:
        raise ValueError(f"devices needs {receivers + 1} entries (sender first), got {len(devices)}")
    spec = {
        "engine": engine,
        "cases": cases,
        "steps": steps,
        "state": state,
        "via_manager": via_manager,
        "die": die,
        "timeout_s": timeout_s,
    }
    if "process" in kinds:
        import multiprocessing

        context: Any = multiprocessing.get_context("spawn")
        outbox: Any = context.Queue()
        inboxes: list[Any] = [context.Queue() for _ in labels]
    else:  # all in this process: the metadata may hold live objects (naive's channel)
        context = None
        outbox = queue.Queue()
        inboxes = [queue.Queue() for _ in labels]
    workers: list[Any] = []
    for i, (label, kind) in enumerate(zip(labels, kinds, strict=True)):
        args = (label, devices[i], spec, inboxes[i], outbox)
        name = f"weight-transfer {label}"
        if kind == "process":
            workers.append(context.Process(target=_peer_main, args=args, name=name))
        else:
            workers.append(threading.Thread(target=_peer_main, args=args, name=name, daemon=True))
    report = TransferReport()
    mailbox = _Mailbox(outbox, workers, labels, timeout_s)
    try:
        for worker in workers:
            worker.start()
        for index, case in enumerate(cases):
            engine_class = _resolve(case.get("engine", engine))
            if not _run_case(index, engine_class, receivers, labels, inboxes, mailbox, report):
                break
    finally:
        for inbox in inboxes:
            inbox.put(("stop", None))
        _reap(workers, timeout_s)
        if context is not None:
            for q in [*inboxes, outbox]:
                q.close()
                q.cancel_join_thread()
    return report


def _peer_kinds(peers: str | list[str], count: int) -> list[str]:
    if peers in ("threads", "processes"):
        return [{"threads": "thread", "processes": "process"}[peers]] * count
    kinds = list(peers)
    if len(kinds) != count or any(kind not in ("thread", "process") for kind in kinds):
        raise ValueError(
            f"peers must be 'threads', 'processes' or a list of {count} 'thread' / 'process' entries "
            f"(sender first), got {peers!r}"
        )
    return kinds


def _run_case(
    index: int,
    engine_class: Any,
    receivers: int,
    labels: list[str],
    inboxes: list[Any],
    mailbox: _Mailbox,
    report: TransferReport,
) -> bool:
    """One case of :func:`run_weight_transfer`; False when a peer failed (the run stops)."""
    got = mailbox.gather(["sender"], index, "meta")
    kind, payload = got["sender"]
    if kind != "meta":
        return _record_failures(report, {**got, **mailbox.gather(labels[1:], index, "done", wait=False)})
    trainer_kwargs, rollout_kwargs = engine_class.build_topology(1, receivers, payload)
    inboxes[0].put(("init", trainer_kwargs[0]))
    for i in range(receivers):
        inboxes[i + 1].put(("init", rollout_kwargs[i]))
    got = mailbox.gather(labels, index, "done")
    if any(kind != "done" for kind, _ in got.values()):
        return _record_failures(report, got)
    report.received.append([])
    report.calls.append([])
    report.events.append([])
    for i in range(receivers):
        steps = got[f"receiver {i}"][1]
        report.received[-1].append([[_decode(item) for item in step["tensors"]] for step in steps])
        report.calls[-1].append([step["calls"] for step in steps])
        report.events[-1].append([step["events"] for step in steps])
    for inbox in inboxes:
        inbox.put(("finalize", None))
    got = mailbox.gather(labels, index, "finalized")
    if any(kind != "finalized" for kind, _ in got.values()):
        return _record_failures(report, got)
    return True


def _record_failures(report: TransferReport, got: dict[str, tuple[str, Any]]) -> bool:
    for label, (kind, payload) in got.items():
        if kind in ("error", "died", "silent"):
            report.errors[label] = payload
    return False


class _Mailbox:
    """The peers' messages ``(kind, label, case, payload)``, read in the order the harness wants them."""

    def __init__(self, outbox: Any, workers: list[Any], labels: list[str], timeout_s: float) -> None:
        self.outbox = outbox
        self.workers = dict(zip(labels, workers, strict=True))
        self.timeout_s = timeout_s
        self.backlog: list[tuple[str, str, int, Any]] = []

    def gather(
        self, wanted: list[str], index: int, kind: str, *, wait: bool = True
    ) -> dict[str, tuple[str, Any]]:
        """The ``kind`` (or ``error``) message of each peer in ``wanted`` for case ``index``; dead or
        silent peers noted as ``died`` / ``silent``. ``wait=False``: only what already arrived."""
        got: dict[str, tuple[str, Any]] = {}
        deadline = time.monotonic() + (self.timeout_s if wait else 0.0)
        while True:
            for message in list(self.backlog):
                what, label, case, payload = message
                if case == index and label in wanted and label not in got and what in (kind, "error"):
                    got[label] = (what, payload)
                    self.backlog.remove(message)
            if len(got) == len(wanted):
                return got
            try:
                self.backlog.append(self.outbox.get(timeout=_POLL_S))
                continue
            except queue.Empty:
                pass
            dead = [label for label in wanted if label not in got and not self.workers[label].is_alive()]
            if dead and self._drain():  # a peer that reported and then ended: its report came late
                continue
            for label in dead:
                code = getattr(self.workers[label], "exitcode", None)
                got[label] = ("died", (f"exit {code}", "the peer ended without reporting", ""))
            if time.monotonic() >= deadline:
                for label in wanted:
                    got.setdefault(label, ("silent", ("timeout", f"no word within {self.timeout_s:g} s", "")))
            if len(got) == len(wanted):
                return got

    def _drain(self) -> bool:
        """Move every message already sent into the backlog; whether there was any.

        A peer's last report can reach the outbox between a poll that came back empty and the
        check that finds the peer ended (a process's queue flushes from a feeder thread), so a
        peer is declared dead only after this finds nothing more.
        """
        moved = False
        wait_s = _LATE_REPORT_S  # patient once: a loaded machine can hold a feeder thread up
        while True:
            try:
                self.backlog.append(self.outbox.get(timeout=wait_s))
                moved, wait_s = True, _POLL_S
            except queue.Empty:
                return moved


def _reap(workers: list[Any], timeout_s: float) -> None:
    """Wait for every peer; terminate (then kill) processes that outlive the grace period."""
    deadline = time.monotonic() + min(timeout_s, 30.0)
    for worker in workers:
        if worker.ident is None:
            continue  # never started
        worker.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if hasattr(worker, "terminate") and worker.is_alive():
            worker.terminate()
            worker.join(5)
            if worker.is_alive():
                worker.kill()
                worker.join(5)


def _encode(name: str, tensor: Any) -> tuple[str, str, tuple[int, ...], bytes]:
    import torch

    cpu = tensor.detach().cpu().contiguous()
    data = cpu.reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, str(cpu.dtype).removeprefix("torch."), tuple(cpu.shape), data


def _decode(item: tuple[str, str, tuple[int, ...], bytes]) -> tuple[str, Any]:
    import torch

    from trellis.checkpoint.base import resolve_dtype

    name, dtype, shape, data = item
    out = torch.empty(shape, dtype=resolve_dtype(dtype))
    if data:
        out.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return name, out


def _describe(exc: BaseException) -> tuple[str, str, str]:
    return type(exc).__name__, str(exc), "".join(traceback.format_exception(exc))


def _dying(named_tensors: Any, after: int) -> Any:
    for count, item in enumerate(named_tensors):
        if count == after:
            os._exit(17)
        yield item


def _peer_main(label: str, device: str, spec: dict[str, Any], inbox: Any, outbox: Any) -> None:
    """One peer of :func:`run_weight_transfer` (a thread or a spawned process)."""
    try:
        import torch

        torch.set_num_threads(1)  # peers share the cores with each other and the test
        if torch.device(device).type != "cpu":
            torch.get_device_module(torch.device(device).type).set_device(torch.device(device))
        from trellis.checkpoint.sync import WeightSyncManager

        make_state = spec["state"] if callable(spec["state"]) else _load_function(spec["state"])
    except BaseException as exc:
        outbox.put(("error", label, 0, _describe(exc)))
        return
    is_sender = label == "sender"
    die = spec["die"]
    die_after = die[1] if die is not None and (die[0] == "sender") == is_sender else None

    def wait_inbox() -> tuple[str, Any]:
        try:
            return inbox.get(timeout=spec["timeout_s"])
        except queue.Empty:
            return ("stop", None)

    for index, case in enumerate(spec["cases"]):
        engine = None
        try:
            engine_class = _resolve(case.get("engine", spec["engine"]))
            kwargs = {key: value for key, value in case.items() if key not in CASE_OPTIONS}
            via_manager = case.get("via_manager", spec["via_manager"])
            manager = WeightSyncManager(engine_class, **kwargs) if via_manager else None
            engine = manager.create_engine() if manager is not None else engine_class(**kwargs)
            if is_sender:
                outbox.put(("meta", label, index, engine.prepare()))
            message, init_kwargs = wait_inbox()
            if message != "init":
                return
            engine.init_process_group(**init_kwargs)
            results = []
            for step in range(spec["steps"]):
                after = die_after if step == 0 else None
                if is_sender:
                    source: Any = iter(make_state(step, device).items())
                    if after is not None:
                        source = _dying(source, after)
                    if manager is not None:
                        asyncio.run(manager.send(engine, source))
                    else:
                        asyncio.run(engine.send_weights(source))
                else:
                    results.append(asyncio.run(_receive_step(engine, manager, after)))
            outbox.put(("done", label, index, results))
            message, _ = wait_inbox()
            if message != "finalize":
                return
        except BaseException as exc:
            outbox.put(("error", label, index, _describe(exc)))
            return
        finally:
            if engine is not None:
                engine.finalize()
        outbox.put(("finalized", label, index, None))


def _load_function(reference: str) -> Callable[..., Any]:
    from trellis.registry import load_reference

    return load_reference(reference)


async def _receive_step(engine: Any, manager: Any, die_after: int | None) -> dict[str, Any]:
    if manager is not None:
        replica = RecordingReplica()
        await manager.receive(engine, [replica])
        return {
            "tensors": [_encode(name, tensor) for name, tensor in replica.loaded],
            "calls": [[name for name, _ in call] for call in replica.calls],
            "events": list(replica.events),
        }
    tensors: list[tuple[str, str, tuple[int, ...], bytes]] = []
    async for name, tensor in engine.receive_weights():
        if die_after is not None and len(tensors) == die_after:
            os._exit(17)
        tensors.append(_encode(name, tensor))
    return {"tensors": tensors, "calls": None, "events": None}


# ---------------------------------------------------------------- the contract


class CheckpointEngineContract(RegistryEntryContract):
    """Proves a checkpoint engine honours :class:`trellis.checkpoint.CheckpointEngine`.

    Class attributes to set in the subclass:
        engine_name: the name it registers in ``trellis.checkpoint_engines``.
        engine_class: the class itself, to test one that is not (yet) registered; with
            ``engine_name`` too, the registry must resolve the name to this class.
        engine_kwargs: more constructor arguments for every engine the tests build.
        device: the device tensors are sent from (``"cuda"`` for a GPU engine).
        receivers: rollout ranks in the round trips (1 for a one-receiver engine such as ``naive``).
        topology_cases: ``(trainer_world_size, rollout_world_size)`` pairs to check the topology of.
        cross_process: whether the metadata and kwargs must be picklable (False for ``naive``).
        peers: ``"threads"``, ``"processes"`` or one entry per peer; see :func:`run_weight_transfer`.
        timeout_s: the engines' ``timeout_s`` in the round trips.
        short_timeout_s: the engines' ``timeout_s`` where a test waits for a timeout on purpose.

    Override :meth:`peer_devices` to give each peer its own accelerator, :meth:`transfer` to run
    peers another way, and :meth:`skip_reason` to skip where the engine cannot run.
    """

    registry: ClassVar[str] = "checkpoint_engines"
    engine_name: ClassVar[str | None] = None
    engine_class: ClassVar[type | None] = None
    engine_kwargs: ClassVar[dict[str, Any]] = {}
    device: ClassVar[str] = "cpu"
    receivers: ClassVar[int] = 2
    topology_cases: ClassVar[tuple[tuple[int, int], ...]] = ((1, 1), (1, 2), (2, 3), (4, 1))
    cross_process: ClassVar[bool] = True
    peers: ClassVar[str | list[str]] = "threads"
    timeout_s: ClassVar[float] = 30.0
    short_timeout_s: ClassVar[float] = 1.0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.engine_name is not None:
            cls.name = cls.engine_name

    # ---------------------------------------------------------------- hooks

    def _engine_class(self) -> Any:
        if self.engine_name is not None:
            cls = self._registry().get(self.engine_name)
            if self.engine_class is not None:
                assert cls is self.engine_class, (
                    f"the registry resolves {self.engine_name!r} to {cls!r}, not {self.engine_class!r}"
                )
            return cls
        if self.engine_class is None:
            raise TypeError(f"{type(self).__name__}: set engine_name or engine_class.")
        return self.engine_class

    def _component(self) -> Any:
        return self._engine_class()

    def skip_reason(self) -> str | None:
        """Why the tests that move weights cannot run here (None: they can). Default: the
        engine's ``unavailable_reason()``."""
        reason = getattr(self._engine_class(), "unavailable_reason", None)
        return reason() if reason is not None else None

    def _require(self) -> None:
        reason = self.skip_reason()
        if reason is not None:
            _skip(f"{self.name!r} cannot run here: {reason}")

    def peer_devices(self, count: int) -> list[str]:
        """The device of each of ``count`` peers, sender first. Default: all on :attr:`device`."""
        return [self.device] * count

    def make_engine(self, **kwargs: Any) -> Any:
        """A fresh engine with :attr:`engine_kwargs` and ``kwargs``."""
        return self._engine_class()(**{"timeout_s": self.timeout_s, **self.engine_kwargs, **kwargs})

    def transfer(
        self, cases: list[dict[str, Any]], *, steps: int = 2, state: Any = CONTRACT_STATE
    ) -> TransferReport:
        """Run :func:`run_weight_transfer` with this class's peers; fail on any peer's error."""
        engine = self.engine_name or self._engine_class()
        if self.peers != "threads" and not isinstance(engine, str):
            engine = f"{engine.__module__}:{engine.__qualname__}"
        full_cases = [{"timeout_s": self.timeout_s, **self.engine_kwargs, **case} for case in cases]
        return run_weight_transfer(
            engine,
            full_cases,
            receivers=self.receivers,
            steps=steps,
            peers=self.peers,
            state=state,
            devices=self.peer_devices(self.receivers + 1),
            timeout_s=max(60.0, 4 * self.timeout_s),
        ).check()

    def _round_trip(self, bucket_bytes: int, **kwargs: Any) -> None:
        self._require()
        report = self.transfer([{"bucket_bytes": bucket_bytes, **kwargs}])
        for receiver in range(self.receivers):
            for step, received in enumerate(report.received[0][receiver]):
                assert_bit_identical(contract_state_dict(step), received, dtype=kwargs.get("dtype"))

    @staticmethod
    def _sizes() -> tuple[int, int]:
        import torch

        state = contract_state_dict()
        sizes = [t.numel() * t.element_size() for t in state.values()]
        assert max(sizes) == state["model.embed_tokens.weight"].numel() * torch.float32.itemsize
        return max(sizes), sum(sizes)

    # ---------------------------------------------------------------- the contract

    def test_is_listed(self) -> None:
        if self.engine_name is None:
            _skip("engine_class without engine_name: registration is not checked")
        super().test_is_listed()

    def test_resolves_in_fresh_process(self) -> None:
        if self.engine_name is None:
            _skip("engine_class without engine_name: registration is not checked")
        super().test_resolves_in_fresh_process()

    def test_is_a_checkpoint_engine(self) -> None:
        from trellis.checkpoint import CheckpointEngine

        cls = self._engine_class()
        assert issubclass(cls, CheckpointEngine), (
            f"{cls!r} does not subclass trellis.checkpoint.CheckpointEngine"
        )
        if self.engine_name is not None:
            assert cls.name == self.engine_name, (
                f"{cls.__qualname__}.name is {cls.name!r} but it is registered as {self.engine_name!r}; "
                "make them equal (error messages use the name)."
            )

    def test_build_topology_shapes(self) -> None:
        import pickle

        self._require()
        cls = self._engine_class()
        for trainer_world_size, rollout_world_size in self.topology_cases:
            engine = self.make_engine(bucket_bytes=1024)
            try:
                metadata = engine.prepare()
                trainer, rollout = cls.build_topology(trainer_world_size, rollout_world_size, metadata)
            finally:
                engine.finalize()
                engine.finalize()  # idempotent
            assert isinstance(trainer, list) and len(trainer) == trainer_world_size, trainer
            assert isinstance(rollout, list) and len(rollout) == rollout_world_size, rollout
            assert all(isinstance(kw, dict) for kw in trainer + rollout), (trainer, rollout)
            if self.cross_process:
                pickle.dumps((metadata, trainer, rollout))  # they must travel to other processes

    def test_round_trip_bucket_smaller_than_one_tensor(self) -> None:
        largest, _ = self._sizes()
        self._round_trip(largest // 3 + 7)  # odd: chunks split inside elements

    def test_round_trip_bucket_equal_to_largest_tensor(self) -> None:
        largest, _ = self._sizes()
        self._round_trip(largest)

    def test_round_trip_bucket_larger_than_model(self) -> None:
        _, total = self._sizes()
        self._round_trip(2 * total + 4096)

    def test_dtype_conversion(self) -> None:
        largest, _ = self._sizes()
        self._round_trip(largest // 2, dtype="bfloat16")

    def test_receive_yields_names_in_send_order(self) -> None:
        self._require()
        report = self.transfer([{"bucket_bytes": 96}], steps=1, state=ORDERING_STATE)
        sent = list(ordering_state_dict(0))
        for receiver in range(self.receivers):
            assert [name for name, _ in report.received[0][receiver][0]] == sent

    def test_idle_trainer_rank_consumes_iterator(self) -> None:
        self._require()
        cls = self._engine_class()
        sender = self.make_engine(bucket_bytes=1024)
        idle = self.make_engine(bucket_bytes=1024)
        state = contract_state_dict(0, self.device)
        seen: list[str] = []

        def named_tensors() -> Any:
            for name, tensor in state.items():
                seen.append(name)
                yield name, tensor

        try:
            trainer, _ = cls.build_topology(2, 1, sender.prepare())
            idle.init_process_group(**trainer[1])
            asyncio.run(asyncio.wait_for(idle.send_weights(named_tensors()), self.timeout_s))
        finally:
            idle.finalize()
            sender.finalize()
        assert seen == list(state), f"trainer rank 1 did not iterate every tensor: {seen}"

    def test_receiver_without_sender_raises_weight_sync_error(self) -> None:
        from trellis.errors import WeightSyncError

        self._require()
        cls = self._engine_class()
        sender = self.make_engine(bucket_bytes=1024, timeout_s=self.short_timeout_s)
        receiver = self.make_engine(bucket_bytes=1024, timeout_s=self.short_timeout_s)
        outcome: list[BaseException] = []

        async def drain() -> None:
            async for _ in receiver.receive_weights():
                pass

        def run() -> None:
            try:
                receiver.init_process_group(**cls.build_topology(1, 1, metadata)[1][0])
                asyncio.run(drain())
            except BaseException as exc:
                outcome.append(exc)

        try:
            metadata = sender.prepare()
            thread = threading.Thread(target=run, daemon=True)
            start = time.monotonic()
            thread.start()
            thread.join(30 + 10 * self.short_timeout_s)
            waited = time.monotonic() - start
        finally:
            receiver.finalize()
            sender.finalize()
        assert not thread.is_alive(), "a receiver whose sender never sends hangs instead of timing out"
        assert outcome and isinstance(outcome[0], WeightSyncError), (
            f"expected WeightSyncError, got {outcome[0]!r}" if outcome else "receive_weights returned"
        )
        assert cls.name in str(outcome[0]), f"the message does not name the engine {cls.name!r}: {outcome[0]}"
        assert waited >= self.short_timeout_s * 0.9, f"gave up after {waited:.2f} s, before timeout_s"
