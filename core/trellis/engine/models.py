"""The models an engine trains: a causal LM (actor, reference) or a value model (critic).

The value model is the Hugging Face ``AutoModelForTokenClassification`` of the policy's
architecture with one label: the LM backbone plus a linear head ``score`` (hidden → 1) in
place of the LM head. The backbone loads from the causal-LM checkpoint; the head (missing there)
is initialised by the architecture's own init, seeded, so every rank and every engine gets the
same head. Parameter names stay Hugging Face's (``model.layers.0...``, ``score.weight``), and a
saved critic reloads with the same class. Its dropout is set to 0: values must not depend on
whether the model is in train or eval mode.

An engine that reads the weights on one rank only (``fsdp``: rank 0) builds the same model on the
others with :func:`build_meta_model`, without storage, and fills it from that rank.

Weights are always loaded in float32 (the optimizer's master copy); ``model.dtype`` is the
compute dtype, applied by the engine (autocast, or FSDP's mixed precision).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from trellis.config.base import schema_default
from trellis.config.schema import ModelConfig
from trellis.engine import grouped_attention, packing
from trellis.utils.auto_model import load_pretrained
from trellis.utils.settings import setting

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(name: Any) -> torch.dtype:
    """The torch dtype named by ``model.dtype`` (``"bfloat16"``, ...; a torch dtype passes through).

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"model.dtype {name!r} is not supported; use one of {list(DTYPES)}.")
    return DTYPES[name]


def model_setting(model_config: Any, key: str) -> Any:
    """``key`` of a ``ModelConfig`` (or a dict, or None); missing or null: the schema's default."""
    return setting(model_config, key, schema_default(ModelConfig, key))


def load_model(
    model_config: Any, *, value_model: bool = False, path: str | None = None, seed: int = 0
) -> Any:
    """Load the float32 model of ``model_config`` on CPU.

    Args:
        model_config: a ``ModelConfig`` (or anything with its keys): ``path``, ``attn_implementation``,
            ``trust_remote_code``, ``override_config``.
        value_model: load the value model (token classification, 1 label) instead of the causal LM.
        path: weights to load instead of ``model_config.path`` (e.g. ``critic.model_path``).
        seed: seeds the initialisation of weights the checkpoint lacks (the value head), without
            touching the caller's random state.

    Raises:
        ValueError: no path; an architecture without a token-classification class (for a critic).
    """
    auto_class, path, kwargs = _model_spec(model_config, value_model=value_model, path=path)
    with torch.random.fork_rng(devices=[]), _no_value_head_class(value_model, kwargs["config"]):
        torch.manual_seed(seed)
        return load_pretrained(auto_class, path, **kwargs)


def build_meta_model(model_config: Any, *, value_model: bool = False, path: str | None = None) -> Any:
    """The model :func:`load_model` loads, with every parameter and buffer on the meta device.

    Same class, config, attention implementation and value head; tied weights are tied. Only the
    config is read from ``path``: the tensors have shapes and dtypes (float32) but no storage, for
    an engine that materialises them later (``to_empty``) and fills them from a rank that loaded
    the weights. The module is in eval mode, as :func:`load_model` returns it.

    Raises:
        ValueError: as :func:`load_model`.
    """
    auto_class, _, kwargs = _model_spec(model_config, value_model=value_model, path=path)
    config = kwargs.pop("config")
    with torch.device("meta"), _no_value_head_class(value_model, config):
        model = auto_class.from_config(config, **kwargs)
    return model.eval()


def _model_spec(model_config: Any, *, value_model: bool, path: str | None) -> tuple[Any, str, dict[str, Any]]:
    """``(auto class, path, from_pretrained kwargs)`` of the model ``load_model`` loads (reads its config)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from trellis.utils.auto_model import policy_auto_class

    path = path or model_setting(model_config, "path")
    if not path:
        raise ValueError(
            "model.path is not set: name the model to train, a Hugging Face hub id or a local folder."
        )
    trust = bool(model_setting(model_config, "trust_remote_code"))
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    for key, value in dict(model_setting(model_config, "override_config")).items():
        setattr(config, key, value)
    auto_class: Any
    if value_model:
        config.num_labels = 1
        config.classifier_dropout = 0.0
        auto_class = AutoModelForTokenClassification
    else:
        auto_class = policy_auto_class(config)  # AutoModelForCausalLM, or image-text-to-text for a VL model
    attn_implementation = model_setting(model_config, "attn_implementation")
    if attn_implementation == "sdpa" and model_setting(model_config, "use_remove_padding"):
        # Packed sequences through sdpa need a 4-D mask: attention over total² positions. Our
        # per-sequence sdpa gives the same numbers and is 1.5-2x faster (benchmarks/packing.py).
        attn_implementation = packing.VARLEN_SDPA
    if attn_implementation == packing.VARLEN_SDPA:  # ours: registered with transformers on first use
        packing.register_varlen_sdpa()
    if attn_implementation == "eager" and grouped_attention.is_grouped(config):
        # eager's math without repeating the key/value heads per query head (the copies autograd kept
        # for backward were 3x the keys and values in SmolLM2)
        attn_implementation = grouped_attention.register_grouped_eager()
    kwargs = {
        "config": config,
        "dtype": torch.float32,
        "attn_implementation": attn_implementation,
        "trust_remote_code": trust,
    }
    return auto_class, path, kwargs


@contextlib.contextmanager
def _no_value_head_class(value_model: bool, config: Any) -> Iterator[None]:
    """Turn transformers' error for an architecture without a token-classification class into ours."""
    try:
        yield
    except ValueError as exc:
        if value_model and "Unrecognized configuration class" in str(exc):
            raise ValueError(
                f"The critic needs a token-classification (value head) class for model type "
                f"{config.model_type!r}, and transformers has none; use a critic.model_path of an "
                "architecture that has one (Llama, Qwen2, Mistral, ...)."
            ) from exc
        raise


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: modules whose class the model lists in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def sparse_tied_embedding_grad(model: Any) -> bool:
    """Make a trained input embedding that is tied to the output layer pass back only the rows it
    looked up (``nn.Embedding.sparse``); whether it did.

    A tied weight's gradient is the output layer's (dense: a matmul over the whole vocabulary) plus the
    lookup's (nonzero only at the looked-up rows). Dense, the lookup's share is built as a zero
    ``(vocab, hidden)`` tensor with those rows scattered in and then added to the output layer's out of
    place: two more vocabulary-sized tensors per pass (113 MB each for SmolLM2-135M in float32). Sparse,
    autograd adds the rows into the output layer's gradient in place. The sum is dense either way, so
    optimizers and gradient clipping see what they always see, with the same values.

    Left dense (False): an embedding that is not tied, not an ``nn.Embedding`` or not trained (``ref``,
    LoRA). Only for engines that hold whole parameters (``single``): sharded (``fsdp``) and streamed
    (``offload``) parameters take dense gradients.
    """
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(embedding, torch.nn.Embedding) or head is None:
        return False
    weight = embedding.weight
    if getattr(head, "weight", None) is not weight or not weight.requires_grad:
        return False
    embedding.sparse = True
    return True


def densify_grads(model: torch.nn.Module) -> None:
    """Turn any sparse ``.grad`` of ``model`` dense: a tied embedding whose output layer took no part in
    a backward pass (:func:`sparse_tied_embedding_grad`) would otherwise reach the optimizer sparse."""
    for param in model.parameters():
        if param.grad is not None and param.grad.is_sparse:
            param.grad = param.grad.to_dense()
