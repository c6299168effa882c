"""Eager attention for grouped-query models without repeating the key/value heads (``trellis_eager``).

transformers' ``eager`` attention copies each key/value head once per query head that reads it
(``repeat_kv``) before its two matmuls, and autograd keeps those copies for backward. In a
grouped-query model the copies are ``groups`` times the cache: SmolLM2-135M has 9 query heads on 3
key/value heads, so a 32-row micro-batch of the demo kept 170 MiB of repeated keys and values for
backward where the keys and values themselves are 57 MiB.

Here the query heads that share a key/value head are laid one after another along the query axis
instead, ``(b, h, q, d) -> (b, h_kv, groups * q, d)``, so both matmuls read each key/value head as it
is: the same dot products and the same softmax per query as eager, without the copies. The mask
``(b, 1, q, k)`` broadcasts over the groups. :func:`trellis.engine.models.load_model` loads text
models whose attention is grouped with this implementation when ``model.attn_implementation`` is
``eager`` (as it turns ``sdpa`` into ``trellis_varlen_sdpa`` for packed sequences); the rollout
replicas load their own models with ``eager`` as asked.

What eager computes beyond that stays the model's own: attention with logit soft-capping (Gemma 2)
or sink logits (gpt-oss), and a module whose heads are not grouped, run the eager function of the
module's modeling file.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

GROUPED_EAGER = "trellis_eager"


def register_grouped_eager() -> str:
    """Register ``trellis_eager`` (and its mask: eager's) with transformers; returns its name.

    Calling this again is harmless. It affects only models loaded with, or set to, this name.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(GROUPED_EAGER, grouped_eager_forward)
    AttentionMaskInterface.register(GROUPED_EAGER, eager_mask)
    return GROUPED_EAGER


def is_grouped(config: Any) -> bool:
    """Whether the text model of ``config`` has fewer key/value heads than query heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None)
    return isinstance(heads, int) and isinstance(kv_heads, int) and 0 < kv_heads < heads


def grouped_eager_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' attention-function signature: query ``(b, h, q, d)``, key and value
    ``(b, h_kv, k, d)``, an additive mask ``(b, 1, q, >= k)`` or None.

    Returns:
        ``(output (b, q, h, d_v), attention weights (b, h, q, k))``, as eager returns them.
    """
    b, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    special = any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks"))
    if kv_heads == heads or heads % kv_heads or special or hasattr(module, "sinks"):
        return _model_eager(module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    groups = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    # query head kv * groups + g reads key/value head kv (what repeat_kv lays out): one block per kv head
    scores = torch.matmul(query.reshape(b, kv_heads, groups * length, dim), key.transpose(2, 3)) * scale
    scores = scores.view(b, kv_heads, groups, length, keys)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None, :, :keys]
    weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights.view(b, kv_heads, groups * length, keys), value)
    output = output.view(b, heads, length, value.shape[-1]).transpose(1, 2).contiguous()
    return output, weights.view(b, heads, length, keys)


def _model_eager(module: torch.nn.Module) -> Any:
    """The eager attention function of ``module``'s modeling file (Llama's where it has none)."""
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is not None:
        return own
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward
