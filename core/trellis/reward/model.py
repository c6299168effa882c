"""Model-based rewards (``reward.model``): a judge LLM over an OpenAI-compatible API, or a classifier.

Two scorers, one manager:

* :class:`JudgeClient` (``kind: generative``) sends each sample to ``POST {base_url}/chat/completions``
  as one user message, ``reward.model.prompt_template`` filled with ``{prompt}``, ``{response}`` and
  ``{ground_truth}``; up to ``max_concurrency`` requests run at once, each under ``timeout_seconds``.
  The judge's reply becomes the score through a registered reward function (``reward.model.function``,
  by default :func:`~trellis.reward.builtin.judge_score`), called as
  ``fn(data_source, solution_str=<the reply>, ground_truth, extra_info)``. A request that fails (an
  HTTP error, a timeout, a reply without text) scores 0 and is counted; the step goes on.
* :class:`ClassifierRewardModel` (``kind: classifier``) runs an ``AutoModelForSequenceClassification``
  with one output in this process, over prompt + response (through its own tokenizer's chat template
  when it has one), ``micro_batch_size`` samples a forward pass: the score is the logit of label 0.

:class:`ModelRewardManager` is a reward manager (called as ``manager(data, return_dict=False)``) that
puts the model's score on each response's last valid token. Given a rule-based manager too (when
``reward.function`` is set), it adds the two: ``score_i = rule_i + model_i``.

Where the judge runs is the trainer's business (:mod:`trellis.trainer.judge` serves a colocated one);
this module only needs its address. httpx (the ``gateway`` extra) is imported when a judge is first
called.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from trellis.config.base import schema_default
from trellis.config.schema import RewardModelConfig
from trellis.data.protocol import DataProto
from trellis.errors import TrellisError
from trellis.reward.managers import ScoreOutcome, outcome_of
from trellis.reward.resolve import resolve_reward_function
from trellis.utils.auto_model import load_pretrained
from trellis.utils.coroutines import run_coroutine

logger = logging.getLogger(__name__)

MODEL_METRICS = ("reward/model_errors", "reward/model_timeouts")
"""Counts a model-scored batch reports: failed judge calls (timeouts included) and timed-out ones."""


@dataclass
class ModelSample:
    """What a reward model reads of one sample.

    Attributes:
        prompt: the prompt as text (its chat messages' contents, or the decoded prompt tokens).
        messages: the prompt as chat messages (``raw_prompt`` when the batch has it, else one user
            message holding ``prompt``).
        response: the decoded response (its valid tokens, special tokens skipped).
        ground_truth: ``reward_model["ground_truth"]`` of the sample, or None.
        data_source, extra_info: the sample's columns (None when absent).
    """

    prompt: str
    messages: list[dict[str, Any]]
    response: str
    ground_truth: Any = None
    data_source: Any = None
    extra_info: Any = None


# ---------------------------------------------------------------- reading a batch


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple):  # content parts: keep the text ones
        parts = [p.get("text", "") if isinstance(p, dict) else str(p) for p in content]
        return "".join(parts)
    return "" if content is None else str(content)


def _as_messages(raw: Any) -> list[dict[str, Any]] | None:
    if isinstance(raw, np.ndarray):
        raw = raw.tolist()
    if isinstance(raw, list | tuple) and raw and all(isinstance(m, dict) and "role" in m for m in raw):
        return [{"role": m["role"], "content": _content_text(m.get("content"))} for m in raw]
    return None


def _prompt_text(messages: list[dict[str, Any]]) -> str:
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def read_samples(data: DataProto, tokenizer: Any) -> tuple[list[ModelSample], list[int]]:
    """Each row of ``data`` as a :class:`ModelSample`, and the index of its last valid response token.

    Reads ``batch["responses"]`` (bs, T) with ``batch["response_mask"]`` (bs, T) (else the last T
    columns of ``batch["attention_mask"]``), the prompt from ``non_tensor_batch["raw_prompt"]`` (chat
    messages; ``data.return_raw_chat``) or else ``batch["prompts"]`` (bs, P) decoded with the first P
    columns of ``attention_mask``, and the optional columns ``reward_model``, ``data_source`` and
    ``extra_info``. The last index is -1 for an empty response.

    Raises:
        ValueError: ``responses``, the masks or any prompt is missing; the message names the key.
    """
    batch, columns = data.batch, data.non_tensor_batch
    if batch is None or "responses" not in batch:
        raise ValueError("The reward model needs data.batch['responses'] (bs, T); it is missing.")
    responses = batch["responses"]
    width = responses.shape[1]
    if "response_mask" in batch:
        mask = batch["response_mask"].bool()
    elif "attention_mask" in batch:
        mask = batch["attention_mask"][:, -width:].bool()
    else:
        raise ValueError(
            "The reward model needs data.batch['response_mask'] or ['attention_mask'] to find each "
            "response's valid tokens; neither is present."
        )
    size = responses.shape[0]
    raw_prompts = columns.get("raw_prompt")
    if raw_prompts is None and not ("prompts" in batch and "attention_mask" in batch):
        raise ValueError(
            "The reward model needs each prompt: data.non_tensor_batch['raw_prompt'] (set "
            "data.return_raw_chat=true) or data.batch['prompts'] with ['attention_mask']; neither is present."
        )

    def column(key: str) -> list[Any]:
        return list(columns[key]) if key in columns else [None] * size

    sources, extras, rows = column("data_source"), column("extra_info"), column("reward_model")
    samples, last_index = [], []
    for i in range(size):
        raw = raw_prompts[i] if raw_prompts is not None else None
        messages = _as_messages(raw)
        if messages is None:
            if "prompts" not in batch:
                raise ValueError(
                    f"data.non_tensor_batch['raw_prompt'][{i}] is not a list of chat messages ({raw!r}) "
                    "and the batch has no 'prompts' tokens to decode instead."
                )
            prompt_width = batch["prompts"].shape[1]
            prompt_ids = batch["prompts"][i][batch["attention_mask"][i, :prompt_width].bool()]
            messages = [
                {"role": "user", "content": tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=True)}
            ]
        valid = mask[i].nonzero().flatten()
        row = rows[i]
        samples.append(
            ModelSample(
                prompt=_prompt_text(messages),
                messages=messages,
                response=tokenizer.decode(responses[i][mask[i]].tolist(), skip_special_tokens=True),
                ground_truth=row.get("ground_truth") if isinstance(row, dict) else None,
                data_source=sources[i],
                extra_info=extras[i],
            )
        )
        last_index.append(int(valid[-1]) if len(valid) else -1)
    return samples, last_index


# ---------------------------------------------------------------- the judge

_DEFAULT_FUNCTION: str = schema_default(RewardModelConfig, "function")


def _is_loopback(url: str) -> bool:
    return (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


@dataclass
class _Request:
    """One judge call's outcome and the judge's reply (None when the call failed)."""

    outcome: ScoreOutcome
    reply: str | None = None


class JudgeClient:
    """Scores samples with a judge LLM behind an OpenAI-compatible ``/chat/completions`` endpoint.

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name sent with each request; None = the first id ``GET {base_url}/models``
            lists (asked once).
        prompt_template: format string with ``{prompt}``, ``{response}``, ``{ground_truth}``.
        function: turns the reply into the score: a name in ``trellis.reward_functions``, a reference
            or a callable (see :func:`~trellis.reward.resolve.resolve_reward_function`).
        max_tokens: the longest reply, in tokens.
        timeout_seconds: the limit of one request (connecting, waiting and reading).
        max_concurrency: requests in flight at once.

    Raises:
        UnknownComponentError, InvalidReferenceError, ...: ``function`` names no reward function.
        ValueError: a limit is not positive.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        prompt_template: str = schema_default(RewardModelConfig, "prompt_template"),
        function: str | Callable[..., Any] = _DEFAULT_FUNCTION,
        max_tokens: int = schema_default(RewardModelConfig, "max_tokens"),
        timeout_seconds: float = schema_default(RewardModelConfig, "timeout_seconds"),
        max_concurrency: int = schema_default(RewardModelConfig, "max_concurrency"),
    ) -> None:
        for name, value in (
            ("max_tokens", max_tokens),
            ("timeout_seconds", timeout_seconds),
            ("max_concurrency", max_concurrency),
        ):
            if not value > 0:
                raise ValueError(f"reward.model.{name} must be > 0, got {value!r}.")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.prompt_template = prompt_template
        self.function = resolve_reward_function(function)
        self.max_tokens = int(max_tokens)
        self.timeout_seconds = float(timeout_seconds)
        self.max_concurrency = int(max_concurrency)
        self.last_replies: list[str | None] = []
        """The judge's reply to each sample of the last batch (None where the call failed)."""

    def judge_prompt(self, sample: ModelSample) -> str:
        """The user message sent for ``sample``: the template filled with its texts."""
        truth = "" if sample.ground_truth is None else str(sample.ground_truth)
        return self.prompt_template.format(prompt=sample.prompt, response=sample.response, ground_truth=truth)

    def score(self, samples: Sequence[ModelSample]) -> list[ScoreOutcome]:
        """Score ``samples`` concurrently, in order (see :meth:`score_async`)."""
        return run_coroutine(self.score_async(samples))

    async def score_async(self, samples: Sequence[ModelSample]) -> list[ScoreOutcome]:
        """One :class:`~trellis.reward.managers.ScoreOutcome` per sample, in order; a failed call has
        score 0 and ``error`` set (``timed_out`` too past ``timeout_seconds``).

        Raises:
            TrellisError: from the reward function (a configuration error, which would zero every score).
        """
        try:
            import httpx
        except ImportError as exc:
            raise ImportError(
                "reward.model (kind=generative) calls its judge with httpx, part of the gateway extra: "
                "pip install 'trellis-rl[gateway]'"
            ) from exc
        limits = httpx.Limits(max_connections=self.max_concurrency)
        async with httpx.AsyncClient(
            timeout=self.timeout_seconds, limits=limits, trust_env=not _is_loopback(self.base_url)
        ) as client:
            try:
                model = await self._model_name(client)
            except Exception as exc:
                error = f"listing the models at {self.base_url}/models failed: {type(exc).__name__}: {exc}"
                self.last_replies = [None] * len(samples)
                return [ScoreOutcome(error=error) for _ in samples]
            limit = asyncio.Semaphore(self.max_concurrency)
            done = await asyncio.gather(*(self._judge(client, model, s, limit) for s in samples))
        self.last_replies = [d.reply for d in done]
        return [d.outcome for d in done]

    async def _model_name(self, client: Any) -> str:
        if self.model is None:
            response = await asyncio.wait_for(client.get(f"{self.base_url}/models"), self.timeout_seconds)
            response.raise_for_status()
            self.model = str(response.json()["data"][0]["id"])
        return self.model

    async def _judge(
        self, client: Any, model: str, sample: ModelSample, limit: asyncio.Semaphore
    ) -> _Request:
        import httpx

        payload = {
            "model": model,
            "messages": [{"role": "user", "content": self.judge_prompt(sample)}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        async with limit:
            try:
                response = await asyncio.wait_for(
                    client.post(f"{self.base_url}/chat/completions", json=payload), self.timeout_seconds
                )
                response.raise_for_status()
                reply = _reply_text(response.json())
            except (asyncio.TimeoutError, httpx.TimeoutException):
                return _Request(
                    ScoreOutcome(error=f"timed out after {self.timeout_seconds} s", timed_out=True)
                )
            except Exception as exc:
                return _Request(ScoreOutcome(error=f"{type(exc).__name__}: {exc}"))
        try:
            result = self.function(
                data_source=sample.data_source,
                solution_str=reply,
                ground_truth=sample.ground_truth,
                extra_info=sample.extra_info,
            )
            if inspect.isawaitable(result):
                result = await result
            return _Request(outcome_of(result), reply)
        except TrellisError:
            raise
        except Exception as exc:
            return _Request(ScoreOutcome(error=f"{type(exc).__name__}: {exc}"), reply)


def _reply_text(body: Any) -> str:
    """The text of a chat-completion response body; ValueError when it has none."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"the judge's answer is not a chat completion: {str(body)[:200]!r}") from None
    if not isinstance(content, str):
        raise ValueError(f"the judge's answer has no text content: {content!r}")
    return content


# ---------------------------------------------------------------- the classifier


class ClassifierRewardModel:
    """A sequence classifier with one output whose logit is the reward.

    Args:
        path: a folder or hub id holding an ``AutoModelForSequenceClassification`` and its tokenizer.
        micro_batch_size: samples per forward pass.
        device: where it runs (default: cpu).
        dtype: a torch dtype or its name; None = transformers' default.
        trust_remote_code: allow the repository's own code.

    Raises:
        ValueError: the model has more than one output (``num_labels`` != 1), or its tokenizer has
            neither a pad nor an eos token to pad batches with.
    """

    def __init__(
        self,
        path: str,
        *,
        micro_batch_size: int = schema_default(RewardModelConfig, "micro_batch_size"),
        device: str | torch.device | None = None,
        dtype: Any = None,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not micro_batch_size >= 1:
            raise ValueError(f"reward.model.micro_batch_size must be >= 1, got {micro_batch_size!r}.")
        self.micro_batch_size = int(micro_batch_size)
        self.device = torch.device(device or "cpu")
        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if dtype is not None:
            kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = load_pretrained(AutoModelForSequenceClassification, path, **kwargs)
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward.model.path={path!r} has {self.model.config.num_labels} labels; a classifier reward "
                "model needs one output (num_labels=1), whose logit is the reward."
            )
        self.model.to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(
                    f"The tokenizer of reward.model.path={path!r} has neither a pad nor an eos token to pad "
                    "batches with; add a pad token to it."
                )
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # the model finds each row's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # an overlong text keeps its end: the response
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))

    def text(self, sample: ModelSample) -> str:
        """What the classifier reads: the conversation through its chat template, else prompt + response."""
        if self.chat:
            messages = [*sample.messages, {"role": "assistant", "content": sample.response}]
            return str(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return sample.prompt + sample.response

    @torch.no_grad()
    def score(self, samples: Sequence[ModelSample]) -> list[ScoreOutcome]:
        """The logit of label 0 for each sample, ``micro_batch_size`` samples a forward pass."""
        texts = [self.text(s) for s in samples]
        longest = getattr(self.model.config, "max_position_embeddings", None)
        scores: list[float] = []
        for start in range(0, len(texts), self.micro_batch_size):
            encoded = self.tokenizer(
                texts[start : start + self.micro_batch_size],
                return_tensors="pt",
                padding=True,
                truncation=longest is not None,
                max_length=longest,
                add_special_tokens=not self.chat,  # a chat template writes its own special tokens
            ).to(self.device)
            logits = self.model(
                input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]
            ).logits
            scores += logits[:, 0].float().cpu().tolist()
        return [ScoreOutcome(score=s) for s in scores]


# ---------------------------------------------------------------- the manager


@dataclass
class ModelRewardManager:
    """A reward manager scoring with a reward model, plus a rule-based manager's score when given.

    Called as ``manager(data, return_dict=False)`` like every manager. The returned
    ``reward_extra_info`` holds ``model_score`` per sample (and, from a dict-returning judge function,
    its other fields as ``model_<field>``); ``metrics`` hold the rule manager's counts (zeros without
    one) and :data:`MODEL_METRICS`.

    Attributes:
        tokenizer: the policy's tokenizer, which decodes prompts and responses.
        scorer: a :class:`JudgeClient` or :class:`ClassifierRewardModel` (anything with
            ``score(samples) -> list[ScoreOutcome]``).
        rule: the ``reward.manager`` built for ``reward.function``, or None (the model's score alone).
    """

    tokenizer: Any
    scorer: Any
    rule: Any = None
    last_metrics: dict[str, float] = field(default_factory=dict)

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        """``token_level_scores`` (bs, T) float32: ``rule_i + model_i`` on each response's last valid
        token, zeros elsewhere; with ``return_dict``, a dict of ``reward_tensor`` (that),
        ``reward_extra_info`` and ``metrics``."""
        samples, last_index = read_samples(data, self.tokenizer)
        outcomes = self.scorer.score(samples)
        responses = data.tensors["responses"]
        if self.rule is not None:
            out = self.rule(data, return_dict=True)
            reward = out["reward_tensor"].to(torch.float32).clone()
            extra_info = dict(out.get("reward_extra_info", {}))
            metrics = {k: float(v) for k, v in out.get("metrics", {}).items()}
        else:
            reward = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
            extra_info, metrics = {}, {"reward/errors": 0.0, "reward/timeouts": 0.0}
        for i, (outcome, last) in enumerate(zip(outcomes, last_index, strict=True)):
            if last >= 0:  # an empty response has no token to carry its reward
                reward[i, last] += outcome.score
        extra_info["model_score"] = [o.score for o in outcomes]
        for key in dict.fromkeys(k for o in outcomes for k in o.extra):
            extra_info[f"model_{key}"] = [o.extra.get(key) for o in outcomes]
        errors = [o.error for o in outcomes if o.error is not None]
        metrics["reward/model_errors"] = float(len(errors))
        metrics["reward/model_timeouts"] = float(sum(o.timed_out for o in outcomes))
        if errors:
            logger.warning(
                "%d of %d reward-model calls failed; first: %s", len(errors), len(outcomes), errors[0]
            )
        self.last_metrics = metrics
        if return_dict:
            return {"reward_tensor": reward, "reward_extra_info": extra_info, "metrics": metrics}
        return reward

    def close(self) -> None:
        """Stop what the rule manager runs (the async manager's processes)."""
        close = getattr(self.rule, "close", None)
        if close is not None:
            close()


def build_model_reward_manager(
    model_config: Any,
    tokenizer: Any,
    rule: Any = None,
    *,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
) -> ModelRewardManager:
    """The :class:`ModelRewardManager` ``reward.model`` (``model_config``) describes.

    A generative judge is reached at ``model_config.base_url`` (for a colocated judge the trainer fills
    it in once the judge is served); ``device`` and ``trust_remote_code`` concern a classifier.

    Raises:
        ValueError: a generative judge without ``base_url`` (a colocated judge that the trainer has not
            started), or a classifier without ``path``.
        UnknownComponentError, ...: ``model_config.function`` names no reward function.
    """
    if model_config.kind == "classifier":
        if not model_config.path:
            raise ValueError("reward.model.kind=classifier needs reward.model.path, the classifier to load.")
        scorer: Any = ClassifierRewardModel(
            model_config.path,
            micro_batch_size=model_config.micro_batch_size,
            device=device,
            trust_remote_code=trust_remote_code,
        )
    else:
        if not model_config.base_url:
            raise ValueError(
                "reward.model has no base_url: with placement=external set it to the judge server's API "
                "root; with placement=colocated the trainer serves reward.model.path and fills it in "
                "(trellis.trainer.judge.start_judge) before the reward managers are built."
            )
        scorer = JudgeClient(
            model_config.base_url,
            model=model_config.path,
            prompt_template=model_config.prompt_template,
            function=model_config.function,
            max_tokens=model_config.max_tokens,
            timeout_seconds=model_config.timeout_seconds,
            max_concurrency=model_config.max_concurrency,
        )
    return ModelRewardManager(tokenizer, scorer, rule)
