"""trellis.reward.model and trellis.trainer.judge: model-based rewards (``reward.model``).

The judge client runs against a stub OpenAI-compatible server (FastAPI + uvicorn on 127.0.0.1) whose
answers the tests choose; the classifier is a tiny LlamaForSequenceClassification built here; the
colocated judge is the tiny causal LM behind the Trellis gateway. Nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import torch

import trellis
from trellis.config import ConfigValueError, load_config
from trellis.data.protocol import DataProto
from trellis.errors import UnknownComponentError
from trellis.recipes.presets import preset_overrides
from trellis.recipes.tiny import build_tiny_tokenizer
from trellis.registries import reward_functions
from trellis.reward.builtin import judge_score, parse_judge_score
from trellis.reward.model import (
    ClassifierRewardModel,
    JudgeClient,
    ModelRewardManager,
    ModelSample,
    read_samples,
)
from trellis.trainer.judge import needs_judge, start_judge
from trellis.trainer.workers import build_reward_manager

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


# ---------------------------------------------------------------- a stub judge server


class StubJudge:
    """An OpenAI-compatible judge whose reply to a request is ``reply(user message)``.

    A message containing ``HANG`` is answered after 3 s, ``FAIL`` gets a 500, ``GARBAGE`` a body that is
    no chat completion. Every request body is recorded; ``max_in_flight`` is the most requests (other
    than hanging ones) it held at once, each held ``delay`` seconds.
    """

    def __init__(self) -> None:
        self.reply = lambda content: "Score: 7"
        self.requests: list[dict] = []
        self.delay = 0.0
        self.in_flight = 0
        self.max_in_flight = 0
        self.app = fastapi.FastAPI()

        @self.app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "stub-judge", "object": "model"}]}

        @self.app.post("/v1/chat/completions")
        async def chat(request: fastapi.Request):
            body = await request.json()
            self.requests.append(body)
            content = body["messages"][-1]["content"]
            if "HANG" in content:  # not counted in flight: it outlives the test that sent it
                await asyncio.sleep(3.0)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay)
            finally:
                self.in_flight -= 1
            if "FAIL" in content:
                return fastapi.responses.JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if "GARBAGE" in content:
                return {"unexpected": True}
            message = {"role": "assistant", "content": self.reply(content)}
            return {"object": "chat.completion", "choices": [{"index": 0, "message": message}]}

    def reset(self, reply=None, delay: float = 0.0) -> None:
        self.reply = reply or (lambda content: "Score: 7")
        self.requests.clear()
        self.delay = delay
        self.max_in_flight = 0


@contextlib.contextmanager
def serve(app):
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port) from a thread; yields the ``/v1`` base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the stub judge did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def stub():
    judge = StubJudge()
    with serve(judge.app) as url:
        judge.url = url
        yield judge


def sample(response: str, prompt: str = "Say something.", truth=None) -> ModelSample:
    return ModelSample(
        prompt=prompt,
        messages=[{"role": "user", "content": prompt}],
        response=response,
        ground_truth=truth,
        data_source="chat",
    )


def make_batch(tokenizer, prompts, responses, truths=None, raw_chat=True):
    """A generate-stage batch: chat-templated prompts left-padded, responses (each ending in eos)
    right-padded; ``raw_prompt`` with ``raw_chat``. Returns it and each response's last index."""
    chats = [[{"role": "user", "content": p}] for p in prompts]
    prompt_ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
    prompt_ids = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompt_ids]
    response_ids = [
        [*tokenizer.encode(r, add_special_tokens=False), tokenizer.eos_token_id] for r in responses
    ]
    width_p, width_r = max(map(len, prompt_ids)), max(map(len, response_ids)) + 2
    pad = tokenizer.pad_token_id
    tensors = {
        "prompts": torch.full((len(prompts), width_p), pad),
        "responses": torch.full((len(prompts), width_r), pad),
        "attention_mask": torch.zeros((len(prompts), width_p + width_r), dtype=torch.long),
        "response_mask": torch.zeros((len(prompts), width_r), dtype=torch.long),
    }
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        tensors["prompts"][i, width_p - len(p) :] = torch.tensor(p)
        tensors["attention_mask"][i, width_p - len(p) : width_p + len(r)] = 1
        tensors["responses"][i, : len(r)] = torch.tensor(r)
        tensors["response_mask"][i, : len(r)] = 1
    non_tensors = {
        "reward_model": [{"ground_truth": t} for t in (truths or [None] * len(prompts))],
        "data_source": ["chat"] * len(prompts),
    }
    if raw_chat:
        non_tensors["raw_prompt"] = chats
    return DataProto.from_dict(tensors, non_tensors), [len(r) - 1 for r in response_ids]


def config(*overrides):
    return load_config(None, list(overrides))


def one_tiny_step(run_dir, *overrides):
    """Overrides of the tiny preset for one training step into ``run_dir``: no validation, no trackers."""
    return [
        *preset_overrides("tiny"),
        f"trainer.run_dir={run_dir}",
        "trainer.trackers=[]",
        "trainer.resume_mode=disable",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        *overrides,
    ]


# ---------------------------------------------------------------- judge_score


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("The answer is right. Score: 9", 0.9),
        ("Score: 3\nOn reflection... Score: 8", 0.8),  # the last verdict
        ("**Score:** 6/10", 0.6),
        ("score = 10", 1.0),
        ("I would give it 4 out of 10 for 3 reasons.", 0.4),  # "N out of 10" before the last number
        ("Mostly fine, 7.5", 0.75),  # no "Score:": the last number
        ("Score: 12", 1.0),  # clipped to 0-10
        ("Score: -3", 0.0),
        ("I cannot grade this.", 0.0),  # no number at all
        ("", 0.0),
    ],
)
def test_judge_score_reads_the_last_verdict_and_maps_0_to_10_onto_0_to_1(reply, expected):
    assert judge_score("chat", reply, None, None) == pytest.approx(expected)


def test_judge_score_is_a_registered_reward_function():
    (entry,) = [e for e in reward_functions.entries() if e.name == "judge_score"]
    assert (entry.provider, entry.target) == ("trellis-rl", "trellis.reward.builtin:judge_score")
    assert reward_functions.get("judge_score") is judge_score
    assert parse_judge_score("none here") is None


# ---------------------------------------------------------------- the judge client


def test_judge_scores_come_from_the_replies(stub):
    replies = {
        "good": "Looks right. Score: 9",
        "okay": "**Score:** 5/10",
        "bad": "Score: 0",
        "none": "No idea.",
    }
    stub.reset(lambda content: next(v for k, v in replies.items() if f"RESPONSE={k}" in content))
    client = JudgeClient(stub.url, model="stub-judge", prompt_template="RESPONSE={response}", max_tokens=33)
    outcomes = client.score([sample(k) for k in replies])
    assert [o.score for o in outcomes] == pytest.approx([0.9, 0.5, 0.0, 0.0])
    assert [o.error for o in outcomes] == [None] * 4
    assert client.last_replies == list(replies.values())
    assert {r["model"] for r in stub.requests} == {"stub-judge"}
    assert {r["max_tokens"] for r in stub.requests} == {33}
    assert {r["temperature"] for r in stub.requests} == {0.0}


def test_without_a_model_name_the_judge_asks_the_server_for_it(stub):
    stub.reset()
    client = JudgeClient(stub.url)
    assert [o.score for o in client.score([sample("x")])] == pytest.approx([0.7])
    assert client.model == "stub-judge" and stub.requests[0]["model"] == "stub-judge"


def test_failures_and_timeouts_score_zero_and_are_counted(stub, tokenizer):
    stub.reset(lambda content: "Score: 8")
    cfg = config(
        "reward.function=null",
        "reward.model.placement=external",
        f"reward.model.base_url={stub.url}",
        "reward.model.path=stub-judge",
        "reward.model.prompt_template='{response}'",
        "reward.model.timeout_seconds=0.5",
    )
    manager = build_reward_manager(cfg, tokenizer)
    assert isinstance(manager, ModelRewardManager) and manager.rule is None
    data, last = make_batch(tokenizer, ["a", "b", "c", "d"], ["fine", "FAIL", "HANG", "GARBAGE"])
    started = time.monotonic()
    out = manager(data, return_dict=True)
    assert time.monotonic() - started < 2.5  # the 0.5 s limit, not the 3 s hang
    scores = out["reward_tensor"]
    assert scores[0, last[0]] == pytest.approx(0.8) and scores.sum() == pytest.approx(0.8)
    assert out["reward_extra_info"]["model_score"] == pytest.approx([0.8, 0.0, 0.0, 0.0])
    # three failed calls (HTTP 500, the timeout, a body without choices), one of them a timeout
    assert out["metrics"] == {
        "reward/errors": 0.0,
        "reward/timeouts": 0.0,
        "reward/model_errors": 3.0,
        "reward/model_timeouts": 1.0,
    }


def test_requests_are_concurrent_up_to_max_concurrency(stub, tokenizer):
    stub.reset(delay=0.2)
    cfg = config(
        "reward.model.placement=external",
        f"reward.model.base_url={stub.url}",
        "reward.model.path=stub-judge",
        "reward.model.max_concurrency=2",
    )
    data, _ = make_batch(tokenizer, ["p"] * 6, ["r"] * 6)
    started = time.monotonic()
    build_reward_manager(cfg, tokenizer)(data)
    elapsed = time.monotonic() - started
    assert len(stub.requests) == 6 and stub.max_in_flight == 2
    assert elapsed >= 0.6  # 3 rounds of 0.2 s at least: never more than 2 at once


def test_the_prompt_template_max_tokens_and_function_come_from_the_config(stub, tokenizer):
    stub.reset(lambda content: "a reply of 26 characters..")
    reward_functions.register(
        "tests_reply_length",
        lambda data_source, solution_str, ground_truth, extra_info=None: len(solution_str),
    )
    try:
        cfg = config(
            "reward.model.placement=external",
            f"reward.model.base_url={stub.url}",
            "reward.model.path=judge-7b",
            "reward.model.prompt_template='Q: {prompt} | A: {response} | T: {ground_truth} {{ok}}'",
            "reward.model.function=tests_reply_length",
            "reward.model.max_tokens=12",
        )
        data, last = make_batch(tokenizer, ["What is 2+2?"], ["4"], truths=["four"])
        scores = build_reward_manager(cfg, tokenizer)(data)
    finally:
        reward_functions.unregister("tests_reply_length")
    assert scores[0, last[0]] == 26.0
    (request,) = stub.requests
    assert request["messages"] == [{"role": "user", "content": "Q: What is 2+2? | A: 4 | T: four {ok}"}]
    assert request["model"] == "judge-7b" and request["max_tokens"] == 12


def test_prompts_are_decoded_from_tokens_without_raw_chat(tokenizer):
    data, _ = make_batch(tokenizer, ["Add 2 and 3."], ["5"], raw_chat=False)
    (s,), _ = read_samples(data, tokenizer)
    ids = data.batch["prompts"][0][data.batch["attention_mask"][0, : data.batch["prompts"].shape[1]].bool()]
    assert s.prompt == tokenizer.decode(ids.tolist(), skip_special_tokens=True)
    assert "Add 2 and 3." in s.prompt and s.response == "5"
    with_chat, _ = read_samples(make_batch(tokenizer, ["Add 2 and 3."], ["5"])[0], tokenizer)
    assert with_chat[0].prompt == "Add 2 and 3."
    assert with_chat[0].messages == [{"role": "user", "content": "Add 2 and 3."}]


def test_an_unknown_judge_function_fails_when_the_manager_is_built(stub, tokenizer):
    cfg = config(
        "reward.model.placement=external",
        f"reward.model.base_url={stub.url}",
        "reward.model.function=nowhere",
    )
    with pytest.raises(UnknownComponentError, match="Unknown reward function 'nowhere'"):
        build_reward_manager(cfg, tokenizer)


def test_with_reward_function_set_the_rule_and_model_scores_add_up(stub, tokenizer):
    stub.reset(lambda content: "Score: 5")
    cfg = config(
        "reward.function=exact_match",
        "reward.model.placement=external",
        f"reward.model.base_url={stub.url}",
    )
    data, last = make_batch(tokenizer, ["p", "q"], ["yes", "no"], truths=["yes", "yes"])
    manager = build_reward_manager(cfg, tokenizer)
    out = manager(data, return_dict=True)
    assert out["reward_tensor"][0, last[0]] == pytest.approx(1.5)  # exact match 1 + judge 0.5
    assert out["reward_tensor"][1, last[1]] == pytest.approx(0.5)
    assert out["reward_tensor"].sum() == pytest.approx(2.0)
    assert out["reward_extra_info"]["model_score"] == pytest.approx([0.5, 0.5])


# ---------------------------------------------------------------- config checks


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["reward.model.base_url=http://h:1/v1"],
            "'reward.model.base_url' must be null with reward.model.placement=colocated",
        ),
        (["reward.model.placement=external", "reward.model.path=j"], "'reward.model.base_url' must be set"),
        (
            ["reward.model.kind=classifier", "reward.model.placement=external"],
            "'reward.model.placement' is for",
        ),
        (
            ["reward.model.placement=external", "reward.model.base_url=h:1"],
            "must be an http:// or https:// URL",
        ),
        (["reward.model.prompt_template='Rate {answer}'"], "'reward.model.prompt_template' .* names answer"),
        (["reward.model.prompt_template=Rate it"], "'reward.model.prompt_template' .* lacks \\{response\\}"),
        (["reward.model.kind=judge"], "'reward.model.kind' must be one of 'generative', 'classifier'"),
        (["reward.model.max_concurrency=0"], "'reward.model.max_concurrency' must be >= 1"),
    ],
)
def test_bad_reward_model_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigValueError, match=message):
        config(*overrides)


# ---------------------------------------------------------------- the classifier


def save_tiny_classifier(path, *, chat_template=True, num_labels=1):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = build_tiny_tokenizer()
    if not chat_template:
        tok.chat_template = None
    settings = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, head_dim=32, num_key_value_heads=1, max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        num_labels=num_labels,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(LlamaConfig(**settings))
        torch.nn.init.normal_(model.score.weight, std=1.0)  # logits well apart from 0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("chat_template", [True, False])
def test_classifier_scores_are_the_label_0_logit_of_each_conversation(tmp_path, tokenizer, chat_template):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = save_tiny_classifier(tmp_path / "rm", chat_template=chat_template)
    cfg = config(
        "reward.model.kind=classifier", f"reward.model.path={path}", "reward.model.micro_batch_size=2"
    )
    manager = build_reward_manager(cfg, tokenizer)
    rows = []
    forward = manager.scorer.model.forward

    def counting_forward(*args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    manager.scorer.model.forward = counting_forward
    prompts, responses = (
        ["What is 2+2?", "Name a colour.", "Count to three."],
        ["4", "blue, or maybe red", "1 2 3"],
    )
    data, last = make_batch(tokenizer, prompts, responses)
    scores = manager(data)
    assert rows == [2, 1]  # micro_batch_size 2: three samples in two forward passes

    reference = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    expected = []
    for prompt, response in zip(prompts, responses, strict=True):
        if chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            text = tok.apply_chat_template(messages, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(prompt + response)["input_ids"]
        with torch.no_grad():  # one unpadded row: the logit at its last token
            expected.append(float(reference(input_ids=torch.tensor([ids])).logits[0, 0]))
    got = [float(scores[i, last[i]]) for i in range(3)]
    assert got == pytest.approx(expected, abs=1e-4)
    assert len({round(v, 3) for v in got}) == 3  # three different conversations, three scores
    assert scores.count_nonzero() == 3


def test_a_classifier_needs_one_label(tmp_path):
    path = save_tiny_classifier(tmp_path / "rm2", num_labels=2)
    with pytest.raises(ValueError, match="has 2 labels; a classifier reward model needs one output"):
        ClassifierRewardModel(path)


# ---------------------------------------------------------------- where the judge runs


def test_only_a_colocated_generative_judge_is_served_by_the_trainer(stub):
    assert needs_judge(config("reward.model.path=j"))
    assert not needs_judge(config())
    assert not needs_judge(config("reward.model.path=j", "reward.model.kind=classifier"))
    external = config(
        "reward.model.path=j", "reward.model.placement=external", f"reward.model.base_url={stub.url}"
    )
    assert not needs_judge(external) and start_judge(external) is None
    with pytest.raises(UnknownComponentError, match="Unknown rollout replica 'nowhere'"):
        start_judge(config("reward.model.path=j", "reward.model.replica=nowhere"))


def test_a_colocated_judge_on_several_machines_needs_driver_scoring():
    cfg = config("reward.model.path=j", "trainer.nnodes=2", "trainer.executor=ray")
    with pytest.raises(ConfigValueError, match=r"'reward\.placement' must be driver with a colocated judge"):
        start_judge(cfg)


def test_colocated_judge_is_the_tiny_model_behind_the_gateway(tmp_path, tiny_model_path, tokenizer):
    """start_judge serves reward.model.path with an hf replica on loopback; the manager built from the
    same config reaches it there, and each score is the function of the judge's greedy reply."""
    pytest.importorskip("trellis.rollout.gateway")
    reward_functions.register(
        "tests_reply_length",
        lambda data_source, solution_str, ground_truth, extra_info=None: len(solution_str),
    )
    cfg = config(f"reward.model.path={tiny_model_path}", "reward.model.max_tokens=5",
                 "reward.model.function=tests_reply_length", "model.dtype=float32")  # fmt: skip
    judge = start_judge(cfg)
    try:
        assert judge is not None and cfg.reward.model.base_url == judge.base_url
        assert judge.base_url.startswith("http://127.0.0.1:") and judge.base_url.endswith("/v1")
        manager = build_reward_manager(cfg, tokenizer)
        data, last = make_batch(tokenizer, ["Write digits", "Say hi"], ["12", "hello"])
        out = manager(data, return_dict=True)
        replies = manager.scorer.last_replies
    finally:
        reward_functions.unregister("tests_reply_length")
        judge.stop()
    assert cfg.reward.model.base_url is None  # cleared when the judge stops
    assert out["metrics"]["reward/model_errors"] == 0.0
    assert all(isinstance(r, str) for r in replies)
    assert [float(out["reward_tensor"][i, last[i]]) for i in range(2)] == [float(len(r)) for r in replies]

    # the reply is the tiny model's greedy continuation of the judge prompt, at most max_tokens tokens
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    judge_tok = build_tiny_tokenizer()
    (first,), _ = read_samples(data[[0]], tokenizer)
    prompt = manager.scorer.judge_prompt(first)
    ids = judge_tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([ids]), max_new_tokens=5, do_sample=False, pad_token_id=judge_tok.pad_token_id
        )[0, len(ids) :]
    assert replies[0] == judge_tok.decode(generated.tolist(), skip_special_tokens=True)


# ---------------------------------------------------------------- in a training run


@pytest.mark.parametrize(
    ("function", "placement", "expected"),
    [("null", "workers", 0.7), ("tests_quarter", "driver", 0.95)],
)
def test_a_training_step_is_scored_by_the_external_judge(tmp_path, stub, function, placement, expected):
    """The tiny preset for one step, scored by a stub judge that always says "Score: 7": every reward is
    0.7, or 0.25 + 0.7 with a rule function that gives 0.25."""
    stub.reset()
    reward_functions.register("tests_quarter", lambda **_: 0.25, replace=True)
    try:
        result = trellis.train(
            overrides=one_tiny_step(
                tmp_path,
                f"reward.function={function}",
                f"reward.placement={placement}",
                "reward.model.placement=external",
                f"reward.model.base_url={stub.url}",
                "reward.model.path=stub-judge",
            )
        )
    finally:
        reward_functions.unregister("tests_quarter")
    metrics = result.history[0]
    assert metrics["score/min"] == pytest.approx(expected) and metrics["score/max"] == pytest.approx(expected)
    assert metrics["reward_extra/model_score/mean"] == pytest.approx(0.7)
    assert metrics["reward/model_errors"] == 0.0 and metrics["reward/model_timeouts"] == 0.0
    assert len(stub.requests) == 8 * 4  # one request per response: 8 prompts x rollout.n 4
    assert all("Write digits" in r["messages"][0]["content"] for r in stub.requests)


def test_a_training_step_is_scored_by_a_colocated_judge(tmp_path, tiny_model_path):
    """The trainer serves reward.model.path itself for the run (every call answered: each score is 1.0)
    and stops it at the end, clearing reward.model.base_url again."""
    pytest.importorskip("trellis.rollout.gateway")
    from trellis.trainer.ppo import Trainer

    reward_functions.register(
        "tests_answered", lambda data_source, solution_str, ground_truth, extra_info=None: 1.0, replace=True
    )
    cfg = config(
        *one_tiny_step(
            tmp_path,
            "reward.function=null",
            f"reward.model.path={tiny_model_path}",
            "reward.model.function=tests_answered",
            "reward.model.max_tokens=4",
        )
    )
    trainer = Trainer(cfg)
    try:
        result = trainer.fit()
    finally:
        reward_functions.unregister("tests_answered")
    metrics = result.history[0]
    assert metrics["score/min"] == 1.0 and metrics["score/max"] == 1.0
    assert metrics["reward/model_errors"] == 0.0
    assert trainer.judge is None and cfg.reward.model.base_url is None


def test_a_run_that_fails_to_build_stops_the_judge_it_started(tmp_path, tiny_model_path, monkeypatch):
    """A failure after the colocated judge started (here: building the workers) stops the judge's
    replica and gateway before the error propagates."""
    pytest.importorskip("trellis.rollout.gateway")
    from trellis.trainer import judge as judge_module
    from trellis.trainer.ppo import Trainer

    started = []
    real_start = judge_module.start_judge

    def recording_start(config):
        started.append(real_start(config))
        return started[-1]

    def broken_build(self):
        raise RuntimeError("no workers today")

    monkeypatch.setattr(judge_module, "start_judge", recording_start)
    monkeypatch.setattr(Trainer, "_build_workers", broken_build)
    cfg = config(
        *preset_overrides("tiny"),
        f"trainer.run_dir={tmp_path}",
        "reward.function=null",
        f"reward.model.path={tiny_model_path}",
    )
    trainer = Trainer(cfg)
    with pytest.raises(RuntimeError, match="no workers today"):
        trainer.fit()
    (judge,) = started
    assert not judge.gateway.thread.is_alive() and trainer.judge is None
    assert cfg.reward.model.base_url is None


@pytest.mark.parametrize("placement", ["workers", "driver"])
def test_a_training_step_is_scored_by_a_classifier(tmp_path, placement):
    """The tiny preset for one step with a classifier reward model, scored in the policy worker or the
    driver: each sample's score is the classifier's logit on its conversation (prompt, decoded response),
    computed here with a plain forward pass of the saved model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trellis.trainer.ppo import Trainer

    class Scored(Trainer):
        def score(self, batch):
            out, metrics = super().score(batch)
            self.scored = (batch, out.batch["token_level_scores"])
            return out, metrics

    path = save_tiny_classifier(tmp_path / "rm")
    cfg = config(
        *one_tiny_step(
            tmp_path / "run",
            "reward.function=null",
            f"reward.placement={placement}",
            "reward.model.kind=classifier",
            f"reward.model.path={path}",
        )
    )
    trainer = Scored(cfg)
    result = trainer.fit()
    batch, scores = trainer.scored
    reference = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    expected = []
    b = batch.batch
    width = b["prompts"].shape[1]
    # data.return_raw_chat is off, yet the batch keeps each prompt's messages for the reward model:
    # the policy's templated prompt, decoded, carries the policy's role markers as text
    assert not cfg.data.return_raw_chat and "raw_prompt" in batch.non_tensor_batch
    for i, raw in enumerate(batch.non_tensor_batch["raw_prompt"]):
        messages = [{"role": m["role"], "content": m["content"]} for m in raw]
        decoded = trainer.tokenizer.decode(
            b["prompts"][i][b["attention_mask"][i, :width].bool()].tolist(), skip_special_tokens=True
        )
        assert decoded != messages[-1]["content"] and messages[-1]["content"] in decoded
        response = trainer.tokenizer.decode(
            b["responses"][i][b["response_mask"][i].bool()].tolist(), skip_special_tokens=True
        )
        messages.append({"role": "assistant", "content": response})
        text = tok.apply_chat_template(messages, tokenize=False)
        with torch.no_grad():
            row = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
            expected.append(float(reference(input_ids=row).logits[0, 0]))
    assert len(expected) == 8 * 4  # every response of the step
    assert scores.sum(-1).tolist() == pytest.approx(expected, abs=1e-4)
    assert result.history[0]["reward_extra/model_score/mean"] == pytest.approx(sum(expected) / 32, abs=1e-4)
