"""Chat-template helper (prompts with tools, appended turns) and tool-call parsers."""

from __future__ import annotations

import pytest

from trellis.errors import UnknownComponentError
from trellis.recipes.tiny import build_tiny_tokenizer
from trellis.rollout.chat import ChatTemplate, tool_schemas
from trellis.rollout.tool_agent import TRUNCATION_MARK, truncate
from trellis.rollout.tool_parser import FunctionCall, HermesToolParser, get_tool_parser, tool_parsers
from trellis.tools.base import load_tools

USER = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_prompt_ids_match_the_template_and_list_tool_schemas(tok):
    chat = ChatTemplate(tok)
    plain = chat.prompt_ids(USER)
    assert (
        plain
        == tok(
            tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
    )
    tools = load_tools([{"name": "calculator"}])
    with_tools = tok.decode(chat.prompt_ids(USER, list(tools.values())))
    assert with_tools.startswith("<|im_start|>system\n# Tools\n<tools>\n")
    assert '"name": "calculator"' in with_tools and '"expression"' in with_tools
    assert with_tools.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert tool_schemas(tools.values())[0]["function"]["name"] == "calculator"
    assert tool_schemas(None) is None and tool_schemas([]) is None


def test_continuation_after_eos_closes_the_turn_and_opens_the_next(tok):
    chat = ChatTemplate(tok)
    ids = chat.continuation_ids([{"role": "tool", "content": "4"}])
    assert tok.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # a turn cut off before its end-of-turn token gets that token first
    cut = chat.continuation_ids([{"role": "tool", "content": "4"}], ended_with_eos=False)
    assert cut == [tok.eos_token_id, *ids]
    # appending the continuation to a rendered conversation gives what the template renders in one go
    convo = [*USER, {"role": "assistant", "content": "hi"}]
    whole = chat.render([*convo, {"role": "tool", "content": "4"}])
    assert chat.render(convo, add_generation_prompt=False)[:-1] + ids == whole  # [:-1]: drop the "\n"


@pytest.mark.parametrize("shape", ["list", "nested", "batch_encoding"])
def test_transformers4_and_5_output_shapes_are_read(tok, shape):
    class Shaped:  # apply_chat_template returning what transformers 4 or 5 returns
        chat_template = "x"
        eos_token_id = tok.eos_token_id

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
            text = tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
            return {
                "list": ids,
                "nested": [ids],
                "batch_encoding": {"input_ids": [ids], "attention_mask": [[1] * len(ids)]},
            }[shape]

    assert ChatTemplate(Shaped()).prompt_ids(USER) == ChatTemplate(tok).prompt_ids(USER)


def test_bad_templates_and_prompts_are_reported(tok):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="NoTemplate has no chat template"):
        ChatTemplate(NoTemplate())
    with pytest.raises(ValueError, match="non-empty list of chat messages"):
        ChatTemplate(tok).prompt_ids("What is 2 + 2?")

    class Unstable:  # renders the last message differently from earlier ones
        chat_template = "x"
        eos_token_id = tok.eos_token_id

        def apply_chat_template(self, messages, **kwargs):
            return [len(messages)] + [7] * len(messages)

    with pytest.raises(ValueError, match="renders earlier turns differently"):
        ChatTemplate(Unstable()).continuation_ids([{"role": "tool", "content": "4"}])


def test_hermes_parser_reads_calls_and_reports_malformed_ones():
    parser = get_tool_parser("hermes")
    assert isinstance(parser, HermesToolParser) and tool_parsers.get("hermes") is HermesToolParser
    text = (
        "Let me compute. "
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>'
        "<tool_call>not json</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": 3}</tool_call>'
        '<tool_call>{"name": "g"}</tool_call> done <tool_call>{"name": "cut'
    )
    content, calls = parser.extract_tool_calls(text)
    assert content == 'Let me compute. \n done <tool_call>{"name": "cut'
    assert calls[0] == FunctionCall("calculator", {"expression": "2 + 2"})
    assert calls[1] == FunctionCall("search", {"q": "x"})  # arguments given as a JSON string
    assert calls[2].error.startswith("the tool call is not valid JSON")
    assert calls[3].error == "the tool call must be a JSON object, got list"
    assert calls[4].error == 'the tool call has no "name" string'
    assert calls[5] == FunctionCall("f", {}, 'the "arguments" of f must be a JSON object')
    assert calls[6] == FunctionCall("g", {})
    assert len(calls) == 7  # the unclosed block at the end is not a call
    assert parser.extract_tool_calls("no calls here") == ("no calls here", [])


def test_hermes_openings_complete_to_the_calls_they_force():
    parser = HermesToolParser()
    anything, named = parser.call_prefix(None), parser.call_prefix('say "hi"')
    assert anything == '<tool_call>{"name": "'
    assert named == '<tool_call>{"name": "say \\"hi\\"", "arguments":'  # the name JSON-escaped
    _, (call,) = parser.extract_tool_calls(anything + 'calculator", "arguments": {"x": 1}}</tool_call>')
    assert call == FunctionCall("calculator", {"x": 1})
    _, (call,) = parser.extract_tool_calls(named + ' {"to": "you"}}</tool_call>')
    assert call == FunctionCall('say "hi"', {"to": "you"})


def test_unknown_parser_lists_the_known_ones():
    with pytest.raises(UnknownComponentError, match="hermes"):
        get_tool_parser("hermez")


@pytest.mark.parametrize(
    ("side", "expected"),
    [
        ("right", "abcd" + TRUNCATION_MARK),
        ("left", TRUNCATION_MARK + "ghij"),
        ("middle", "ab" + TRUNCATION_MARK + "ij"),
    ],
)
def test_truncate_sides(side, expected):
    assert truncate("abcdefghij", 4, side) == expected
    assert truncate("abcd", 4, side) == "abcd"


def test_truncate_rejects_an_unknown_side():
    with pytest.raises(ValueError, match="left, right or middle, got 'top'"):
        truncate("abcdefghij", 4, "top")
