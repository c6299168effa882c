"""A fake SGLang for tests on machines without a GPU: the API surface the replica uses, on a real HF model.

    fake = FakeSGLang()
    monkeypatch.setattr(SGLangRolloutReplica, "load_sglang", staticmethod(lambda: fake.api))
    ...                                      # build and drive replicas as usual
    engine = fake.engines[-1]                # the FakeEngine a replica made
    engine.calls                             # [(method, kwargs), ...] in call order

:class:`FakeEngine` has the names, argument names and answer shapes of SGLang 0.5.3+ (see
:mod:`trellis_sglang.engine` for where they were checked): ``sglang.Engine(**server_args)``,
``async_generate(...)`` answering ``{"text", "output_ids", "meta_info"}``, and a
``tokenizer_manager`` with ``release_memory_occupation`` / ``resume_memory_occupation`` /
``update_weights_from_tensor`` / ``flush_cache``. Unknown keyword arguments and unknown sampling
parameters raise TypeError, as SGLang's own constructors do. Underneath, a Hugging Face causal LM
decodes one token at a time, so greedy tokens and log-probs are the model's own.

Where real SGLang would crash or hang, the fake raises instead, and says so:

- a request or a weight update while the memory it needs is released (real SGLang would touch
  unmapped GPU memory);
- releasing memory while a request runs (SGLang asserts the scheduler is idle);
- resuming a tag that is not released (SGLang removes it from a set: KeyError);
- using the engine from a second event loop: like SGLang's tokenizer manager, the engine binds to
  the loop of its first call (``tokenizer_manager.event_loop``) and raises RuntimeError on any
  other (SGLang would wait forever for answers delivered to the first);
- building ``sglang.Engine`` off the main thread (``FakeSGLang(main_thread_engine=True)``, the
  default): SGLang releases before sgl-project/sglang#18752 (early 2026) register a SIGQUIT
  handler while the engine starts, and ``signal.signal`` raises ValueError in any other thread.
  An engine behind :meth:`FakeSGLang.launch_server` runs in "its own process" and may start
  anywhere.

Weights resumed without ``enable_weights_cpu_backup`` come back as fresh memory, not content: the
fake fills them with noise. ``hold_requests()`` keeps new requests from ever finishing (a busy or
dead scheduler), for abort tests. :meth:`FakeSGLang.launch_server` serves a FakeEngine over HTTP
(the endpoints the replica uses) in a thread, as ``python -m sglang.launch_server`` would.

Sampling is the fake's own (temperature, then top-k, top-p, a multinomial draw), so sampled
tokens match SGLang's in distribution, not draw for draw; penalties, grammars and ``n > 1`` are
not implemented and raise NotImplementedError.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers the tensor reductions ForkingPickler uses

from trellis_sglang.engine import ALL_MEMORY_TAGS, KV_CACHE, WEIGHTS, SGLangAPI

__all__ = ["FakeEngine", "FakeSGLang", "FakeServer", "FakeTokenizerManager"]

SERVER_ARGS: dict[str, type] = {
    "model_path": str,
    "tokenizer_path": str,
    "trust_remote_code": bool,
    "dtype": str,
    "tp_size": int,
    "mem_fraction_static": float,
    "random_seed": int,
    "enable_memory_saver": bool,
    "enable_weights_cpu_backup": bool,
    "enable_deterministic_inference": bool,
    "base_gpu_id": int,
    "log_level": str,
    "host": str,
    "port": int,
    "skip_tokenizer_init": bool,
    "context_length": int,
    "attention_backend": str,
    "sampling_backend": str,
    "disable_cuda_graph": bool,
    "disable_radix_cache": bool,
    "max_running_requests": int,
    "chunked_prefill_size": int,
    "load_format": str,
    "served_model_name": str,
}
"""The ``ServerArgs`` fields the fake accepts (a subset of SGLang's), with their types."""

ASYNC_GENERATE_ARGS = frozenset(
    {
        "prompt",
        "sampling_params",
        "input_ids",
        "image_data",
        "audio_data",
        "video_data",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "lora_path",
        "custom_logit_processor",
        "return_hidden_states",
        "stream",
        "rid",
        "priority",
    }
)
"""Keyword arguments of ``Engine.async_generate`` (as in SGLang 0.5.3)."""

SAMPLING_PARAMS: dict[str, Any] = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "custom_params": None,
    "stream_interval": None,
    "logit_bias": None,
    "sampling_seed": None,
}
"""SGLang's ``SamplingParams`` fields with their defaults; other keys are a TypeError."""

_NOT_IMPLEMENTED = (
    "stop_regex",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "custom_params",
    "logit_bias",
)


# ---------------------------------------------------------------- io_struct and serializer


@dataclass
class ReleaseMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass
class ResumeMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[Any]
    load_format: str | None = None
    flush_cache: bool = True


@dataclass
class FlushCacheReqOutput:
    success: bool = True


def serialize(obj: Any, output_str: bool = False) -> Any:
    """What SGLang's ``MultiprocessingSerializer.serialize`` does: ForkingPickler, base64 for HTTP."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    data = buf.getvalue()
    return base64.b64encode(data).decode() if output_str else data


def deserialize(data: Any) -> Any:
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return ForkingPickler.loads(data)


# ---------------------------------------------------------------- the engine


@dataclass
class _Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: set[int]
    stop: list[str]
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    sampling_seed: int | None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def _sampling(params: dict[str, Any] | None) -> _Sampling:
    """SGLang's ``SamplingParams(**params)`` and its normalisation, for the fields the fake implements."""
    params = dict(params or {})
    unknown = sorted(set(params) - set(SAMPLING_PARAMS))
    if unknown:
        raise TypeError(f"SamplingParams.__init__() got an unexpected keyword argument {unknown[0]!r}")
    values = {**SAMPLING_PARAMS, **{k: v for k, v in params.items() if v is not None}}
    for key in _NOT_IMPLEMENTED:
        if values[key] is not None:
            raise NotImplementedError(f"the fake SGLang engine does not implement sampling parameter {key!r}")
    for key in ("min_p", "frequency_penalty", "presence_penalty", "min_new_tokens"):
        if values[key] != SAMPLING_PARAMS[key]:
            raise NotImplementedError(f"the fake SGLang engine does not implement {key}={values[key]!r}")
    if values["repetition_penalty"] != 1.0 or values["n"] != 1:
        raise NotImplementedError("the fake SGLang engine implements neither repetition_penalty nor n > 1")
    temperature, top_k = float(values["temperature"]), int(values["top_k"])
    if 0 <= temperature < 1e-6:  # SGLang: a zero temperature means greedy, i.e. top_k = 1
        temperature, top_k = 1.0, 1
    stop = values["stop"] or []
    return _Sampling(
        max_new_tokens=int(values["max_new_tokens"]),
        temperature=temperature,
        top_p=float(values["top_p"]),
        top_k=top_k,
        stop_token_ids={int(t) for t in values["stop_token_ids"] or ()},
        stop=[stop] if isinstance(stop, str) else list(stop),
        ignore_eos=bool(values["ignore_eos"]),
        skip_special_tokens=bool(values["skip_special_tokens"]),
        no_stop_trim=bool(values["no_stop_trim"]),
        sampling_seed=values["sampling_seed"],
    )


class FakeTokenizerManager:
    """The async control methods of SGLang's ``TokenizerManager`` that the replica awaits."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.event_loop: asyncio.AbstractEventLoop | None = None

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self.event_loop is None:
            self.event_loop = loop  # SGLang starts its receive loop on the first loop that asks
        elif loop is not self.event_loop:
            raise RuntimeError(
                "fake SGLang: the tokenizer manager is bound to another event loop (real SGLang would "
                "wait forever for the answer)"
            )

    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self._bind()
        self.engine._record("release_memory_occupation", tags=obj.tags)
        self.engine._release(obj.tags)

    async def resume_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self._bind()
        self.engine._record("resume_memory_occupation", tags=obj.tags)
        self.engine._resume(obj.tags)

    async def update_weights_from_tensor(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self._bind()
        return await asyncio.to_thread(self.engine._update_weights, obj)

    async def flush_cache(self) -> FlushCacheReqOutput:
        self._bind()
        self.engine._record("flush_cache")
        return FlushCacheReqOutput(success=self.engine.in_flight == 0)


class FakeEngine:
    """``sglang.Engine`` on a Hugging Face model on the CPU (see the module docstring).

    Attributes:
        calls: ``(method, kwargs)`` of every API call, in order (``__init__`` first).
        released: memory tags released right now.
        in_flight / max_in_flight: requests running now / the most that ran at once.
        model, tokenizer: the Hugging Face objects underneath.
    """

    def __init__(self, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in SERVER_ARGS:
                raise TypeError(f"ServerArgs.__init__() got an unexpected keyword argument {key!r}")
        if "model_path" not in kwargs:
            raise TypeError("ServerArgs.__init__() missing 1 required positional argument: 'model_path'")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.server_args = dict(kwargs)
        self.calls: list[tuple[str, dict[str, Any]]] = [("__init__", dict(kwargs))]
        dtype = kwargs.get("dtype", "auto")
        self.model = AutoModelForCausalLM.from_pretrained(
            kwargs["model_path"],
            dtype="auto" if dtype == "auto" else getattr(torch, dtype),
            trust_remote_code=bool(kwargs.get("trust_remote_code", False)),
        ).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(
            kwargs.get("tokenizer_path") or kwargs["model_path"],
            trust_remote_code=bool(kwargs.get("trust_remote_code", False)),
        )
        self.generator = torch.Generator().manual_seed(int(kwargs.get("random_seed", 0)))
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.released: set[str] = set()
        self.in_flight = 0
        self.max_in_flight = 0
        self.is_shut_down = False
        self._hold = False
        self._model_lock = threading.Lock()  # one forward at a time, as SGLang runs one batch at a time
        self._stash: dict[str, torch.Tensor] = {}
        self._static_state: dict[str, torch.Tensor] = {}
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = {eos} if isinstance(eos, int) else set(eos or ())
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))

    def _record(self, method: str, **kwargs: Any) -> None:
        self.calls.append((method, kwargs))

    def calls_to(self, method: str) -> list[dict[str, Any]]:
        """The kwargs of every call to ``method``, in order."""
        return [kwargs for name, kwargs in self.calls if name == method]

    def hold_requests(self) -> None:
        """From now on, requests never finish (until cancelled), like those of a stuck scheduler."""
        self._hold = True

    def release_requests(self) -> None:
        """Let held requests (and later ones) run to the end again."""
        self._hold = False

    # ---------------------------------------------------------------- generation

    async def async_generate(self, **kwargs: Any) -> dict[str, Any]:
        unknown = sorted(set(kwargs) - ASYNC_GENERATE_ARGS)
        if unknown:
            raise TypeError(f"Engine.async_generate() got an unexpected keyword argument {unknown[0]!r}")
        self._record("async_generate", **kwargs)
        self.tokenizer_manager._bind()
        if self.is_shut_down:
            raise RuntimeError("fake SGLang: the engine is shut down (real SGLang would never answer)")
        if kwargs.get("stream"):
            raise NotImplementedError("the fake SGLang engine does not stream")
        busy = self.released & {KV_CACHE, WEIGHTS} if self.server_args.get("enable_memory_saver") else set()
        if busy:
            raise RuntimeError(
                f"fake SGLang: a request while {sorted(busy)} memory is released (real SGLang would use "
                "unmapped GPU memory)"
            )
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            input_ids = self.tokenizer(kwargs["prompt"])["input_ids"]
        sampling = _sampling(kwargs.get("sampling_params"))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # let requests submitted together join, like a scheduler's batch
            while self._hold:
                await asyncio.sleep(0.01)
            return await asyncio.to_thread(
                self._decode, list(input_ids), sampling, bool(kwargs.get("return_logprob")), kwargs.get("rid")
            )
        finally:
            self.in_flight -= 1

    def _decode(
        self, input_ids: list[int], sp: _Sampling, return_logprob: bool, rid: str | None
    ) -> dict[str, Any]:
        start = time.perf_counter()
        generator = self.generator
        if self.server_args.get("enable_deterministic_inference"):
            # SGLang seeds each request (42 when it names none) only in deterministic mode
            generator = torch.Generator().manual_seed(
                42 if sp.sampling_seed is None else int(sp.sampling_seed)
            )
        output_ids: list[int] = []
        logprobs: list[float] = []
        finish: dict[str, Any] | None = None
        with self._model_lock, torch.no_grad():
            while finish is None:
                # the whole sequence every step: no cache API to depend on, and a tiny model is quick
                logits = self.model(input_ids=torch.tensor([input_ids + output_ids])).logits[0, -1].float()
                if sp.greedy:
                    token = int(logits.argmax())
                    logprob = torch.log_softmax(logits, -1)[token]
                else:
                    logp = torch.log_softmax(logits / sp.temperature, -1)
                    token = self._draw(logp.exp(), sp, generator)
                    logprob = logp[token]
                output_ids.append(token)
                logprobs.append(float(logprob))
                finish = self._finished(output_ids, sp)
        text_ids = output_ids
        if not sp.no_stop_trim and isinstance(finish.get("matched"), int):
            text_ids = output_ids[:-1]
        text = self.tokenizer.decode(text_ids, skip_special_tokens=sp.skip_special_tokens)
        if not sp.no_stop_trim and isinstance(finish.get("matched"), str):
            text = text[: text.find(finish["matched"])]
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "e2e_latency": time.perf_counter() - start,
        }
        if return_logprob:
            meta["input_token_logprobs"] = [(None, input_ids[0], None)]
            meta["output_token_logprobs"] = [
                (lp, t, None) for lp, t in zip(logprobs, output_ids, strict=True)
            ]
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    @staticmethod
    def _draw(probs: torch.Tensor, sp: _Sampling, generator: torch.Generator) -> int:
        sorted_probs, order = probs.sort(descending=True)
        if sp.top_k > 0:
            sorted_probs[sp.top_k :] = 0
        if sp.top_p < 1:  # drop a token once the mass before it exceeds top_p
            sorted_probs[(sorted_probs.cumsum(0) - sorted_probs) > sp.top_p] = 0
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])

    def _finished(self, output_ids: list[int], sp: _Sampling) -> dict[str, Any] | None:
        """SGLang's ``Req.check_finished``: the length limit first, then stop tokens, then stop strings."""
        if len(output_ids) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        last = output_ids[-1]
        if not sp.ignore_eos and (last in sp.stop_token_ids or last in self.eos_token_ids):
            return {"type": "stop", "matched": last}
        if sp.stop:
            text = self.tokenizer.decode(output_ids, skip_special_tokens=False)
            for stop in sp.stop:
                if stop in text:
                    return {"type": "stop", "matched": stop}
        return None

    # ---------------------------------------------------------------- memory and weights

    def _release(self, tags: Sequence[str] | None) -> None:
        if self.in_flight:
            raise AssertionError("release_memory_occupation should be called only when no ongoing request.")
        tags = list(tags or ALL_MEMORY_TAGS)
        self.released.update(tags)
        if WEIGHTS in tags and self.server_args.get("enable_memory_saver"):
            self._static_state = {k: v.clone() for k, v in self.model.named_buffers()}
            if self.server_args.get("enable_weights_cpu_backup"):
                self._stash = {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def _resume(self, tags: Sequence[str] | None) -> None:
        tags = list(tags or ALL_MEMORY_TAGS)
        for tag in tags:
            self.released.remove(tag)  # KeyError for a tag that is not released, as in SGLang
        if WEIGHTS in tags and self.server_args.get("enable_memory_saver"):
            with self._model_lock, torch.no_grad():
                for name, param in self.model.named_parameters():
                    if name in self._stash:
                        param.copy_(self._stash[name])
                    else:  # the pages come back, their content does not
                        param.normal_(generator=torch.Generator().manual_seed(len(name)))
                buffers = dict(self.model.named_buffers())
                for name, value in self._static_state.items():
                    buffers[name].copy_(value)
            self._stash, self._static_state = {}, {}

    def _update_weights(self, obj: Any) -> tuple[bool, str]:
        payloads = list(obj.serialized_named_tensors)
        named = deserialize(payloads[0]) if payloads else []
        self._record(
            "update_weights_from_tensor",
            names=[name for name, _ in named],
            shapes=[tuple(t.shape) for _, t in named],
            tp_payloads=len(payloads),
            load_format=obj.load_format,
            flush_cache=obj.flush_cache,
        )
        tp_size = int(self.server_args.get("tp_size", 1))
        if len(payloads) != tp_size:
            return False, f"Failed to update weights: {len(payloads)} payloads for tp_size={tp_size}"
        if WEIGHTS in self.released and self.server_args.get("enable_memory_saver"):
            return (
                False,
                "fake SGLang: the weights' memory is released (real SGLang would write to unmapped memory)",
            )
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        with self._model_lock, torch.no_grad():
            for name, tensor in named:
                target = targets.get(name)
                if target is None:
                    return False, f"Failed to update weights: KeyError({name!r})"
                if tuple(target.shape) != tuple(tensor.shape):
                    return False, (
                        f"Failed to update weights: AssertionError('Attempted to load weight "
                        f"({tuple(tensor.shape)}) into parameter ({tuple(target.shape)})')"
                    )
                target.copy_(tensor.to(dtype=target.dtype))
        return True, "Succeeded to update model weights."

    def shutdown(self) -> None:
        self._record("shutdown")
        self.is_shut_down = True


# ---------------------------------------------------------------- the server


class FakeServer:
    """``python -m sglang.launch_server`` for a FakeEngine: the HTTP endpoints the replica uses, in threads.

    ``/generate``, ``/health``, ``/release_memory_occupation``, ``/resume_memory_occupation``,
    ``/update_weights_from_tensor`` and ``/flush_cache`` take and answer the JSON of SGLang's
    ``http_server``; an exception becomes HTTP 400 with ``{"error": {"message": ...}}``.
    """

    def __init__(self, engine: FakeEngine, host: str, port: int) -> None:
        self.engine = engine
        self.returncode: int | None = None
        self._stopping = False
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="fake-sglang-loop"
        )
        self._loop_thread.start()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep the test output clean
                pass

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._answer(200, {})
                else:
                    self._answer(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                try:
                    self._answer(200, server._route(self.path, body))
                except Exception as exc:
                    self._answer(400, {"error": {"message": f"{type(exc).__name__}: {exc}"}})

            def _answer(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer((host, port), Handler)
        self.http.daemon_threads = True
        self._http_thread = threading.Thread(
            target=self.http.serve_forever, args=(0.02,), daemon=True, name="fake-sglang-http"
        )
        self._http_thread.start()

    def _run(self, coroutine: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        while True:  # until answered, or until stop() (which may leave the loop before running it)
            try:
                return future.result(timeout=0.05)
            except concurrent.futures.TimeoutError:
                if self._stopping:
                    future.cancel()
                    raise RuntimeError("fake SGLang: the server is shutting down") from None

    def _route(self, path: str, body: dict[str, Any]) -> Any:
        manager = self.engine.tokenizer_manager
        if path == "/generate":
            return self._run(self.engine.async_generate(**body))
        if path == "/release_memory_occupation":
            self._run(manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(**body)))
            return {}
        if path == "/resume_memory_occupation":
            self._run(manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(**body)))
            return {}
        if path == "/update_weights_from_tensor":
            success, message = self._run(
                manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(**body))
            )
            return {"success": success, "message": message}
        if path == "/flush_cache":
            self._run(manager.flush_cache())
            return {}
        raise LookupError(f"no route {path}")

    # the ServerProcess protocol
    def poll(self) -> int | None:
        return self.returncode

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.returncode is not None:
            return
        self._stopping = True
        self.http.shutdown()
        self.http.server_close()
        self.engine.shutdown()
        # requests still running end as the process would end them: their connections get an answer
        asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self.loop).result(timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout_s)
        self.loop.close()
        self.returncode = 0


async def _cancel_other_tasks() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _ExitedProcess:
    def __init__(self, code: int) -> None:
        self.code = code

    def poll(self) -> int:
        return self.code

    def stop(self, timeout_s: float = 30.0) -> None:
        pass


@dataclass
class FakeSGLang:
    """A fake ``sglang`` package: :attr:`api` for ``SGLangRolloutReplica.load_sglang``, and what it made.

    Attributes:
        main_thread_engine: ``Engine(...)`` raises ValueError off the main thread, as SGLang
            0.5.3 does (see the module docstring); False models later releases.
        engines: every FakeEngine built, in order (in-process ones and those behind servers).
        servers: every FakeServer launched.
        launches: the ``launch_server`` command lines, in order.
    """

    main_thread_engine: bool = True
    engines: list[FakeEngine] = field(default_factory=list)
    servers: list[FakeServer] = field(default_factory=list)
    launches: list[list[str]] = field(default_factory=list)

    @property
    def api(self) -> SGLangAPI:
        return SGLangAPI(
            Engine=self.Engine,
            ReleaseMemoryOccupationReqInput=ReleaseMemoryOccupationReqInput,
            ResumeMemoryOccupationReqInput=ResumeMemoryOccupationReqInput,
            UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
            serialize=serialize,
            launch_server=self.launch_server,
            version="0.5.3 (fake)",
        )

    def Engine(self, **kwargs: Any) -> FakeEngine:  # stands in for the class sglang.Engine
        if self.main_thread_engine and threading.current_thread() is not threading.main_thread():
            # what signal.signal(SIGQUIT, ...) in SGLang's _set_envs_and_config raises there
            raise ValueError("signal only works in main thread of the main interpreter")
        return self._engine(**kwargs)

    def _engine(self, **kwargs: Any) -> FakeEngine:
        engine = FakeEngine(**kwargs)
        self.engines.append(engine)
        return engine

    def launch_server(self, cli_args: list[str], log_file: Any) -> Any:
        """Parse ``cli_args`` as ``launch_server`` would and serve a FakeEngine; a bad flag exits with 2."""
        self.launches.append(list(cli_args))
        try:
            kwargs = _parse_cli(cli_args)
            engine = self._engine(**kwargs)  # the server's own process: its main thread
        except (TypeError, ValueError) as exc:
            log_file.write(f"launch_server: error: {exc}\n".encode())
            log_file.flush()
            return _ExitedProcess(2)
        server = FakeServer(engine, kwargs.get("host", "127.0.0.1"), int(kwargs.get("port", 30000)))
        self.servers.append(server)
        return server


def _parse_cli(cli_args: list[str]) -> dict[str, Any]:
    """``--tp-size 2 --enable-memory-saver`` -> ``{"tp_size": 2, "enable_memory_saver": True}``."""
    kwargs: dict[str, Any] = {}
    key: str | None = None
    for token in cli_args:
        if token.startswith("--"):
            key = token[2:].replace("-", "_")
            if key not in SERVER_ARGS:
                raise ValueError(f"unrecognized arguments: {token}")
            kwargs[key] = True
        elif key is None:
            raise ValueError(f"unrecognized arguments: {token}")
        else:
            kind = SERVER_ARGS[key]
            if kind is bool:
                raise ValueError(f"argument --{key.replace('_', '-')}: ignored explicit argument {token!r}")
            kwargs[key] = kind(token)
            key = None
    return kwargs
