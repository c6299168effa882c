"""The ``sglang`` rollout replica: token-in/token-out generation on an SGLang engine.

Follows SGLang 0.5.3+ (see :mod:`trellis_sglang.engine` for the API it uses and where each name
was checked). Importing this module imports neither sglang nor torch; sglang is imported by
:meth:`SGLangRolloutReplica.init`.

Engines. ``rollout.engine_kwargs.server`` picks one:

- false (default): ``sglang.Engine`` in this process.
- true: ``python -m sglang.launch_server`` on 127.0.0.1 and a free port, talked to over HTTP;
  ``server_address`` is ``"127.0.0.1:PORT"``. Weight updates still pass CUDA IPC handles, so the
  server must run on this machine.

Event loops. SGLang's in-process engine binds to the event loop of its first call (its tokenizer
manager receives every answer there), while callers come with loops of their own: the trainer
runs one ``asyncio.run`` per call. So each replica owns an event loop in a daemon thread
(:class:`trellis.utils.loop_thread.LoopThread`, started by ``init``, stopped by ``shutdown``):
every coroutine of the replica hands its work to that loop and awaits the result there, so the
engine, the replica's lock and its running requests live on that one loop, and callers may use
any loop, one after another or several at once. The engine itself is built on the caller's
thread (SGLang releases before early 2026 register a signal handler while an engine starts,
which only the main thread may do) and bound to the replica's loop by its first call. Server mode
takes the same path (its HTTP client, a thread pool, works from any loop). Tensors handed to
``update_weights`` are read on the replica's thread, with the CUDA device that was current on the
caller's thread when ``init`` ran.

In every mode SGLang loads its own copy of ``model.path``; in ``hybrid`` mode (and whenever
``init`` gets a ``model``) the replica then pushes that model's weights into it, so it serves the
training weights.

Sampling (:func:`to_sglang_sampling_params`): temperature, top_p and top_k (-1 = off, as in
Trellis) go as they are, with min_p and the penalties set to neutral so the model's
``generation_config`` (SGLang's default source of sampling defaults) cannot change them;
``max_tokens`` becomes ``max_new_tokens``; stop ids and strings go as ``stop_token_ids`` / ``stop``.
The stop token (eos, a stop id, or the token completing a stop string) is part of the returned
tokens, as with ``hf``; ``no_stop_trim`` keeps SGLang's text consistent with them. ``seed`` goes as
``sampling_seed``, which SGLang honours only when the engine runs with
``enable_deterministic_inference=True`` (pass it in ``engine_kwargs``; there a request without a
seed gets SGLang's default 42, so give each sample its own); otherwise requests draw from the
engine's generator, seeded with ``rollout.seed + replica_rank``.

Log-probs are SGLang's: ``log_softmax(logits / T)`` of the sampled token (``T = 1`` for greedy),
before top-k / top-p truncation, like ``hf`` (unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set,
which makes them ignore ``T``). Finish reasons map one to one (``stop``, ``length``, ``abort``);
SGLang checks the length limit first, so an eos drawn as the very last allowed token reports
``"length"`` where ``hf`` says ``"stop"``.

Memory (``rollout.free_cache_engine``, default true, starts SGLang with ``enable_memory_saver``):

- ``sleep()`` releases the KV cache, the weights and the CUDA graphs (after in-flight requests
  finish; SGLang refuses to release while one runs).
- ``wake_up()`` restores the weights only, so that a weight sync loads into them before the KV
  cache comes back; ``update_weights`` loads buckets; ``resume()`` (called by
  ``WeightSyncManager`` last) restores the KV cache and CUDA graphs and flushes the prefix cache.
  ``generate`` calls ``resume()`` itself when needed, so ``sleep(); wake_up(); generate()`` works.
- Released weights come back as memory, not content, unless SGLang keeps a CPU copy
  (``enable_weights_cpu_backup``: on by default in colocated/standalone mode). Hybrid mode skips
  the copy: the weights are pushed again after every ``wake_up`` by the weight sync, or, if none
  came, from the training model the replica was given.
- With ``free_cache_engine=false`` nothing is released: ``sleep`` only marks the replica asleep.

``generate`` while asleep raises RuntimeError, as ``hf``. ``shutdown()`` resolves requests still
running with ``stop_reason="abort"`` and stops the engine; it is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, ClassVar

from trellis.rollout.base import RolloutReplica
from trellis.rollout.sampling import SamplingParams, TokenOutput
from trellis.utils.loop_thread import LoopThread
from trellis_sglang.engine import (
    ALL_MEMORY_TAGS,
    SERVING_TAGS,
    WEIGHTS,
    EngineClient,
    InProcessEngine,
    ServerEngine,
    SGLangAPI,
    for_ipc,
    load_sglang_api,
    sglang_unavailable_reason,
)

__all__ = ["SGLangRolloutReplica", "to_sglang_sampling_params", "to_token_output"]

REPLICA_OPTIONS = {
    "server": False,
    "server_startup_timeout_s": 600.0,
    "server_request_timeout_s": 3600.0,
    "server_max_connections": 256,
    "update_weights_bucket_megabytes": 512.0,
}
"""``engine_kwargs`` the replica consumes, with their defaults; every other key goes to SGLang."""

_FINISH_REASONS = ("stop", "length", "abort")  # SGLang's finish_reason types are Trellis' stop reasons


def to_sglang_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict for ``params`` (see the module docstring for each field)."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def to_token_output(result: dict[str, Any], params: SamplingParams, request_id: str) -> TokenOutput:
    """The :class:`TokenOutput` of SGLang's answer ``{"output_ids", "meta_info": {...}}``.

    Raises:
        RuntimeError: an unknown finish reason, or log-probs missing or not matching the tokens.
    """
    token_ids = [int(t) for t in result["output_ids"]]
    meta = result.get("meta_info") or {}
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    reason = kind if kind in _FINISH_REASONS else None
    if reason is None:
        raise RuntimeError(f"request {request_id!r}: SGLang finished with an unknown reason {finish!r}.")
    log_probs = None
    if params.wants_logprobs:
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise RuntimeError(f"request {request_id!r}: log-probs were asked for but SGLang returned none.")
        log_probs = [float(entry[0]) for entry in entries]
        if [int(entry[1]) for entry in entries] != token_ids:
            raise RuntimeError(
                f"request {request_id!r}: SGLang's log-probs are for tokens {[e[1] for e in entries]}, "
                f"its output is {token_ids}."
            )
    return TokenOutput(token_ids, log_probs, reason)


def _aborted(params: SamplingParams) -> TokenOutput:
    return TokenOutput([], [] if params.wants_logprobs else None, "abort")


def _model_weights(model: Any) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` of ``model``'s state dict, as the weight sync sends them."""
    yield from model.state_dict().items()


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device; None where CUDA is not in use yet (every thread is on 0 then).

    Neither imports torch nor creates a CUDA context for this.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


async def _use_cuda_device(index: int) -> None:
    import torch

    torch.cuda.set_device(index)  # per thread: the engine loop's thread starts on device 0


def _close(loop: LoopThread, state: dict[str, Any]) -> None:
    """Stop the replica's loop, then SGLang (``shutdown``, or garbage collection / exit without it)."""
    engine = state.pop("engine", None)
    try:
        loop.stop()  # cancels what still runs there (SGLang's receive loop) and joins the thread
    finally:
        if engine is not None:
            engine.close()


class SGLangRolloutReplica(RolloutReplica):
    """Generation on SGLang (NVIDIA or AMD GPUs): continuous batching, sleep/wake, in-place weight updates.

    See the module docstring for engines, sampling, log-probs and memory. ``engine_kwargs`` keys it
    reads: ``server``, ``server_startup_timeout_s``, ``server_request_timeout_s``,
    ``server_max_connections``, ``update_weights_bucket_megabytes``; the others are SGLang
    ``ServerArgs`` and override what the replica derives (:meth:`engine_args`).

    ``load_sglang`` returns the SGLang names the engines use; tests replace it with
    :class:`trellis_sglang.testing.FakeSGLang`'s ``api``.
    """

    load_sglang: ClassVar[Callable[[], SGLangAPI]] = staticmethod(load_sglang_api)

    def __init__(self, replica_rank: int, rollout_config: Any, model_config: Any) -> None:
        super().__init__(replica_rank, rollout_config, model_config)
        kwargs = dict(getattr(rollout_config, "engine_kwargs", None) or {})
        options = {key: kwargs.pop(key, default) for key, default in REPLICA_OPTIONS.items()}
        if not isinstance(options["server"], bool):
            raise ValueError(f"engine_kwargs.server must be true or false, got {options['server']!r}.")
        self.server: bool = options["server"]
        self.server_startup_timeout_s = _positive(options, "server_startup_timeout_s", float)
        self.server_request_timeout_s = _positive(options, "server_request_timeout_s", float)
        self.server_max_connections = _positive(options, "server_max_connections", int)
        self.bucket_bytes = int(_positive(options, "update_weights_bucket_megabytes", float) * 2**20)
        self.sglang_kwargs: dict[str, Any] = kwargs
        self.free_cache_engine = bool(getattr(rollout_config, "free_cache_engine", True))
        self.engine: EngineClient | None = None
        self.released: set[str] = set()  # memory tags SGLang holds released right now
        self._weights_backed_up = False
        self._weights_stale = False  # weights resumed without content and not pushed since
        self._source_model: Any = None  # hybrid: the training model, to refill stale weights from
        self._loop: LoopThread | None = None  # the replica's event loop: every engine call runs there
        self._state: dict[str, Any] = {}  # {"engine": ...} for the finalizer
        self._finalizer: Any = None
        # used on the replica's loop only: the lock orders sleep / wake_up / resume / update_weights
        self._lock = asyncio.Lock()
        self._inflight: set[asyncio.Task] = set()
        self._aborting: set[asyncio.Task] = set()
        self._rids = itertools.count()
        self._closed = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None where SGLang can run, else why not ("sglang is not installed: ..."); imports no sglang."""
        return sglang_unavailable_reason()

    @property
    def server_address(self) -> str | None:
        """``"127.0.0.1:PORT"`` of the SGLang server (``engine_kwargs.server=true``), else None."""
        return None if self.engine is None else self.engine.address

    # ------------------------------------------------------------------ lifecycle

    def engine_args(self, mode: str, device: Any = None) -> dict[str, Any]:
        """SGLang ``ServerArgs`` for this replica: derived from the configs, then ``engine_kwargs`` on top.

        ``model_path`` / ``tokenizer_path`` / ``trust_remote_code`` / ``dtype`` from ``model``;
        ``tp_size`` = ``rollout.tensor_parallel_size``; ``mem_fraction_static`` =
        ``rollout.gpu_memory_utilization``; ``enable_memory_saver`` = ``rollout.free_cache_engine``
        (with ``enable_weights_cpu_backup`` outside hybrid mode); ``random_seed`` =
        ``rollout.seed + replica_rank``; ``base_gpu_id`` = the index of ``device``.

        Raises:
            ValueError: ``model.path`` is not set (SGLang loads its own copy in every mode).
        """
        mc, rc = self.model_config, self.rollout_config
        path = getattr(mc, "path", None)
        if not path:
            raise ValueError(
                f"sglang loads its own copy of the model in every mode ({mode} too): set model.path "
                f"(got {path!r})."
            )
        args: dict[str, Any] = {
            "model_path": str(path),
            "dtype": getattr(mc, "dtype", "auto") or "auto",
            "trust_remote_code": bool(getattr(mc, "trust_remote_code", False)),
            "tp_size": int(getattr(rc, "tensor_parallel_size", 1) or 1),
            "mem_fraction_static": float(getattr(rc, "gpu_memory_utilization", 0.5)),
            "enable_memory_saver": self.free_cache_engine,
        }
        tokenizer_path = getattr(mc, "tokenizer_path", None)
        if tokenizer_path:
            args["tokenizer_path"] = str(tokenizer_path)
        if self.free_cache_engine:
            args["enable_weights_cpu_backup"] = mode != "hybrid"
        seed = getattr(rc, "seed", None)
        if seed is not None:
            args["random_seed"] = int(seed) + self.replica_rank
        index = _device_index(device)
        if index is not None:
            args["base_gpu_id"] = index
        args.update(self.sglang_kwargs)
        return args

    async def init(
        self, mode: str = "hybrid", *, model: Any = None, tokenizer: Any = None, device: Any = None
    ) -> None:
        """Start SGLang for ``mode``; in hybrid mode (or given ``model``) push ``model``'s weights into it.

        Starts the replica's event loop thread, which every later call of the replica goes through
        (see the module docstring). ``tokenizer`` is not used: SGLang loads its own from
        ``model.tokenizer_path`` or ``model.path``. ``device`` (e.g. ``"cuda:1"``) sets SGLang's
        ``base_gpu_id``.

        Raises:
            ValueError: an unknown mode, hybrid mode without ``model``, or no ``model.path``.
            ImportError / RuntimeError: sglang is not installed / CUDA is not available.
        """
        self.mode = self.check_mode(mode)
        if self._closed or self.engine is not None:
            raise RuntimeError(
                "SGLangRolloutReplica.init: this replica was already started; build a new one."
            )
        if mode == "hybrid" and model is None:
            raise ValueError(
                "hybrid mode serves the training worker's weights: pass init(..., model=module)."
            )
        args = self.engine_args(mode, device)
        api = self.load_sglang()
        cuda_device = _current_cuda_device()
        self._loop = loop = LoopThread(f"trellis-sglang-{self.replica_rank}")
        self._state = {}
        self._finalizer = weakref.finalize(self, _close, loop, self._state)
        try:
            if cuda_device is not None:
                await loop.call(_use_cuda_device(cuda_device))
            if self.server:
                engine: EngineClient = await loop.call(
                    ServerEngine.launch(
                        api,
                        args,
                        startup_timeout_s=self.server_startup_timeout_s,
                        request_timeout_s=self.server_request_timeout_s,
                        max_connections=self.server_max_connections,
                    )
                )
            else:
                # Built here, on the caller's thread (usually the main one, where SGLang may set its
                # signal handlers); bound to the replica's loop by its first call, which goes there.
                engine = InProcessEngine(api, args)
            self._state["engine"] = engine
        except BaseException:
            await asyncio.to_thread(self._finalizer)
            self._loop = None
            raise
        self.engine = engine
        self._weights_backed_up = bool(args.get("enable_weights_cpu_backup", False))
        self.free_cache_engine = bool(args.get("enable_memory_saver", False))
        self.asleep = False
        if model is not None:
            self._source_model = model if mode == "hybrid" else None
            await self.update_weights(_model_weights(model))

    async def sleep(self) -> None:
        """Stop taking requests, let running ones finish, then release SGLang's GPU memory (module doc)."""
        engine = self._engine("sleep")
        await self._call(self._sleep(engine))

    async def wake_up(self) -> None:
        """Restore the weights' memory and take requests again; the KV cache follows in :meth:`resume`."""
        engine = self._engine("wake_up")
        await self._call(self._wake_up(engine))

    async def resume(self) -> None:
        """Restore the KV cache and CUDA graphs, the last step of a weight sync; no-op if none is released."""
        engine = self._engine("resume")
        await self._call(self._resume(engine))

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load ``(name, tensor)`` pairs (Hugging Face names) into SGLang's model in place.

        Sent in buckets of ``engine_kwargs.update_weights_bucket_megabytes`` (default 512 MiB, at
        least one tensor each) with ``update_weights_from_tensor``. Resumes the weights' memory
        first if it is released. The prefix cache is flushed with every bucket while the KV
        cache is in memory (otherwise by :meth:`resume`). ``named_tensors`` is iterated on the
        replica's loop thread.

        Raises:
            RuntimeError: SGLang refused a bucket (an unknown name, a wrong shape); the message is
                SGLang's.
        """
        engine = self._engine("update_weights")
        await self._call(self._update_weights(engine, named_tensors))

    async def shutdown(self) -> None:
        """Resolve running requests with ``stop_reason="abort"``, then stop SGLang and the loop thread.

        Idempotent; safe before ``init`` and after a failed one.
        """
        self._closed = True
        self.engine = None
        loop = self._loop
        if loop is not None and loop.running:
            with contextlib.suppress(RuntimeError):  # stopped meanwhile (a concurrent shutdown)
                await loop.call(self._abort_running())
        if self._finalizer is not None and self._finalizer.alive:
            await asyncio.to_thread(self._finalizer)

    # ------------------------------------------------------------------ generation

    async def generate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, request_id: str
    ) -> TokenOutput:
        engine = self._engine("generate")
        prompt_ids = self.check_request(prompt_ids, sampling_params, request_id)
        return await self._call(self._generate(engine, prompt_ids, sampling_params, request_id))

    # ------------------------------------------------------------------ on the replica's loop

    async def _generate(
        self, engine: EngineClient, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> TokenOutput:
        if self.released or self._weights_stale:
            async with self._lock:
                if self.asleep:  # sleep() took the lock first
                    raise RuntimeError(
                        "SGLangRolloutReplica is asleep: await replica.wake_up() before generate."
                    )
                if not self._closed:
                    await self._resume_serving(engine)
        if self._closed:  # shutdown() came first: nothing reaches the engine any more
            return _aborted(params)
        # rids must be unique among SGLang's running requests; callers may reuse a request_id
        rid = f"{request_id}#{next(self._rids)}"
        task = asyncio.ensure_future(
            engine.generate(prompt_ids, to_sglang_sampling_params(params), params.wants_logprobs, rid)
        )
        self._inflight.add(task)
        try:
            result = await task
        except asyncio.CancelledError:
            if task in self._aborting:  # shutdown() cancelled it: the request is aborted, not the caller
                return _aborted(params)
            task.cancel()
            raise
        finally:
            self._inflight.discard(task)
            self._aborting.discard(task)
        return to_token_output(result, params, request_id)

    async def _sleep(self, engine: EngineClient) -> None:
        async with self._lock:
            self.asleep = True
            if self._inflight:
                await asyncio.wait(set(self._inflight))
            tags = [tag for tag in ALL_MEMORY_TAGS if tag not in self.released]
            if self.free_cache_engine and tags:
                await engine.release_memory_occupation(tags)
                self.released.update(tags)

    async def _wake_up(self, engine: EngineClient) -> None:
        async with self._lock:
            await self._resume_weights(engine)
            self.asleep = False

    async def _resume(self, engine: EngineClient) -> None:
        async with self._lock:
            await self._resume_serving(engine)

    async def _update_weights(self, engine: EngineClient, named_tensors: Iterable[tuple[str, Any]]) -> None:
        async with self._lock:
            await self._resume_weights(engine)
            await self._push(engine, named_tensors)

    async def _abort_running(self) -> None:
        """Resolve the running requests as aborted, then let control calls already queued finish."""
        running = [task for task in self._inflight if not task.done()]
        for task in running:
            self._aborting.add(task)
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        async with self._lock:  # FIFO: whatever waited for the lock is done when this gets it
            pass

    # ------------------------------------------------------------------ helpers

    @property
    def _kv_in_memory(self) -> bool:
        return not self.released.intersection(SERVING_TAGS)

    def _engine(self, action: str) -> EngineClient:
        if self._closed:
            raise RuntimeError(f"SGLangRolloutReplica.{action} after shutdown(): build a new replica.")
        if self.engine is None:
            raise RuntimeError(
                f"SGLangRolloutReplica.{action} before init(): await replica.init(mode) first."
            )
        return self.engine

    async def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Await ``coroutine`` on the replica's loop (from whatever loop the caller runs)."""
        assert self._loop is not None  # set by init() before self.engine
        return await self._loop.call(coroutine)

    async def _resume_weights(self, engine: EngineClient) -> None:
        """Give the weights their memory back (caller holds the lock)."""
        if WEIGHTS in self.released:
            await engine.resume_memory_occupation([WEIGHTS])
            self.released.discard(WEIGHTS)
            self._weights_stale = not self._weights_backed_up

    async def _resume_serving(self, engine: EngineClient) -> None:
        """Weights in memory and current, then KV cache and CUDA graphs back (caller holds the lock)."""
        await self._resume_weights(engine)
        if self._weights_stale:
            if self._source_model is None:
                raise RuntimeError(
                    "SGLang released the weights without a CPU copy (enable_weights_cpu_backup=false) and "
                    "none were pushed since wake_up(): call update_weights (a weight sync) before "
                    "generating."
                )
            await self._push(engine, _model_weights(self._source_model))
        tags = [tag for tag in SERVING_TAGS if tag in self.released]
        if tags:
            await engine.resume_memory_occupation(tags)
            self.released.difference_update(tags)
            await engine.flush_cache()  # nothing cached before the release may be reused

    async def _push(self, engine: EngineClient, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Send ``named_tensors``, one ``update_weights_from_tensor`` per bucket (caller holds the lock)."""
        bucket: list[tuple[str, Any]] = []
        size = 0
        for name, tensor in named_tensors:
            tensor = for_ipc(tensor)
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                await engine.update_weights_from_tensor(bucket, flush_cache=self._kv_in_memory)
                bucket, size = [], 0
        if bucket:
            await engine.update_weights_from_tensor(bucket, flush_cache=self._kv_in_memory)
        self._weights_stale = False


def _positive(options: dict[str, Any], key: str, kind: Callable[[Any], Any]) -> Any:
    value = options[key]
    try:
        converted = kind(value)
    except (TypeError, ValueError):
        converted = None
    if isinstance(value, bool) or converted is None or not converted > 0:
        raise ValueError(f"engine_kwargs.{key} must be a positive number, got {value!r}.")
    return converted


def _device_index(device: Any) -> int | None:
    """The GPU index of ``device`` (``"cuda:1"``, ``torch.device("cuda", 1)``, ``1``), or None."""
    if device is None or isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device
    if not isinstance(device, str):  # a torch.device
        index = getattr(device, "index", None)
        return None if index is None else int(index)
    tail = device.rsplit(":", 1)[-1]
    return int(tail) if ":" in device and tail.isdigit() else None
