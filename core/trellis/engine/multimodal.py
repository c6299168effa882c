"""The vision inputs of a training forward pass: pixel values per micro-batch and M-RoPE positions.

A vision-language batch carries, per row, the processor's tensors in the non-tensor column
``multi_modal_inputs`` (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
``video_grid_thw``, ...; empty for a row without images). For a micro-batch,
:func:`vision_inputs` concatenates them in row order (the model scatters the vision features into
the image pad tokens in order of appearance, row after row) and computes each token's multimodal
position ids with the model's own ``get_rope_index`` (Qwen2-VL's M-RoPE: temporal, height and width
positions for vision tokens, text positions after them shifted by the image's extent), from the
full prompt + response ids and the attention mask, so left padding and the response are placed as
in generation.

Packed micro-batches (``model.use_remove_padding``) keep the real tokens' positions
(:func:`packed_positions`) and put the plain per-sequence text positions in front, the
``(4, 1, total)`` layout with which Qwen2-VL-family models find the packed sequences' boundaries.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from trellis.data.protocol import DataProto
from trellis.engine import packing

MULTI_MODAL_INPUTS = "multi_modal_inputs"
GRID_KEYS = ("image_grid_thw", "video_grid_thw")


def merged_inputs(cells: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The per-row ``multi_modal_inputs`` dicts concatenated key by key (row order) on ``device``."""
    parts: dict[str, list[torch.Tensor]] = {}
    for cell in cells:
        for key, value in (cell or {}).items():
            parts.setdefault(key, []).append(torch.as_tensor(value))
    return {key: torch.cat(values).to(device) for key, values in parts.items()}


def rope_module(model: torch.nn.Module) -> Any | None:
    """The submodule with ``get_rope_index`` (the multimodal model inside the LM head), or None."""
    cached = getattr(model, "_trellis_rope_module", False)
    if cached is not False:
        return cached
    found = next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)
    object.__setattr__(model, "_trellis_rope_module", found)
    return found


@dataclass
class VisionBatch:
    """One micro-batch's vision inputs: the rows' processor tensors concatenated, each token's modality
    (1 image, 2 video, 0 text; ``(bs, L)``) and its M-RoPE positions ``(3, bs, L)``."""

    inputs: dict[str, torch.Tensor]
    token_types: torch.Tensor
    positions: torch.Tensor
    owner: Any

    def embeddings(
        self, model: torch.nn.Module, input_ids: torch.Tensor, token_types: torch.Tensor
    ) -> torch.Tensor:
        """``model``'s input embeddings of ``input_ids`` with the vision features in place of the item
        pad tokens that ``token_types`` marks (any layout: padded ``(bs, L)`` or packed ``(1, total)``).

        The features replace exactly the marked tokens, so a pad token the policy generated stays the
        embedding of that token, as it was in generation (the model's own forward would count it as an
        item and fail)."""
        embed: Any = model.get_input_embeddings()  # type: ignore[operator]
        embeds = embed(input_ids)
        for kind, pixels, grid, getter in (
            (1, "pixel_values", "image_grid_thw", "get_image_features"),
            (2, "pixel_values_videos", "video_grid_thw", "get_video_features"),
        ):
            if pixels not in self.inputs:
                continue
            features = _features(getattr(self.owner, getter)(self.inputs[pixels], self.inputs.get(grid)))
            where = token_types == kind
            if int(where.sum()) != features.shape[0]:
                raise ValueError(
                    f"The batch has {int(where.sum())} {('image', 'video')[kind - 1]} tokens in its prompts "
                    f"but its {pixels} give {features.shape[0]} features; the rows' multi_modal_inputs do "
                    "not match their prompts (were they processed with this model's processor?)."
                )
            embeds = embeds.masked_scatter(where.unsqueeze(-1), features.to(embeds.dtype))
        return embeds


def _features(output: Any) -> torch.Tensor:
    """Vision features ``(tokens, hidden)`` from what ``get_image_features`` returns across versions."""
    pooled = getattr(output, "pooler_output", None)
    value = pooled if pooled is not None else output
    if isinstance(value, list | tuple):
        return torch.cat(list(value))
    return value


def vision_inputs(
    model: torch.nn.Module, micro: DataProto, attention_mask: torch.Tensor
) -> VisionBatch | None:
    """The :class:`VisionBatch` of one micro-batch, or None for a batch without a ``multi_modal_inputs``
    column or whose rows have no items.

    Only the prompts' pad tokens (and those of tool turns: ``response_mask`` 0) stand for items; a pad
    token the policy generated is text, as it was in generation.
    """
    cells = micro.non_tensor_batch.get(MULTI_MODAL_INPUTS)
    if cells is None:
        return None
    input_ids = micro.tensors["input_ids"]
    inputs = merged_inputs(cells, input_ids.device)
    owner = rope_module(model)
    if owner is None:
        if not inputs:
            return None
        raise ValueError(
            f"The batch has images or videos, but {type(model).__name__} has no get_rope_index: only "
            "Qwen2-VL-family models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, ...) are supported for now."
        )
    generated = torch.zeros_like(input_ids, dtype=torch.bool)
    responses = micro.tensors["responses"]
    mask = micro.tensors.get("response_mask")
    generated[:, input_ids.shape[1] - responses.shape[1] :] = True if mask is None else mask.bool()
    token_types = modality_types(getattr(owner, "config", None), input_ids, ~generated)
    if not inputs:
        if bool(token_types.any()):  # pad tokens that stand for items, and no items: never train blind
            raise ValueError(
                f"The batch's prompts hold {int((token_types > 0).sum())} image/video tokens but its rows' "
                "multi_modal_inputs are empty; keep the dataset's multi_modal_inputs column with the rows."
            )
        return None
    accepted = inspect.signature(owner.get_rope_index).parameters
    kwargs: dict[str, Any] = {k: v for k, v in inputs.items() if k in accepted}
    if "mm_token_type_ids" in accepted:
        kwargs["mm_token_type_ids"] = token_types
    positions, _ = owner.get_rope_index(input_ids, attention_mask=attention_mask, **kwargs)
    return VisionBatch(inputs, token_types, positions, owner)


def modality_types(config: Any, input_ids: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """Per token 1 for an image pad token, 2 for a video pad token, 0 for text (the model's
    ``mm_token_type_ids``); only where ``where`` is true (None = everywhere)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    for kind, name in ((1, "image_token_id"), (2, "video_token_id")):
        token_id = getattr(config, name, None)
        if token_id is not None:
            hit = input_ids == token_id
            types[hit if where is None else hit & where] = kind
    return types


def packed_positions(positions: torch.Tensor, packed: packing.PackedBatch) -> torch.Tensor:
    """``(4, 1, total)``: the packed sequences' text positions, then the real tokens' 3 M-RoPE rows."""
    rows = positions.reshape(positions.shape[0], -1)[:, packed.indices]  # (3, total), packed order
    return torch.cat([packed.position_ids.reshape(1, -1), rows]).unsqueeze(1)
