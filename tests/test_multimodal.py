"""Vision-language RL from dataset to loss, on a tiny Qwen2-VL built at test time (random weights).

Images are read in every form a dataset holds them; placeholders, pixel limits and bad items give
clear errors naming the row and column; the processor widens each image to its tokens; the ``hf``
replica generates with the pixel values; the training forward (padded and packed) gives the replica's
log-probs to 1e-4 in float32; a GRPO run on the red-squares task trains with the reward rising, and a
geo3k-format parquet trains one step.
"""

from __future__ import annotations

import asyncio
import io
import os
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trellis.data import multimodal
from trellis.errors import DatasetError

warnings.filterwarnings("ignore", message=".*video processor.*")


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    from trellis.recipes.tiny_vl import save_tiny_vl_model

    return save_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl"))


@pytest.fixture(scope="module")
def parts(vl_path):
    from trellis.utils.tokenizer import hf_processor, hf_tokenizer

    return hf_tokenizer(vl_path), hf_processor(vl_path)


def png(color=(255, 0, 0), size=(56, 56), fmt="PNG") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, fmt)
    return buffer.getvalue()


def write(tmp_path, rows, name="data.parquet") -> str:
    path = str(tmp_path / name)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def image_tokens(ids, tokenizer) -> int:
    return sum(t == tokenizer.convert_tokens_to_ids("<|image_pad|>") for t in ids)


# ---------------------------------------------------------------- items


def test_images_load_from_every_form_a_dataset_holds(tmp_path):
    from PIL import Image

    data = png((0, 255, 0), (30, 20))
    path = tmp_path / "a.png"
    path.write_bytes(data)
    forms = [
        data,
        {"bytes": data, "path": None},
        {"bytes": None, "path": str(path)},
        str(path),
        f"file://{path}",
        Image.open(io.BytesIO(data)).convert("L"),  # converted to RGB
        np.full((20, 30, 3), 7, dtype=np.uint8),
    ]
    for form in forms:
        image = multimodal.load_image(form)
        assert image.mode == "RGB" and image.size == (30, 20), form


def test_pixel_limits_resize_with_the_aspect_ratio_kept():
    big = multimodal.load_image(png(size=(400, 100)), max_pixels=100 * 100)
    assert big.size == (200, 50)
    small = multimodal.load_image(png(size=(20, 10)), min_pixels=800)
    assert small.size == (40, 20)
    same = multimodal.load_image(png(size=(40, 20)), max_pixels=10_000, min_pixels=10)
    assert same.size == (40, 20)


def test_bad_items_name_where_they_are(monkeypatch):
    with pytest.raises(DatasetError, match=r"row 3, column 'images', item 1: cannot read the image"):
        multimodal.load_image(b"not a picture", where="row 3, column 'images', item 1")
    with pytest.raises(DatasetError, match="needs 'bytes' or 'path'"):
        multimodal.load_image({"bytes": None, "path": None})
    with pytest.raises(DatasetError, match="does not exist"):
        multimodal.load_image("/nonexistent/x.png")
    with pytest.raises(DatasetError, match="sides may differ by at most 200x"):
        multimodal.load_image(png(size=(1000, 2)))
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # a decompression bomb, as PIL sees it
    with pytest.raises(DatasetError, match="too large to decode safely"):
        multimodal.load_image(png(size=(56, 56)))


def test_videos_load_as_frames_of_one_size(tmp_path):
    from PIL import Image

    frames = [Image.new("RGB", (28, 28), (i * 40, 0, 0)) for i in range(4)]
    gif = io.BytesIO()
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:])
    (tmp_path / "v.gif").write_bytes(gif.getvalue())
    for form in ([png(size=(28, 28))] * 3, np.zeros((2, 28, 28, 3), np.uint8), str(tmp_path / "v.gif")):
        video = multimodal.load_video(form, max_pixels=14 * 14)
        assert {frame.size for frame in video} == {(14, 14)} and len(video) in (2, 3, 4)
    with pytest.raises(DatasetError, match="frames differ in size"):
        multimodal.load_video([png(size=(28, 28)), png(size=(56, 28))])
    with pytest.raises(DatasetError, match="only animated images are decoded here"):
        multimodal.load_video(b"\x00\x00\x00 ftypmp42 not decodable")


def test_placeholders_become_content_parts_and_must_match_the_items():
    messages = [{"role": "user", "content": "Look: <image> then <video>, and <image>."}]
    out = multimodal.vision_messages(messages, 2, 1)
    assert [p["type"] for p in out[0]["content"]] == [
        "text",
        "image",
        "text",
        "video",
        "text",
        "image",
        "text",
    ]
    bare = multimodal.vision_messages(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], 2, 0
    )
    assert [p["type"] for p in bare[1]["content"]] == ["image", "image", "text"]
    with pytest.raises(
        DatasetError, match=r"row 5.*1 <image> and 0 <video> placeholders but the row has 2 images"
    ):
        multimodal.vision_messages(
            [{"role": "user", "content": "<image> only one"}], 2, 0, where="row 5, column 'prompt'"
        )


# ---------------------------------------------------------------- dataset


def test_a_geo3k_layout_parquet_loads_with_each_image_widened_to_its_tokens(parts, tmp_path):
    from trellis.data.dataset import RLDataset

    tokenizer, processor = parts
    rows = [
        {
            "prompt": [{"role": "user", "content": "<image>Find x."}],
            "images": [{"bytes": png(), "path": None}],
        },
        {
            "prompt": [{"role": "user", "content": "<image> vs <image>"}],
            "images": [{"bytes": png(size=(112, 56)), "path": None}, {"bytes": png(), "path": None}],
        },
        {"prompt": [{"role": "user", "content": "text only"}], "images": []},
    ]
    data = RLDataset(
        write(tmp_path, rows), tokenizer, processor=processor, max_prompt_length=128, return_raw_chat=True
    )
    items = [data[i] for i in range(3)]
    # 56x56 -> a 4x4 patch grid -> 4 tokens (merge 2x2); 112x56 -> 8 tokens
    assert [image_tokens(it["raw_prompt_ids"], tokenizer) for it in items] == [4, 12, 0]
    assert items[0]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert items[1]["multi_modal_inputs"]["pixel_values"].shape == (16 + 32, 1176)
    assert items[2]["multi_modal_inputs"] == {} and items[2]["multi_modal_data"] == {"image": [], "video": []}
    assert [len(it["multi_modal_data"]["image"]) for it in items] == [1, 2, 0]
    assert "images" not in items[0] and items[0]["raw_prompt"][0]["content"][0] == {"type": "image"}
    batch = data.collate_fn(items)
    assert batch.non_tensor_batch["multi_modal_inputs"].shape == (3,)


def test_dataset_image_settings_are_honoured_and_errors_name_the_row(parts, tmp_path):
    from trellis.data.dataset import RLDataset

    tokenizer, processor = parts
    rows = [{"question": [{"role": "user", "content": "<image>q"}], "pics": [png(size=(112, 112))]}]
    path = write(tmp_path, rows)
    kwargs = {"prompt_key": "question", "max_prompt_length": 128}
    plain = RLDataset(path, tokenizer, processor=processor, image_key="pics", **kwargs)
    assert image_tokens(plain[0]["raw_prompt_ids"], tokenizer) == 16  # 112x112: an 8x8 grid
    small = RLDataset(
        path, tokenizer, processor=processor, image_key="pics", image_max_pixels=56 * 56, **kwargs
    )
    assert image_tokens(small[0]["raw_prompt_ids"], tokenizer) == 4
    tiny = write(tmp_path, [{"question": "<image>q", "pics": [png(size=(28, 28))]}], "t.parquet")
    assert (
        image_tokens(
            RLDataset(tiny, tokenizer, processor=processor, image_key="pics", **kwargs)[0]["raw_prompt_ids"],
            tokenizer,
        )
        == 1
    )
    up = RLDataset(tiny, tokenizer, processor=processor, image_key="pics", image_min_pixels=56 * 56, **kwargs)
    assert image_tokens(up[0]["raw_prompt_ids"], tokenizer) == 4
    videos = write(
        tmp_path, [{"prompt": "<video>what happens?", "clips": [[png(size=(28, 28))] * 2]}], "v.parquet"
    )
    with pytest.raises(DatasetError, match=r"v.parquet: row 0: has videos.*no video processor.*torchvision"):
        RLDataset(videos, tokenizer, processor=processor, video_key="clips", max_prompt_length=64)

    with pytest.raises(DatasetError, match=r"row 0: column 'pics' holds images.*no multimodal processor"):
        RLDataset(path, tokenizer, image_key="pics", **kwargs)
    bad = write(
        tmp_path,
        [*rows, {"question": [{"role": "user", "content": "<image>q"}], "pics": [b"junk"]}],
        "b.parquet",
    )
    with pytest.raises(DatasetError, match=r"b.parquet: row 1, column 'pics', item 0: cannot read the image"):
        RLDataset(bad, tokenizer, processor=processor, image_key="pics", **kwargs)
    with pytest.raises(DatasetError, match=r"row 0, column 'question'.*longer than max_prompt_length=8"):
        RLDataset(
            path, tokenizer, processor=processor, image_key="pics", prompt_key="question", max_prompt_length=8
        )


# ---------------------------------------------------------------- rollout and training forward


def _rollout(vl_path, parts, tmp_path, dtype="float32"):
    from trellis.config import load_config
    from trellis.data.dataset import RLDataset
    from trellis.rollout.agent_loop import AgentLoopManager
    from trellis.rollout.hf import HFRolloutReplica

    tokenizer, processor = parts
    rows = [
        {
            "prompt": [{"role": "user", "content": "<image>How many?"}],
            "images": [{"bytes": png(), "path": None}],
        },
        {
            "prompt": [{"role": "user", "content": "<image> and <image>"}],
            "images": [{"bytes": png((0, 0, 255), (84, 56)), "path": None}, {"bytes": png(), "path": None}],
        },
        {"prompt": [{"role": "user", "content": "no picture here"}], "images": []},
    ]
    data = RLDataset(write(tmp_path, rows), tokenizer, processor=processor, max_prompt_length=128)
    batch = data.collate_fn([data[i] for i in range(3)])
    config = load_config(
        None,
        [
            f"model.path={vl_path}",
            f"model.dtype={dtype}",
            "rollout.calculate_log_probs=true",
            "rollout.seed=3",
            "data.max_response_length=10",
        ],
    )
    replica = HFRolloutReplica(0, config.rollout, config.model)
    asyncio.run(replica.init("colocated", tokenizer=tokenizer))
    out = AgentLoopManager(config.rollout, [replica], tokenizer, response_length=10).generate_sequences(batch)
    return config, out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_training_log_probs_equal_the_replicas_in_float32(vl_path, parts, tmp_path, packed):
    from trellis.config import load_config
    from trellis.registries import training_engines

    config, out = _rollout(vl_path, parts, tmp_path)
    assert out.tensors["responses"].shape[1] == 10
    model = load_config(
        None,
        [f"model.path={vl_path}", "model.dtype=float32", f"model.use_remove_padding={str(packed).lower()}"],
    ).model
    engine = training_engines.get("single")(model, config.actor, role="actor", total_steps=1, device="cpu")
    with engine.phase():
        log_probs = engine.forward(out)["log_probs"]
    mask = out.tensors["response_mask"].bool()
    assert mask.sum() > 20
    diff = (log_probs - out.tensors["rollout_log_probs"])[mask].abs().max()
    assert diff < 1e-4, diff
    # without the pictures the same tokens score differently: the pixels reach the forward
    blind = out[[0]]
    blind.non_tensor_batch["multi_modal_inputs"] = np.array([{}], dtype=object)
    with (
        pytest.raises(
            ValueError, match="hold 4 image/video tokens but its rows' multi_modal_inputs are empty"
        ),
        engine.phase(),
    ):
        engine.forward(blind)


def test_the_vision_features_and_positions_change_the_log_probs(vl_path, parts, tmp_path):
    from trellis.config import load_config
    from trellis.engine import multimodal as engine_multimodal
    from trellis.registries import training_engines

    config, out = _rollout(vl_path, parts, tmp_path)
    engine = training_engines.get("single")(
        config.model, config.actor, role="actor", total_steps=1, device="cpu"
    )
    with engine.phase():
        seen = engine.forward(out)["log_probs"]
        other = out[[0, 1, 2]]
        cells = other.non_tensor_batch["multi_modal_inputs"]
        cells[0] = {k: (-v if k == "pixel_values" else v) for k, v in cells[0].items()}
        changed = engine.forward(other)["log_probs"]
    mask = out.tensors["response_mask"].bool()
    assert (seen[0] - changed[0])[mask[0]].abs().max() > 1e-3  # other pixels, other log-probs
    assert torch.equal(seen[2], changed[2])  # the text-only row is untouched
    vision = engine_multimodal.vision_inputs(engine.model, out[[0]], out.tensors["attention_mask"][:1])
    prompt = out.tensors["prompts"].shape[1]
    # M-RoPE: the 4 image tokens share a temporal position and spread over height and width
    image = (vision.token_types[0] == 1).nonzero().flatten()
    assert len(image) == 4 and image.max() < prompt
    grid = vision.positions[:, 0, image]
    assert len(set(grid[0].tolist())) == 1 and sorted(set(grid[1].tolist())) == [
        grid[1].min().item(),
        grid[1].min().item() + 1,
    ]
    del load_config


def test_a_model_without_multimodal_positions_is_refused_clearly(tiny_model_path, vl_path, parts, tmp_path):
    from transformers import AutoModelForCausalLM

    from trellis.engine.multimodal import vision_inputs

    _, out = _rollout(vl_path, parts, tmp_path)
    text_model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with pytest.raises(ValueError, match="has no get_rope_index: only Qwen2-VL-family models"):
        vision_inputs(text_model, out, out.tensors["attention_mask"])


def test_replicas_without_image_support_refuse_images(tiny_model_path):
    from trellis.config import load_config
    from trellis.rollout.base import RolloutReplica
    from trellis.rollout.hf import HFRolloutReplica
    from trellis.rollout.sampling import SamplingParams

    class TextOnly(RolloutReplica):
        async def init(self, *a, **k): ...
        async def generate(self, prompt_ids, sampling_params, request_id, *, multi_modal_data=None): ...
        async def sleep(self): ...
        async def wake_up(self): ...
        async def update_weights(self, named_tensors): ...

    config = load_config(None, [f"model.path={tiny_model_path}"])
    params = SamplingParams(max_tokens=2)
    images = {"image": [png()], "video": []}
    with pytest.raises(ValueError, match=r"TextOnly does not take images or videos.*rollout.name=hf or vllm"):
        TextOnly(0, config.rollout, config.model).check_request([1, 2], params, "r1", images)
    assert TextOnly(0, config.rollout, config.model).check_request([1, 2], params, "r1", {"image": []}) == [
        1,
        2,
    ]
    replica = HFRolloutReplica(0, config.rollout, config.model)
    asyncio.run(replica.init("colocated"))
    with pytest.raises(ValueError, match="has no multimodal processor; serve a vision-language model"):
        asyncio.run(replica.generate([1, 2], params, "r2", multi_modal_data=images))


# ---------------------------------------------------------------- training


def test_grpo_on_red_squares_trains_with_the_reward_rising(tmp_path):
    from trellis.config import load_config
    from trellis.recipes.red_squares import prepare_run
    from trellis.trainer.ppo import Trainer

    overrides = [
        *prepare_run(str(tmp_path)),
        "trainer.total_training_steps=12",
        f"trainer.run_dir={tmp_path}/run",
    ]
    history = Trainer(load_config(overrides=overrides)).fit().history
    rewards = [m["reward/mean"] for m in history]
    assert len(rewards) == 12
    # measured: 0.019 0.05 0.013 0.013 0.013 0.019 0.044 0.112 0.169 0.194 0.2 0.2
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.1, rewards
    assert all(np.isfinite(m["actor/pg_loss"]) for m in history)


def test_a_geo3k_parquet_written_here_trains_one_step(tmp_path):
    from trellis.config import load_config
    from trellis.recipes.red_squares import prepare_run
    from trellis.trainer.ppo import Trainer

    overrides = prepare_run(str(tmp_path), n_rows=8)
    rows = [  # verl's examples/data_preprocess/geo3k.py layout
        {
            "data_source": "hiyouga/geometry3k",
            "prompt": [{"role": "user", "content": f"<image>Find the angle {i}. Answer with a digit."}],
            "images": [{"bytes": png((i * 30, 0, 0), (56 + 28 * (i % 2), 56)), "path": f"img{i}.png"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i % 10)},
            "extra_info": {
                "split": "train",
                "index": i,
                "answer": str(i % 10),
                "question": "Find the angle.",
            },
        }
        for i in range(8)
    ]
    data = write(tmp_path, rows, "geo3k.parquet")
    overrides = [o for o in overrides if not o.startswith(("data.train_files", "data.val_files"))]
    overrides += [
        f"data.train_files=[{data}]",
        "trainer.total_training_steps=1",
        f"trainer.run_dir={tmp_path}/run",
    ]
    (metrics,) = Trainer(load_config(overrides=overrides)).fit().history
    assert metrics["response_length/mean"] > 0 and np.isfinite(metrics["actor/pg_loss"])
    assert os.path.exists(tmp_path / "run")


def test_the_trainer_reads_the_image_settings(tmp_path):
    """data.image_key, image_max_pixels, image_min_pixels and video_key reach the trainer's dataset."""
    from trellis.config import load_config
    from trellis.recipes.red_squares import prepare_run
    from trellis.trainer.ppo import Trainer

    overrides = [
        o
        for o in prepare_run(str(tmp_path), n_rows=8)
        if not o.startswith(("data.train_files", "data.val_files"))
    ]
    rows = [{"prompt": "<image>count", "pics": [png(size=(112, 112))], "small": [png(size=(28, 28))]}] * 8
    data = write(tmp_path, rows, "pics.parquet")
    overrides += [f"data.train_files=[{data}]", "data.val_files=[]", f"trainer.run_dir={tmp_path}/run"]

    def image_tokens_of(*extra: str) -> int:
        trainer = Trainer(load_config(overrides=[*overrides, *extra]))
        trainer._build_data()
        return image_tokens(trainer.train_set[0]["raw_prompt_ids"], trainer.tokenizer)

    assert image_tokens_of("data.image_key=pics") == 16
    assert image_tokens_of("data.image_key=pics", "data.image_max_pixels=3136") == 4
    assert image_tokens_of("data.image_key=small") == 1
    assert image_tokens_of("data.image_key=small", "data.image_min_pixels=3136") == 4
    with pytest.raises(
        DatasetError, match="has 1 <image> and 0 <video> placeholders but the row has 1 images and 1 videos"
    ):
        image_tokens_of("data.image_key=pics", "data.video_key=small")  # frames read as one video


# ---------------------------------------------------------------- tools that return images


def test_a_tool_shows_the_model_an_image_and_the_row_trains_with_it(vl_path, parts, tmp_path):
    """A ``tool_agent`` turn whose tool returns a picture: the tool turn holds its image tokens (widened),
    the next turn is generated with both images, the row carries both, and the training forward reads them
    (the tool turn's pad tokens have response_mask 0, so they stand for the tool's image)."""
    import json
    from typing import ClassVar

    from trellis.config import load_config
    from trellis.data.dataset import RLDataset
    from trellis.registries import training_engines
    from trellis.rollout.agent_loop import AgentLoopManager
    from trellis.rollout.hf import HFRolloutReplica
    from trellis.rollout.sampling import TokenOutput
    from trellis.tools.base import BaseTool
    from trellis.tools.schema import ToolResponse

    tokenizer, processor = parts

    class Camera(BaseTool):
        default_schema: ClassVar[dict] = {
            "type": "function",
            "function": {"name": "camera", "description": "a photo", "parameters": {"type": "object"}},
        }

        async def execute(self, instance_id, parameters, **kwargs):
            mode = parameters.get("mode")
            return (
                ToolResponse(text="photo", image=[b"junk" if mode == "bad" else png((0, 0, 255), (112, 56))]),
                0.0,
                {},
            )

    class Scripted(HFRolloutReplica):
        """The real replica, but its first turn calls the camera (a random model would not)."""

        seen: ClassVar[list] = []

        async def generate(self, prompt_ids, sampling_params, request_id, *, multi_modal_data=None):
            Scripted.seen.append((list(prompt_ids), multi_modal_data))
            if request_id.endswith("-0"):
                text = (
                    "<tool_call>"
                    + json.dumps({"name": "camera", "arguments": {"mode": self.mode_}})
                    + "</tool_call>"
                )
                ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                return TokenOutput(ids, [-0.5] * len(ids), "stop")
            params = sampling_params
            return await super().generate(prompt_ids, params, request_id, multi_modal_data=multi_modal_data)

    rows = [
        {"prompt": [{"role": "user", "content": "<image>Look."}], "images": [{"bytes": png(), "path": None}]}
    ]
    data = RLDataset(
        write(tmp_path, rows), tokenizer, processor=processor, max_prompt_length=256, return_raw_chat=True
    )
    batch = data.collate_fn([data[0]])
    batch.non_tensor_batch["agent_name"] = np.array(["tool_agent"], dtype=object)
    config = load_config(
        None,
        [
            f"model.path={vl_path}",
            "model.dtype=float32",
            "rollout.calculate_log_probs=true",
            "data.max_response_length=400",
        ],
    )
    replica = Scripted(0, config.rollout, config.model)
    asyncio.run(replica.init("colocated", tokenizer=tokenizer))
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    replica.mode_ = "ok"
    manager = AgentLoopManager(
        config.rollout, [replica], tokenizer, tools={"camera": Camera()}, processor=processor
    )
    out = manager.generate_sequences(batch)
    (first_prompt, first_items), (second_prompt, second_items) = Scripted.seen[-2:]
    assert len(first_items["image"]) == 1 and len(second_items["image"]) == 2
    assert first_prompt.count(pad) == 4 and second_prompt.count(pad) == 4 + 8  # 112x56: 8 tokens
    assert out.meta_info["metrics"]["tool/images"] == 1.0
    row = out.non_tensor_batch
    assert len(row["multi_modal_data"][0]["image"]) == 2
    assert row["multi_modal_inputs"][0]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    engine = training_engines.get("single")(
        config.model, config.actor, role="actor", total_steps=1, device="cpu"
    )
    with engine.phase():
        log_probs = engine.forward(out)["log_probs"]
    generated = out.tensors["response_mask"].bool()
    # the second turn came from the replica itself: its log-probs, given both images, are the forward's
    second = generated.clone()
    second[0, : (~generated[0]).nonzero().max() + 1] = False
    assert second.sum() > 0
    assert (log_probs - out.tensors["rollout_log_probs"])[second].abs().max() < 1e-4

    # without a processor the picture is dropped and counted; an unreadable picture is the model's to read
    text_only = AgentLoopManager(config.rollout, [replica], tokenizer, tools={"camera": Camera()})
    with pytest.raises(ValueError, match="renders a prompt with images, which needs the model's processor"):
        text_only.generate_sequences(batch)
    plain = write(
        tmp_path, [{"prompt": [{"role": "user", "content": "Look."}], "images": []}], "plain.parquet"
    )
    text_data = RLDataset(plain, tokenizer, processor=processor, max_prompt_length=256, return_raw_chat=True)
    text_batch = text_data.collate_fn([text_data[0]])
    text_batch.non_tensor_batch["agent_name"] = np.array(["tool_agent"], dtype=object)
    dropped = text_only.generate_sequences(text_batch)
    assert dropped.meta_info["metrics"]["tool/images_dropped"] == 1.0
    replica.mode_ = "bad"
    bad = manager.generate_sequences(batch)
    assert bad.meta_info["metrics"]["tool/bad_output"] == 1.0
    assert "Error: tool 'camera': cannot read the image" in tokenizer.decode(Scripted.seen[-1][0])
    assert len(bad.non_tensor_batch["multi_modal_data"][0]["image"]) == 1


def test_a_prompt_whose_pad_tokens_do_not_match_its_images_fails_alone_and_at_once(vl_path, parts, tmp_path):
    """One pad token too many (e.g. one the policy generated in an earlier turn): that request fails with
    both counts named, in seconds (transformers would raise StopIteration in the worker thread, which
    asyncio cannot hand back: the request would hang), and a good request beside it is served."""
    from trellis.config import load_config
    from trellis.data.dataset import RLDataset
    from trellis.rollout.hf import HFRolloutReplica
    from trellis.rollout.sampling import SamplingParams

    tokenizer, processor = parts
    rows = [
        {"prompt": [{"role": "user", "content": "<image>Look."}], "images": [{"bytes": png(), "path": None}]}
    ]
    item = RLDataset(write(tmp_path, rows), tokenizer, processor=processor, max_prompt_length=64)[0]
    good, images = item["raw_prompt_ids"], item["multi_modal_data"]
    bad = [*good, tokenizer.convert_tokens_to_ids("<|image_pad|>"), *good[-3:]]
    config = load_config(None, [f"model.path={vl_path}", "model.dtype=float32"])
    replica = HFRolloutReplica(0, config.rollout, config.model)
    asyncio.run(replica.init("colocated", tokenizer=tokenizer))
    params = SamplingParams(max_tokens=3)

    async def both():
        return await asyncio.wait_for(
            asyncio.gather(
                replica.generate(bad, params, "bad", multi_modal_data=images),
                replica.generate(good, params, "good", multi_modal_data=images),
                return_exceptions=True,
            ),
            timeout=60,
        )

    failed, served = asyncio.run(both())
    assert isinstance(failed, ValueError)
    assert "request 'bad': the prompt holds 5 image pad tokens but its 1 image(s) make 4" in str(failed)
    assert len(served.token_ids) == 3


def test_one_call_renders_tools_images_and_text_through_the_processor(parts):
    """``chat_ids``: the processor's chat template with the tools' schemas and image parts, the images
    widened to their tokens, ids read with normalize_token_ids; videos without a video processor are
    refused naming where."""
    tokenizer, processor = parts
    tool = {"type": "function", "function": {"name": "zoom", "description": "zoom in", "parameters": {}}}
    messages = multimodal.vision_messages([{"role": "user", "content": "<image>What is it?"}], 1, 0)
    image = multimodal.load_image(png(size=(112, 56)))
    ids, inputs = multimodal.chat_ids(processor, messages, tools=[tool], images=[image])
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n") and '"name": "zoom"' in text
    assert image_tokens(ids, tokenizer) == 8 and inputs["image_grid_thw"].tolist() == [[1, 4, 8]]
    assert text.endswith("<|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n")
    assert all(isinstance(t, int) for t in ids)
    plain, none = multimodal.chat_ids(processor, [{"role": "user", "content": "hi"}])
    assert none == {} and tokenizer.decode(plain) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    clip = multimodal.vision_messages([{"role": "user", "content": "<video>"}], 0, 1)
    with pytest.raises(DatasetError, match=r"^row 9: has videos, but Qwen2VLProcessor has no video"):
        multimodal.chat_ids(processor, clip, videos=[[image, image]], where="row 9")


def test_an_openai_sdk_agent_sends_the_rows_images_and_the_row_trains_with_them(vl_path, parts, tmp_path):
    """The ``openai_agent`` loop on a vision-language model: the sample's messages carry its images as
    image_url data URLs, the agent sends them with the real ``openai`` SDK, and the captured row holds the
    prompt's image tokens and the images, which the training forward reads (log-probs equal to 1e-4)."""
    pytest.importorskip("openai")
    from trellis.config import load_config
    from trellis.data.dataset import RLDataset
    from trellis.registries import training_engines
    from trellis.rollout.agent_loop import AgentLoopManager
    from trellis.rollout.hf import HFRolloutReplica

    tokenizer, processor = parts
    agent = tmp_path / "vl_agent.py"
    agent.write_text(
        "import openai\n"
        "async def run(base_url, sample):\n"
        "    first = sample['messages'][0]['content'][0]\n"
        "    assert first['image_url']['url'].startswith('data:image/png;base64,')\n"
        "    client = openai.AsyncOpenAI(base_url=base_url, api_key='-', max_retries=0)\n"
        "    messages = sample['messages']\n"
        "    await client.chat.completions.create(model='policy', messages=messages, max_tokens=5)\n"
        "    return 1.0\n"
    )
    rows = [
        {"prompt": [{"role": "user", "content": "<image>Count."}], "images": [{"bytes": png(), "path": None}]}
    ]
    data = RLDataset(
        write(tmp_path, rows), tokenizer, processor=processor, max_prompt_length=64, return_raw_chat=True
    )
    item = data[0]
    batch = data.collate_fn([item])
    config = load_config(
        None,
        [
            f"model.path={vl_path}",
            "model.dtype=float32",
            "rollout.calculate_log_probs=true",
            "data.max_response_length=5",
            "rollout.agent.default_agent_loop=openai_agent",
            f"rollout.agent.function={agent}:run",
        ],
    )
    replica = HFRolloutReplica(0, config.rollout, config.model)

    async def main():
        await replica.init("colocated", tokenizer=tokenizer)
        manager = AgentLoopManager(
            config.rollout, [replica], tokenizer, response_length=5, processor=processor
        )
        return await manager.generate_sequences_async(batch)

    out = asyncio.run(main())
    assert out.meta_info["metrics"]["agent/function_errors"] == 0.0
    prompt = out.tensors["prompts"][0][out.tensors["prompts"][0] != tokenizer.pad_token_id].tolist()
    assert prompt == item["raw_prompt_ids"]  # the gateway rendered the prompt as the dataset did
    assert out.non_tensor_batch["multi_modal_inputs"][0]["image_grid_thw"].tolist() == [[1, 4, 4]]
    engine = training_engines.get("single")(
        config.model, config.actor, role="actor", total_steps=1, device="cpu"
    )
    with engine.phase():
        log_probs = engine.forward(out)["log_probs"]
    mask = out.tensors["response_mask"].bool()
    assert mask.sum() == 5
    assert (log_probs - out.tensors["rollout_log_probs"])[mask].abs().max() < 1e-4


def test_a_pad_token_the_policy_generated_is_text_in_training(vl_path, parts, tmp_path):
    """A response token equal to the image pad token (a policy may sample it) is embedded as that token,
    as in generation, not taken for an image: the forward runs and the prompt's image is still read."""
    from trellis.registries import training_engines

    tokenizer, _ = parts
    config, out = _rollout(vl_path, parts, tmp_path)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    out.tensors["responses"][0, 1] = pad
    out.tensors["input_ids"][0, -out.tensors["responses"].shape[1] + 1] = pad
    engine = training_engines.get("single")(
        config.model, config.actor, role="actor", total_steps=1, device="cpu"
    )
    for packed in (False, True):
        engine.use_remove_padding = packed
        with engine.phase():
            log_probs = engine.forward(out)["log_probs"]
        assert torch.isfinite(log_probs).all() and log_probs[0, 1] < 0
