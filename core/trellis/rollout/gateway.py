"""An OpenAI-compatible HTTP gateway over rollout replicas, capturing every session's tokens exactly.

Agents written against the OpenAI API (the ``openai`` SDK, LangChain, LangGraph, ``httpx``) talk to
the policy through it unmodified: point their ``base_url`` at a session and train on what they did::

    gateway = Gateway(tokenizer, replicas=[replica], model_name="policy")
    running = start_gateway(gateway)                 # uvicorn on 127.0.0.1, a thread of its own
    client = openai.OpenAI(base_url=running.base_url + "/../sessions/s1/v1", api_key="-")

Routes (each also under ``/sessions/<id>``): ``POST /v1/chat/completions`` (streaming or not),
``POST /v1/completions``, ``GET /v1/models``, ``GET /health``. Requests name the served model
(``model``); sampling parameters (``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
``stop_token_ids``, ``n``, ``max_tokens`` / ``max_completion_tokens``, ``logprobs``) map onto
:class:`~trellis.rollout.sampling.SamplingParams`; tool calling renders ``tools`` and tool messages
through the model's chat template and reads calls back with the registered tool-call parser
(``hermes`` by default). ``tool_choice``: ``auto``, ``none`` (no call is read), or ``required`` / a
named function, which the gateway forces by ending the prompt with the parser's opening of a call
(:meth:`~trellis.rollout.tool_parser.ToolParser.call_prefix`; for a named function, up to its
arguments): the model continues inside the call, and the capture holds the opening as prompt (loss
mask 0), since the policy did not choose it. Parameters the replicas cannot honour
(``presence_penalty`` != 0, ``logit_bias``, ``top_logprobs`` > 0, ``echo``) are refused with a 400
naming the ``param``; unknown keys are ignored, as OpenAI-compatible servers do.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
request, 404 for an unknown model or session, 429 when ``max_inflight`` generations already run,
503 while the replica is asleep (its weights are being updated) or shut down. Nothing a client
sends stops the gateway.

Sessions and capture. A session (``open_session``; ``trellis serve`` opens them on first use)
records, for every call, the prompt token ids, the completion token ids, the replica's log-probs and
weight versions. A call whose prompt extends an earlier call's prompt + completion continues that
call's :class:`Trajectory`: the tokens in between (tool results, the next user turn, the chat
template's turn markers) join it with loss mask 0, the completion with mask 1. For chat requests the
gateway builds such prompts itself, without decoding and re-encoding: when the request's messages
are an earlier call's messages plus the reply it returned plus new messages, the prompt is that
call's token ids followed by the chat template's tokens for the new messages
(:meth:`~trellis.rollout.chat.ChatTemplate.continuation_ids`). A call that extends nothing (the
agent rewrote its history, or changed its tools) starts a new trajectory, and counts in
``gateway/rewritten_history``. A session's samples are its trajectories that no later call
extended (:meth:`Session.samples`). ``max_response_tokens`` bounds each trajectory's response: a
call gets at most what is left (``finish_reason: length`` with no tokens once nothing is).

Images. A gateway given the model's multimodal processor (``Gateway(..., processor=hf_processor(path))``;
``trellis serve`` passes it) takes OpenAI image content parts in chat messages:
``{"type": "image_url", "image_url": {"url": ...}}`` where the URL is a ``data:`` URL (base64) or a
path or URL read through fsspec (``http(s)://``, ``s3://``, ``file://``, a local path: mind what a
gateway reachable by others may read). The messages are rendered with the processor's chat template
(each image as ``{"type": "image"}``) and tokenized by the processor, so the prompt holds one pad
token per image token; the replica gets the images as ``multi_modal_data``. Continuing a turn
renders only the new messages (and decodes only their images), as for text. A trajectory keeps its
last call's images (:attr:`Trajectory.multi_modal_data`; earlier calls' images come first, as in
their prompts), and :meth:`Trajectory.to_output` hands them, with the processor's
``multi_modal_inputs`` for them, to training. Without a processor a request with an image gets a 400
(param ``messages``); an image that cannot be read gets a 400 naming its message and part.

Streaming returns the finished completion as server-sent chunks, since replicas return whole
responses: per choice, the role, the whole content in one chunk, each tool call, then the
``finish_reason`` (and the usage chunk when ``stream_options.include_usage`` asks).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import hashlib
import json
import logging
import socket
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from trellis.data import multimodal
from trellis.errors import DatasetError
from trellis.rollout.agent_loop import AgentLoopOutput, ReplicaRouter
from trellis.rollout.base import has_items
from trellis.rollout.chat import ChatTemplate, tool_schemas
from trellis.rollout.sampling import SamplingParams, TokenOutput
from trellis.rollout.tool_parser import get_tool_parser
from trellis.utils.tokenizer import normalize_token_ids

logger = logging.getLogger(__name__)

MAX_N = 64
"""Most choices one request may ask for (``n``)."""


class APIError(Exception):
    """A request the gateway refuses, as an OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# ---------------------------------------------------------------- capture


@dataclass
class Trajectory:
    """One sample captured from a session: a prompt, then model tokens (mask 1) and the tokens
    between calls (mask 0), with the replica's log-probs and weight versions."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[int] | None = field(default_factory=list)
    calls: int = 0
    finish_reason: str | None = None
    multi_modal_data: dict[str, list[Any]] | None = None
    """The images of the trajectory's last call, ``{"image": [PIL images], "video": []}`` in the order of
    their pad tokens (an earlier call's images come first, as in its prompt); None for text."""
    processor: Any = field(default=None, repr=False, compare=False)
    """The model's multimodal processor (set with images): :meth:`to_output` computes their
    ``multi_modal_inputs`` with it."""

    def tokens(self) -> list[int]:
        """Prompt and response: what a call must start with to continue this trajectory."""
        return self.prompt_ids + self.response_ids

    def extended(
        self,
        between: Sequence[int],
        out: TokenOutput,
        multi_modal_data: dict[str, list[Any]] | None = None,
        processor: Any = None,
    ) -> Trajectory:
        """A copy continued by ``between`` (mask 0) and the completion ``out`` (mask 1); the call's
        ``multi_modal_data`` (all the images of its prompt) replaces this trajectory's when given."""
        tokens = list(out.token_ids)
        versions = self.response_versions
        if versions is not None and out.weight_versions is not None:
            versions = [*versions, *([-1] * len(between)), *out.weight_versions]
        else:
            versions = None
        logprobs = list(out.log_probs) if out.log_probs is not None else [0.0] * len(tokens)
        return Trajectory(
            prompt_ids=self.prompt_ids,
            response_ids=[*self.response_ids, *between, *tokens],
            response_mask=[*self.response_mask, *([0] * len(between)), *([1] * len(tokens))],
            response_logprobs=[*self.response_logprobs, *([0.0] * len(between)), *logprobs],
            response_versions=versions,
            calls=self.calls + 1,
            finish_reason=_finish_reason(out),
            multi_modal_data=self.multi_modal_data if multi_modal_data is None else multi_modal_data,
            processor=self.processor if processor is None else processor,
        )

    def to_output(self, **fields: Any) -> AgentLoopOutput:
        """The trajectory as an agent loop's output (``fields``: reward, metrics, extra ...).

        With images, ``extra`` also holds ``multi_modal_data`` (the images) and ``multi_modal_inputs``
        (the processor's tensors for them: ``pixel_values``, ``image_grid_thw``, ...), the non-tensor
        columns a vision-language model trains on.

        Raises:
            ValueError: the trajectory has images but no :attr:`processor` to compute their inputs.
        """
        if self.multi_modal_data is not None:
            if self.processor is None:
                raise ValueError(
                    "Trajectory.to_output: the trajectory has images but no processor to compute their "
                    "multi_modal_inputs; set Trajectory.processor (a Gateway given processor= sets it)."
                )
            images = list(self.multi_modal_data.get("image") or [])
            videos = [list(v) for v in self.multi_modal_data.get("video") or []]
            extra = dict(fields.pop("extra", None) or {})
            extra[multimodal.MULTI_MODAL_DATA] = {"image": images, "video": videos}
            extra[multimodal.MULTI_MODAL_INPUTS] = multimodal.vision_inputs(self.processor, images, videos)
            fields["extra"] = extra
        return AgentLoopOutput(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            response_mask=list(self.response_mask),
            response_logprobs=list(self.response_logprobs),
            num_turns=max(2, 2 * self.calls),  # the prompt, each model turn, the turns between them
            response_versions=None if self.response_versions is None else list(self.response_versions),
            **fields,
        )


@dataclass
class _ChatTurn:
    """A chat call's choice, for matching the next request's messages against it."""

    messages: list[Any]
    tools: Any
    reply: Any
    trajectory: Trajectory
    ended_with_eos: bool


class Session:
    """The calls of one agent episode; see the module docstring.

    Args:
        session_id: the id in its URL (``/sessions/<id>/v1``).
        generate: ``async (prompt_ids, sampling_params) -> TokenOutput``, also given
            ``multi_modal_data=`` for a prompt with images (as ``ReplicaSession.generate`` takes it);
            None: the gateway's router, sticky to this session.
        loop: the event loop ``generate`` must run on (None: the gateway's own).
        defaults: sampling parameters for what a request leaves unset (e.g. the rollout's temperature).
        max_response_tokens: most response tokens one trajectory may hold (None: no bound).
        fixed_sampling: use ``defaults``' temperature, top_p and top_k whatever a request asks (counted in
            ``gateway/sampling_overridden`` when it asks otherwise): in training, the log-probs the trainer
            computes assume the rollout's sampling.
    """

    def __init__(
        self,
        session_id: str,
        generate: Callable[[list[int], SamplingParams], Awaitable[TokenOutput]] | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        defaults: SamplingParams | None = None,
        max_response_tokens: int | None = None,
        fixed_sampling: bool = False,
    ) -> None:
        self.id = session_id
        self.fixed_sampling = fixed_sampling
        self.generate = generate
        self.loop = loop
        self.defaults = defaults
        self.max_response_tokens = max_response_tokens
        self.trajectories: list[Trajectory] = []
        self._extended: set[int] = set()  # ids of trajectories a later call continued
        self._turns: list[_ChatTurn] = []
        self.metrics: Counter[str] = Counter()
        self.lock = threading.Lock()

    def samples(self) -> list[Trajectory]:
        """The trajectories no later call continued, oldest first: what the session trains on."""
        with self.lock:
            return [t for t in self.trajectories if id(t) not in self._extended]

    def base(self, prompt_ids: Sequence[int]) -> Trajectory | None:
        """The longest trajectory whose tokens ``prompt_ids`` begins with."""
        best = None
        for traj in self.trajectories:
            tokens = traj.tokens()
            longer = best is None or len(tokens) > len(best.tokens())
            if longer and len(tokens) <= len(prompt_ids) and list(prompt_ids[: len(tokens)]) == tokens:
                best = traj
        return best

    def budget(self, base: Trajectory | None, prompt_ids: Sequence[int]) -> int | None:
        """Response tokens a call on ``prompt_ids`` may still generate (None: unbounded)."""
        if self.max_response_tokens is None:
            return None
        used = len(prompt_ids) - len(base.prompt_ids) if base is not None else 0
        return max(0, self.max_response_tokens - used)

    def record(
        self,
        prompt_ids: list[int],
        base: Trajectory | None,
        out: TokenOutput,
        multi_modal_data: dict[str, list[Any]] | None = None,
        processor: Any = None,
        *,
        sibling: bool = False,
    ) -> Trajectory:
        """Capture one completion of ``prompt_ids`` (continuing ``base`` when given); ``multi_modal_data``:
        the prompt's images, with the ``processor`` that tokenized them. ``sibling``: another choice of a
        call whose first choice is recorded (``n`` > 1): a trajectory of its own, never rewritten history."""
        with self.lock:
            self.metrics["gateway/calls"] += 1
            if base is None:
                if self.trajectories and not sibling:
                    self.metrics["gateway/rewritten_history"] += 1
                base = Trajectory(prompt_ids=list(prompt_ids), response_versions=[])
                between: list[int] = []
            else:
                self._extended.add(id(base))
                between = list(prompt_ids[len(base.tokens()) :])
            traj = base.extended(between, out, multi_modal_data, processor)
            self.trajectories.append(traj)
            return traj

    def remember_turn(self, turn: _ChatTurn) -> None:
        with self.lock:
            self._turns.append(turn)

    def match_turn(self, messages: list[Any], tools: Any) -> tuple[_ChatTurn, list[Any]] | None:
        """The latest chat turn ``messages`` continues (its messages, then its reply), and the new
        messages after them."""
        with self.lock:
            turns = list(self._turns)
        for turn in sorted(turns, key=lambda t: -len(t.messages)):
            n = len(turn.messages)
            if (
                turn.tools == tools
                and len(messages) > n
                and messages[:n] == turn.messages
                and messages[n] == turn.reply
            ):
                return turn, messages[n + 1 :]
        return None


# ---------------------------------------------------------------- the gateway


class Gateway:
    """The FastAPI app and its sessions; see the module docstring.

    Args:
        tokenizer: the served model's tokenizer (with a chat template for chat completions).
        replicas: initialised replicas for requests outside a session, routed least-loaded and
            sticky per session; None when only sessions with their own ``generate`` are served (in
            training every call belongs to a sample).
        model_name: the ``model`` requests must name (``/v1/models`` lists it).
        tool_parser: the registered tool-call parser reading calls out of completions.
        max_inflight: generations running at once before requests get 429.
        auto_sessions: open a session on the first request to an unknown ``/sessions/<id>`` (serving);
            off: such requests get 404 (training opens its sessions itself).
        session_idle_s: sessions ``auto_sessions`` opened and not used for this long are closed when
            the next one opens (counted in ``gateway/sessions_expired``), so a long-running server's
            sessions and their captures do not pile up; None: kept until a client deletes them.
            Sessions opened with :meth:`open_session` never expire.
        chat_template_kwargs: passed to every ``apply_chat_template`` call.
        processor: the model's multimodal processor (:func:`trellis.utils.tokenizer.hf_processor`) for
            chat messages with images; None: requests with images get a 400.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        replicas: Sequence[Any] | None = None,
        model_name: str = "trellis",
        tool_parser: str = "hermes",
        max_inflight: int = 256,
        auto_sessions: bool = False,
        session_idle_s: float | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        processor: Any = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}.")
        if session_idle_s is not None and not session_idle_s > 0:
            raise ValueError(f"session_idle_s must be > 0 or None (never expire), got {session_idle_s!r}.")
        self.session_idle_s = session_idle_s
        self._last_used: dict[str, float] = {}  # auto-opened sessions: when a request last named each
        self.tokenizer = tokenizer
        self.router = ReplicaRouter(replicas) if replicas else None
        self.model_name = model_name
        self.parser = get_tool_parser(tool_parser)
        self.max_inflight = int(max_inflight)
        self.auto_sessions = auto_sessions
        self.chat = (
            ChatTemplate(tokenizer, **dict(chat_template_kwargs or {})) if _has_template(tokenizer) else None
        )
        self.processor = processor
        self.vision = (
            _VisionChat(processor, tokenizer, self.chat.eos_token_ids, dict(chat_template_kwargs or {}))
            if processor is not None and self.chat is not None
            else None
        )
        self.sessions: dict[str, Session] = {}
        self.inflight = 0
        self.metrics: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.app = self._build_app()

    # ------------------------------------------------------------ sessions

    def open_session(self, session_id: str | None = None, **kwargs: Any) -> Session:
        """A new session (keyword arguments: see :class:`Session`); its URL is
        ``/sessions/<id>/v1``. Raises ``ValueError`` when ``session_id`` is taken."""
        session_id = session_id or uuid.uuid4().hex
        with self._lock:
            if session_id in self.sessions:
                raise ValueError(
                    f"session {session_id!r} is already open; close it first or pick another id."
                )
            session = Session(session_id, **kwargs)
            self.sessions[session_id] = session
        return session

    def close_session(self, session_id: str) -> Session:
        """Remove the session (later requests to it get 404) and return it with its capture."""
        with self._lock:
            session = self.sessions.pop(session_id, None)
            self._last_used.pop(session_id, None)
        if session is None:
            raise KeyError(f"no open session {session_id!r}.")
        if self.router is not None and session.generate is None:
            self.router.release(session_id)  # its replica counts one session fewer
        return session

    def _session(self, session_id: str | None, *, open_unknown: bool = True) -> Session | None:
        """The open session ``session_id`` (None without one). An unknown id opens a session under
        ``auto_sessions`` when ``open_unknown`` (a generating call), else gets a 404: reading a
        capture or listing models must not open one."""
        if session_id is None:
            return None
        expired: list[Session] = []
        now = time.monotonic()
        with self._lock:
            session = self.sessions.get(session_id)
            if session is None and self.auto_sessions and open_unknown:
                if (
                    self.session_idle_s is not None
                ):  # the sessions idle too long go (under the lock: none in use)
                    for idle in [k for k, t in self._last_used.items() if now - t > self.session_idle_s]:
                        del self._last_used[idle]
                        expired.append(self.sessions.pop(idle))
                session = self.sessions[session_id] = Session(session_id)
                self._last_used[session_id] = now
            elif session_id in self._last_used:
                self._last_used[session_id] = now
        for idle_session in expired:
            if self.router is not None:
                self.router.release(idle_session.id)  # its replica counts one session fewer
            self.metrics["gateway/sessions_expired"] += 1
        if session is None:
            why = (
                "a serving gateway opens a session at its first completion call, and closes it on"
                " DELETE or after session_idle_s unused"
                if self.auto_sessions
                else "sessions are opened by the trainer for each sample"
            )
            raise APIError(404, f"no open session {session_id!r}: {why}.", code="session_not_found")
        return session

    # ------------------------------------------------------------ app

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="Trellis gateway", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError) -> JSONResponse:
            return exc.response()

        @app.exception_handler(Exception)
        async def internal(request: Request, exc: Exception) -> JSONResponse:
            logger.exception("gateway: %s %s failed", request.method, request.url.path)
            return APIError(
                500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"
            ).response()

        async def health(session_id: str | None = None) -> dict[str, str]:
            return {"status": "ok"}

        async def models(session_id: str | None = None) -> dict[str, Any]:
            if not self.auto_sessions:  # a serving gateway lists its model under any session URL
                self._session(session_id)
            card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "trellis"}
            return {"object": "list", "data": [card]}

        async def chat(request: Request, session_id: str | None = None) -> Response:
            return await self._chat_completions(await _json(request), self._session(session_id))

        async def completions(request: Request, session_id: str | None = None) -> Response:
            return await self._completions(await _json(request), self._session(session_id))

        async def trajectories(session_id: str) -> dict[str, Any]:
            session = self._session(session_id, open_unknown=False)
            assert session is not None
            return {"session": session_id, "trajectories": [_trajectory_json(t) for t in session.samples()]}

        for prefix in ("", "/sessions/{session_id}"):
            app.add_api_route(prefix + "/health", health, methods=["GET"])
            app.add_api_route(prefix + "/v1/models", models, methods=["GET"])
            app.add_api_route(prefix + "/v1/chat/completions", chat, methods=["POST"])
            app.add_api_route(prefix + "/v1/completions", completions, methods=["POST"])

        async def close(session_id: str) -> dict[str, Any]:
            try:
                session = self.close_session(session_id)
            except KeyError:
                raise APIError(404, f"no open session {session_id!r}.", code="session_not_found") from None
            return {"session": session_id, "trajectories": [_trajectory_json(t) for t in session.samples()]}

        app.add_api_route("/sessions/{session_id}/trajectories", trajectories, methods=["GET"])
        app.add_api_route("/sessions/{session_id}", close, methods=["DELETE"])
        return app

    # ------------------------------------------------------------ endpoints

    async def _chat_completions(self, body: dict[str, Any], session: Session | None) -> Response:
        self._check_model(body)
        if self.chat is None:
            raise APIError(
                400, "the served tokenizer has no chat template; use /v1/completions.", param="messages"
            )
        messages = _messages(body.get("messages"))
        tools = _tools(body)
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        forced = self._forced_call(tool_choice, tools)
        logprobs = _bool(body, "logprobs", False)
        if _int(body, "top_logprobs", 0, 0, 20):
            raise _bad(
                "top_logprobs",
                "top_logprobs > 0 is not supported: replicas return the sampled token's log-prob only.",
            )
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        images: dict[str, list[Any]] | None = None
        if _has_images(messages):
            prompt_ids, base, images = await self._vision_prompt(messages, tools, session)
        else:
            prompt_ids, base = self._chat_prompt(messages, tools, session)
        if forced:  # the reply starts inside a call: the opening is prompt (mask 0 in the capture)
            prompt_ids = prompt_ids + self.tokenizer(forced, add_special_tokens=False)["input_ids"]
        outs, params = await self._generate(
            body, session, prompt_ids, base, max_tokens, param, logprobs, multi_modal_data=images
        )
        created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        choices = []
        for index, (out, traj) in enumerate(outs):
            message, finish = self._reply(
                out, params, parse_tools=bool(tools) and tool_choice != "none", opening=forced or ""
            )
            if session is not None and traj is not None:
                normalized = [_norm_message(m) for m in messages]
                turn = _ChatTurn(
                    normalized, _norm(tools), _norm_message(message), traj, _ended(out, self.chat)
                )
                session.remember_turn(turn)
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "finish_reason": finish,
                "logprobs": None,
            }
            if logprobs:
                choice["logprobs"] = {"content": self._token_logprobs(out)}
            choices.append(choice)
        usage = _usage(prompt_ids, [o for o, _ in outs])
        if _bool(body, "stream", False):
            return self._stream_chat(rid, created, choices, usage, body)
        return JSONResponse(self._envelope(rid, "chat.completion", created, choices, usage))

    async def _completions(self, body: dict[str, Any], session: Session | None) -> Response:
        self._check_model(body)
        if body.get("echo"):
            raise _bad("echo", "echo is not supported.")
        if body.get("suffix"):
            raise _bad("suffix", "suffix is not supported.")
        logprobs = _int(body, "logprobs", None, 0, 1)
        prompt_ids = self._completion_prompt(body.get("prompt"))
        base = session.base(prompt_ids) if session is not None else None
        outs, params = await self._generate(
            body, session, prompt_ids, base, body.get("max_tokens", 16), "max_tokens", logprobs is not None
        )
        choices = []
        for index, (out, _) in enumerate(outs):
            text = _cut_at_stop(self.tokenizer.decode(out.token_ids, skip_special_tokens=True), params.stop)
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "finish_reason": _finish_reason(out),
                "logprobs": None,
            }
            if logprobs is not None:
                pieces = [self.tokenizer.decode([t]) for t in out.token_ids]
                choice["logprobs"] = {
                    "tokens": pieces,
                    "token_logprobs": list(out.log_probs or []),
                    "top_logprobs": None,
                    "text_offset": _offsets(pieces),
                }
            choices.append(choice)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        usage = _usage(prompt_ids, [o for o, _ in outs])
        if _bool(body, "stream", False):
            return self._stream_completion(rid, created, choices, usage, body)
        return JSONResponse(self._envelope(rid, "text_completion", created, choices, usage))

    def _envelope(
        self, rid: str, kind: str, created: int, choices: list[dict[str, Any]], usage: dict[str, int] | None
    ) -> dict[str, Any]:
        """A response (or stream chunk) object around ``choices``; ``usage`` None leaves it out."""
        envelope = {
            "id": rid,
            "object": kind,
            "created": created,
            "model": self.model_name,
            "choices": choices,
        }
        if usage is not None:
            envelope["usage"] = usage
        return envelope

    # ------------------------------------------------------------ prompts

    def _chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, session: Session | None
    ) -> tuple[list[int], Trajectory | None]:
        """The prompt's token ids and the trajectory they continue (None: a new one)."""
        assert self.chat is not None
        if session is not None:
            match = session.match_turn([_norm_message(m) for m in messages], _norm(tools))
            if match is not None:
                turn, new = match
                try:
                    more = self.chat.continuation_ids(
                        [_template_message(m) for m in messages[len(messages) - len(new) :]],
                        ended_with_eos=turn.ended_with_eos,
                    )
                except ValueError:  # an unstable template: render afresh (a new trajectory)
                    session.metrics["gateway/unstable_template"] += 1
                else:
                    return turn.trajectory.tokens() + more, turn.trajectory
        try:
            ids = self.chat.render([_template_message(m) for m in messages], tools=tools)
        except Exception as exc:  # the template refused these messages (roles, order ...)
            raise _bad(
                "messages", f"the chat template cannot render these messages: {type(exc).__name__}: {exc}"
            ) from exc
        return ids, session.base(ids) if session is not None else None

    async def _vision_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, session: Session | None
    ) -> tuple[list[int], Trajectory | None, dict[str, list[Any]]]:
        """A chat request with images: its prompt (one pad token per image token), the trajectory it
        continues (None: a new one), and its images in the order of their pad tokens."""
        if self.vision is None:
            raise _bad(
                "messages",
                f"the model {self.model_name!r} takes no images: this gateway has no multimodal processor "
                "for it. Send text content only, or serve a vision-language model (Gateway(..., "
                "processor=hf_processor(path)); trellis serve loads it).",
            )
        if session is not None:
            match = session.match_turn([_norm_message(m) for m in messages], _norm(tools))
            if match is not None:
                turn, new = match
                start = len(messages) - len(new)
                images = await _load_images(messages, start)  # only the new messages': the rest are known
                try:
                    more = self.vision.continuation_ids(
                        [_template_message(m) for m in messages[start:]],
                        images,
                        ended_with_eos=turn.ended_with_eos,
                    )
                except ValueError:  # an unstable template: render afresh (a new trajectory)
                    session.metrics["gateway/unstable_template"] += 1
                else:
                    earlier = list((turn.trajectory.multi_modal_data or {}).get("image") or [])
                    prompt = turn.trajectory.tokens() + more
                    return prompt, turn.trajectory, {"image": [*earlier, *images], "video": []}
        images = await _load_images(messages, 0)
        try:
            ids = self.vision.render([_template_message(m) for m in messages], images, tools=tools)
        except Exception as exc:  # the template or the processor refused these messages
            raise _bad(
                "messages",
                f"the chat template or processor cannot render these messages: {type(exc).__name__}: {exc}",
            ) from exc
        return ids, session.base(ids) if session is not None else None, {"image": images, "video": []}

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise _bad("prompt", "prompt is empty.")
            return normalize_token_ids(self.tokenizer(prompt)["input_ids"])
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1}).")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return self._completion_prompt(prompt[0])
        raise _bad(
            "prompt", "prompt must be a non-empty string or a list of token ids (one prompt per request)."
        )

    # ------------------------------------------------------------ generation

    async def _generate(
        self,
        body: dict[str, Any],
        session: Session | None,
        prompt_ids: list[int],
        base: Trajectory | None,
        max_tokens: Any,
        max_param: str,
        logprobs: bool,
        multi_modal_data: dict[str, list[Any]] | None = None,
    ) -> tuple[list[tuple[TokenOutput, Trajectory | None]], SamplingParams]:
        n = _int(body, "n", 1, 1, MAX_N)
        params = self._sampling(body, session, max_tokens, max_param, logprobs or session is not None)
        budget = session.budget(base, prompt_ids) if session is not None else None
        if session is not None and budget is not None:
            if budget <= 0:  # the trajectory's response is full: nothing generated
                session.metrics["gateway/out_of_budget"] += 1
                empty = TokenOutput(
                    token_ids=[], log_probs=[] if params.wants_logprobs else None, stop_reason="length"
                )
                return [(empty, None) for _ in range(n)], params
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens, budget))
        with self._lock:
            if self.inflight + n > self.max_inflight:
                self.metrics["gateway/rejected_busy"] += 1
                raise APIError(
                    429,
                    f"the gateway already runs {self.inflight} generations (max_inflight "
                    f"{self.max_inflight}); retry shortly.",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                )
            self.inflight += n
        try:
            calls = []
            for i in range(n):
                p = (
                    params
                    if params.seed is None or i == 0
                    else dataclasses.replace(params, seed=params.seed + i)
                )
                calls.append(self._one(session, prompt_ids, p, multi_modal_data))
            outs = await asyncio.gather(*calls)
        finally:
            with self._lock:
                self.inflight -= n
        results = []
        for i, out in enumerate(outs):
            if out.stop_reason == "abort":
                raise APIError(
                    503,
                    "the replica shut down before the request ran.",
                    type="server_error",
                    code="replica_unavailable",
                )
            traj = None
            if session is not None:
                processor = self.processor if multi_modal_data is not None else None
                traj = session.record(prompt_ids, base, out, multi_modal_data, processor, sibling=i > 0)
            results.append((out, traj))
        return results, params

    async def _one(
        self,
        session: Session | None,
        prompt_ids: list[int],
        params: SamplingParams,
        multi_modal_data: dict[str, list[Any]] | None = None,
    ) -> TokenOutput:
        if session is not None and session.generate is not None:
            # the images go as a keyword only when there are some: text-only generate callables stay valid
            extra = {"multi_modal_data": multi_modal_data} if has_items(multi_modal_data) else {}
            coro = session.generate(prompt_ids, params, **extra)
            loop = session.loop
        else:
            if self.router is None:
                raise APIError(
                    404,
                    "this gateway serves sessions only (/sessions/<id>/v1): in training every call belongs "
                    "to a sample.",
                    code="session_required",
                )
            coro = self._routed(
                session.id if session is not None else uuid.uuid4().hex,
                prompt_ids,
                params,
                release=session is None,
                multi_modal_data=multi_modal_data,
            )
            loop = None
        if loop is None or loop is asyncio.get_running_loop():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_awaited(coro), loop))

    async def _routed(
        self,
        key: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        release: bool,
        multi_modal_data: dict[str, list[Any]] | None = None,
    ) -> TokenOutput:
        assert self.router is not None
        replica = self.router.replica_for(key)
        try:
            if getattr(replica, "asleep", False):
                raise APIError(
                    503,
                    "the replica is asleep while its weights are updated; retry shortly.",
                    type="server_error",
                    code="weights_syncing",
                )
            request_id = f"gw-{uuid.uuid4().hex}"
            if has_items(multi_modal_data):
                if not getattr(replica, "supports_multi_modal", False):
                    raise _bad(
                        "messages",
                        f"the {type(replica).__name__} serving {self.model_name!r} takes no images; serve "
                        "vision-language models with a replica that does (rollout.name=hf or vllm).",
                    )
                return await replica.generate(
                    prompt_ids, params, request_id, multi_modal_data=multi_modal_data
                )
            return await replica.generate(prompt_ids, params, request_id)
        finally:
            if release:
                self.router.release(key)

    def _sampling(
        self, body: dict[str, Any], session: Session | None, max_tokens: Any, max_param: str, logprobs: bool
    ) -> SamplingParams:
        defaults = (session.defaults if session is not None else None) or SamplingParams(max_tokens=256)
        for key, allowed in (("presence_penalty", 0), ("frequency_penalty", 0)):
            if body.get(key) not in (None, allowed):
                raise _bad(key, f"{key} is not supported (only {allowed}).")
        if body.get("logit_bias"):
            raise _bad("logit_bias", "logit_bias is not supported.")
        if max_tokens is None:
            max_tokens = defaults.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _bad(max_param, f"{max_param} must be an integer >= 1, got {max_tokens!r}.")
        stop = body.get("stop")
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise _bad("stop", "stop must be a string or a list of non-empty strings.")
        stop_ids = body.get("stop_token_ids") or []
        if not (
            isinstance(stop_ids, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)
        ):
            raise _bad("stop_token_ids", "stop_token_ids must be a list of token ids.")
        seed = body.get("seed", defaults.seed)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _bad("seed", f"seed must be an integer, got {seed!r}.")
        values = {
            "temperature": _number(body, "temperature", defaults.temperature, 0.0, 2.0),
            "top_p": _number(body, "top_p", defaults.top_p, 0.0, 1.0),
            "top_k": _int(body, "top_k", defaults.top_k, -1, None),
        }
        if session is not None and session.fixed_sampling:  # training: the policy samples as configured
            fixed = {"temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k}
            if fixed != values:
                session.metrics["gateway/sampling_overridden"] += 1
            values = fixed
        try:
            return SamplingParams(
                **values,
                max_tokens=int(max_tokens),
                stop=tuple(stop),
                stop_token_ids=tuple(stop_ids),
                seed=seed,
                logprobs=logprobs,
            )
        except ValueError as exc:
            message = str(exc)
            param = next((k for k in values if message.startswith(k)), None)
            raise _bad(param or "body", message) from exc

    # ------------------------------------------------------------ replies

    def _forced_call(self, tool_choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
        """The opening of a call the reply must start with (``tool_choice`` ``required`` or a named
        function, through the parser's :meth:`~trellis.rollout.tool_parser.ToolParser.call_prefix`),
        or None (``auto``, ``none``). A 400 naming ``tool_choice`` for anything else."""
        if tool_choice in ("auto", "none"):
            return None
        names = [t["function"]["name"] for t in tools or []]
        if tool_choice == "required":
            name = None
        elif (
            isinstance(tool_choice, Mapping)
            and tool_choice.get("type") == "function"
            and isinstance(tool_choice.get("function"), Mapping)
            and isinstance(tool_choice["function"].get("name"), str)
        ):
            name = tool_choice["function"]["name"]
            if name not in names:
                raise _bad("tool_choice", f"tool_choice names {name!r}, which is not in tools ({names}).")
        else:
            raise _bad(
                "tool_choice",
                f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                f"{{'name': ...}}}}, got {tool_choice!r}.",
            )
        if not names:
            raise _bad(
                "tool_choice", f"tool_choice {tool_choice!r} needs tools to call; the request has none."
            )
        opening = self.parser.call_prefix(name)
        if not opening:
            raise _bad(
                "tool_choice",
                f"tool_choice {tool_choice!r} needs a tool-call parser that can open a call; "
                f"{type(self.parser).__name__} cannot (it has no call_prefix). Use 'auto'.",
            )
        return opening

    def _reply(
        self, out: TokenOutput, params: SamplingParams, *, parse_tools: bool, opening: str = ""
    ) -> tuple[dict[str, Any], str]:
        """The assistant message of ``out`` and its finish reason; ``opening``: the text of a forced
        call's opening, which the prompt ended with and the reply continues."""
        text = _cut_at_stop(
            opening + self.tokenizer.decode(out.token_ids, skip_special_tokens=True), params.stop
        )
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parse_tools:
            raw = opening + self.tokenizer.decode(out.token_ids, skip_special_tokens=False)
            content, calls = self.parser.extract_tool_calls(_cut_at_stop(raw, params.stop))
            good = [c for c in calls if c.error is None]
            if good:
                message["content"] = _strip_special(self.tokenizer, content) or None
                message["tool_calls"] = [
                    {
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                    }
                    for c in good
                ]
                return message, "tool_calls"
        return message, _finish_reason(out)

    def _token_logprobs(self, out: TokenOutput) -> list[dict[str, Any]]:
        result = []
        for token, logprob in zip(out.token_ids, out.log_probs or [], strict=False):
            piece = self.tokenizer.decode([token])
            result.append(
                {
                    "token": piece,
                    "logprob": float(logprob),
                    "bytes": list(piece.encode("utf-8")),
                    "top_logprobs": [],
                }
            )
        return result

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is None:
            raise _bad("model", f"model is required; this gateway serves {self.model_name!r}.")
        if model != self.model_name:
            raise APIError(
                404,
                f"The model {model!r} does not exist; this gateway serves {self.model_name!r}.",
                param="model",
                code="model_not_found",
            )

    # ------------------------------------------------------------ streaming

    def _stream_chat(
        self,
        rid: str,
        created: int,
        choices: list[dict[str, Any]],
        usage: dict[str, int],
        body: dict[str, Any],
    ) -> StreamingResponse:
        kind = "chat.completion.chunk"

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
            return self._envelope(rid, kind, created, [choice], None)

        events: list[dict[str, Any]] = []
        for choice in choices:
            message, index = choice["message"], choice["index"]
            events.append(chunk(index, {"role": "assistant", "content": ""}))
            if message.get("content"):
                events.append(chunk(index, {"content": message["content"]}))
            for i, call in enumerate(message.get("tool_calls") or []):
                events.append(chunk(index, {"tool_calls": [{"index": i, **call}]}))
            events.append(chunk(index, {}, choice["finish_reason"]))
        return self._sse(events, rid, kind, created, usage, body)

    def _stream_completion(
        self,
        rid: str,
        created: int,
        choices: list[dict[str, Any]],
        usage: dict[str, int],
        body: dict[str, Any],
    ) -> StreamingResponse:
        kind = "text_completion"
        events = [self._envelope(rid, kind, created, [c], None) for c in choices]
        return self._sse(events, rid, kind, created, usage, body)

    def _sse(
        self,
        events: list[dict[str, Any]],
        rid: str,
        kind: str,
        created: int,
        usage: dict[str, int],
        body: dict[str, Any],
    ) -> StreamingResponse:
        """``events`` as server-sent events, then the usage chunk when ``stream_options`` asks, then
        ``[DONE]``."""
        if (body.get("stream_options") or {}).get("include_usage"):
            events = [*events, self._envelope(rid, kind, created, [], usage)]

        async def stream() -> AsyncIterator[str]:
            for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


# ---------------------------------------------------------------- images


_VISION_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
"""A fixed turn pair the continuation of a conversation is rendered after (as ``ChatTemplate`` does)."""


class _VisionChat:
    """Chat messages with images as token ids: the chat template (the processor's, else the tokenizer's)
    renders each ``{"type": "image"}`` part as the model's placeholder, and the processor widens it to
    one pad token per image token (:func:`trellis.data.multimodal.process`).

    :meth:`continuation_ids` works like :meth:`trellis.rollout.chat.ChatTemplate.continuation_ids`:
    new messages are rendered after a fixed turn pair, whose tokens are cut off again.
    """

    def __init__(
        self, processor: Any, tokenizer: Any, eos_token_ids: Sequence[int], template_kwargs: dict[str, Any]
    ) -> None:
        self.processor = processor
        self.renderer = processor if getattr(processor, "chat_template", None) else tokenizer
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.template_kwargs = template_kwargs
        self._probe: list[int] | None = None

    def text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Any = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text for ``messages`` (and ``tools``)."""
        kwargs = dict(self.template_kwargs)
        schemas = tool_schemas(tools)
        if schemas is not None:
            kwargs["tools"] = schemas
        text = self.renderer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        if isinstance(text, list) and len(text) == 1:  # a processor may answer a batch of one
            text = text[0]
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) gave {type(text).__name__}, not text.")
        return text

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        images: Sequence[Any],
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` whose image parts hold ``images`` (in order)."""
        text = self.text(messages, tools, add_generation_prompt)
        return multimodal.process(self.processor, text, images)[0]

    def continuation_ids(
        self, messages: Sequence[Mapping[str, Any]], images: Sequence[Any], *, ended_with_eos: bool
    ) -> list[int]:
        """Tokens that follow the model's last turn: ``messages`` (holding ``images``), then the next
        generation prompt; closed first with the end-of-turn token when the turn did not end with it.

        Raises:
            ValueError: the template renders earlier turns differently once ``messages`` follow them.
        """
        if self._probe is None:
            self._probe = self.render(_VISION_PROBE, (), add_generation_prompt=False)
        probe = self._probe
        full = self.render([*_VISION_PROBE, *messages], images)
        if full[: len(probe)] != probe:
            raise ValueError(
                "the chat template renders earlier turns differently when later turns follow them."
            )
        ends = [i for i, t in enumerate(probe) if t in self.eos_token_ids]
        closing = probe[ends[-1] + 1 :] if ends else []
        head = closing if ended_with_eos else self.eos_token_ids[:1] + closing
        return head + full[len(probe) :]


def _has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a request's messages (as :func:`_messages` gives them) hold an image part."""
    return any(isinstance(m.get("content"), list) for m in messages)


async def _load_images(messages: Sequence[Mapping[str, Any]], start: int) -> list[Any]:
    """The images of ``messages[start:]``, in order, as RGB PIL images (read in a worker thread: a URL
    may take a while, and the event loop serves the other requests meanwhile)."""
    sources = [
        (i, j, part["image_url"]["url"])
        for i in range(start, len(messages))
        if isinstance(messages[i].get("content"), list)
        for j, part in enumerate(messages[i]["content"])
        if part["type"] == "image_url"
    ]
    if not sources:
        return []
    return await asyncio.to_thread(lambda: [_load_image(url, i, j) for i, j, url in sources])


def _load_image(url: str, index: int, part: int) -> Any:
    """The image of ``messages[index].content[part]``: a ``data:`` URL decoded, any other URL or path read
    through fsspec; a 400 naming the message and part when it cannot be read."""
    where, param = f"messages[{index}].content[{part}]", f"messages[{index}]"
    source: Any = url
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma:
            raise _bad(param, f"{where}: the data URL has no ',' before its data ({url[:40]!r}...).")
        try:
            if header.endswith(";base64"):
                source = base64.b64decode("".join(payload.split()), validate=True)
            else:
                source = urllib.parse.unquote_to_bytes(payload)
        except (binascii.Error, ValueError) as exc:
            raise _bad(param, f"{where}: the data URL's base64 data is invalid ({exc}).") from exc
    try:
        return multimodal.load_image(source, where=where)
    except DatasetError as exc:
        raise _bad(param, str(exc)) from exc


def _image_url(value: Any, where: str, param: str) -> str:
    """The URL of an ``image_url`` part: ``{"url": ...}`` (OpenAI's layout) or the URL itself."""
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise _bad(
            param,
            f"{where}: an image_url part must be {{'type': 'image_url', 'image_url': {{'url': ...}}}} with a "
            "data: URL (base64), a path or an http(s) URL.",
        )
    return url


def _trajectory_json(traj: Trajectory) -> dict[str, Any]:
    """A trajectory as JSON: its fields, with the number of images for the images themselves."""
    data = {
        f.name: getattr(traj, f.name)
        for f in dataclasses.fields(traj)
        if f.name not in ("multi_modal_data", "processor")
    }
    if traj.multi_modal_data is not None:
        data["num_images"] = len(traj.multi_modal_data.get("image") or ())
    return data


# ---------------------------------------------------------------- serving


class RunningGateway:
    """A gateway served by uvicorn on a thread (and event loop) of its own; see :func:`start_gateway`."""

    def __init__(
        self,
        gateway: Gateway,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        server: Any,
        host: str,
        port: int,
    ) -> None:
        self.gateway, self.loop, self.thread, self.server = gateway, loop, thread, server
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        """``http://host:port`` (no path)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL outside sessions: ``http://host:port/v1``."""
        return f"{self.url}/v1"

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL of a session: ``http://host:port/sessions/<id>/v1``."""
        return f"{self.url}/sessions/{session_id}/v1"

    def call(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        """Run ``coro`` on the gateway's event loop (where its replicas live) and return its result."""
        return asyncio.run_coroutine_threadsafe(_awaited(coro), self.loop).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and join the thread (idempotent)."""
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(timeout)


def start_gateway(
    gateway: Gateway, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0
) -> RunningGateway:
    """Serve ``gateway`` on ``host:port`` (0: a free port) from a daemon thread; returns once it listens.

    Raises:
        RuntimeError: the server did not start within ``timeout`` seconds (the cause is chained).
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(gateway.app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    loop = asyncio.new_event_loop()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        except BaseException as exc:  # reported by start_gateway when it happens during start
            failure.append(exc)
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            sock.close()

    thread = threading.Thread(target=run, name="trellis-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if failure or not thread.is_alive():
            raise RuntimeError(f"the gateway did not start on {host}:{port}") from (
                failure[0] if failure else None
            )
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the gateway did not start on {host}:{port} within {timeout:.0f} s")
        time.sleep(0.01)
    return RunningGateway(gateway, loop, thread, server, host, sock.getsockname()[1])


# ---------------------------------------------------------------- helpers


async def _awaited(coro: Awaitable[Any]) -> Any:
    return await coro


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except Exception as exc:
        raise _bad("body", f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _bad("body", f"the request body must be a JSON object, got {type(body).__name__}.")
    return body


def _has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise _bad(key, f"{key} must be a number in [{lo:g}, {hi:g}], got {value!r}.")
    return float(value)


def _int(body: Mapping[str, Any], key: str, default: Any, lo: int, hi: int | None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise _bad(key, f"{key} must be an integer {bound}, got {value!r}.")
    return value


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(key, f"{key} must be true or false, got {value!r}.")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise _bad(
                    where, f"{where}: content part of type {kind!r} is not supported; send text parts."
                )
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(where, f"{where}: content must be a string or a list of text (and image_url) parts.")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: text (a string, or a list of text parts) as one string; with image parts,
    the list of parts: ``{"type": "text", "text": ...}`` and
    ``{"type": "image_url", "image_url": {"url": ...}}``."""
    if not isinstance(content, list):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") == "image_url":
            url = _image_url(part.get("image_url"), f"{where}.content[{j}]", where)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise _bad(
                where,
                f"{where}: content part of type {kind!r} is not supported; send text or image_url parts.",
            )
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of chat messages.")
    result = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise _bad(where, f"{where} must be an object with role system, user, assistant or tool.")
        message = dict(m)
        message["content"] = _content(m.get("content"), where)
        calls = m.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list)
            and all(isinstance(c, Mapping) and isinstance(c.get("function"), Mapping) for c in calls)
        ):
            raise _bad(
                where, f"{where}.tool_calls must be a list of {{'type': 'function', 'function': {{...}}}}."
            )
        result.append(message)
    return result


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, Mapping)
        and isinstance(t.get("function"), Mapping)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise _bad(
            "tools",
            "tools must be a list of {'type': 'function', 'function': {'name': ..., 'parameters': ...}}.",
        )
    return [dict(t) for t in tools]


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return value
    return value


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: tool-call arguments as objects, ``developer`` as system."""
    result = {k: v for k, v in message.items() if v is not None}
    if result.get("role") == "developer":
        result["role"] = "system"
    if isinstance(result.get("content"), list):  # with images: each one the template's image part
        result["content"] = [
            {"type": "image"} if p["type"] == "image_url" else {"type": "text", "text": p["text"]}
            for p in result["content"]
        ]
    if message.get("tool_calls"):
        result["tool_calls"] = [
            {
                "type": "function",
                "id": c.get("id"),
                "function": {
                    "name": c["function"].get("name"),
                    "arguments": _arguments(c["function"].get("arguments")),
                },
            }
            for c in message["tool_calls"]
        ]
    return result


def _norm_message(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must be equal for a resent message to count as the same one."""
    calls = tuple(
        (c["function"].get("name"), json.dumps(_arguments(c["function"].get("arguments")), sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    content = message.get("content")
    norm: Any
    if isinstance(content, list) and any(
        isinstance(p, Mapping) and p.get("type") == "image_url" for p in content
    ):
        # the parts in order, an image by its URL's digest (a data URL may be megabytes)
        norm = tuple(
            ("image", hashlib.sha256(p["image_url"]["url"].encode()).hexdigest())
            if p.get("type") == "image_url"
            else ("text", p.get("text"))
            for p in content
        )
    else:
        norm = (
            content if isinstance(content, str) else _text(content, "message") if content is not None else ""
        )
        norm = norm.strip()
    return (message.get("role"), norm, calls, message.get("tool_call_id"), message.get("name"))


def _norm(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _ended(out: TokenOutput, chat: ChatTemplate | None) -> bool:
    return bool(out.token_ids) and chat is not None and out.token_ids[-1] in chat.eos_token_ids


def _finish_reason(out: TokenOutput) -> str:
    """``length`` when the replica hit max_tokens, else ``stop`` (tool calls are decided by the reply)."""
    return "length" if out.stop_reason == "length" else "stop"


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def _strip_special(tokenizer: Any, text: str) -> str:
    for token in getattr(tokenizer, "all_special_tokens", ()):
        text = text.replace(token, "")
    return text.strip()


def _offsets(pieces: Sequence[str]) -> list[int]:
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return offsets


def _usage(prompt_ids: Sequence[int], outs: Sequence[TokenOutput]) -> dict[str, int]:
    completion = sum(len(o.token_ids) for o in outs)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }
