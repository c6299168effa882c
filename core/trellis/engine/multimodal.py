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

The pixel values go into the model's forward; inside it (:meth:`VisionBatch.placeholders`) the
vision tower runs on them alone and the features land on exactly the prompt's (and tool turns') item
tokens, so a pad token the policy generated stays text, and under ``fsdp`` everything runs inside the
root module's forward with its weights gathered (the tower is a sharding unit of its own).

Packed micro-batches (``model.use_remove_padding``) keep the real tokens' positions
(:func:`packed_positions`) and put the plain per-sequence text positions in front, the
``(4, 1, total)`` layout with which Qwen2-VL-family models find the packed sequences' boundaries.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
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

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The vision keyword arguments of the model's forward: pixel values and grids."""
        return dict(self.inputs)

    def _encode(self, owner: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` of the multimodal model's forward with the pixel values replaced by the vision
        tower's outputs (``mm_encoder_outputs``), computed without the forward's other keyword arguments:
        the packed-text attention arguments (``cu_seq_lens_q`` ...) describe the text sequences, and the
        tower would read them as its own."""
        encoded: dict[str, Any] = {}
        for kind, pixels, grid, getter in (
            ("image", "pixel_values", "image_grid_thw", "get_image_features"),
            ("video", "pixel_values_videos", "video_grid_thw", "get_video_features"),
        ):
            values = kwargs.pop(pixels, None)
            if values is not None:
                encoded[kind] = getattr(owner, getter)(values, kwargs.get(grid), return_dict=True)
        if encoded:
            kwargs["mm_encoder_outputs"] = encoded
        return kwargs

    @contextlib.contextmanager
    def placeholders(self, token_types: torch.Tensor) -> Iterator[None]:
        """Inside: the model places the vision features at exactly the tokens ``token_types`` marks (any
        layout: padded ``(bs, L)`` or packed ``(1, total)``), not at every pad token of ``input_ids``, and
        runs its vision tower on the pixel values alone (:meth:`_encode`, in a pre-forward hook of the
        multimodal model, so under ``fsdp`` it runs inside the root's forward, weights gathered).

        A pad token the policy generated then stays that token's embedding, as it was in generation,
        where the model's own placement (every pad token) would count it as an item and fail."""
        owner = self.owner
        hook = owner.register_forward_pre_hook(
            lambda module, args, kwargs: (args, self._encode(module, kwargs)), with_kwargs=True
        )

        def masks(
            input_ids: Any,
            inputs_embeds: torch.Tensor,
            image_features: Any = None,
            video_features: Any = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            found = []
            for kind, features, name in ((1, image_features, "image"), (2, video_features, "video")):
                where = (token_types == kind).unsqueeze(-1).to(inputs_embeds.device)
                if features is not None and int(where.sum()) * inputs_embeds.shape[-1] != features.numel():
                    raise ValueError(
                        f"The batch has {int(where.sum())} {name} tokens in its prompts but its pixels give "
                        f"{features.shape[0]} features; the rows' multi_modal_inputs do not match their "
                        "prompts (were they processed with this model's processor?)."
                    )
                found.append(where.expand_as(inputs_embeds))
            return found[0], found[1]

        owner.get_placeholder_mask = masks  # an instance attribute: shadows the class's method
        try:
            yield
        finally:
            del owner.get_placeholder_mask
            hook.remove()


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


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """A vision-language model's vision tower (``visual`` of its multimodal model), or None."""
    owner = rope_module(model)
    tower = getattr(owner, "visual", None) if owner is not None else None
    return tower if isinstance(tower, torch.nn.Module) else None


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
