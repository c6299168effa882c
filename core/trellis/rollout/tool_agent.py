"""The ``tool_agent`` agent loop: the model calls tools, reads their answers, and goes on.

One sample runs as::

    prompt (chat template, with the tools' schemas)
      -> model turn                        response_mask 1, log-probs from the replica
      -> tool calls parsed from its text   (rollout.agent.tool_parser, default hermes)
      -> tool responses as "tool" turns    response_mask 0, through the chat template
      -> model turn -> ...

until a model turn has no tool call, ``rollout.agent.max_turns`` model turns ran, a turn stopped
for length, or the next tool turn would not leave room for a model token within
``sampling_params.max_tokens`` (the budget of all turns together; a tool turn that does not fit is
dropped, so the response ends with the model's last turn).

Tools come from ``rollout.agent.tool_config_path``. A tool's instance is created on the sample's
first call to it, with ``create_kwargs`` from the sample's ``tools_kwargs`` (``{tool name:
{"create_kwargs": {...}}}``, e.g. a ground truth), and released when the sample ends. At most
``max_parallel_calls`` calls of one turn run (concurrently); each runs under
``tool_timeout_s``. Whatever goes wrong — an unparseable call, an unknown tool, a tool that raises,
hangs or returns garbage — becomes an ``Error: ...`` tool response for the model and a metric
(``tool/parse_errors``, ``tool/unknown``, ``tool/errors``, ``tool/timeouts``,
``tool/bad_output``); the rollout never crashes on it. Tool responses longer than
``max_tool_response_length`` characters are cut on ``tool_response_truncate_side``. Images in tool
responses (``ToolResponse.image``) are shown to a vision-language model (the loop has a processor): they
go in front of the tool turn's text, each widened to its tokens, and join the sample's images (the
prompt's first), which every later turn is generated with and which the sample trains with
(``multi_modal_data`` / ``multi_modal_inputs`` of its row); ``tool/images`` counts them. A text model
cannot see them: they are counted in ``tool/images_dropped``.

Tool rewards: the step rewards of every call, plus each opened instance's ``calc_reward`` when the sample
ends (just before ``release``), add up to the sample's ``tool_reward``, which the score stage adds to its
reward (``reward.tool_reward_weight``). A ``calc_reward`` that raises or overruns ``tool_timeout_s``
counts 0 and ``tool/reward_errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import defaultdict
from typing import Any

from trellis.data.multimodal import load_image
from trellis.errors import DatasetError
from trellis.rollout.agent_loop import AgentLoop, AgentLoopOutput, agent_setting
from trellis.rollout.sampling import SamplingParams
from trellis.rollout.tool_parser import FunctionCall, get_tool_parser
from trellis.tools.base import call_tool

TRUNCATION_MARK = "...(truncated)..."


def _tool_message(reply: str, images: int) -> dict[str, Any]:
    """A tool turn: its text, after ``images`` image parts when the tool showed pictures."""
    if not images:
        return {"role": "tool", "content": reply}
    return {"role": "tool", "content": [{"type": "image"}] * images + [{"type": "text", "text": reply}]}


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """``text`` cut to at most ``limit`` characters (plus a marker where it was cut).

    ``side``: ``"left"`` drops the start (keeps the end), ``"right"`` drops the end, ``"middle"`` keeps
    the first and last ``limit // 2`` characters.
    """
    if len(text) <= limit:
        return text
    if side == "left":
        return TRUNCATION_MARK + text[len(text) - limit :]
    if side == "right":
        return text[:limit] + TRUNCATION_MARK
    if side == "middle":
        head = limit // 2
        return text[:head] + TRUNCATION_MARK + text[len(text) - (limit - head) :]
    raise ValueError(f"tool_response_truncate_side must be left, right or middle, got {side!r}.")


class ToolAgentLoop(AgentLoop):
    """Multi-turn generation with tool calls; see the module docstring."""

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput:
        cfg = self.agent_config
        max_turns = agent_setting(cfg, "max_turns")
        max_calls = int(agent_setting(cfg, "max_parallel_calls"))
        parser = get_tool_parser(agent_setting(cfg, "tool_parser"))
        chat = self.chat_template()
        prompt_ids = self.prompt_ids(sample, tools=list(self.tools.values()))
        media = sample.get("multi_modal_data") or {}
        images, videos = list(media.get("image") or ()), list(media.get("video") or ())
        budget = sampling_params.max_tokens
        response_ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] | None = []  # None once a turn came without weight versions
        metrics: dict[str, float] = defaultdict(float)
        instances: dict[str, str] = {}
        model_turns = tool_turns = 0
        tool_reward = 0.0
        try:
            while True:
                params = dataclasses.replace(sampling_params, max_tokens=budget - len(response_ids))
                items = {"image": list(images), "video": list(videos)} if images or videos else None
                out = await self.server.generate(prompt_ids + response_ids, params, items)
                tokens = list(out.token_ids)
                response_ids += tokens
                mask += [1] * len(tokens)
                logprobs += list(out.log_probs) if out.log_probs is not None else [0.0] * len(tokens)
                versions = (
                    versions + list(out.weight_versions)
                    if versions is not None and out.weight_versions is not None
                    else None
                )
                model_turns += 1
                if out.stop_reason != "stop" or len(response_ids) >= budget:
                    metrics["agent/truncated"] = 1.0
                    break
                if max_turns is not None and model_turns >= max_turns:
                    metrics["agent/max_turns_reached"] = 1.0
                    break
                _, calls = parser.extract_tool_calls(self.tokenizer.decode(tokens, skip_special_tokens=False))
                if not calls:
                    break
                metrics["tool/ignored_calls"] += max(0, len(calls) - max_calls)
                replies, shown = await self._run_calls(calls[:max_calls], sample, instances, metrics)
                ended = bool(tokens) and tokens[-1] in chat.eos_token_ids
                turn = chat.continuation_ids(
                    [_tool_message(r, len(pics)) for r, pics in zip(replies, shown, strict=True)],
                    ended_with_eos=ended,
                )
                new = [image for pics in shown for image in pics]
                if new:
                    turn = self._widen_image_tokens(turn, new)
                if len(response_ids) + len(turn) >= budget:
                    metrics["agent/truncated"] = 1.0
                    break
                response_ids += turn
                images += new
                mask += [0] * len(turn)
                logprobs += [0.0] * len(turn)
                if versions is not None:
                    versions += [-1] * len(turn)
                tool_turns += 1
        finally:
            tool_reward = metrics["tool/step_reward"] + await self._final_rewards(instances, metrics)
            await self._release(instances)
        metrics["agent/model_turns"] = float(model_turns)
        extra: dict[str, Any] = {}
        if self.processor is not None:  # the row trains with every image it was shown, tools' included
            from trellis.data.multimodal import vision_inputs

            extra["multi_modal_data"] = {"image": images, "video": videos}
            extra["multi_modal_inputs"] = vision_inputs(self.processor, images, videos)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=mask,
            response_logprobs=logprobs if sampling_params.wants_logprobs else None,
            num_turns=1 + model_turns + tool_turns,
            metrics=dict(metrics),
            tool_reward=tool_reward,
            response_versions=versions,
            extra=extra,
        )

    def _widen_image_tokens(self, turn: list[int], images: list[Any]) -> list[int]:
        """``turn`` with its image pad tokens (one per image, as the chat template renders them) widened
        to each image's token count under the processor (Qwen-VL family: patches / merge_size²)."""
        from trellis.data.multimodal import item_tokens, vision_inputs

        counts = iter(item_tokens(self.processor, vision_inputs(self.processor, images)))
        pad = self.tokenizer.convert_tokens_to_ids(getattr(self.processor, "image_token", "<|image_pad|>"))
        out: list[int] = []
        for token in turn:
            out += [token] * next(counts) if token == pad else [token]
        return out

    async def _run_calls(
        self,
        calls: list[FunctionCall],
        sample: dict[str, Any],
        instances: dict[str, str],
        metrics: dict[str, float],
    ) -> tuple[list[str], list[list[Any]]]:
        """Each call's reply text (errors included) and the images it shows the model (none for a text
        model); calls of one turn run concurrently."""
        cfg = self.agent_config
        timeout = float(agent_setting(cfg, "tool_timeout_s"))
        limit = int(agent_setting(cfg, "max_tool_response_length"))
        side = agent_setting(cfg, "tool_response_truncate_side")
        replies: list[str | None] = [None] * len(calls)
        shown: list[list[Any]] = [[] for _ in calls]
        jobs = []
        for i, call in enumerate(calls):  # instances are opened one by one, before any call runs
            metrics["tool/calls"] += 1
            if call.error is not None:
                metrics["tool/parse_errors"] += 1
                replies[i] = f"Error: {call.error}."
                continue
            tool = self.tools.get(call.name)
            if tool is None:
                metrics["tool/unknown"] += 1
                known = ", ".join(sorted(self.tools)) or "none"
                replies[i] = f"Error: there is no tool named {call.name!r}; available tools: {known}."
                continue
            if call.name not in instances:
                error = await self._open(call.name, tool, sample, instances, timeout)
                if error is not None:
                    metrics["tool/errors"] += 1
                    replies[i] = error
                    continue
            jobs.append((i, call_tool(tool, instances[call.name], call.arguments, timeout=timeout)))
        results = await asyncio.gather(*(job for _, job in jobs))
        for (i, _), (response, step_reward, tool_metrics) in zip(jobs, results, strict=True):
            for key, value in tool_metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    metrics[key] += float(value)
            metrics["tool/step_reward"] += float(step_reward)
            replies[i] = response.text or ""
            if response.image and self.processor is not None:
                try:
                    shown[i] = [
                        load_image(image, where=f"tool {calls[i].name!r}") for image in response.image
                    ]
                    metrics["tool/images"] += len(shown[i])
                except DatasetError as exc:  # garbage for an image: the model reads why, the run goes on
                    metrics["tool/bad_output"] += 1
                    replies[i] = f"{replies[i]}\nError: {exc}".lstrip()
            elif response.image:  # a text model cannot see them
                metrics["tool/images_dropped"] += len(response.image)
        return [truncate(r or "", limit, side) for r in replies], shown

    async def _open(
        self, name: str, tool: Any, sample: dict[str, Any], instances: dict[str, str], timeout: float
    ) -> str | None:
        """Create the sample's instance of ``tool``; an error reply for the model when that fails."""
        spec = (sample.get("tools_kwargs") or {}).get(name) or {}
        create_kwargs = dict(spec.get("create_kwargs") or {}) if isinstance(spec, dict) else {}
        try:
            instance_id, _ = await asyncio.wait_for(tool.create(**create_kwargs), timeout)
        except Exception as exc:  # a tool that cannot start is the model's problem to read, not a crash
            detail = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
            return f"Error: the tool {name!r} could not start ({detail})."
        instances[name] = instance_id
        return None

    async def _final_rewards(self, instances: dict[str, str], metrics: dict[str, float]) -> float:
        """Σ ``calc_reward`` over the sample's tool instances (the trajectory-level tool rewards)."""
        timeout = float(agent_setting(self.agent_config, "tool_timeout_s"))
        total = 0.0
        for name, instance_id in instances.items():
            try:
                reward = await asyncio.wait_for(self.tools[name].calc_reward(instance_id), timeout)
                total += float(reward)
            except Exception:  # a faulty tool costs its reward, never the rollout
                metrics["tool/reward_errors"] += 1
        metrics["tool/final_reward"] += total
        return total

    async def _release(self, instances: dict[str, str]) -> None:
        for name, instance_id in instances.items():
            with contextlib.suppress(Exception):
                await self.tools[name].release(instance_id)
