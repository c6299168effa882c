"""Agent loops and their manager: routing, the DataProto they return, tool turns and their failures.

The model here is a scripted replica (it answers by rule, so every path is reached on purpose);
tests/test_rollout_agent_e2e.py runs the same loops on a real tiny model.
"""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

import numpy as np
import pytest
import torch

from trellis.config.schema import RolloutConfig, ValidationSamplingConfig
from trellis.data.protocol import DataProto
from trellis.errors import UnknownComponentError
from trellis.recipes.tiny import build_tiny_tokenizer
from trellis.registries import agent_loops
from trellis.rollout import RolloutReplica, SamplingParams, TokenOutput
from trellis.rollout.agent_loop import (
    AgentLoop,
    AgentLoopManager,
    AgentLoopOutput,
    ReplicaRouter,
    load_tool_config,
    sampling_params_for,
)
from trellis.rollout.chat import ChatTemplate
from trellis.rollout.single_turn import SingleTurnAgentLoop
from trellis.rollout.tool_agent import ToolAgentLoop
from trellis.tools.base import BaseTool, ToolConfigError, load_tools
from trellis.tools.schema import ToolResponse

USER = [{"role": "user", "content": "What is 2 + 2?"}]


def call(name="calculator", **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


class ScriptedReplica(RolloutReplica):
    """Answers with ``script[k]`` where k = tool responses already in the prompt; records requests."""

    def __init__(self, tokenizer, script, rank=0, delay=0.0):
        super().__init__(rank, None, None)
        self.tokenizer, self.script, self.delay = tokenizer, script, delay
        self.requests: list[tuple[str, list[int], SamplingParams]] = []

    async def init(self, mode="hybrid", **kwargs):
        self.mode = mode

    async def generate(self, prompt_ids, sampling_params, request_id):
        self.requests.append((request_id, list(prompt_ids), sampling_params))
        await asyncio.sleep(self.delay)
        turn = self.tokenizer.decode(prompt_ids).count("<tool_response>")
        text = self.script[min(turn, len(self.script) - 1)]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        reason = "stop"
        if len(ids) > sampling_params.max_tokens:
            ids, reason = ids[: sampling_params.max_tokens], "length"
        lps = [-0.25 - 0.01 * i for i in range(len(ids))] if sampling_params.wants_logprobs else None
        return TokenOutput(ids, lps, reason)

    async def sleep(self):
        pass

    async def wake_up(self):
        pass

    async def update_weights(self, named_tensors):
        pass


def config(**agent):
    cfg = RolloutConfig(temperature=1.0, max_tokens=200, calculate_log_probs=True)
    for key, value in agent.items():
        setattr(cfg.agent, key, value)
    return cfg


def batch(n, agent_name=None, **columns):
    data = {"raw_prompt": [USER] * n, **columns}
    if agent_name is not None:
        data["agent_name"] = [agent_name] * n
    return DataProto.from_dict(non_tensors=data)


def generate(cfg, replicas, tok, data, tools=None):
    manager = AgentLoopManager(cfg, replicas, tok, tools=tools if tools is not None else {})
    return manager.generate_sequences(data), manager


def test_builtin_loops_are_registered():
    assert agent_loops.get("single_turn") is SingleTurnAgentLoop
    assert agent_loops.get("tool_agent") is ToolAgentLoop


def test_single_turn_output_layout(tok):
    replica = ScriptedReplica(tok, ["four", "a longer answer here"])
    data = batch(3, index=[0, 1, 2])
    out, _ = generate(config(), [replica], tok, data)
    expected = tok("four", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prompt = ChatTemplate(tok).prompt_ids(USER)
    b = out.batch
    assert b["prompts"].shape == (3, len(prompt)) and b["responses"].shape == (3, len(expected))
    assert b["input_ids"].shape == (3, len(prompt) + len(expected))
    assert b["prompts"][0].tolist() == prompt and b["responses"][0].tolist() == expected
    assert b["response_mask"].eq(1).all() and b["attention_mask"].eq(1).all()
    assert b["position_ids"][0].tolist() == list(range(len(prompt) + len(expected)))
    assert torch.allclose(
        b["rollout_log_probs"][0], torch.tensor([-0.25 - 0.01 * i for i in range(len(expected))])
    )
    assert out.non_tensor_batch["__num_turns__"].tolist() == [2, 2, 2]
    assert out.non_tensor_batch["index"].tolist() == [0, 1, 2]  # input columns carried through
    assert "rm_scores" not in b
    assert out.meta_info["metrics"]["agent/num_turns/mean"] == 2.0


def test_prompt_ids_column_is_used_when_there_are_no_messages(tok):
    replica = ScriptedReplica(tok, ["x"])
    data = DataProto.from_dict(non_tensors={"raw_prompt_ids": [[5, 6, 7], [8, 9]]})
    out, _ = generate(config(), [replica], tok, data)
    assert [r[1] for r in replica.requests] == [[5, 6, 7], [8, 9]]
    assert out.batch["prompts"].tolist()[1] == [tok.pad_token_id, 8, 9]  # left-padded
    assert out.batch["attention_mask"][1, 0] == 0


def test_tool_agent_masks_tool_turns_and_counts_turns(tok):
    replica = ScriptedReplica(tok, [call(expression="2 + 2"), call(expression="4 * 10"), "The answer is 40"])
    tools = load_tools([{"name": "calculator"}])
    out, _ = generate(config(), [replica], tok, batch(2, "tool_agent"), tools)
    chat = ChatTemplate(tok)
    row = out.batch["responses"][0]
    mask = out.batch["response_mask"][0]
    valid = int(out.batch["attention_mask"][0, out.batch["prompts"].shape[1] :].sum())
    text = tok.decode(row[:valid])
    assert "<tool_response>\n4\n</tool_response>" in text and "<tool_response>\n40\n</tool_response>" in text
    assert text.endswith("The answer is 40<|im_end|>")
    # exactly the two tool turns are masked out, and they are the template's continuation tokens
    first = tok(call(expression="2 + 2"), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    turn = chat.continuation_ids([{"role": "tool", "content": "4"}])
    assert mask[: len(first)].eq(1).all()
    assert row[len(first) : len(first) + len(turn)].tolist() == turn
    assert mask[len(first) : len(first) + len(turn)].eq(0).all()
    assert int(mask.sum()) == valid - len(turn) - len(
        chat.continuation_ids([{"role": "tool", "content": "40"}])
    )
    lp = out.batch["rollout_log_probs"][0]
    assert lp[mask == 0].eq(0).all() and lp[:valid][mask[:valid] == 1].lt(0).all()
    assert out.non_tensor_batch["__num_turns__"].tolist() == [6, 6]  # user, 3 model turns, 2 tool turns
    metrics = out.meta_info["metrics"]
    assert metrics["tool/calls"] == 2.0 and metrics["tool/errors"] == 0.0
    assert metrics["agent/model_turns"] == 3.0
    # the prompt listed the calculator's schema
    assert '"name": "calculator"' in tok.decode(out.batch["prompts"][0])


def test_every_turn_of_a_sample_goes_to_its_replica_and_load_is_balanced(tok):
    replicas = [ScriptedReplica(tok, [call(expression="1+1"), "done"], rank=r, delay=0.01) for r in range(2)]
    tools = load_tools([{"name": "calculator"}])
    generate(config(), replicas, tok, batch(6, "tool_agent"), tools)
    for replica in replicas:
        samples = {rid.rsplit("-", 1)[0] for rid, _, _ in replica.requests}
        assert len(samples) == 3  # 6 samples over 2 replicas, 3 each
        for sample in samples:  # both turns of each sample landed here
            assert sorted(rid for rid, _, _ in replica.requests if rid.startswith(sample)) == [
                f"{sample}-0",
                f"{sample}-1",
            ]


def test_router_least_loaded_and_release():
    router = ReplicaRouter(["a", "b", "c"])
    assert [router.replica_for(r) for r in ("s1", "s2", "s3", "s1")] == ["a", "b", "c", "a"]
    router.release("s2")
    assert router.replica_for("s4") == "b"  # b has no running sample now
    assert router.index_of("s4") == 1 and router.index_of("gone") is None
    router.release("s1")
    router.release("s1")  # releasing twice is harmless
    assert router.active == [0, 1, 1]
    with pytest.raises(ValueError, match="at least one rollout replica"):
        ReplicaRouter([])


class Flaky(BaseTool):
    """Behaves by its ``mode`` argument: raise, hang, garbage, long, or echo."""

    default_schema: ClassVar[dict] = {
        "type": "function",
        "function": {
            "name": "flaky",
            "description": "test tool",
            "parameters": {"type": "object", "properties": {"mode": {"type": "string"}}},
        },
    }
    released: ClassVar[list[str]] = []

    async def execute(self, instance_id, parameters, **kwargs):
        mode = parameters.get("mode")
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "garbage":
            return "not a tuple"
        if mode == "long":
            return ToolResponse(text="x" * 50 + "y" * 50), 0.5, {"flaky/long": 1}
        if mode == "image":
            return ToolResponse(text="a chart", image=["img-1", "img-2"]), 0.0, {}
        return ToolResponse(text=f"echo {self.state(instance_id)['secret']}"), 1.0, {}

    async def release(self, instance_id, **kwargs):
        Flaky.released.append(instance_id)
        await super().release(instance_id)


@pytest.mark.parametrize(
    ("script", "reply", "metric"),
    [
        ([call("flaky", mode="raise"), "ok"], "Error: flaky failed: RuntimeError: boom", "tool/errors"),
        ([call("flaky", mode="hang"), "ok"], "Error: flaky timed out after 0.2 s", "tool/timeouts"),
        ([call("flaky", mode="garbage"), "ok"], "Error: flaky returned an invalid result", "tool/bad_output"),
        (
            [call("nope"), "ok"],
            "Error: there is no tool named 'nope'; available tools: flaky.",
            "tool/unknown",
        ),
        (
            ["<tool_call>{oops}</tool_call>", "ok"],
            "Error: the tool call is not valid JSON",
            "tool/parse_errors",
        ),
    ],
)
def test_tool_failures_reach_the_model_as_errors_and_metrics(tok, script, reply, metric):
    replica = ScriptedReplica(tok, script)
    tools = {"flaky": Flaky()}
    cfg = config(tool_timeout_s=0.2)
    data = batch(1, "tool_agent", extra_info=[{"tools_kwargs": {"flaky": {"create_kwargs": {"secret": 7}}}}])
    out, _ = generate(cfg, [replica], tok, data, tools)
    text = tok.decode(out.batch["responses"][0])
    assert reply in text and text.endswith("ok<|im_end|>")
    assert out.meta_info["metrics"][metric] == 1.0


def test_tool_state_truncation_and_release(tok):
    Flaky.released.clear()
    replica = ScriptedReplica(tok, [call("flaky", mode="echo") + call("flaky", mode="long"), "ok"])
    cfg = config(max_parallel_calls=2, max_tool_response_length=10, tool_response_truncate_side="middle")
    data = batch(1, "tool_agent", extra_info=[{"tools_kwargs": {"flaky": {"create_kwargs": {"secret": 7}}}}])
    out, _ = generate(cfg, [replica], tok, data, {"flaky": Flaky()})
    text = tok.decode(out.batch["responses"][0])
    assert "<tool_response>\necho 7\n</tool_response>" in text  # create_kwargs reached the instance
    assert "<tool_response>\nxxxxx...(truncated)...yyyyy\n</tool_response>" in text
    metrics = out.meta_info["metrics"]
    assert (
        metrics["tool/step_reward"] == 1.5 and metrics["flaky/long"] == 1.0 and metrics["tool/calls"] == 2.0
    )
    assert len(Flaky.released) == 1  # one instance per tool per sample, released at the end


def test_calls_beyond_max_parallel_calls_are_ignored(tok):
    replica = ScriptedReplica(tok, [call(expression="1") + call(expression="2") + call(expression="3"), "ok"])
    out, _ = generate(
        config(max_parallel_calls=2),
        [replica],
        tok,
        batch(1, "tool_agent"),
        load_tools([{"name": "calculator"}]),
    )
    text = tok.decode(out.batch["responses"][0])
    assert text.count("<tool_response>") == 2
    assert out.meta_info["metrics"]["tool/ignored_calls"] == 1.0


def test_max_turns_and_length_budget_end_the_loop(tok):
    tools = load_tools([{"name": "calculator"}])
    forever = ScriptedReplica(tok, [call(expression="1 + 1")])  # always calls a tool
    out, _ = generate(config(max_turns=3), [forever], tok, batch(1, "tool_agent"), tools)
    assert out.non_tensor_batch["__num_turns__"].tolist() == [6]  # user + 3 model + 2 tool turns
    assert out.meta_info["metrics"]["agent/max_turns_reached"] == 1.0
    cfg = config()
    cfg.max_tokens = 60
    out, _ = generate(
        cfg, [ScriptedReplica(tok, [call(expression="1 + 1")])], tok, batch(1, "tool_agent"), tools
    )
    assert out.batch["attention_mask"][0, out.batch["prompts"].shape[1] :].sum() <= 60
    assert out.batch["response_mask"][0].sum() > 0
    assert out.meta_info["metrics"]["agent/truncated"] == 1.0
    # the response ends with a model token, never a dropped tool turn
    mask = out.batch["response_mask"][0]
    valid = int(out.batch["attention_mask"][0, out.batch["prompts"].shape[1] :].sum())
    assert mask[valid - 1] == 1


def test_agent_name_column_beats_the_default_and_unknown_names_fail_first(tok):
    replica = ScriptedReplica(tok, [call(expression="1 + 1"), "ok"])
    data = DataProto.from_dict(non_tensors={"raw_prompt": [USER, USER], "agent_name": ["tool_agent", None]})
    out, _ = generate(config(), [replica], tok, data, load_tools([{"name": "calculator"}]))
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4, 2]  # None falls back to single_turn
    replica.requests.clear()
    with pytest.raises(UnknownComponentError, match="tool_agnet"):
        generate(config(), [replica], tok, batch(2, "tool_agnet"))
    assert replica.requests == []  # nothing generated before the bad name was found


def test_seeds_per_sample_are_stable_and_distinct(tok):
    cfg = config()
    cfg.seed = 3
    replica = ScriptedReplica(tok, [call(expression="1 + 1"), "ok"])
    generate(
        cfg, [replica], tok, batch(2, "tool_agent", index=[10, 11]), load_tools([{"name": "calculator"}])
    )
    first = [p.seed for _, _, p in replica.requests]
    assert len(set(first)) == 4  # two samples x two turns, each its own seed
    replica.requests.clear()
    generate(
        cfg, [replica], tok, batch(2, "tool_agent", index=[10, 11]), load_tools([{"name": "calculator"}])
    )
    assert sorted(p.seed for _, _, p in replica.requests) == sorted(first)


def test_sampling_params_from_config():
    cfg = RolloutConfig(temperature=0.7, top_p=0.9, top_k=20, calculate_log_probs=True)
    train = sampling_params_for(cfg, 64)
    assert (train.temperature, train.top_p, train.top_k, train.max_tokens, train.logprobs) == (
        0.7,
        0.9,
        20,
        64,
        True,
    )
    val = sampling_params_for(cfg, 64, validate=True)
    assert val.temperature == 0.0 and val.top_k == -1  # val_kwargs: greedy
    cfg.max_tokens = 32
    cfg.do_sample = False
    assert sampling_params_for(cfg, 64).max_tokens == 32 and sampling_params_for(cfg, 64).temperature == 0.0


def test_loop_rewards_land_on_the_last_model_token(tok):
    class Rewarded(AgentLoop):
        async def run(self, sampling_params, **sample):
            return AgentLoopOutput(
                [1, 2], [5, 6, 7, 8], [1, 1, 0, 0], None, 3, {}, reward=float(sample["index"])
            )

    agent_loops.register("rewarded_test", Rewarded)
    try:
        out, _ = generate(
            config(), [ScriptedReplica(tok, ["x"])], tok, batch(2, "rewarded_test", index=[2, 5])
        )
    finally:
        agent_loops.unregister("rewarded_test")
    assert out.batch["rm_scores"].tolist() == [[0.0, 2.0, 0.0, 0.0], [0.0, 5.0, 0.0, 0.0]]
    assert "rollout_log_probs" not in out.batch


def test_output_validation_names_the_problem():
    with pytest.raises(ValueError, match="response_mask has 1 entries for 2 response tokens"):
        AgentLoopOutput([1], [2, 3], [1])
    with pytest.raises(ValueError, match="only 0"):
        AgentLoopOutput([1], [2], [2])
    with pytest.raises(ValueError, match="response_logprobs has 1 entries"):
        AgentLoopOutput([1], [2, 3], [1, 1], [0.0])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        AgentLoopOutput([], [2], [1])


def test_loop_returning_the_wrong_type_is_reported(tok):
    class Wrong(AgentLoop):
        async def run(self, sampling_params, **sample):
            return {"response_ids": []}

    agent_loops.register("wrong_test", Wrong)
    try:
        with pytest.raises(
            TypeError, match="'wrong_test' returned dict; run\\(\\) must return an AgentLoopOutput"
        ):
            generate(config(), [ScriptedReplica(tok, ["x"])], tok, batch(1, "wrong_test"))
    finally:
        agent_loops.unregister("wrong_test")


def test_tool_agent_needs_chat_messages(tok):
    data = DataProto.from_dict(non_tensors={"raw_prompt_ids": [[5, 6]], "agent_name": ["tool_agent"]})
    with pytest.raises(ValueError, match=r"data\.return_raw_chat: true"):
        generate(config(), [ScriptedReplica(tok, ["x"])], tok, data, load_tools([{"name": "calculator"}]))


def test_tools_load_from_the_configured_yaml(tok, tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - name: calculator\n  - name: gsm8k\n")
    assert sorted(load_tool_config(str(path))) == ["calc_gsm8k_reward", "calculator"]
    manager = AgentLoopManager(config(tool_config_path=str(path)), [ScriptedReplica(tok, ["x"])], tok)
    assert sorted(manager.tools) == ["calc_gsm8k_reward", "calculator"]
    with pytest.raises(ToolConfigError, match="does not exist"):
        load_tool_config(str(tmp_path / "missing.yaml"))
    path.write_text("tools: calculator\n")
    with pytest.raises(ToolConfigError, match="expected a 'tools:' list"):
        load_tool_config(str(path))


def test_gsm8k_tool_gets_its_ground_truth_from_tools_kwargs(tok):
    replica = ScriptedReplica(tok, [call("calc_gsm8k_reward", answer="72"), "#### 72"])
    extra = [{"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}]
    out, _ = generate(
        config(), [replica], tok, batch(1, "tool_agent", extra_info=extra), load_tools([{"name": "gsm8k"}])
    )
    assert "Parsed answer: 72. Correct." in tok.decode(out.batch["responses"][0])
    assert out.meta_info["metrics"]["tool/step_reward"] == 1.0


def test_empty_batch_is_rejected(tok):
    manager = AgentLoopManager(config(), [ScriptedReplica(tok, ["x"])], tok, tools={})
    with pytest.raises(ValueError, match="empty batch"):
        manager.generate_sequences(DataProto.from_dict(non_tensors={"raw_prompt": np.empty(0, dtype=object)}))


def test_validation_sampling_follows_val_kwargs():
    cfg = RolloutConfig(temperature=0.7, top_p=0.9, top_k=20)
    cfg.val_kwargs = ValidationSamplingConfig(temperature=0.6, top_p=0.8, top_k=5, do_sample=True)
    val = sampling_params_for(cfg, 64, validate=True)
    assert (val.temperature, val.top_p, val.top_k) == (0.6, 0.8, 5)
    cfg.val_kwargs.do_sample = False
    assert sampling_params_for(cfg, 64, validate=True).temperature == 0.0  # greedy
    assert sampling_params_for(cfg, 64).temperature == 0.7  # training sampling is its own


def test_default_agent_loop_runs_samples_that_name_none(tok):
    replica = ScriptedReplica(tok, [call(expression="1 + 1"), "ok"])
    out, _ = generate(
        config(default_agent_loop="tool_agent"),
        [replica],
        tok,
        batch(2),
        load_tools([{"name": "calculator"}]),
    )
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4, 4]  # user, model, tool, model


def test_tool_parser_is_the_configured_one(tok):
    replica = ScriptedReplica(tok, [call(expression="1 + 1"), "ok"])
    with pytest.raises(UnknownComponentError, match=r"'hermez'.*hermes"):
        generate(
            config(tool_parser="hermez"),
            [replica],
            tok,
            batch(1, "tool_agent"),
            load_tools([{"name": "calculator"}]),
        )


@pytest.mark.parametrize(
    ("side", "shown"),
    [("left", "...(truncated)...yyyyyyyyyy"), ("right", "xxxxxxxxxx...(truncated)...")],
)
def test_tool_responses_are_truncated_on_the_configured_side(tok, side, shown):
    replica = ScriptedReplica(tok, [call("flaky", mode="long"), "ok"])
    cfg = config(max_tool_response_length=10, tool_response_truncate_side=side)
    data = batch(1, "tool_agent", extra_info=[{"tools_kwargs": {"flaky": {"create_kwargs": {"secret": 7}}}}])
    out, _ = generate(cfg, [replica], tok, data, {"flaky": Flaky()})
    assert f"<tool_response>\n{shown}\n</tool_response>" in tok.decode(out.batch["responses"][0])


class Rewarding(Flaky):
    """Flaky whose trajectory reward is its ``final`` create argument (``"raise"`` makes it fail)."""

    async def calc_reward(self, instance_id, **kwargs):
        final = self.state(instance_id).get("final", 0.0)
        if final == "raise":
            raise RuntimeError("no reward today")
        return final


@pytest.mark.parametrize(("final", "expected", "errors"), [(2.0, 3.5, 0.0), ("raise", 1.5, 1.0)])
def test_tool_step_rewards_and_calc_reward_add_up_to_the_tool_reward(tok, final, expected, errors):
    # two calls: echo (step reward 1.0) and long (0.5); then calc_reward once per instance at the end
    replica = ScriptedReplica(tok, [call("flaky", mode="echo") + call("flaky", mode="long"), "ok"])
    extra = [{"tools_kwargs": {"flaky": {"create_kwargs": {"secret": 7, "final": final}}}}]
    plain = [{"tools_kwargs": {}}]
    data = batch(2, "tool_agent", extra_info=extra + plain)
    data.non_tensor_batch["raw_prompt"][1] = [{"role": "user", "content": "no tools"}]
    out, _ = generate(config(max_parallel_calls=2), [replica], tok, data, {"flaky": Rewarding()})
    assert out.batch["tool_rewards"].dtype == torch.float32
    assert out.batch["tool_rewards"][0].item() == expected  # 1.0 + 0.5 + calc_reward
    metrics = out.meta_info["metrics"]
    assert metrics.get("tool/reward_errors", 0.0) == errors / 2  # a mean over the 2 samples


def test_single_turn_loops_report_zero_tool_reward(tok):
    out, _ = generate(config(), [ScriptedReplica(tok, ["hi"])], tok, batch(3))
    assert out.batch["tool_rewards"].tolist() == [0.0, 0.0, 0.0]


def test_greedy_meta_info_decodes_greedily_whatever_the_config_says(tok):
    replica = ScriptedReplica(tok, ["hi"])
    data = batch(2)
    data.meta_info["greedy"] = True
    generate(RolloutConfig(temperature=0.9, top_p=0.8, top_k=5, max_tokens=8), [replica], tok, data)
    assert {(r[2].temperature, r[2].top_p, r[2].top_k) for r in replica.requests} == {(0.0, 1.0, -1)}


def test_images_a_text_only_loop_cannot_show_are_counted(tok):
    replica = ScriptedReplica(tok, [call("flaky", mode="image"), "ok"])
    out, _ = generate(config(), [replica], tok, batch(1, "tool_agent"), {"flaky": Flaky()})
    assert "<tool_response>\na chart\n</tool_response>" in tok.decode(out.batch["responses"][0])
    assert out.meta_info["metrics"]["tool/images_dropped"] == 2.0


def test_rollouts_of_several_workers_are_repadded_to_one_batch(tok):
    from trellis.errors import DataProtoError
    from trellis.rollout.agent_loop import concat_rollouts

    questions = ["Hi", "What is 2 + 2? Think it through.", "Add 3 and 4.", "x"]
    data = DataProto.from_dict(
        non_tensors={"raw_prompt": [[{"role": "user", "content": q}] for q in questions]}
    )

    class ByPrompt(ScriptedReplica):
        """Answers long for long prompts, so the two halves differ in prompt and response width."""

        async def generate(self, prompt_ids, sampling_params, request_id):
            text = "a much longer answer to a longer question" if len(prompt_ids) > 14 else "ok"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            return TokenOutput(ids, [-0.5] * len(ids), "stop")

    whole, _ = generate(config(), [ByPrompt(tok, ["ok"])], tok, data)
    halves = [generate(config(), [ByPrompt(tok, ["ok"])], tok, data[rows])[0] for rows in ([0, 3], [1, 2])]
    assert halves[0].batch["prompts"].shape[1] < halves[1].batch["prompts"].shape[1]
    assert halves[0].batch["responses"].shape[1] < halves[1].batch["responses"].shape[1]
    with pytest.raises(DataProtoError, match="prompts"):  # what gathering shards used to do
        DataProto.concat(halves)
    merged = concat_rollouts(halves)
    order = [0, 3, 1, 2]
    for key in whole.batch.keys():  # noqa: SIM118 - iterating a TensorDict walks its rows
        assert torch.equal(merged.batch[key], whole.batch[key][order]), key
    assert merged.meta_info["pad_token_id"] == tok.pad_token_id
    assert concat_rollouts(halves[:1]) is halves[0]
