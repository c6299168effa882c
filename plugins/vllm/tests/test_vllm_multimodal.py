"""The ``vllm`` replica with images, without the engine: the prompt it hands to ``AsyncLLM.generate``.

A fake engine records the prompts (and fake ``vllm`` modules stand in for the two names ``_generate``
imports), so these run in the default suite, where vLLM is not installed. The prompt carries the
request's images as ``multi_modal_data`` with one pad token per image (vLLM widens it itself);
text-only prompts are sent as before.
"""

from __future__ import annotations

import asyncio
import sys
from types import ModuleType, SimpleNamespace

import pytest
from PIL import Image
from trellis_vllm.replica import VLLMRolloutReplica, _placeholder_ids, vllm_prompt

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.rollout import SamplingParams
from trellis.utils.loop_thread import LoopThread

IMAGE, VIDEO, START, END = 402, 403, 400, 401  # the tiny Qwen2-VL's pad and vision marker tokens


def widened(*pads: int) -> list[int]:
    """A prompt as the processor gives it: each item ``<|vision_start|>``, its pads, ``<|vision_end|>``."""
    ids = [1, 355, 202]
    for n in pads:
        ids += [START, *[IMAGE] * n, END]
    return [*ids, 90, 2, 202]


def images(n: int) -> list[Image.Image]:
    return [Image.new("RGB", (56, 56), (40 * i, 0, 0)) for i in range(n)]


def test_the_replica_takes_images():
    assert VLLMRolloutReplica.supports_multi_modal is True


def test_text_prompts_are_sent_as_they_are():
    assert vllm_prompt([5, 6, 7]) == {"prompt_token_ids": [5, 6, 7]}
    assert vllm_prompt([5, 6], {"image": [], "video": []}, {"image": IMAGE}) == {"prompt_token_ids": [5, 6]}


def test_each_run_of_pads_becomes_one_placeholder_with_the_images_alongside():
    pictures = images(2)
    prompt = vllm_prompt(widened(4, 6), {"image": pictures, "video": []}, {"image": IMAGE, "video": VIDEO})
    assert prompt["prompt_token_ids"] == [1, 355, 202, START, IMAGE, END, START, IMAGE, END, 90, 2, 202]
    assert prompt["multi_modal_data"] == {"image": pictures}  # no empty "video" entry
    assert all(a is b for a, b in zip(prompt["multi_modal_data"]["image"], pictures, strict=True))


@pytest.mark.parametrize(
    ("data", "placeholders", "message"),
    [
        ({"image": images(1)}, {}, "names no image_token_id; serve a vision-language model"),
        (
            {"image": images(3)},
            {"image": IMAGE},
            "2 run\\(s\\) of the image pad token 402 but multi_modal_data has 3",
        ),
        ({"audio": [b"..."]}, {"image": IMAGE}, "holds audio; the vllm replica takes 'image' and 'video'"),
    ],
    ids=["text-model", "count-mismatch", "unknown-modality"],
)
def test_prompts_and_items_that_do_not_fit_are_refused_clearly(data, placeholders, message):
    with pytest.raises(ValueError, match=f"request 'r7': .*{message}"):
        vllm_prompt(widened(4, 6), data, placeholders, "r7")


def test_the_pad_tokens_are_read_from_the_model_config(tmp_path):
    from transformers import Qwen2VLConfig

    Qwen2VLConfig(image_token_id=IMAGE, video_token_id=VIDEO).save_pretrained(tmp_path / "vl")
    assert _placeholder_ids(SimpleNamespace(path=str(tmp_path / "vl"))) == {"image": IMAGE, "video": VIDEO}


class FakeEngine:
    """Records each ``generate`` call's prompt; answers with ``replies`` in turn (``(tokens, reason)``).

    ``interrupt`` marks the first request interrupted, as ``begin_weight_update`` does under partial rollout.
    """

    def __init__(self, replica, replies, interrupt=False):
        self.replica, self.replies, self.interrupt = replica, list(replies), interrupt
        self.prompts = []

    async def generate(self, prompt, sampling_params, request_id):
        self.prompts.append(prompt)
        if self.interrupt and len(self.prompts) == 1:
            self.replica._traffic.in_flight[request_id].interrupted = True
        tokens, reason = self.replies.pop(0)
        completion = SimpleNamespace(token_ids=tokens, logprobs=None, finish_reason=reason)
        yield SimpleNamespace(outputs=[completion])


@pytest.fixture
def replica(monkeypatch):
    """A replica with a fake engine on a loop thread of its own, as ``init`` would leave it."""

    class FakeSamplingParams:  # vllm.SamplingParams: only its keywords matter here
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    vllm = ModuleType("vllm")
    vllm.SamplingParams = FakeSamplingParams
    sampling = ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final_only")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    replica = VLLMRolloutReplica(0, RolloutConfig(partial_rollout=True), ModelConfig(path="/m"))
    replica._placeholders = {"image": IMAGE, "video": VIDEO}
    replica._loop = LoopThread("test-vllm-multimodal")
    yield replica
    replica._loop.stop()


def test_the_engine_gets_the_images_with_the_prompt(replica):
    replica.engine = FakeEngine(replica, [([7, 8, 2], "stop"), ([9], "length")])
    pictures = images(2)
    out = asyncio.run(
        replica.generate(
            widened(4, 6), SamplingParams(max_tokens=3), "r1", multi_modal_data={"image": pictures}
        )
    )
    assert out.token_ids == [7, 8, 2] and out.stop_reason == "stop"
    (sent,) = replica.engine.prompts
    assert sent["prompt_token_ids"].count(IMAGE) == 2 and len(sent["prompt_token_ids"]) == 12
    assert sent["multi_modal_data"]["image"] == pictures

    text = asyncio.run(replica.generate([5, 6], SamplingParams(max_tokens=1), "r2"))  # text: as before
    assert text.token_ids == [9] and replica.engine.prompts[1] == {"prompt_token_ids": [5, 6]}


def test_a_request_resumed_after_a_weight_update_keeps_its_images(replica):
    replica.engine = FakeEngine(replica, [([7, 8], "abort"), ([9, 2], "stop")], interrupt=True)
    pictures = images(1)
    out = asyncio.run(
        replica.generate(widened(4), SamplingParams(max_tokens=5), "r3", multi_modal_data={"image": pictures})
    )
    assert out.token_ids == [7, 8, 9, 2]
    first, resumed = replica.engine.prompts
    assert resumed["prompt_token_ids"] == [*first["prompt_token_ids"], 7, 8]
    assert resumed["multi_modal_data"] == first["multi_modal_data"] == {"image": pictures}


def test_images_with_a_text_model_are_refused_before_the_engine(replica):
    replica._placeholders = {}  # what a text model's config gives
    replica.engine = FakeEngine(replica, [])
    with pytest.raises(ValueError, match="names no image_token_id"):
        asyncio.run(
            replica.generate(widened(4), SamplingParams(), "r4", multi_modal_data={"image": images(1)})
        )
    assert replica.engine.prompts == []
