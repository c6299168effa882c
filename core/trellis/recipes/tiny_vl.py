"""A tiny vision-language model (Qwen2-VL family) built from a config in seconds, for hermetic tests.

The tiny tokenizer (:mod:`trellis.recipes.tiny`) gains Qwen2-VL's vision tokens; the image
processor is Qwen2-VL's (patch 14, merge 2, temporal patch 2) with small pixel limits, so a 56x56
image is 4 patches of 2x2 and costs 4 image tokens; the model is a ``Qwen2VLForConditionalGeneration``
with a 2-layer text model of hidden size 64 (M-RoPE sections ``[4, 6, 6]`` over head_dim 32) and a
one-block vision tower of width 32 (about 0.17M parameters). Weights are random.

:func:`save_tiny_vl_model` writes a folder that :func:`trellis.utils.tokenizer.hf_processor` and
``AutoModelForImageTextToText`` load, with or without torchvision.
"""

from __future__ import annotations

import os
from typing import Any

from trellis.recipes.tiny import build_tiny_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

VL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    '</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'tool' %}\n</tool_response>{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with Qwen2-VL's vision blocks: a content part ``{"type": "image"}`` (or ``video``) renders as
``<|vision_start|><|image_pad|><|vision_end|>``, which the processor widens to one pad per image token."""

MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112


def build_tiny_vl_tokenizer() -> Any:
    """The tiny tokenizer with Qwen2-VL's vision tokens and :data:`VL_CHAT_TEMPLATE`."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def build_tiny_image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> Any:
    """Qwen2-VL's image processor (PIL backend, so no torchvision needed) with small pixel limits."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )


def build_tiny_vl_processor(tokenizer: Any | None = None) -> Any:
    """A ``Qwen2VLProcessor`` of the tiny tokenizer and image processor (no video processor)."""
    from transformers import Qwen2VLProcessor

    from trellis.utils.tokenizer import processor_without_video

    tokenizer = tokenizer or build_tiny_vl_tokenizer()
    return processor_without_video(
        Qwen2VLProcessor, build_tiny_image_processor(), tokenizer, VL_CHAT_TEMPLATE
    )


def build_tiny_vl_model(tokenizer: Any, seed: int = 0, **text_config: Any) -> Any:
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` sized for ``tokenizer``."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "tie_word_embeddings": True,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }
    text.update(text_config)
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": text["hidden_size"],  # the merger's output: the text model's width
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2VLForConditionalGeneration(config)


def save_tiny_vl_model(path: str | os.PathLike[str], seed: int = 0, **text_config: Any) -> str:
    """Write the tiny VL tokenizer, image processor, chat template and model into ``path``; returns it."""
    path = os.fspath(path)
    tokenizer = build_tiny_vl_tokenizer()
    model = build_tiny_vl_model(tokenizer, seed=seed, **text_config)
    image_processor = build_tiny_image_processor()
    # Qwen2-VL's processor class, named where AutoProcessor looks for it; saved part by part, since
    # ProcessorMixin.save_pretrained needs the video processor, which needs torchvision
    image_processor.processor_class = tokenizer.processor_class = "Qwen2VLProcessor"
    image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as handle:
        handle.write(VL_CHAT_TEMPLATE)
    model.save_pretrained(path)
    return path
