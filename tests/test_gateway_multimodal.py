"""The OpenAI-compatible gateway with images, on an ``hf`` replica of the tiny Qwen2-VL (random weights):
image content parts (base64 data URLs and paths) reach the replica with one pad token per image token,
a session's trajectory keeps its images across calls for training, and requests the gateway cannot
serve (no processor, an unreadable image, an unknown part) get OpenAI-shaped 400s."""

from __future__ import annotations

import base64
import io

import pytest

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.data import multimodal
from trellis.rollout.hf import HFRolloutReplica

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
gateway_module = pytest.importorskip("trellis.rollout.gateway")
Gateway, start_gateway = gateway_module.Gateway, gateway_module.start_gateway

pytestmark = pytest.mark.filterwarnings("ignore:.*without its video processor")  # no torchvision here


def png(color=(255, 0, 0), size=(56, 56)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(running gateway, tokenizer, processor)``: an hf replica of the tiny VL model, with its processor."""
    from trellis.recipes.tiny_vl import save_tiny_vl_model
    from trellis.utils.tokenizer import hf_processor, hf_tokenizer

    path = save_tiny_vl_model(tmp_path_factory.mktemp("gateway_vl"))
    tok, processor = hf_tokenizer(path), hf_processor(path)
    replica = HFRolloutReplica(
        0, RolloutConfig(calculate_log_probs=True), ModelConfig(path=path, dtype="float32")
    )
    gateway = Gateway(tok, replicas=[replica], model_name="tiny-vl", auto_sessions=True, processor=processor)
    running = start_gateway(gateway)
    running.call(replica.init("colocated", tokenizer=tok))
    yield running, tok, processor
    running.call(replica.shutdown())
    running.stop()


def pads(ids, tok) -> int:
    return sum(t == tok.convert_tokens_to_ids("<|image_pad|>") for t in ids)


def test_an_image_part_reaches_the_replica_and_the_trajectory_keeps_it(served, tmp_path):
    running, tok, processor = served
    c = openai.OpenAI(base_url=running.session_url("vl-1"), api_key="-", max_retries=0)
    question = {"role": "user", "content": [image_part(data_url(png())), {"type": "text", "text": "Colour?"}]}
    first = c.chat.completions.create(model="tiny-vl", messages=[question], max_tokens=4, temperature=0)
    assert 1 <= first.usage.completion_tokens <= 4 and first.choices[0].finish_reason in ("length", "stop")

    # the prompt is the processor's: a 56x56 image is 4 image tokens (4 pads between the vision markers)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected, _ = multimodal.process(processor, text, [multimodal.load_image(png())])
    assert pads(expected, tok) == 4 and first.usage.prompt_tokens == len(expected)

    # the next turn (the reply, then a second image given as a path) continues the same trajectory
    path = tmp_path / "blue.png"
    path.write_bytes(png((0, 0, 255), (84, 56)))
    follow = {"role": "user", "content": [{"type": "text", "text": "And this?"}, image_part(str(path))]}
    messages = [question, first.choices[0].message.model_dump(exclude_none=True), follow]
    second = c.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=3, temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens

    captured = httpx.get(running.url + "/sessions/vl-1/trajectories").json()["trajectories"]
    assert [t["num_images"] for t in captured] == [2] and captured[0]["calls"] == 2
    (traj,) = running.gateway.close_session("vl-1").samples()
    assert traj.prompt_ids == expected
    assert [im.size for im in traj.multi_modal_data["image"]] == [(56, 56), (84, 56)]
    assert traj.multi_modal_data["image"][1].getpixel((0, 0)) == (0, 0, 255)
    between = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m == 0]
    assert pads(between, tok) == 6  # the 84x56 image: 6 image tokens, in the tokens between the calls
    out = traj.to_output(reward=1.0)
    assert out.extra["multi_modal_data"]["image"] == traj.multi_modal_data["image"]
    grids = out.extra["multi_modal_inputs"]["image_grid_thw"].tolist()
    assert grids == [[1, 4, 4], [1, 4, 6]]  # 2x2 and 2x3 merged patches: 4 + 6 pad tokens
    assert pads(out.prompt_ids + out.response_ids, tok) == 10


def test_without_a_processor_images_are_refused_with_a_400(served):
    tok = served[1]
    running = start_gateway(Gateway(tok, model_name="tiny-vl"))
    try:
        body = {
            "model": "tiny-vl",
            "messages": [
                {"role": "user", "content": [image_part(data_url(png())), {"type": "text", "text": "?"}]}
            ],
        }
        reply = httpx.post(running.base_url + "/chat/completions", json=body)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "messages"
        assert "takes no images" in error["message"]
    finally:
        running.stop()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "cannot read the image"),  # base64 of text
        ("data:image/png;base64,@@not base64@@", "base64 data is invalid"),
        ("/no/such/picture.png", "does not exist"),
    ],
    ids=["not-an-image", "bad-base64", "missing-file"],
)
def test_an_unreadable_image_gets_a_400_naming_its_message(served, url, says):
    running = served[0]
    messages = [
        {"role": "system", "content": "Look closely."},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image_part(url)]},
    ]
    reply = httpx.post(
        running.base_url + "/chat/completions", json={"model": "tiny-vl", "messages": messages}
    )
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "messages[1]"
    assert error["message"].startswith("messages[1].content[1]: ") and says in error["message"]


def test_unknown_content_parts_and_malformed_image_parts_are_named(served):
    running = served[0]
    for part, says in (
        ({"type": "input_audio", "input_audio": {}}, "'input_audio' is not supported"),
        ({"type": "image_url", "image_url": {}}, "an image_url part must be"),
    ):
        messages = [{"role": "user", "content": [part]}]
        reply = httpx.post(
            running.base_url + "/chat/completions", json={"model": "tiny-vl", "messages": messages}
        )
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "messages[0]" and says in error["message"]


def test_text_requests_to_a_gateway_with_a_processor_stay_text(served):
    running = served[0]
    c = openai.OpenAI(base_url=running.session_url("vl-text"), api_key="-", max_retries=0)
    c.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    (traj,) = running.gateway.close_session("vl-text").samples()
    assert traj.multi_modal_data is None and traj.to_output().extra == {}
