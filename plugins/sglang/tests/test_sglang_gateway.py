"""``trellis serve --replica sglang`` on the fake SGLang (so on the CPU): the gateway in front of the
sglang replica started as the command starts it, with the same routes and token-exact capture as in
front of ``hf``, and the tokens SGLang generated."""

from __future__ import annotations

import pytest
import torch

from trellis.cli import build_parser, start_serving
from trellis.testing.rollout import teacher_forced_log_probs

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("trellis.rollout.gateway")

QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]


def test_trellis_serve_runs_an_sglang_replica_behind_the_gateway(tiny_model_path, hf, fake):
    model, tok = hf
    serve = ["serve", "--model", tiny_model_path, "--replica", "sglang", "--port", "0"]
    overrides = ["rollout.calculate_log_probs=true", "model.dtype=float32"]
    args = build_parser().parse_args([*serve, "--served-model-name", "tiny", *overrides])
    # the in-process engine is built on this (the main) thread: the fake refuses any other, as SGLang does
    running, replica, name = start_serving(args)
    try:
        assert name == "tiny" and type(replica).__name__ == "SGLangRolloutReplica"
        assert httpx.get(running.url + "/health").json() == {"status": "ok"}
        assert [m.id for m in openai.OpenAI(base_url=running.base_url, api_key="-").models.list()] == ["tiny"]
        client = openai.OpenAI(base_url=running.session_url("eval"), api_key="-", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=6, temperature=0)
        assert reply.usage.completion_tokens == 6 and reply.choices[0].finish_reason == "length"
        (request,) = fake.engines[0].calls_to("async_generate")  # the request reached SGLang
        text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        assert request["input_ids"] == prompt and request["return_logprob"] is True
        (traj,) = running.gateway.close_session("eval").samples()
        assert traj.prompt_ids == prompt and traj.response_mask == [1] * 6
        with torch.no_grad():  # SGLang's greedy tokens are the model's, its log-probs a forward pass's
            ids = list(prompt)
            for _ in range(6):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert traj.response_ids == ids[len(prompt) :]
        assert reply.choices[0].message.content == tok.decode(traj.response_ids, skip_special_tokens=True)
        torch.testing.assert_close(
            torch.tensor(traj.response_logprobs),
            teacher_forced_log_probs(model, prompt, traj.response_ids, 0),
            atol=1e-4,
            rtol=0,
        )
    finally:
        running.call(replica.shutdown())
        running.stop()
