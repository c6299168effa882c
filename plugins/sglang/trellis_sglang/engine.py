"""Everything that talks to SGLang: the names it uses, and two adapters with one async interface.

Written against SGLang 0.5.3 and later (``sglang.Engine`` / ``python -m sglang.launch_server``);
every name below was checked against SGLang's source (``srt/entrypoints/engine.py``,
``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``,
``srt/managers/scheduler_update_weights_mixin.py``, ``srt/utils``):

- generation: ``Engine.async_generate(input_ids=..., sampling_params={...}, return_logprob=...,
  rid=...)`` in-process, ``POST /generate`` with the same fields as JSON for a server. Both answer
  ``{"text", "output_ids", "meta_info"}``; ``meta_info["finish_reason"]`` is
  ``{"type": "stop" | "length" | "abort", ...}`` and ``meta_info["output_token_logprobs"]`` a list
  of ``(logprob, token_id, text)``.
- memory: ``tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags))``
  and ``resume_memory_occupation(ResumeMemoryOccupationReqInput(tags))`` (``POST
  /release_memory_occupation`` / ``/resume_memory_occupation`` with ``{"tags": [...]}``). The tags
  are ``weights``, ``kv_cache`` and ``cuda_graph``; the scheduler refuses to release while a request
  runs, and resuming a tag that is not released is an error (it removes it from a set).
- weights: ``tokenizer_manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
  serialized_named_tensors=[one payload per TP rank], load_format=None, flush_cache=...))``, each
  payload ``MultiprocessingSerializer.serialize(list_of_pairs)`` (``POST
  /update_weights_from_tensor`` with the payloads base64-encoded, ``output_str=True``). The
  payload carries CUDA IPC handles, not the bytes: sender and SGLang must share the machine.

Why the tokenizer manager and not ``Engine.release_memory_occupation`` & co: those wrappers call
``loop.run_until_complete``, which fails inside a running event loop; the replica awaits the
coroutines they wrap instead (as verl and slime do). Every one of them, like ``async_generate``,
starts the tokenizer manager's receive loop (``auto_create_handle_loop``) on the event loop of the
first call and answers through it from then on, so the in-process engine is bound to the loop
that first uses it: the replica sends every call through its own loop thread
(:class:`trellis.utils.loop_thread.LoopThread`). Building ``sglang.Engine`` binds no loop, but
SGLang releases before sgl-project/sglang#18752 (early 2026) register a SIGQUIT handler while it
starts, which only the main thread may do, so the replica builds it on the caller's thread.

Tests replace :func:`load_sglang_api` with :mod:`trellis_sglang.testing`'s fake; nothing here
imports sglang (or torch) at import time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
CUDA_GRAPH = "cuda_graph"
ALL_MEMORY_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
"""What ``sleep`` releases: every kind of GPU memory SGLang's memory saver tracks."""
SERVING_TAGS = (KV_CACHE, CUDA_GRAPH)
"""What a replica needs besides its weights to serve: restored by ``resume`` (after a weight sync)."""

INSTALL_HINT = "pip install 'sglang[all]>=0.5.3'"
SERVER_HOST = "127.0.0.1"


def sglang_unavailable_reason() -> str | None:
    """Why SGLang cannot run here, or None. Cheap: finds the package without importing it."""
    if importlib.util.find_spec("sglang") is None:
        return f"sglang is not installed: {INSTALL_HINT} (needs CUDA)"
    from trellis.registries import device_backends

    cuda = device_backends.get("cuda")().unavailable_reason()  # never raises (device-backend protocol)
    return None if cuda is None else f"CUDA is not available: SGLang runs on NVIDIA/AMD GPUs only ({cuda})"


# ---------------------------------------------------------------- the SGLang names used


class ServerProcess(Protocol):
    """A launched server: ``poll()`` is its exit code (None while it runs); ``stop()`` ends it."""

    def poll(self) -> int | None: ...

    def stop(self, timeout_s: float = 30.0) -> None: ...


@dataclass(frozen=True)
class SGLangAPI:
    """The parts of SGLang this plugin uses, resolved once by :func:`load_sglang_api`.

    Attributes:
        Engine: ``sglang.Engine``; called with ``ServerArgs`` keyword arguments.
        ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput,
        UpdateWeightsFromTensorReqInput: the request objects of ``sglang.srt.managers.io_struct``.
        serialize: ``MultiprocessingSerializer.serialize(obj, output_str=False)``.
        launch_server: ``(cli_args, log_file) -> ServerProcess``; starts
            ``python -m sglang.launch_server *cli_args``.
        version: ``sglang.__version__``.
    """

    Engine: Callable[..., Any]
    ReleaseMemoryOccupationReqInput: Callable[..., Any]
    ResumeMemoryOccupationReqInput: Callable[..., Any]
    UpdateWeightsFromTensorReqInput: Callable[..., Any]
    serialize: Callable[..., Any]
    launch_server: Callable[[list[str], Any], ServerProcess]
    version: str = "unknown"


def load_sglang_api() -> SGLangAPI:
    """Import SGLang and return the names the adapters use.

    Raises:
        ImportError: sglang is not installed (the message says how to install it).
        RuntimeError: sglang is installed but CUDA is not available.
    """
    reason = sglang_unavailable_reason()
    if reason is not None:
        error = ImportError if "not installed" in reason else RuntimeError
        raise error(f"rollout.name=sglang cannot start: {reason}. On a CPU machine use rollout.name=hf.")
    import sglang
    from sglang.srt.managers.io_struct import (
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.utils import MultiprocessingSerializer

    try:  # CUDA IPC handles that name devices by UUID, so differing CUDA_VISIBLE_DEVICES still work
        from sglang.srt.patch_torch import monkey_patch_torch_reductions
    except ImportError:  # pragma: no cover - older or newer layouts patch inside serialize
        monkey_patch_torch_reductions = None

    def serialize(obj: Any, output_str: bool = False) -> Any:
        if monkey_patch_torch_reductions is not None:
            monkey_patch_torch_reductions()
        return MultiprocessingSerializer.serialize(obj, output_str=output_str)

    return SGLangAPI(
        Engine=sglang.Engine,
        ReleaseMemoryOccupationReqInput=ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput=ResumeMemoryOccupationReqInput,
        UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
        serialize=serialize,
        launch_server=launch_sglang_server,
        version=str(getattr(sglang, "__version__", "unknown")),
    )


def launch_sglang_server(cli_args: list[str], log_file: Any) -> ServerProcess:
    """``python -m sglang.launch_server *cli_args`` in its own process group, output to ``log_file``."""
    process = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", *cli_args],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # so stop() can signal the scheduler and detokenizer children too
    )
    return _ProcessGroup(process)


class _ProcessGroup:
    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=timeout_s)
                return
            except subprocess.TimeoutExpired:
                continue


# ---------------------------------------------------------------- the adapters


class EngineClient(Protocol):
    """What the replica needs from an engine; :class:`InProcessEngine` and :class:`ServerEngine` fit it."""

    address: str | None

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], return_logprob: bool, rid: str
    ) -> dict[str, Any]: ...

    async def release_memory_occupation(self, tags: Sequence[str]) -> None: ...

    async def resume_memory_occupation(self, tags: Sequence[str]) -> None: ...

    async def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], flush_cache: bool
    ) -> None: ...

    async def flush_cache(self) -> None: ...

    def close(self) -> None:
        """Stop SGLang (blocking, from any thread, idempotent); nothing may be awaited on it after."""


def for_ipc(tensor: Any) -> Any:
    """``tensor`` as SGLang's serializer ships it: whole (a DTensor gathered), detached, on the GPU.

    SGLang's scheduler runs in another process and receives CUDA IPC handles; a CPU tensor would
    go through shared memory instead, which only works for processes of one multiprocessing tree.
    """
    if hasattr(tensor, "full_tensor"):  # a DTensor shard of FSDP2
        tensor = tensor.full_tensor()
    tensor = tensor.detach()
    if not tensor.is_cuda:
        import torch

        if torch.cuda.is_available():
            # blocking: the copy must be complete before another process reads it through the handle
            tensor = tensor.to(torch.cuda.current_device())
    return tensor


class InProcessEngine:
    """``sglang.Engine`` in this process: its tokenizer manager here, scheduler and detokenizer as children.

    Building it blocks until the model is loaded; its coroutines must all be awaited on one event
    loop (the first one's). ``Engine.shutdown`` ends every child process of this process (SGLang's
    ``kill_process_tree``), so run one in-process engine per process.
    """

    address: str | None = None

    def __init__(self, api: SGLangAPI, engine_args: dict[str, Any]) -> None:
        self.api = api
        self.tp_size = int(engine_args.get("tp_size", 1))
        self.engine = api.Engine(**engine_args)

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], return_logprob: bool, rid: str
    ) -> dict[str, Any]:
        return await self.engine.async_generate(
            input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob, rid=rid
        )

    async def release_memory_occupation(self, tags: Sequence[str]) -> None:
        request = self.api.ReleaseMemoryOccupationReqInput(tags=list(tags))
        await self.engine.tokenizer_manager.release_memory_occupation(request, None)

    async def resume_memory_occupation(self, tags: Sequence[str]) -> None:
        request = self.api.ResumeMemoryOccupationReqInput(tags=list(tags))
        await self.engine.tokenizer_manager.resume_memory_occupation(request, None)

    async def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], flush_cache: bool
    ) -> None:
        # one payload per TP rank: each rank deserializes (and so releases) only its own copy
        payloads = [self.api.serialize(named_tensors) for _ in range(self.tp_size)]
        request = self.api.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format=None, flush_cache=flush_cache
        )
        success, message = await self.engine.tokenizer_manager.update_weights_from_tensor(request, None)
        if not success:
            raise RuntimeError(f"SGLang did not load the weights: {message}")

    async def flush_cache(self) -> None:
        await self.engine.tokenizer_manager.flush_cache()

    def close(self) -> None:
        self.engine.shutdown()  # waits for the children to exit


def free_port(host: str = SERVER_HOST) -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_cli_args(args: dict[str, Any]) -> list[str]:
    """``ServerArgs`` keyword arguments as ``launch_server`` flags: ``tp_size=2`` -> ``--tp-size 2``.

    True adds the bare flag, False and None leave it out (SGLang's boolean options are off by
    default), a list or tuple gives one value per item, a dict becomes JSON.
    """
    cli: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            cli.append(flag)
        elif isinstance(value, (list, tuple)):
            cli += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            cli += [flag, json.dumps(value)]
        else:
            cli += [flag, str(value)]
    return cli


class ServerEngine:
    """An SGLang HTTP server (``python -m sglang.launch_server``) on loopback, driven over HTTP.

    Requests go through the standard library's ``urllib`` in a pool of ``max_connections`` threads,
    so that many requests are in flight at once and SGLang batches them; nothing here is bound to
    an event loop (each call uses the loop it runs on). Use :meth:`launch`; :meth:`close` stops the
    server and joins the pool's threads.
    """

    def __init__(
        self,
        api: SGLangAPI,
        process: ServerProcess,
        host: str,
        port: int,
        *,
        tp_size: int = 1,
        log_dir: str | None = None,
        request_timeout_s: float = 3600.0,
        max_connections: int = 256,
    ) -> None:
        self.api = api
        self.process = process
        self.host, self.port = host, int(port)
        self.tp_size = tp_size
        self.log_dir = log_dir
        self.request_timeout_s = request_timeout_s
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_connections, thread_name_prefix="trellis-sglang-http"
        )
        # loopback only: never route through a proxy from the environment
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    async def launch(
        cls,
        api: SGLangAPI,
        engine_args: dict[str, Any],
        *,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 3600.0,
        max_connections: int = 256,
    ) -> ServerEngine:
        """Start a server with ``engine_args`` (``host`` defaults to 127.0.0.1, ``port`` to a free one).

        Returns once ``GET /health`` answers 200. Raises RuntimeError (with the end of the server's
        log) if the process exits first, TimeoutError after ``startup_timeout_s``.
        """
        args = dict(engine_args)
        args.setdefault("host", SERVER_HOST)
        if not args.get("port"):
            args["port"] = free_port(args["host"])
        log_dir = tempfile.mkdtemp(prefix="trellis-sglang-")
        log_path = os.path.join(log_dir, "server.log")
        try:
            with open(log_path, "wb") as log:  # the child keeps its own handle
                process = api.launch_server(server_cli_args(args), log)
        except BaseException:
            shutil.rmtree(log_dir, ignore_errors=True)
            raise
        engine = cls(
            api,
            process,
            args["host"],
            args["port"],
            tp_size=int(args.get("tp_size", 1)),
            log_dir=log_dir,
            request_timeout_s=request_timeout_s,
            max_connections=max_connections,
        )
        try:
            await engine._wait_until_healthy(startup_timeout_s, log_path)
        except BaseException:
            engine.close()
            raise
        return engine

    async def _wait_until_healthy(self, timeout_s: float, log_path: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"The SGLang server exited with code {code} while starting; its log ends with:\n"
                    f"{_tail(log_path)}"
                )
            try:
                status, _ = await self._call("GET", "/health", None, timeout_s=5.0)
                if status == 200:
                    return
            except OSError:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"The SGLang server at {self.address} did not answer /health within {timeout_s:g} s "
                    f"(engine_kwargs.server_startup_timeout_s); its log ends with:\n{_tail(log_path)}"
                )
            await asyncio.sleep(0.2)

    async def _call(
        self, method: str, path: str, body: Any, *, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        request = urllib.request.Request(
            f"http://{self.address}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method=method,
        )
        timeout = self.request_timeout_s if timeout_s is None else timeout_s

        def send() -> tuple[int, bytes]:
            try:
                with self._opener.open(request, timeout=timeout) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as error:
                return error.code, error.read()

        return await asyncio.get_running_loop().run_in_executor(self._executor, send)

    async def _post(self, path: str, body: Any) -> Any:
        try:
            status, data = await self._call("POST", path, body)
        except OSError as exc:
            code = self.process.poll()
            state = "is running" if code is None else f"exited with code {code}"
            raise RuntimeError(
                f"The SGLang server at {self.address} did not answer {path} ({exc}); its process {state}."
            ) from exc
        if status != 200:
            text = data.decode(errors="replace")[:2000]
            raise RuntimeError(f"The SGLang server answered {path} with HTTP {status}: {text}")
        try:
            return json.loads(data) if data else None
        except ValueError:
            return data.decode(errors="replace")

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], return_logprob: bool, rid: str
    ) -> dict[str, Any]:
        body = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
            "rid": rid,
        }
        return await self._post("/generate", body)

    async def release_memory_occupation(self, tags: Sequence[str]) -> None:
        await self._post("/release_memory_occupation", {"tags": list(tags)})

    async def resume_memory_occupation(self, tags: Sequence[str]) -> None:
        await self._post("/resume_memory_occupation", {"tags": list(tags)})

    async def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], flush_cache: bool
    ) -> None:
        payloads = [self.api.serialize(named_tensors, output_str=True) for _ in range(self.tp_size)]
        body = {"serialized_named_tensors": payloads, "load_format": None, "flush_cache": flush_cache}
        answer = await self._post("/update_weights_from_tensor", body)
        if isinstance(answer, dict) and not answer.get("success", True):
            raise RuntimeError(f"SGLang did not load the weights: {answer.get('message')}")

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", {})

    def close(self) -> None:
        try:
            self.process.stop()
        finally:
            # the server is gone, so requests still in the pool fail at once: join their threads
            self._executor.shutdown(wait=True, cancel_futures=True)
            if self.log_dir is not None:
                shutil.rmtree(self.log_dir, ignore_errors=True)
                self.log_dir = None


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]) or "(empty)"
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
