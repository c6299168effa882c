"""The ``openai_agent`` agent loop: train any agent that talks to the OpenAI API.

The user writes the agent as they would for production, against a base URL::

    # my_agent.py                                  rollout.agent.default_agent_loop=openai_agent
    async def run(base_url, sample):               rollout.agent.function=./my_agent.py:run
        client = openai.AsyncOpenAI(base_url=base_url, api_key="-")
        reply = await client.chat.completions.create(model="policy", messages=sample["messages"], ...)
        ...                                        # tools, several turns, any framework
        return 1.0 if ... else 0.0                 # or {"reward": r, "my_metric": x}, or None

For each sample the loop opens a session on this process's :class:`~trellis.rollout.gateway.Gateway`
(started on first use, on loopback) whose generation goes through the sample's replica session
(sticky replica, per-sample seeds, the rollout's temperature, top_p and top_k whatever the agent
asks, since the trainer's log-probs assume them, and the response length as each trajectory's
budget), calls ``function(session_url, sample)`` and closes the session:
its trajectories, captured token-exactly, are the sample's training rows (several when the agent
rewrote its history; see the gateway's docstring). The model is served as ``policy``.

``sample`` is a plain dict of the dataset row: ``messages`` (the chat prompt), ``data_source``,
``ground_truth`` (from ``reward_model``), ``extra_info``, ``index`` and the other columns.
``function`` may be a coroutine function (run on an event loop of its own, in a thread of its own) or
a plain one (in a thread), so blocking clients (``openai.OpenAI``, ``requests``) work; at most
``rollout.agent.function_concurrency`` run at once per process. Its return value: a number (the
reward of every row of the sample), a dict with ``reward`` and other numbers (logged as
``agent/<key>``), or None (the reward function scores each row). A call that raises or runs past
``rollout.agent.function_timeout_s`` ends its sample with reward 0, counted in
``agent/function_errors`` / ``agent/function_timeouts``; a call that ran over is abandoned, its session
closed (later requests get 404). A sample whose agent made no call has an empty response (mask 0).
Metrics per sample: ``gateway/calls``, ``gateway/rewritten_history``, ``gateway/out_of_budget``,
``gateway/sampling_overridden`` and ``agent/samples_per_prompt``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from trellis.rollout.agent_loop import AgentLoop, AgentLoopOutput, agent_setting
from trellis.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"
"""The ``model`` name agents send; the gateway serves the policy under it."""

SESSION_METRICS = (
    "gateway/calls",
    "gateway/rewritten_history",
    "gateway/out_of_budget",
    "gateway/sampling_overridden",
)
"""The session counters each sample reports (see :mod:`trellis.rollout.gateway`)."""

_lock = threading.Lock()
_gateways: dict[tuple[int, str, int], Any] = {}
_semaphores: dict[int, threading.BoundedSemaphore] = {}


def process_gateway(tokenizer: Any, tool_parser: str = "hermes", processor: Any = None) -> Any:
    """This process's running training gateway for ``tokenizer`` (started on first use, on loopback;
    sessions only, each opened by a loop); with a vision-language model's ``processor`` it takes images."""
    from trellis.rollout.gateway import Gateway, start_gateway

    key = (id(tokenizer), tool_parser, id(processor))
    with _lock:
        running = _gateways.get(key)
        if running is None or not running.thread.is_alive():
            gateway = Gateway(
                tokenizer,
                model_name=MODEL_NAME,
                tool_parser=tool_parser,
                max_inflight=4096,
                processor=processor,
            )
            running = _gateways[key] = start_gateway(gateway)
        return running


def _slots(size: int) -> threading.BoundedSemaphore:
    """The process's bound on agent function calls running at once (one per configured size)."""
    with _lock:
        slots = _semaphores.get(size)
        if slots is None:
            slots = _semaphores[size] = threading.BoundedSemaphore(size)
        return slots


def submit_call(fn: Callable[..., Any], base_url: str, sample: dict[str, Any], concurrency: int) -> Any:
    """Run ``fn(base_url, sample)`` in a daemon thread of its own once one of ``concurrency`` slots is
    free; a ``concurrent.futures.Future`` of its result. Daemon threads: a call abandoned after its
    timeout never holds the process at exit (a ThreadPoolExecutor's workers would)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    slots = _slots(concurrency)

    def target() -> None:
        with slots:
            if not future.set_running_or_notify_cancel():  # cancelled while waiting for a slot
                return
            try:
                future.set_result(_call(fn, base_url, sample))
            except BaseException as exc:
                future.set_exception(exc)

    threading.Thread(target=target, name="trellis-agent", daemon=True).start()
    return future


def load_agent_function(reference: str | None) -> Callable[..., Any]:
    """The callable ``rollout.agent.function`` names.

    Raises:
        ValueError: no function is configured (the message says which key to set).
        trellis.errors.TrellisError: the reference cannot be loaded (from the registry's loader).
    """
    if not reference:
        raise ValueError(
            "the openai_agent loop needs rollout.agent.function: 'package.module:fn' or './file.py:fn', an "
            "async or plain function fn(base_url, sample)."
        )
    from trellis.registry import load_reference

    fn = load_reference(reference)  # a file is imported once per path, so later calls only look it up
    if not callable(fn):
        raise ValueError(f"rollout.agent.function {reference!r} is a {type(fn).__name__}, not a function.")
    return fn


def _call(fn: Callable[..., Any], base_url: str, sample: dict[str, Any]) -> Any:
    """Run the user's function to completion in this (worker) thread, on an event loop of its own
    when it returns an awaitable (a coroutine function)."""
    result = fn(base_url, sample)
    return asyncio.run(_await(result)) if inspect.isawaitable(result) else result


async def _await(awaitable: Any) -> Any:
    return await awaitable


class OpenAIAgentLoop(AgentLoop):
    """Runs ``rollout.agent.function`` against a capturing gateway session; see the module docstring."""

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> list[AgentLoopOutput]:
        cfg = self.agent_config
        fn = load_agent_function(agent_setting(cfg, "function"))
        timeout = float(agent_setting(cfg, "function_timeout_s"))
        running = process_gateway(self.tokenizer, agent_setting(cfg, "tool_parser"), self.processor)
        gateway = running.gateway
        params = sampling_params if sampling_params.wants_logprobs else _with_logprobs(sampling_params)
        session = gateway.open_session(
            self.server.request_id,
            generate=self.server.generate,
            loop=asyncio.get_running_loop(),
            defaults=params,
            max_response_tokens=sampling_params.max_tokens,
            fixed_sampling=True,
        )
        metrics: dict[str, float] = {"agent/function_errors": 0.0, "agent/function_timeouts": 0.0}
        reward: float | None = None
        concurrency = int(agent_setting(cfg, "function_concurrency"))
        future = submit_call(fn, running.session_url(session.id), plain_sample(sample), concurrency)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            future.cancel()  # not started yet: never will; running: abandoned (its session closes below)
            metrics["agent/function_timeouts"] = 1.0
            reward = 0.0
            logger.warning("agent function timed out after %.0f s (sample %s)", timeout, sample.get("index"))
        except Exception as exc:
            metrics["agent/function_errors"] = 1.0
            reward = 0.0
            logger.warning(
                "agent function raised %s: %s (sample %s)", type(exc).__name__, exc, sample.get("index")
            )
        else:
            reward = self._reward(result, metrics)
        finally:
            gateway.close_session(session.id)
        for key in SESSION_METRICS:  # every sample reports each, so batch means are per sample
            metrics[key] = float(session.metrics.get(key, 0))
        trajectories = session.samples()
        metrics["agent/samples_per_prompt"] = float(max(1, len(trajectories)))
        if not trajectories:  # the agent made no call: an empty response, trained on nothing
            return [
                AgentLoopOutput(
                    prompt_ids=self._fallback_prompt(sample),
                    response_ids=[],
                    response_mask=[],
                    response_logprobs=[] if sampling_params.wants_logprobs else None,
                    metrics=metrics,
                    reward=reward,
                )
            ]
        outputs = []
        for traj in trajectories:
            out = traj.to_output(metrics=dict(metrics), reward=reward)
            if not sampling_params.wants_logprobs:
                out.response_logprobs = None
            outputs.append(out)
        return outputs

    @staticmethod
    def _reward(result: Any, metrics: dict[str, float]) -> float | None:
        """The function's result as a reward (None: leave it to the reward function) and metrics."""
        if result is None:
            return None
        if isinstance(result, Mapping):
            for key, value in result.items():
                if key != "reward" and isinstance(value, int | float) and not isinstance(value, bool):
                    metrics[f"agent/{key}"] = float(value)
            result = result.get("reward")
            if result is None:
                return None
        if isinstance(result, bool) or not isinstance(result, int | float) or not math.isfinite(result):
            metrics["agent/function_errors"] = 1.0
            logger.warning(
                "agent function returned %r; return a finite number, a dict with 'reward', or None", result
            )
            return 0.0
        return float(result)

    def _fallback_prompt(self, sample: Mapping[str, Any]) -> list[int]:
        try:
            return self.prompt_ids(sample)
        except ValueError:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            return [int(eos) if eos is not None else 0]


def _with_logprobs(params: SamplingParams) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, logprobs=True)  # captured for training; returned only when asked


SAMPLE_HIDDEN = ("raw_prompt_ids", "tools_kwargs", "multi_modal_data", "multi_modal_inputs")
"""Columns the user's function does not get as they are (token ids, tensors, PIL images)."""


def plain_sample(sample: Mapping[str, Any]) -> dict[str, Any]:
    """The dataset row as plain Python values for the user's function (``messages``, ``ground_truth``).

    A vision-language row's images go into ``messages`` as OpenAI ``image_url`` parts (PNG ``data:``
    URLs), in place of the ``{"type": "image"}`` parts, so the messages can be sent to the gateway as
    they are."""
    result = {k: _plain(v) for k, v in sample.items() if k not in SAMPLE_HIDDEN}
    messages = result.pop("raw_prompt", None)
    if messages is not None:
        images = list((sample.get("multi_modal_data") or {}).get("image") or ())
        result["messages"] = _with_image_urls(messages, images) if images else messages
    reward_model = result.get("reward_model")
    if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
        result.setdefault("ground_truth", reward_model["ground_truth"])
    return result


def _with_image_urls(messages: list[Any], images: list[Any]) -> list[Any]:
    """``messages`` with each ``{"type": "image"}`` part replaced by the next image as a data URL."""
    import base64
    import io

    urls = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    pending = iter(urls)
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            parts = [
                {"type": "image_url", "image_url": {"url": next(pending)}}
                if isinstance(part, Mapping) and part.get("type") == "image"
                else part
                for part in content
            ]
            message = {**message, "content": parts}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
