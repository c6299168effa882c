"""Images and videos from a dataset row to the tensors a vision-language model takes.

A row's ``images`` column (``data.image_key``) holds a list of images, its ``videos`` column
(``data.video_key``) a list of videos. An image may be:

- a PIL image; encoded bytes; a dict ``{"bytes": ..., "path": ...}`` (verl's and Hugging Face
  datasets' layout: bytes win, else the path is read);
- a path or URL, read through fsspec (``file://``, ``s3://``, ``https://``, ...);
- a ``(H, W, 3)`` uint8 array.

A video is a list of frames (each one of the image forms above), a ``(T, H, W, 3)`` uint8 array, or a
path to an animated image (GIF, APNG, WebP; frames read with PIL). Other video files need a decoder
this module does not ship: decode them to frames first.

Images are converted to RGB and, when ``max_pixels`` / ``min_pixels`` are set, resized (aspect ratio
kept) so that ``width * height`` lies within them, as verl's ``process_image`` does. An unreadable
item, one over PIL's decompression-bomb limit, or one whose sides differ by more than
:data:`MAX_ASPECT_RATIO` raises :class:`~trellis.errors.DatasetError` naming the row, the column and
the item.

Prompts: verl's layout puts ``<image>`` / ``<video>`` placeholders in the prompt text;
:func:`vision_messages` splits such a message into content parts (``{"type": "image"}``,
``{"type": "text", ...}``) for the processor's chat template. A prompt without placeholders gets its
images, then videos, in front of the first user message's text.

:func:`process` runs the model's processor (``hf_processor``) on the templated text and the items:
the token ids (one pad token per image token, ``normalize_token_ids`` applied) and the
``multi_modal_inputs`` the model's forward takes (``pixel_values``, ``image_grid_thw``,
``pixel_values_videos``, ``video_grid_thw``, ...), which a batch carries per row as a non-tensor column.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trellis.errors import DatasetError

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
MAX_ASPECT_RATIO = 200
"""Qwen-VL's image processors refuse longer sides than 200x the shorter one; so do we, up front."""

MULTI_MODAL_DATA = "multi_modal_data"
"""Non-tensor column: per row ``{"image": [PIL images], "video": [[PIL frames], ...]}`` (raw, resized)."""
MULTI_MODAL_INPUTS = "multi_modal_inputs"
"""Non-tensor column: per row the processor's tensors for the model (``pixel_values``, grids, ...)."""

_TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
_PLACEHOLDER = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def load_image(
    item: Any, *, where: str = "image", max_pixels: int | None = None, min_pixels: int | None = None
) -> Any:
    """``item`` (any form in the module docstring) as an RGB PIL image within the pixel limits.

    Raises:
        DatasetError: the item cannot be read, is too large to decode, or is too elongated; the
            message starts with ``where``.
    """
    from PIL import Image

    try:
        image = _open_image(item, where)
        image.load()
    except DatasetError:
        raise
    except Image.DecompressionBombError as exc:
        raise DatasetError(
            f"{where}: the image is too large to decode safely ({exc}); shrink it, or raise "
            "PIL.Image.MAX_IMAGE_PIXELS if it is trusted."
        ) from exc
    except Exception as exc:
        raise DatasetError(f"{where}: cannot read the image ({type(exc).__name__}: {exc}).") from exc
    if image.mode != "RGB":
        image = image.convert("RGB")
    width, height = image.size
    if min(width, height) < 1 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise DatasetError(
            f"{where}: the image is {width}x{height} pixels; its sides may differ by at most "
            f"{MAX_ASPECT_RATIO}x. Crop or pad it."
        )
    return resize_within(image, max_pixels=max_pixels, min_pixels=min_pixels)


def resize_within(image: Any, *, max_pixels: int | None, min_pixels: int | None) -> Any:
    """``image`` scaled (aspect ratio kept) so that ``width * height`` lies within the limits."""
    width, height = image.size
    scale = 1.0
    if max_pixels and width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
    elif min_pixels and width * height < min_pixels:
        scale = math.sqrt(min_pixels / (width * height))
    if scale == 1.0:
        return image
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    if min_pixels and size[0] * size[1] < min_pixels:  # rounding down fell short: round up instead
        size = (math.ceil(width * scale), math.ceil(height * scale))
    return image.resize(size)


def _open_image(item: Any, where: str) -> Any:
    from PIL import Image

    if isinstance(item, Image.Image):
        return item
    if isinstance(item, Mapping):
        if item.get("bytes") is not None:
            return Image.open(io.BytesIO(bytes(item["bytes"])))
        if item.get("path"):
            return Image.open(io.BytesIO(_read(str(item["path"]), where)))
        raise DatasetError(f"{where}: an image dict needs 'bytes' or 'path', got keys {sorted(item)}.")
    if isinstance(item, bytes | bytearray | memoryview):
        return Image.open(io.BytesIO(bytes(item)))
    if isinstance(item, str):
        return Image.open(io.BytesIO(_read(item, where)))
    if isinstance(item, np.ndarray) and item.ndim == 3 and item.dtype == np.uint8:
        return Image.fromarray(item)
    raise DatasetError(
        f"{where}: an image must be a PIL image, bytes, {{'bytes': ..., 'path': ...}}, a path or URL, or an "
        f"(H, W, 3) uint8 array; got {type(item).__name__}."
    )


def _read(path: str, where: str) -> bytes:
    import fsspec

    try:
        with fsspec.open(path, "rb") as handle:
            return bytes(handle.read())
    except FileNotFoundError as exc:
        raise DatasetError(f"{where}: {path!r} does not exist.") from exc


def load_video(
    item: Any, *, where: str = "video", max_pixels: int | None = None, min_pixels: int | None = None
) -> list[Any]:
    """``item`` (a list of frames, a ``(T, H, W, 3)`` array or an animated image's path or bytes) as a
    list of RGB PIL frames of one size, within the pixel limits.

    Raises:
        DatasetError: no frames, an unreadable frame or file, frames of different sizes.
    """
    if (
        (isinstance(item, np.ndarray) and item.ndim == 4)
        or isinstance(item, list | tuple)
        or (isinstance(item, np.ndarray) and item.dtype == object)
    ):
        frames = [load_image(frame, where=f"{where}, frame {t}") for t, frame in enumerate(item)]
    else:
        frames = _animated_frames(item, where)
    if not frames:
        raise DatasetError(f"{where}: the video has no frames.")
    sizes = {frame.size for frame in frames}
    if len(sizes) > 1:
        raise DatasetError(f"{where}: the frames differ in size ({sorted(sizes)}); give frames of one size.")
    return [resize_within(frame, max_pixels=max_pixels, min_pixels=min_pixels) for frame in frames]


def _animated_frames(item: Any, where: str) -> list[Any]:
    from PIL import Image, ImageSequence

    if isinstance(item, str):
        data = _read(item, where)
    elif isinstance(item, Mapping) and (item.get("bytes") is not None or item.get("path")):
        data = bytes(item["bytes"]) if item.get("bytes") is not None else _read(str(item["path"]), where)
    elif isinstance(item, bytes | bytearray):
        data = bytes(item)
    else:
        raise DatasetError(
            f"{where}: a video must be a list of frames, a (T, H, W, 3) uint8 array, or an animated image "
            f"(GIF, APNG, WebP) as a path, URL or bytes; got {type(item).__name__}."
        )
    try:
        with Image.open(io.BytesIO(data)) as opened:
            return [frame.convert("RGB") for frame in ImageSequence.Iterator(opened)]
    except Exception as exc:
        raise DatasetError(
            f"{where}: cannot read the video's frames ({type(exc).__name__}: {exc}); only animated images "
            "are decoded here: decode other formats to a list of frames first."
        ) from exc


def vision_messages(
    messages: list[dict[str, Any]], n_images: int, n_videos: int, *, where: str = "prompt"
) -> list[dict[str, Any]]:
    """``messages`` with ``<image>`` / ``<video>`` placeholders turned into content parts.

    The placeholders, counted over all messages, must match the row's items (``n_images``,
    ``n_videos``). Without any placeholder, the items go in front of the first user message's text.
    Messages whose content is already a list of parts are kept as they are (their parts counted).

    Raises:
        DatasetError: the placeholder counts differ from the items (both counts named).
    """
    out: list[dict[str, Any]] = []
    images = videos = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts: list[dict[str, Any]] = []
            for piece in _PLACEHOLDER.split(content):
                if piece == IMAGE_PLACEHOLDER:
                    parts.append({"type": "image"})
                    images += 1
                elif piece == VIDEO_PLACEHOLDER:
                    parts.append({"type": "video"})
                    videos += 1
                elif piece:
                    parts.append({"type": "text", "text": piece})
            out.append({**message, "content": parts})
        else:
            parts = [dict(part) for part in content or []]
            images += sum(part.get("type") == "image" for part in parts)
            videos += sum(part.get("type") == "video" for part in parts)
            out.append({**message, "content": parts})
    if images == videos == 0 and n_images + n_videos:
        first = next((m for m in out if m.get("role") == "user"), out[0])
        first["content"] = (
            [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos + list(first["content"])
        )
        return out
    if (images, videos) != (n_images, n_videos):
        raise DatasetError(
            f"{where}: the prompt has {images} {IMAGE_PLACEHOLDER} and {videos} {VIDEO_PLACEHOLDER} "
            f"placeholders but the row has {n_images} images and {n_videos} videos; give one placeholder "
            "per item (or none, to put them all before the first user message)."
        )
    return out


def process(
    processor: Any,
    text: str,
    images: Sequence[Any] = (),
    videos: Sequence[Any] = (),
    *,
    where: str = "prompt",
) -> tuple[list[int], dict[str, Any]]:
    """The processor on one templated prompt and its items: ``(token ids, multi_modal_inputs)``.

    The ids hold one pad token per image (video) token; ``multi_modal_inputs`` holds every tensor the
    processor returned but the per-token ones (ids, masks, token types), which the batch rebuilds.

    Raises:
        DatasetError: videos without a video processor (transformers needs torchvision for one); the
            message starts with ``where``.
    """
    from trellis.utils.tokenizer import normalize_token_ids

    if videos:
        _video_processor(processor, where)
    kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = list(images)
    if videos:
        kwargs["videos"] = [list(video) for video in videos]
    out = processor(**kwargs)
    ids = normalize_token_ids(out)
    inputs = {key: value for key, value in out.items() if key not in _TOKEN_KEYS}
    return ids, inputs


def _video_processor(processor: Any, where: str) -> Any:
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None:
        raise DatasetError(
            f"{where}: has videos, but {type(processor).__name__} has no video processor: transformers "
            "builds video processors only with torchvision installed (pip install torchvision)."
        )
    return video_processor


def chat_ids(
    processor: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    images: Sequence[Any] = (),
    videos: Sequence[Any] = (),
    add_generation_prompt: bool = True,
    where: str = "prompt",
    **template_kwargs: Any,
) -> tuple[list[int], dict[str, Any]]:
    """Chat messages with optional tools, images and videos through the model's processor, in one call:
    ``(token ids, multi_modal_inputs)``.

    ``messages`` carry content parts (``{"type": "image"}`` ... in item order; see
    :func:`vision_messages`); ``tools`` are OpenAI function schemas, rendered by the processor's chat
    template; ``template_kwargs`` go to ``apply_chat_template`` (e.g. ``enable_thinking``). The ids hold
    one pad token per image (video) token, read with ``normalize_token_ids``.
    """
    kwargs = dict(template_kwargs)
    if tools:
        kwargs["tools"] = [dict(tool) for tool in tools]
    text = processor.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    return process(processor, text, images, videos, where=where)


def vision_inputs(
    processor: Any, images: Sequence[Any] = (), videos: Sequence[Any] = (), *, where: str = "prompt"
) -> dict[str, Any]:
    """``multi_modal_inputs`` of ``images`` and ``videos`` alone (no text): what :func:`process` gives
    for them, computed by the processor's image and video processors."""
    inputs: dict[str, Any] = {}
    if images:
        inputs.update(processor.image_processor(images=list(images), return_tensors="pt"))
    if videos:
        video_processor = _video_processor(processor, where)
        inputs.update(video_processor(videos=[list(v) for v in videos], return_tensors="pt"))
    return {key: value for key, value in inputs.items() if key not in _TOKEN_KEYS}


def item_tokens(processor: Any, inputs: dict[str, Any], kind: str = "image") -> list[int]:
    """How many pad tokens each ``kind`` item of ``inputs`` (:func:`vision_inputs`) takes in a prompt:
    its patches over ``merge_size``² (the Qwen-VL family's rule; ``merge_size`` of the processor's image or
    video processor, 1 when it has none)."""
    part = getattr(processor, f"{kind}_processor", None)
    merge = int(getattr(part, "merge_size", 1) or 1)
    return [int(grid.prod()) // merge**2 for grid in inputs.get(f"{kind}_grid_thw", ())]


def count(data: Any) -> tuple[int, int]:
    """``(images, videos)`` in a ``multi_modal_data`` cell (None or a dict)."""
    if not isinstance(data, Mapping):
        return 0, 0
    return len(data.get("image") or ()), len(data.get("video") or ())
