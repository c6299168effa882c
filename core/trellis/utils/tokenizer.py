"""Loading tokenizers and processors, and reading token ids out of whatever a tokenizer returns.

transformers is imported inside the loaders only, so importing this module is cheap.
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Mapping
from typing import Any, NoReturn

GEMMA2_END_OF_TURN = "<end_of_turn>"

_ACCEPTED = (
    "a list or tuple of ints, a single nested list like [[1, 2, 3]], a 1-D integer tensor or "
    "numpy array (or 2-D with one row), or a dict / BatchEncoding holding 'input_ids'"
)


def hf_tokenizer(
    name_or_path: str | os.PathLike[str],
    correct_pad_token: bool = True,
    correct_gemma2: bool = True,
    **kwargs: Any,
) -> Any:
    """``AutoTokenizer.from_pretrained(name_or_path, **kwargs)``, made ready for batched RL.

    Args:
        name_or_path: a local folder or a hub id.
        correct_pad_token: when the tokenizer has no pad token, use its eos token as pad
            (batching needs one) and say so with a ``UserWarning`` naming the token.
        correct_gemma2: for a Gemma-2 instruct checkpoint (``gemma-2`` and ``-it`` in its name)
            whose eos is not ``<end_of_turn>``, make ``<end_of_turn>`` the eos token with a
            ``UserWarning``: its chat turns end with that token, so generation would otherwise
            run past the end of the answer. An explicit ``eos_token=`` keyword wins.
        **kwargs: passed to ``AutoTokenizer.from_pretrained``.
    """
    from transformers import AutoTokenizer

    name = os.fspath(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    if correct_gemma2 and "eos_token" not in kwargs and _is_gemma2_instruct(name):
        _use_end_of_turn_as_eos(tokenizer, name)
    if correct_pad_token and tokenizer.pad_token_id is None:
        _use_eos_as_pad(tokenizer, name)
    return tokenizer


def _is_gemma2_instruct(name: str) -> bool:
    stem = os.path.basename(name.rstrip("/\\")).lower()
    return "gemma-2" in stem and "-it" in stem


def _use_end_of_turn_as_eos(tokenizer: Any, name: str) -> None:
    if tokenizer.eos_token == GEMMA2_END_OF_TURN or GEMMA2_END_OF_TURN not in tokenizer.get_vocab():
        return
    old = tokenizer.eos_token
    tokenizer.eos_token = GEMMA2_END_OF_TURN
    warnings.warn(
        f"Tokenizer {name!r} is a Gemma-2 instruct tokenizer whose eos token is {old!r}, but its chat "
        f"turns end with {GEMMA2_END_OF_TURN!r}: using {GEMMA2_END_OF_TURN!r} (id {tokenizer.eos_token_id}) "
        "as eos token. Pass correct_gemma2=False to keep the original.",
        UserWarning,
        stacklevel=3,
    )


def _use_eos_as_pad(tokenizer: Any, name: str) -> None:
    if tokenizer.eos_token is None:
        warnings.warn(
            f"Tokenizer {name!r} has neither a pad token nor an eos token; set one, e.g. "
            "tokenizer.pad_token = '<pad>', before batching.",
            UserWarning,
            stacklevel=3,
        )
        return
    tokenizer.pad_token = tokenizer.eos_token
    warnings.warn(
        f"Tokenizer {name!r} has no pad token: using its eos token {tokenizer.eos_token!r} "
        f"(id {tokenizer.eos_token_id}) as pad token. Pass correct_pad_token=False to keep it unset.",
        UserWarning,
        stacklevel=3,
    )


def hf_processor(name_or_path: str | os.PathLike[str], **kwargs: Any) -> Any | None:
    """The multimodal processor of a model (``AutoProcessor.from_pretrained``), or None if it has none.

    A model has a processor when ``AutoProcessor`` gives a ``ProcessorMixin`` (a tokenizer
    combined with an image, video or audio processor). A plain tokenizer, a lone image
    processor, or transformers saying it recognises no processing class (``ValueError`` /
    ``KeyError``) all mean None. Other errors, e.g. a folder that does not exist, propagate.

    Without a working ``torchvision``, transformers 5 has no video processors, and building a
    processor that declares one (Qwen2-VL's, Qwen2.5-VL's, ...) fails while it looks that class up.
    The processor is then assembled from the folder's tokenizer and image processor (whose PIL
    backend needs no torchvision) with no video processor, and a warning says that videos need
    torchvision; images work exactly as with the full processor.
    """
    from transformers import AutoProcessor, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(os.fspath(name_or_path), **kwargs)
    except (ValueError, KeyError):
        return None
    except (AttributeError, ImportError) as exc:  # no torchvision: the video processor class is missing
        processor = _assemble_without_video(os.fspath(name_or_path), exc, **kwargs)
        if processor is None:
            raise
    return processor if isinstance(processor, ProcessorMixin) else None


def _assemble_without_video(path: str, cause: BaseException, **kwargs: Any) -> Any | None:
    """The model's processor built from its tokenizer and image processor, with no video processor;
    None when the folder does not name a processor class that takes those (then ``cause`` stands)."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    name = _processor_class_name(path)
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        return None
    try:
        image_processor = AutoImageProcessor.from_pretrained(path, **kwargs)
    except Exception:
        return None
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    processor = processor_without_video(cls, image_processor, tokenizer, _chat_template(path))
    warnings.warn(
        f"Loaded {name} for {path!r} without its video processor ({type(cause).__name__}: {cause}); "
        "images work, videos need torchvision installed.",
        UserWarning,
        stacklevel=3,
    )
    return processor


def processor_without_video(
    cls: type, image_processor: Any, tokenizer: Any, chat_template: str | None
) -> Any:
    """``cls(image_processor=..., tokenizer=..., video_processor=None, chat_template=...)``, skipping
    transformers' class check of the absent video processor (the check itself needs torchvision)."""

    class _Assembled(cls):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    _Assembled.__name__ = _Assembled.__qualname__ = cls.__name__
    return _Assembled(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=chat_template,
    )


def _processor_class_name(path: str) -> str | None:
    import json

    for file in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(path, file), encoding="utf-8") as handle:
                name = json.load(handle).get("processor_class")
        except (OSError, ValueError):
            continue
        if name:
            return str(name)
    return None


def _chat_template(path: str) -> str | None:
    import json

    for file, read in (
        ("chat_template.jinja", lambda text: text),
        ("chat_template.json", lambda text: json.loads(text).get("chat_template")),
    ):
        try:
            with open(os.path.join(path, file), encoding="utf-8") as handle:
                return read(handle.read())
        except OSError:
            continue
    return None


def normalize_token_ids(output: Any) -> list[int]:
    """The token ids in ``output`` as a plain ``list[int]``.

    ``apply_chat_template(..., tokenize=True)`` returns a list in transformers 4 and a
    ``BatchEncoding`` in transformers 5; tokenizers and engines return tensors or arrays of
    shape ``(seq,)`` or ``(1, seq)``. All of these are accepted: lists and tuples of ints, a
    single nested list ``[[1, 2, 3]]``, 1-D integer tensors / numpy arrays or 2-D ones with one
    row, and mappings (``dict``, ``BatchEncoding``) with an ``input_ids`` entry of those kinds.

    Raises:
        TypeError: anything else (a batch of several rows, floats, bools, strings, a mapping
            without ``input_ids``, ...); the message names the type or shape received.
    """
    value = output
    what = _describe(output)
    if isinstance(output, Mapping):
        if "input_ids" not in output:
            keys = ", ".join(repr(k) for k in output)
            _reject(what, f" without 'input_ids' (its keys: {keys or 'none'})")
        value = output["input_ids"]
        what = f"{what} whose 'input_ids' is a {_describe(value)}"
        if isinstance(value, Mapping):
            _reject(what, "")
    if isinstance(value, (str, bytes)):
        _reject(what, " (text, not token ids: tokenize it first)")
    if hasattr(value, "shape") and hasattr(value, "tolist"):  # torch tensors, numpy arrays
        shape = tuple(value.shape)
        if len(shape) == 2 and shape[0] == 1:
            items = value.tolist()[0]
        elif len(shape) == 1:
            items = value.tolist()
        elif len(shape) == 2:
            _reject(what, f" (a batch of {shape[0]} sequences: pass one row, e.g. output[0])")
        else:
            _reject(what, f" ({len(shape)} dimensions)")
    elif isinstance(value, (list, tuple)):
        items = list(value)
        if len(items) == 1 and isinstance(items[0], (list, tuple)):
            items = list(items[0])
        elif any(isinstance(item, (list, tuple)) for item in items):
            _reject(what, f" (a batch of {len(items)} sequences: pass one, e.g. output[0])")
    else:
        _reject(what, "")
    ids: list[int] = []
    for position, item in enumerate(items):
        token_id = _as_int(item)
        if token_id is None:
            _reject(what, f" (item {position} is {item!r} of type {type(item).__name__}, not an integer)")
        ids.append(token_id)
    return ids


def _as_int(item: Any) -> int | None:
    if isinstance(item, bool):  # an int subclass, but never a token id
        return None
    try:
        return operator.index(item)  # ints, numpy and 0-d torch integers; not floats
    except TypeError:
        return None


def _describe(value: Any) -> str:
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{name} of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (list, tuple)):
        return f"{name} of {len(value)} items"
    return name


def _reject(what: str, reason: str) -> NoReturn:
    raise TypeError(
        f"normalize_token_ids cannot read token ids from a {what}{reason}. It accepts {_ACCEPTED}."
    )
