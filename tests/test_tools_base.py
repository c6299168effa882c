"""trellis.tools.base: the BaseTool protocol, call_tool's fault handling and load_tools."""

from __future__ import annotations

import asyncio
import sys

import pytest

from trellis import registries
from trellis.errors import UnknownComponentError
from trellis.tools import BaseTool, SchemaError, ToolConfigError, ToolResponse, call_tool, load_tools
from trellis.tools.calculator import CalculatorTool
from trellis.tools.gsm8k import Gsm8kTool
from trellis.tools.python import PythonTool

ECHO_SCHEMA = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Echo the text back.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


class EchoTool(BaseTool):
    """A test tool whose behaviour is picked by the ``text`` argument."""

    default_schema = ECHO_SCHEMA

    async def execute(self, instance_id, parameters, **kwargs):
        self.state(instance_id).setdefault("calls", 0)
        self.state(instance_id)["calls"] += 1
        text = parameters["text"]
        if text == "raise":
            raise RuntimeError("boom")
        if text == "hang":
            await asyncio.sleep(3600)
        if text == "stubborn":  # ignores the first cancellation (asyncio.run's shutdown sends another)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(3600)
        if text == "garbage":
            return "just a string"
        if text == "nan":
            return ToolResponse(text="x"), float("nan"), {}
        if text == "badresp":
            return {"text": 3}, 0.0, {}
        if text == "dict":
            return {"text": "from dict"}, 1, {"echo/n": 1}
        return ToolResponse(text=text), 0.5, {"echo/len": len(text)}


def test_registry_round_trips():
    assert registries.tools.get("calculator") is CalculatorTool
    assert registries.tools.get("python") is PythonTool
    assert registries.tools.get("gsm8k") is Gsm8kTool
    assert {"calculator", "python", "gsm8k"} <= set(registries.tools.names())


def test_base_tool_lifecycle():
    tool = EchoTool({"greeting": "hi"})
    assert tool.name == "echo" and tool.config == {"greeting": "hi"}
    assert tool.get_openai_tool_schema().to_dict() == ECHO_SCHEMA

    async def main():
        iid, response = await tool.create()
        assert len(iid) == 36 and response == ToolResponse()
        named, _ = await tool.create("traj-1", ground_truth=3)
        assert named == "traj-1" and tool.state("traj-1") == {"ground_truth": 3}
        with pytest.raises(ValueError, match=r"instance 'traj-1' already exists"):
            await tool.create("traj-1")
        result = await tool.execute(iid, {"text": "abc"})
        assert result == (ToolResponse(text="abc"), 0.5, {"echo/len": 3})
        assert await tool.calc_reward(iid) == 0.0
        await tool.release(iid)
        await tool.release(iid)  # idempotent
        with pytest.raises(KeyError, match=r"echo: unknown instance"):
            await tool.calc_reward(iid)

    asyncio.run(main())


def test_a_tool_without_schema_is_refused():
    class NoSchema(BaseTool):
        pass

    with pytest.raises(SchemaError, match=r"NoSchema has no default_schema; pass tool_schema explicitly"):
        NoSchema({})


def run_calls(tool, texts, timeout=0.2):
    async def main():
        iid, _ = await tool.create()
        return [await call_tool(tool, iid, {"text": t}, timeout=timeout) for t in texts]

    return asyncio.run(main())


def test_call_tool_success_merges_metrics():
    (ok, as_dict) = run_calls(EchoTool({}), ["hello", "dict"])
    response, reward, metrics = ok
    assert response.text == "hello" and reward == 0.5
    assert metrics["echo/len"] == 5
    assert (metrics["tool/errors"], metrics["tool/timeouts"], metrics["tool/bad_output"]) == (0, 0, 0)
    assert metrics["tool/latency_s"] >= 0
    assert (
        as_dict[0] == ToolResponse(text="from dict") and as_dict[1] == 1.0 and isinstance(as_dict[1], float)
    )


def test_call_tool_never_raises_for_faults():
    raised, hung, stubborn, garbage, nan, badresp = run_calls(
        EchoTool({}), ["raise", "hang", "stubborn", "garbage", "nan", "badresp"], timeout=0.05
    )
    assert raised[0].text == "Error: echo failed: RuntimeError: boom"
    assert (raised[1], raised[2]["tool/errors"], raised[2]["tool/timeouts"]) == (0.0, 1, 0)
    for result in (hung, stubborn):
        assert result[0].text == "Error: echo timed out after 0.05 s"
        assert (result[2]["tool/timeouts"], result[2]["tool/errors"]) == (1, 0)
    assert garbage[0].text == (
        "Error: echo returned an invalid result (expected a (response, reward, metrics) tuple, got str)"
    )
    assert garbage[2]["tool/bad_output"] == 1
    assert "step reward must be a finite number, got nan" in nan[0].text and nan[2]["tool/bad_output"] == 1
    assert "ToolResponse.text must be a string or None" in badresp[0].text


def test_call_tool_bad_parameters_and_unknown_instance():
    tool = EchoTool({})

    async def main():
        not_a_dict = await call_tool(tool, "x", ["text"], timeout=1)
        unknown = await call_tool(tool, "never-created", {"text": "a"}, timeout=1)
        return not_a_dict, unknown

    not_a_dict, unknown = asyncio.run(main())
    assert not_a_dict[0].text == "Error: echo expects a JSON object of arguments, got ['text']"
    assert "unknown instance 'never-created'" in unknown[0].text and unknown[2]["tool/errors"] == 1


def test_call_tool_applies_each_tools_own_concurrency_limit():
    class Slow(EchoTool):
        running = 0
        peak = 0

        async def execute(self, instance_id, parameters, **kwargs):
            type(self).running += 1
            type(self).peak = max(type(self).peak, type(self).running)
            await asyncio.sleep(0.01)
            type(self).running -= 1
            return ToolResponse(text="ok"), 0.0, {}

    limited = Slow({"rate_limit": {"max_concurrent": 2}})
    other = Slow({"rate_limit": {"max_concurrent": 2}})
    assert limited.limits is not other.limits

    async def main():
        await asyncio.gather(*(call_tool(limited, "i", {"text": "a"}, timeout=5) for _ in range(8)))

    asyncio.run(main())
    assert Slow.peak == 2


def test_load_tools_by_name_and_reference():
    tools = load_tools(
        [
            {"name": "calculator", "config": {"rate_limit": {"rate": 10, "max_concurrent": 4}}},
            {"name": f"{__name__}:EchoTool"},
            {
                "name": f"{__name__}:EchoTool",
                "config": {"x": 1},
                "schema": {**ECHO_SCHEMA, "function": {**ECHO_SCHEMA["function"], "name": "echo2"}},
            },
        ]
    )
    assert list(tools) == ["calculator", "echo", "echo2"]
    assert isinstance(tools["calculator"], CalculatorTool)
    assert tools["calculator"].limits.bucket.rate == 10.0
    assert tools["calculator"].limits.concurrency.max_concurrent == 4
    assert type(tools["echo2"]) is sys.modules[__name__].EchoTool and tools["echo2"].config == {"x": 1}
    assert load_tools(None) == {} and load_tools([]) == {}


def test_load_tools_from_omegaconf():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"tools": [{"name": "gsm8k", "config": {"repeat_penalty": -0.1}}]})
    tools = load_tools(cfg.tools)
    assert type(tools["calc_gsm8k_reward"].config) is dict
    assert tools["calc_gsm8k_reward"].config == {"repeat_penalty": -0.1}


@pytest.mark.parametrize(
    ("config_list", "error", "message"),
    [
        ([["calculator"]], ToolConfigError, r"tools\[0\] must be a mapping"),
        (
            [{"config": {}}],
            ToolConfigError,
            r"tools\[0\]\.name must be a registry name or module:Class, got None",
        ),
        ([{"name": "calculator", "cfg": {}}], ToolConfigError, r"tools\[0\] has unknown key\(s\) \['cfg'\]"),
        (
            [{"name": "calculator"}, {"name": "calculator"}],
            ToolConfigError,
            r"tools\[1\]: a tool named 'calculator' is already configured",
        ),
        ([{"name": "calculater"}], UnknownComponentError, r"calculator"),
        ([{"name": "calculator", "schema": {"type": "function"}}], SchemaError, r"no 'function' field"),
        (
            [{"name": "calculator", "config": {"rate_limit": {"rate": -1}}}],
            ValueError,
            r"rate must be a positive",
        ),
    ],
)
def test_load_tools_errors(config_list, error, message):
    with pytest.raises(error, match=message):
        load_tools(config_list)
