"""The Trellis gateway in front of the ``vllm`` replica (the real engine, ``nox -s vllm``): an OpenAI
chat completion and a captured session, as with the ``hf`` replica."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
gateway = pytest.importorskip("trellis.rollout.gateway")


@pytest.mark.engine
def test_the_gateway_serves_the_vllm_replica_and_captures_its_tokens(tmp_path):
    from trellis_vllm.replica import VLLMRolloutReplica

    from trellis.config.schema import ModelConfig, RolloutConfig
    from trellis.testing.tiny import save_tiny_model
    from trellis.utils.tokenizer import hf_tokenizer

    path = save_tiny_model(tmp_path / "model")
    replica = VLLMRolloutReplica(0, RolloutConfig(seed=0), ModelConfig(path=path, dtype="float32"))
    running = gateway.start_gateway(
        gateway.Gateway(hf_tokenizer(path), replicas=[replica], model_name="tiny", auto_sessions=True)
    )
    try:
        running.call(replica.init("colocated"), timeout=600)
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": True,
        }
        reply = httpx.post(running.session_url("s") + "/chat/completions", json=body, timeout=120).json()
        choice = reply["choices"][0]
        assert reply["usage"]["completion_tokens"] == len(choice["logprobs"]["content"]) <= 5
        assert choice["finish_reason"] in ("length", "stop")
        (traj,) = running.gateway.close_session("s").samples()
        assert len(traj.response_ids) == reply["usage"]["completion_tokens"] and set(traj.response_mask) == {
            1
        }
        assert [round(x, 4) for x in traj.response_logprobs] == [
            round(c["logprob"], 4) for c in choice["logprobs"]["content"]
        ]
    finally:
        running.call(replica.shutdown(), timeout=120)
        running.stop()
