"""Chat-template application for agent loops: prompts with tool schemas, and the token ids of later turns.

An agent loop keeps its conversation as token ids (what the model generated stays exactly as
generated), so it needs two things from the chat template:

* :meth:`ChatTemplate.prompt_ids`: the opening prompt, rendered with the tools' JSON schemas
  when the loop offers tools;
* :meth:`ChatTemplate.continuation_ids`: the tokens that follow an assistant turn when new
  messages (tool responses, a user reply) join the conversation, ending with the generation
  prompt of the next assistant turn.

``continuation_ids`` renders a fixed two-turn conversation with and without the new messages
and takes the difference, so it works for any template that renders earlier turns the same
whether or not later ones follow (ChatML, Llama 3, Qwen, SmolLM2 ...); a template that does not
is reported with a ``ValueError``. The tokens that close an assistant turn after its end-of-turn
token (ChatML's newline after ``<|im_end|>``) are added too, and, when the model stopped without
its end-of-turn token (e.g. at a stop string), the end-of-turn token first.

Token ids are read through :func:`trellis.utils.tokenizer.normalize_token_ids`, so the list of
transformers 4 and the ``BatchEncoding`` of transformers 5 both work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trellis.utils.tokenizer import normalize_token_ids

_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def tool_schemas(tools: Iterable[Any] | None) -> list[dict[str, Any]] | None:
    """Tools (``BaseTool`` objects, ``OpenAIFunctionToolSchema`` objects or dicts) as the JSON dicts
    ``apply_chat_template(tools=...)`` takes; None when there are none."""
    result = []
    for tool in tools or ():
        if hasattr(tool, "get_openai_tool_schema"):
            tool = tool.get_openai_tool_schema()
        result.append(tool.to_dict() if hasattr(tool, "to_dict") else dict(tool))
    return result or None


class ChatTemplate:
    """A tokenizer's chat template, applied to token ids.

    Args:
        tokenizer: a Hugging Face tokenizer (or processor) with a chat template.
        eos_token_ids: the tokens that end an assistant turn; default: the tokenizer's eos token.
        **template_kwargs: passed to every ``apply_chat_template`` call (e.g. ``enable_thinking``).
    """

    def __init__(
        self, tokenizer: Any, eos_token_ids: Iterable[int] | None = None, **template_kwargs: Any
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat template; agent loops need one to build turns. "
                "Set tokenizer.chat_template or use a chat (instruct) model."
            )
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [] if eos is None else [eos]
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._closing: list[int] | None = None
        self._probe_ids: list[int] | None = None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Iterable[Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """``apply_chat_template(messages, tokenize=True)`` as a plain list of token ids."""
        kwargs = dict(self.template_kwargs)
        schemas = tool_schemas(tools)
        if schemas is not None:
            kwargs["tools"] = schemas
        out = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
        return normalize_token_ids(out)

    def prompt_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: Iterable[Any] | None = None
    ) -> list[int]:
        """The first assistant turn's prompt: ``messages`` (and ``tools``) plus the generation prompt."""
        if isinstance(messages, str) or not messages:
            raise ValueError(f"a prompt must be a non-empty list of chat messages, got {messages!r:.200}.")
        return self.render(messages, tools=tools, add_generation_prompt=True)

    def closing_ids(self) -> list[int]:
        """Tokens the template puts after an assistant turn's end-of-turn token (ChatML: the newline)."""
        if self._closing is None:
            probe = self._probe()
            ends = [i for i, t in enumerate(probe) if t in self.eos_token_ids]
            self._closing = probe[ends[-1] + 1 :] if ends else []
        return list(self._closing)

    def _probe(self) -> list[int]:
        if self._probe_ids is None:
            self._probe_ids = self.render(_PROBE, add_generation_prompt=False)
        return self._probe_ids

    def continuation_ids(
        self, messages: Sequence[Mapping[str, Any]], *, ended_with_eos: bool = True
    ) -> list[int]:
        """Tokens that continue a conversation whose last turn is the model's, with ``messages`` then
        the next generation prompt.

        Args:
            messages: the new turns, e.g. ``[{"role": "tool", "content": "4"}]``.
            ended_with_eos: whether the model's last turn ended with its end-of-turn token. When it did
                not, that token is added first so the turn is closed as the template closes turns.

        Raises:
            ValueError: the template renders the earlier turns differently once ``messages`` follow them.
        """
        probe = self._probe()
        full = self.render([*_PROBE, *messages], add_generation_prompt=True)
        if full[: len(probe)] != probe:
            raise ValueError(
                "The chat template renders earlier turns differently when later turns follow them, so new "
                "turns cannot be appended as tokens. Use a template whose rendering of past turns is stable."
            )
        closing = self.closing_ids()
        head = closing if ended_with_eos else self.eos_token_ids[:1] + closing
        return head + full[len(probe) :]
