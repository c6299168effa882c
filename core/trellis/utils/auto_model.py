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


def load_pretrained(auto_class: Any, path: str, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained(path, **kwargs)`` without transformers' Hub kernels
    (:func:`without_hub_kernels` says why): from transformers 5, where kernelizing became the default,
    with ``use_kernels=False`` (older releases take no such argument or default to off), and reset
    after loading all the same."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["use_kernels"] = False
    return without_hub_kernels(auto_class.from_pretrained(path, **kwargs))


def without_hub_kernels(model: Any) -> Any:
    """``model`` with transformers' Hub kernels turned off; returns it.

    transformers 5 kernelizes every model it loads when the ``kernels`` package is installed (it is a
    dependency of transformers): on each ``train()`` / ``eval()`` that changes the mode it swaps the
    forwards of layers it has a mapping for (RMSNorm, rotary embedding, SiLU, ...) for kernels fetched
    from the Hugging Face Hub and run as remote code, per device and per mode. On an accelerator that
    means a download in the middle of a step, other kernels in training than in forward-only passes (the
    old log-probs, the rollout), and a walk of every module at each switch (about 1 ms on the tiny model
    and 4 ms on SmolLM2-135M even on the CPU, where no kernel applies). Trellis' own fused kernels are
    ``model.fused_kernels``. Older transformers without the feature are left as they are.
    """
    if getattr(model, "use_kernels", False):
        model.use_kernels = False  # transformers' reset: torch forwards, no kernelize on a mode switch
    return model
