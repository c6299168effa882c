"""Which transformers auto class loads a policy: a causal LM, or an image-text-to-text model.

Vision-language checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, ...) have a config with a
``vision_config`` that ``AutoModelForCausalLM`` does not map; they load with
``AutoModelForImageTextToText``, whose models take the same ``input_ids`` and return the same
``logits`` plus the vision inputs. transformers is imported inside the function only.
"""

from __future__ import annotations

from typing import Any


def is_vision_language(config: Any) -> bool:
    """Whether ``config`` (a transformers config) describes a vision-language model."""
    return getattr(config, "vision_config", None) is not None


def policy_auto_class(config: Any) -> Any:
    """``AutoModelForImageTextToText`` for a vision-language ``config``, else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
