"""The sglang replica on a real SGLang engine: only where CUDA and sglang are present (skipped elsewhere).

The same checks as the fake-engine tests, against ``sglang.Engine`` itself: the replica contract,
greedy tokens and log-probs equal to the Hugging Face model's on the same GPU, and a replica driven
by a new event loop for every call (as the trainer drives it) with a weight update in between.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from typing import Any, ClassVar

import pytest
import torch
from sglang_helpers import make_replica

from trellis.rollout import SamplingParams
from trellis.testing import RolloutReplicaContract

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
pytestmark = pytest.mark.skipif(
    not (HAS_SGLANG and torch.cuda.is_available()),
    reason="needs CUDA and sglang: pip install 'sglang[all]>=0.5.3' on a GPU machine",
)

# The tiny test model is float32 with head_dim 32: SGLang's torch-native attention and PyTorch
# sampling take it where the fused kernels (bfloat16 / float16 only) would not.
TINY_MODEL_ENGINE = {
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "mem_fraction_static": 0.2,
}


class TestSGLangContractOnGPU(RolloutReplicaContract):
    replica_name = "sglang"
    mode = "colocated"
    engine_kwargs: ClassVar[dict[str, Any]] = TINY_MODEL_ENGINE


class TestSGLangServerContractOnGPU(RolloutReplicaContract):
    replica_name = "sglang"
    mode = "colocated"
    engine_kwargs: ClassVar[dict[str, Any]] = {**TINY_MODEL_ENGINE, "server": True}


def _check_greedy(model, prompt, out):
    """``out`` is ``model``'s greedy continuation of ``prompt``, with its log-probs."""
    ids = torch.tensor([prompt + out.token_ids], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.log_probs, device="cuda"), expected, atol=1e-3, rtol=0)


def test_greedy_tokens_and_logprobs_equal_the_hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = [tok(text)["input_ids"] for text in ("What is 12 + 7?", "The quick brown fox")]
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=True)

    async def main():
        replica = make_replica(tiny_model_path, **TINY_MODEL_ENGINE)
        await replica.init("colocated")
        try:
            return await asyncio.gather(*(replica.generate(p, sp, f"r{i}") for i, p in enumerate(prompts)))
        finally:
            await replica.shutdown()

    for prompt, out in zip(prompts, asyncio.run(main()), strict=True):
        _check_greedy(model, prompt, out)


def test_every_call_may_come_from_a_new_event_loop(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = [tok(text)["input_ids"] for text in ("What is 12 + 7?", "The quick brown fox")]
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=True)
    replica = make_replica(tiny_model_path, **TINY_MODEL_ENGINE)

    async def generate_all():
        return await asyncio.gather(*(replica.generate(p, sp, f"r{i}") for i, p in enumerate(prompts)))

    asyncio.run(replica.init("colocated"))  # the trainer: one asyncio.run per call
    loop_thread = replica._loop.thread
    try:
        before = asyncio.run(generate_all())
        gen = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=gen, device="cuda") * (param.std() + 0.1))

        async def sync():
            await replica.sleep()
            await replica.wake_up()
            await replica.update_weights(model.state_dict().items())
            await replica.resume()

        asyncio.run(sync())
        after = asyncio.run(generate_all())
    finally:
        asyncio.run(replica.shutdown())
    assert not loop_thread.is_alive() and loop_thread not in threading.enumerate()
    for prompt, out in zip(prompts, after, strict=True):
        _check_greedy(model, prompt, out)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
