"""The OpenAI-compatible gateway on a real hf replica of the tiny calculator model, driven by the real
``openai`` SDK and ``httpx`` over loopback: endpoints, sampling parameters, tool calling, streaming,
OpenAI-shaped errors, and the token-exact capture of sessions."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from _calculator import ANSWER, CALL, QUESTION, TOOLS

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.rollout.base import RolloutReplica
from trellis.rollout.chat import ChatTemplate, tool_schemas
from trellis.rollout.hf import HFRolloutReplica
from trellis.rollout.sampling import SamplingParams, TokenOutput
from trellis.tools.base import load_tools

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
gateway_module = pytest.importorskip("trellis.rollout.gateway")
Gateway, start_gateway = gateway_module.Gateway, gateway_module.start_gateway

OPENAI_TOOLS = tool_schemas(load_tools(TOOLS).values())  # as the model saw them in training


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def served(calculator_model):
    """``(running gateway, tokenizer, model, replica)``: one hf replica serving the calculator model."""
    tok, model, _ = calculator_model
    replica = HFRolloutReplica(0, RolloutConfig(calculate_log_probs=True), ModelConfig())
    gateway = Gateway(tok, replicas=[replica], model_name="tiny", auto_sessions=True, max_inflight=8)
    running = start_gateway(gateway)
    running.call(replica.init("hybrid", model=model, tokenizer=tok))
    yield running, tok, model, replica
    running.call(replica.shutdown())
    running.stop()
    assert not running.thread.is_alive()


def client(running, session=None):
    url = running.session_url(session) if session else running.base_url
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def teacher_forced(model, tokens, start):
    """Log-probs of ``tokens[start:]`` under a plain forward pass (FP32)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : -1], -1)
    return logp.gather(-1, torch.tensor(tokens[start:])[:, None])[:, 0]


def test_health_and_models(served):
    running = served[0]
    assert httpx.get(running.url + "/health").json() == {"status": "ok"}
    models = client(running).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    # reads open no session on a serving gateway: models are listed, an unknown capture is a 404
    assert [m.id for m in client(running, "reader").models.list().data] == ["tiny"]
    unknown = httpx.get(running.url + "/sessions/reader/trajectories")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "session_not_found"
    assert "opens a session at its first completion call" in unknown.json()["error"]["message"]
    assert "reader" not in running.gateway.sessions


def test_a_tool_using_agent_is_captured_token_exactly(served):
    running, tok, model, _ = served
    chat = ChatTemplate(tok)
    c = client(running, "agent-1")
    messages = list(QUESTION)
    first = c.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator" and call.function.arguments == '{"expression": "2 + 2"}'
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "4"},
    ]
    second = c.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS, temperature=0)
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens

    session = running.gateway.close_session("agent-1")
    (traj,) = session.samples()  # one trajectory: the second call extended the first
    prompt = chat.prompt_ids(QUESTION, OPENAI_TOOLS)
    turn1 = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    between = chat.continuation_ids([{"role": "tool", "content": "4"}])
    turn2 = tok(ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert traj.prompt_ids == prompt
    assert traj.response_ids == turn1 + between + turn2
    assert traj.response_mask == [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)
    assert traj.calls == 2 and session.metrics["gateway/rewritten_history"] == 0
    expected = teacher_forced(model, prompt + traj.response_ids, len(prompt))
    got = torch.tensor(traj.response_logprobs)
    mask = torch.tensor(traj.response_mask, dtype=torch.bool)
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-4, rtol=0)
    assert (got[~mask] == 0).all()
    out = traj.to_output(reward=1.0)
    assert out.prompt_ids == prompt and out.response_mask == traj.response_mask and out.num_turns == 4


def test_rewritten_history_becomes_a_separate_sample(served):
    running = served[0]
    c = client(running, "agent-2")
    first = c.chat.completions.create(model="tiny", messages=QUESTION, tools=OPENAI_TOOLS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    edited = {"role": "assistant", "content": "I will compute it."}  # not what the model said
    c.chat.completions.create(
        model="tiny",
        messages=[*QUESTION, edited, {"role": "user", "content": "So?"}],
        temperature=0,
        max_tokens=4,
    )
    session = running.gateway.close_session("agent-2")
    assert [t.calls for t in session.samples()] == [1, 1]
    assert session.metrics["gateway/rewritten_history"] == 1 and session.metrics["gateway/calls"] == 2
    assert call.function.name == "calculator"


def test_streaming_returns_what_the_plain_call_returns(served):
    running = served[0]
    c = client(running)
    plain = c.chat.completions.create(model="tiny", messages=QUESTION, tools=OPENAI_TOOLS, temperature=0)
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=QUESTION,
            tools=OPENAI_TOOLS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    calls = [tc for ch in chunks for choice in ch.choices for tc in choice.delta.tool_calls or []]
    assert [tc.function.name for tc in calls] == [plain.choices[0].message.tool_calls[0].function.name]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions_with_logprobs_seed_and_n(served):
    running, tok = served[0], served[1]
    c = client(running, "completions")
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
    ids = tok(prompt)["input_ids"]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 5
    assert out.choices[0].finish_reason == "length"
    assert len(out.choices[0].logprobs.token_logprobs) == 5
    sampled = c.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=1.0, seed=3, n=2)
    again = c.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=1.0, seed=3, n=2)
    assert [ch.text for ch in sampled.choices] == [ch.text for ch in again.choices]
    session = running.gateway.close_session("completions")
    assert len(session.samples()) == 5  # 1 + 2 + 2: none extended another
    assert all(len(t.response_ids) in (5, 6) for t in session.samples())
    # the two later calls started over; their second choices are siblings, not rewrites
    assert session.metrics["gateway/rewritten_history"] == 2 and session.metrics["gateway/calls"] == 5
    first = client(running, "n-first").completions.create(model="tiny", prompt=ids, max_tokens=3, n=3)
    assert len(first.choices) == 3
    fresh = running.gateway.close_session("n-first")
    assert len(fresh.samples()) == 3 and fresh.metrics["gateway/rewritten_history"] == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "gpt-4", "messages": QUESTION}, 404, "model"),
        ({"messages": QUESTION}, 400, "model"),
        ({"model": "tiny", "messages": QUESTION, "temperature": 3}, 400, "temperature"),
        ({"model": "tiny", "messages": QUESTION, "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": "tiny", "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "messages": QUESTION, "presence_penalty": 1}, 400, "presence_penalty"),
        ({"model": "tiny", "messages": QUESTION, "stop": [3]}, 400, "stop"),
        ({"model": "tiny", "messages": QUESTION, "n": 100}, 400, "n"),
        ({"model": "tiny", "messages": QUESTION, "tool_choice": "required"}, 400, "tool_choice"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0]",
        ),
    ],
)
def test_bad_requests_get_openai_shaped_errors(served, body, status, param):
    running = served[0]
    response = httpx.post(running.base_url + "/chat/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert httpx.get(running.url + "/health").status_code == 200  # the gateway lives on


def test_malformed_json_unknown_session_and_bad_prompt(served):
    running = served[0]
    bad = httpx.post(
        running.base_url + "/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
    prompt = httpx.post(running.base_url + "/completions", json={"model": "tiny", "prompt": [10**9]})
    assert prompt.status_code == 400 and "outside the vocabulary" in prompt.json()["error"]["message"]
    strict = Gateway(served[1], model_name="tiny")  # training gateways open their sessions themselves
    running2 = start_gateway(strict)
    try:
        missing = httpx.post(
            running2.session_url("nope") + "/chat/completions", json={"model": "tiny", "messages": QUESTION}
        )
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
        plain = httpx.post(
            running2.base_url + "/chat/completions", json={"model": "tiny", "messages": QUESTION}
        )
        assert plain.status_code == 404 and plain.json()["error"]["code"] == "session_required"
    finally:
        running2.stop()


def test_busy_gateway_answers_429_and_asleep_replica_503(served):
    running, _, _, replica = served
    gateway = running.gateway
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 2, "n": 9}  # max_inflight is 8
    busy = httpx.post(running.base_url + "/chat/completions", json=body)
    assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
    assert busy.headers["retry-after"] == "1" and gateway.inflight == 0
    running.call(replica.sleep())
    try:
        asleep = httpx.post(running.base_url + "/chat/completions", json={**body, "n": 1})
        assert asleep.status_code == 503 and asleep.json()["error"]["code"] == "weights_syncing"
    finally:
        running.call(replica.wake_up())
    ok = httpx.post(running.base_url + "/chat/completions", json={**body, "n": 1})
    assert ok.status_code == 200 and gateway.inflight == 0


def test_session_budget_and_defaults(served, calculator_model):
    """A training session: its own generate (here the replica on the gateway loop), the rollout's
    sampling defaults, and a response budget per trajectory."""
    running, replica = served[0], served[3]
    calls = []

    async def generate(prompt_ids, params):
        calls.append(params)
        return await replica.generate(prompt_ids, params, f"s-{len(calls)}")

    defaults = SamplingParams(temperature=0.0, max_tokens=64, logprobs=True)
    running.gateway.open_session("budget", generate=generate, defaults=defaults, max_response_tokens=10)
    c = client(running, "budget")
    first = c.chat.completions.create(model="tiny", messages=QUESTION, tools=OPENAI_TOOLS)
    assert calls[0].temperature == 0.0 and calls[0].max_tokens == 10  # the budget caps the default 64
    assert first.choices[0].finish_reason == "length"
    messages = [
        *QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "?"},
    ]
    second = c.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS)
    assert second.choices[0].finish_reason == "length" and second.usage.completion_tokens == 0
    session = running.gateway.close_session("budget")
    assert session.metrics["gateway/out_of_budget"] == 1 and len(calls) == 1
    (traj,) = session.samples()
    assert len(traj.response_ids) == 10


def test_a_session_generating_on_another_event_loop(served):
    """Sessions of an agent loop generate on the loop that runs the loop (another thread)."""
    running, tok, model, _ = served

    async def main():
        replica = HFRolloutReplica(1, RolloutConfig(calculate_log_probs=True), ModelConfig())
        await replica.init("hybrid", model=model, tokenizer=tok)

        async def generate(prompt_ids, params):
            return await replica.generate(prompt_ids, params, "other-loop")

        running.gateway.open_session("other", generate=generate, loop=asyncio.get_running_loop())
        async_client = openai.AsyncOpenAI(base_url=running.session_url("other"), api_key="-", max_retries=0)
        reply = await async_client.chat.completions.create(
            model="tiny", messages=QUESTION, tools=OPENAI_TOOLS, temperature=0
        )
        await replica.shutdown()
        return reply, replica.generate_calls

    reply, replica_calls = asyncio.run(main())
    assert reply.choices[0].message.tool_calls[0].function.name == "calculator" and replica_calls == 1
    assert len(running.gateway.close_session("other").samples()) == 1


def test_trellis_serve_answers_and_stops_on_sigterm(tiny_model_path):
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "trellis", "serve", "--model", tiny_model_path, "--port", "0"]
    proc = subprocess.Popen(
        [*command, "--served-model-name", "tiny", "--replica", "hf", "--session-idle-s", "1.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Serving"):
                break
        match = re.search(r"at (http://\S+/v1)", lines[-1])
        assert match, "".join(lines)
        c = openai.OpenAI(base_url=match.group(1), api_key="-", max_retries=0)
        reply = c.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens <= 3 and reply.choices[0].finish_reason in ("length", "stop")
        session = match.group(1).replace("/v1", "/sessions/eval-1/v1")
        openai.OpenAI(base_url=session, api_key="-", max_retries=0).completions.create(
            model="tiny", prompt="12", max_tokens=2
        )
        captured = httpx.get(session.replace("/v1", "/trajectories")).json()["trajectories"]
        assert len(captured) == 1 and set(captured[0]["response_mask"]) == {1}
        assert 1 <= len(captured[0]["response_ids"]) <= 2
        # --session-idle-s: a session unused for that long is closed when the next one opens
        time.sleep(2.0)
        other = match.group(1).replace("/v1", "/sessions/eval-2/v1")
        openai.OpenAI(base_url=other, api_key="-", max_retries=0).completions.create(
            model="tiny", prompt="12", max_tokens=1
        )
        assert len(httpx.get(other.replace("/v1", "/trajectories")).json()["trajectories"]) == 1
        # eval-1 and its capture are gone
        gone = httpx.get(session.replace("/v1", "/trajectories"))
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and "Stopped." in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Recording(RolloutReplica):
    """A replica that records each request's prompt and sampling parameters and answers ``reply``."""

    def __init__(self, rank, reply):
        super().__init__(rank, RolloutConfig(), ModelConfig())
        self.reply, self.requests = reply, []

    async def init(self, mode="standalone", **kwargs):
        return None

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
        self.requests.append((list(prompt_ids), sampling_params))
        ids = self.reply[: sampling_params.max_tokens]
        logprobs = [-0.25] * len(ids) if sampling_params.wants_logprobs else None
        return TokenOutput(token_ids=ids, log_probs=logprobs, stop_reason="length")

    async def sleep(self):
        return None

    async def wake_up(self):
        return None

    async def update_weights(self, named_tensors):
        return None


def test_sampling_parameters_stop_and_routing_reach_the_replicas(calculator_model):
    """Every sampling parameter of a valid request reaches the replica as given, stop strings cut the
    reply, tool_choice none leaves a tool call as text, and two replicas behind one gateway serve
    sessions least-loaded first, then sticky."""
    tok = calculator_model[0]
    reply = tok(CALL, add_special_tokens=False)["input_ids"]  # the model "says" a tool call
    replicas = [Recording(0, reply), Recording(1, reply)]
    running = start_gateway(Gateway(tok, replicas=replicas, model_name="tiny", auto_sessions=True))
    try:
        a, b = client(running, "a"), client(running, "b")
        chat = a.chat.completions.create(
            model="tiny",
            messages=QUESTION,
            max_completion_tokens=7,
            temperature=0.7,
            top_p=0.9,
            seed=11,
            stop=["never-said"],
            logprobs=True,
            extra_body={"top_k": 5, "stop_token_ids": [3, 4]},
        )
        ((_, params),) = replicas[0].requests
        assert params == SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            max_tokens=7,
            stop=("never-said",),
            stop_token_ids=(3, 4),
            seed=11,
            logprobs=True,
        )
        assert [t.logprob for t in chat.choices[0].logprobs.content] == [-0.25] * 7
        assert chat.usage.completion_tokens == 7
        # session b goes to the other (least-loaded) replica; a stays on its own
        b.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3)
        a.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert [len(r.requests) for r in replicas] == [2, 1]
        assert replicas[1].requests[0][1].max_tokens == 3
        # tools given, tool_choice none: the call stays text; a stop string cuts what is returned
        said = tok.decode(reply, skip_special_tokens=True)
        cut = said[len(said) // 2 :][:4]
        plain = a.chat.completions.create(
            model="tiny", messages=QUESTION, tools=OPENAI_TOOLS, tool_choice="none", max_tokens=64
        )
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"
        assert plain.choices[0].message.content == said
        stopped = a.completions.create(model="tiny", prompt="x", max_tokens=64, stop=[cut])
        assert stopped.choices[0].text == said[: said.index(cut)]
        chunks = list(a.completions.create(model="tiny", prompt="x", max_tokens=64, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == said
    finally:
        running.stop()


def test_idle_auto_sessions_expire_and_opened_ones_stay(calculator_model, monkeypatch):
    tok = calculator_model[0]
    replica = Recording(0, tok("4", add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match="session_idle_s must be > 0"):
        Gateway(tok, replicas=[replica], session_idle_s=0)
    gateway = Gateway(tok, replicas=[replica], model_name="tiny", auto_sessions=True, session_idle_s=10)
    now = [100.0]
    monkeypatch.setattr(gateway_module.time, "monotonic", lambda: now[0])

    def request(session_id):  # what a routed request does: find the session, then its replica
        session = gateway._session(session_id)
        gateway.router.replica_for(session_id)
        return session

    kept = gateway.open_session("training")  # opened by the caller: never expires
    first = request("a")
    now[0] += 6
    request("b")
    now[0] += 6  # a: 12 s idle; b: 6 s
    assert request("a") is first  # used again: its clock restarts, nothing expires (none opened)
    now[0] += 6  # a: 6 s; b: 12 s
    request("c")
    assert sorted(gateway.sessions) == ["a", "c", "training"] and gateway.sessions["training"] is kept
    assert gateway.metrics["gateway/sessions_expired"] == 1
    assert gateway.router.active == [2] and gateway.router.index_of("b") is None  # b's place released


@pytest.mark.parametrize(
    ("tool_choice", "opening"),
    [
        ("required", '<tool_call>{"name": "'),
        (
            {"type": "function", "function": {"name": "calculator"}},
            '<tool_call>{"name": "calculator", "arguments":',
        ),
    ],
)
def test_a_forced_tool_call_opens_the_reply_and_stays_out_of_the_loss(served, tool_choice, opening):
    running, tok, model, _ = served
    c = client(running, "forced")
    messages = list(QUESTION)
    first = c.chat.completions.create(
        model="tiny", messages=messages, tools=OPENAI_TOOLS, tool_choice=tool_choice, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {
        "expression": "2 + 2"
    }
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "4"},
    ]
    second = c.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS, temperature=0)
    assert second.choices[0].message.content == ANSWER
    (traj,) = running.gateway.close_session("forced").samples()  # the forced call's turn was extended
    prompt = ChatTemplate(tok).prompt_ids(QUESTION, OPENAI_TOOLS)
    forced = tok(opening, add_special_tokens=False)["input_ids"]
    assert traj.prompt_ids == prompt + forced  # the opening is prompt: the policy did not choose it
    generated = first.usage.completion_tokens
    assert first.usage.prompt_tokens == len(prompt + forced)
    assert traj.response_mask[:generated] == [1] * generated and traj.calls == 2
    assert tok.decode(forced + traj.response_ids[:generated], skip_special_tokens=True).startswith(opening)
    expected = teacher_forced(model, traj.prompt_ids + traj.response_ids, len(traj.prompt_ids))
    mask = torch.tensor(traj.response_mask, dtype=torch.bool)
    torch.testing.assert_close(torch.tensor(traj.response_logprobs)[mask], expected[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("tool_choice", "message"),
    [
        ({"type": "function", "function": {"name": "search"}}, "names 'search', which is not in tools"),
        ("always", "tool_choice must be 'auto', 'none', 'required'"),
        ({"type": "function"}, "tool_choice must be"),
    ],
)
def test_bad_tool_choices_name_the_param(served, tool_choice, message):
    running = served[0]
    body = {"model": "tiny", "messages": QUESTION, "tools": OPENAI_TOOLS, "tool_choice": tool_choice}
    response = httpx.post(running.base_url + "/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and message in error["message"]


def test_a_parser_that_cannot_open_a_call_refuses_forced_calls(calculator_model):
    from trellis.rollout.tool_parser import HermesToolParser, ToolParser

    class Plain(ToolParser):  # no call_prefix: the base's None
        def extract_tool_calls(self, text):
            return HermesToolParser().extract_tool_calls(text)

    gateway = Gateway(calculator_model[0], replicas=[Recording(0, [5])])
    gateway.parser = Plain()
    with pytest.raises(gateway_module.APIError, match="needs a tool-call parser that can open a call"):
        gateway._forced_call("required", OPENAI_TOOLS)
    assert gateway._forced_call("auto", OPENAI_TOOLS) is None
    with pytest.raises(gateway_module.APIError, match="needs tools to call"):
        Gateway(calculator_model[0], replicas=[Recording(0, [5])])._forced_call("required", None)
