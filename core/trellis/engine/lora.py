"""LoRA adapters through ``peft`` (``model.lora``): train small matrices beside frozen weights.

With ``model.lora.rank`` > 0 an actor or critic engine wraps its model with ``peft``
(:func:`apply_lora`): every targeted layer ``W`` (``d_out × d_in``) gets two trained matrices
``A`` (``rank × d_in``) and ``B`` (``d_out × rank``, zero at the start) and computes::

    y = x Wᵀ + (alpha / rank) · dropout(x) Aᵀ Bᵀ

Only the adapters (and the critic's value head ``score``) require grad, so the optimizer holds
only their state. The reference model never gets adapters: it is the base model.

The engine's state names are peft's (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.
default.weight``). Its training state keeps only the adapter entries (:func:`adapter_state`); on
load the frozen base weights are the engine's own (:func:`with_base_weights`). Weight sync and
export see the merged weights ``W + (alpha / rank) · B A`` under the base model's own Hugging
Face names (:func:`merged_weights`), so a rollout replica serves the current adapters with no
change of its own.

Adapters initialise from a fixed seed: every rank, and every engine of the same settings, starts
from the same ``A`` (``B`` is zero, so the first forward pass equals the base model's).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from trellis.config.base import ConfigValueError, schema_default
from trellis.config.schema import LoraConfig
from trellis.utils.settings import setting

KEYS = ("rank", "alpha", "dropout", "target_modules")
"""The keys of ``model.lora``."""

ALL_LINEAR = "all-linear"
"""``target_modules: [all-linear]``: every linear layer but the output head (peft's shorthand)."""

ADAPTER = "default"
"""peft's name of the (one) adapter, part of every adapter entry's name."""

INIT_SEED = 0
"""Seeds the adapters' initialisation (``A``), so every rank and engine starts from the same one."""

PEFT_PREFIX = "base_model.model."
"""What peft puts before the wrapped model's own names."""

LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
"""Name parts of the low-rank matrices (linear layers; embeddings)."""

SAVED, ORIGINAL, BASE = "modules_to_save", "original_module", "base_layer"
"""Name parts peft uses: a trained copy of a whole module (the critic's head), the frozen module it
copied, and the frozen layer an adapter sits beside."""


def lora_settings(model_config: Any, role: str) -> dict[str, Any] | None:
    """The adapter settings of ``role``'s model, from ``model.lora``; None: no adapters.

    Args:
        model_config: a ``ModelConfig`` (or a dict, or None) whose ``lora`` section (a ``LoraConfig``,
            a dict or None) holds ``rank``, ``alpha``, ``dropout``, ``target_modules``; missing or null
            keys take the schema's defaults.
        role: ``"actor"``, ``"critic"`` or ``"ref"``.

    Returns:
        None for ``ref`` (the reference is the base model) and for ``rank`` 0; otherwise a new plain
        dict ``{"rank": int, "alpha": float, "dropout": float, "target_modules": list[str]}``
        (:func:`apply_lora` adds what it finds in the model: ``fan_in_fan_out``, ``base_model``).

    Raises:
        ConfigValueError: a bad value, naming ``model.lora.<key>`` and the fix; a key ``model.lora``
            does not have.
    """
    section = setting(model_config, "lora", None)
    if isinstance(section, Mapping):
        unknown = sorted(set(section) - set(KEYS))
        if unknown:
            raise ConfigValueError(
                f"model.lora.{unknown[0]}",
                section[unknown[0]],
                f"is not a key of model.lora (it has {list(KEYS)})",
                hint=" Remove it, or check its spelling.",
            )
    values = {key: setting(section, key, schema_default(LoraConfig, key)) for key in KEYS}
    rank = values["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigValueError(
            "model.lora.rank",
            rank,
            "must be a whole number >= 0",
            hint=" Use 0 to train every weight, or an adapter rank such as 8, 16 or 64.",
        )
    if role == "ref" or rank == 0:
        return None
    alpha = values["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ConfigValueError(
            "model.lora.alpha",
            alpha,
            "must be a number > 0",
            hint=f" The update is scaled by alpha / rank; alpha = 2 * rank ({2 * rank}) is a common choice.",
        )
    dropout = values["dropout"]
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ConfigValueError(
            "model.lora.dropout",
            dropout,
            "must be a probability in [0, 1)",
            hint=" Use 0 (the default) so training and rollout passes see the same adapters.",
        )
    targets = values["target_modules"]
    if isinstance(targets, str) or not isinstance(targets, Iterable):
        raise ConfigValueError(
            "model.lora.target_modules",
            targets,
            "must be a list of module names",
            hint=f" Write it as a list: [{targets}], or [q_proj, v_proj], or [{ALL_LINEAR}].",
        )
    targets = list(targets)
    if not targets or not all(isinstance(name, str) and name for name in targets):
        raise ConfigValueError(
            "model.lora.target_modules",
            targets,
            "must be a non-empty list of module names",
            hint=f" Name the layers that get adapters (e.g. [q_proj, v_proj]), or [{ALL_LINEAR}].",
        )
    if ALL_LINEAR in targets and len(targets) > 1:
        raise ConfigValueError(
            "model.lora.target_modules",
            targets,
            f"must be [{ALL_LINEAR}] alone or a list of module names",
            hint=f" [{ALL_LINEAR}] already covers every linear layer.",
        )
    return {"rank": rank, "alpha": float(alpha), "dropout": float(dropout), "target_modules": targets}


def apply_lora(module: Any, settings: dict[str, Any], *, role: str) -> Any:
    """``module`` wrapped by peft with the adapters of ``settings`` (from :func:`lora_settings`).

    The actor's causal LM gets a ``PeftModelForCausalLM``; the critic's value model a
    ``PeftModelForTokenClassification`` whose head ``score`` is trained whole (peft's
    ``modules_to_save``). Only the adapters (and that head) require grad. The wrapper's
    ``forward`` passes every keyword on to the model's (``position_ids``, ``logits_to_keep``,
    packed sequences' ``cu_seq_lens_*``), and ``module.config`` stays readable.

    ``settings`` gets what the model decides, for :func:`merged_weights` and exports:
    ``fan_in_fan_out`` (the targeted layers store ``W`` as ``d_in × d_out``, transformers'
    ``Conv1D`` of GPT-2) and ``base_model`` (where the base weights came from).

    Raises:
        ConfigValueError: ``model.lora.target_modules`` matches no module of the model, or a layer
            whose adapters cannot be merged (only linear and embedding layers can), or an embedding
            tied to the output head.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model
    from peft.tuners.lora import Embedding as LoraEmbedding
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from transformers.pytorch_utils import Conv1D

    targets = settings["target_modules"]
    fan_in_fan_out = any(isinstance(layer, Conv1D) for layer in module.modules())
    config = PeftLoraConfig(
        r=settings["rank"],
        lora_alpha=settings["alpha"],
        lora_dropout=settings["dropout"],
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else list(targets),
        task_type=TaskType.TOKEN_CLS if role == "critic" else TaskType.CAUSAL_LM,
        modules_to_save=["score"] if role == "critic" else None,
        fan_in_fan_out=fan_in_fan_out,
        bias="none",
    )
    base_model = getattr(module, "name_or_path", None)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads a property transformers has renamed; the model's checkpointing is the engine's
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        # targeting a tied embedding is refused below, with the fix
        warnings.filterwarnings(
            "ignore", message=".*a tied layer is part of the adapter", category=UserWarning
        )
        torch.manual_seed(INIT_SEED)
        try:
            wrapped = get_peft_model(module, config)
        except ValueError as exc:
            if "not found in the base model" in str(exc):
                requirement = "must name modules of the model"
            elif "is not supported" in str(exc):  # e.g. a norm layer
                requirement = f"must name linear or embedding layers ({str(exc).split('.')[0]})"
            else:
                raise
            raise ConfigValueError(
                "model.lora.target_modules",
                targets,
                requirement,
                hint=f" Its linear layers are {_linear_names(module)}; or use [{ALL_LINEAR}].",
            ) from None
    tied = bool(getattr(wrapped.config, "tie_word_embeddings", False))
    heads = {id(wrapped.get_input_embeddings()), id(_output_head(wrapped))}
    for name, layer in wrapped.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        if not isinstance(layer, LoraLinear | LoraEmbedding):
            raise ConfigValueError(
                "model.lora.target_modules",
                targets,
                f"must name linear or embedding layers; {name.removeprefix(PEFT_PREFIX)!r} is a "
                f"{type(layer.get_base_layer()).__name__}, whose adapters cannot be merged into its weight",
                hint=f" Its linear layers are {_linear_names(module)}; or use [{ALL_LINEAR}].",
            )
        if tied and (id(layer) in heads or id(layer.get_base_layer()) in heads):
            raise ConfigValueError(
                "model.lora.target_modules",
                targets,
                f"must not name {name.removeprefix(PEFT_PREFIX)!r}: the model ties its input embedding "
                "to its output head, and one merged matrix cannot serve both",
                hint=f" Leave it out, or use [{ALL_LINEAR}] (which skips the output head).",
            )
    settings["fan_in_fan_out"] = fan_in_fan_out
    settings["base_model"] = base_model
    return wrapped


def is_adapter_entry(name: str) -> bool:
    """Whether a state entry of a LoRA model is trained: a low-rank matrix or a trained module copy."""
    parts = name.split(".")
    return SAVED in parts or any(part in LORA_PARTS for part in parts)


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained entries of a LoRA model's state (peft names, tensors as given: shards under fsdp).

    The adapters' ``A`` and ``B`` of every targeted layer and the critic's head
    (``score.modules_to_save.default.*``); not the frozen base weights, which come back from the
    base model (:func:`with_base_weights`).
    """
    return {name: tensor for name, tensor in state.items() if is_adapter_entry(name)}


def with_base_weights(adapters: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """The whole model state to load: ``adapters`` (an :func:`adapter_state`) over ``current``.

    Args:
        adapters: the saved adapter entries.
        current: the engine's own model state (peft names); its frozen base weights are kept.

    Returns:
        Every entry of ``current``, in its order, the adapter entries taken from ``adapters``.

    Raises:
        ValueError: ``adapters`` lacks an adapter entry of the model or holds one it does not have
            (another ``model.lora``, or a state saved without LoRA); the message names a few.
    """
    mine = [name for name in current if is_adapter_entry(name)]
    missing = sorted(set(mine) - set(adapters))
    unexpected = sorted(set(adapters) - set(mine))
    if missing or unexpected:
        hint = ""
        if unexpected and not any(is_adapter_entry(name) for name in unexpected):
            hint = " It holds whole weights: it was saved by an engine without model.lora."
        raise ValueError(
            f"load_state_dict: the saved adapters do not fit this model's (model.lora): missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}.{hint} Load a state saved with the same model and "
            "model.lora settings."
        )
    return {name: adapters.get(name, value) for name, value in current.items()}


def merged_weights(
    named: Iterable[tuple[str, torch.Tensor]], settings: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's own state, adapters merged in, from a LoRA model's ``(name, whole tensor)`` stream.

    Each targeted layer's weight comes out as ``W + (alpha / rank) · B A`` (transposed for
    ``fan_in_fan_out`` layers and embeddings, as peft stores them), under its Hugging Face name
    (``model.layers.0.self_attn.q_proj.weight``); a trained module copy under the module's name
    (``score.modules_to_save.default.weight`` as ``score.weight``), its frozen original dropped;
    every other entry under its name without peft's prefix. Nothing of the adapters is left: the
    names and shapes are exactly the base model's ``state_dict``.

    Streaming: a layer's base weight waits only until its ``A`` and ``B`` have come by (peft keeps
    them together), so at most a few tensors are held at once. The input tensors are not modified.

    Args:
        named: ``(peft name, whole tensor)`` of every entry of the model's state, in its order.
        settings: as :func:`lora_settings` gave them, completed by :func:`apply_lora`.

    Raises:
        ValueError: the stream ended with a layer whose weight, ``A`` or ``B`` never came.
    """
    scaling = settings["alpha"] / settings["rank"]
    fan_in_fan_out = bool(settings.get("fan_in_fan_out", False))
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for full_name, tensor in named:
        parts = full_name.removeprefix(PEFT_PREFIX).split(".")
        if ORIGINAL in parts:  # the frozen original of a trained copy: the copy replaces it
            continue
        if SAVED in parts:  # <module>.modules_to_save.default.<rest> -> <module>.<rest>
            at = parts.index(SAVED)
            yield ".".join(parts[:at] + parts[at + 2 :]), tensor
            continue
        lora = next((i for i, part in enumerate(parts) if part in LORA_PARTS), None)
        if lora is not None:  # <layer>.lora_A.default[.weight]
            layer, kind = ".".join(parts[:lora]), parts[lora]
        elif BASE in parts and parts[-1] == "weight" and parts.index(BASE) == len(parts) - 2:
            layer, kind = ".".join(parts[:-2]), "weight"  # <layer>.base_layer.weight
        else:  # a weight of its own (a base layer's bias: without "base_layer")
            yield ".".join(part for part in parts if part != BASE), tensor
            continue
        entry = pending.setdefault(layer, {})
        entry[kind] = tensor
        merged = _merge(entry, scaling, fan_in_fan_out)
        if merged is not None:
            del pending[layer]
            yield f"{layer}.weight", merged
    if pending:
        layer, entry = next(iter(pending.items()))
        raise ValueError(
            f"merged_weights: the state ended before layer {layer!r} was complete (it had only "
            f"{sorted(entry)}); pass every entry of the model's state."
        )


def _merge(entry: Mapping[str, torch.Tensor], scaling: float, fan_in_fan_out: bool) -> torch.Tensor | None:
    """``W + scaling · ΔW`` of one layer once its base weight and both matrices are in ``entry``."""
    if "weight" not in entry:
        return None
    weight = entry["weight"]
    with torch.no_grad():
        if "lora_A" in entry and "lora_B" in entry:
            delta = entry["lora_B"].float() @ entry["lora_A"].float()  # (d_out, d_in), like nn.Linear
            if fan_in_fan_out:  # Conv1D keeps its weight as (d_in, d_out)
                delta = delta.T
        elif "lora_embedding_A" in entry and "lora_embedding_B" in entry:
            # A (rank, vocab), B (dim, rank): the embedding's (vocab, dim) update is (B A)ᵀ
            delta = (entry["lora_embedding_B"].float() @ entry["lora_embedding_A"].float()).T
        else:
            return None
        return (weight.float() + scaling * delta).to(weight.dtype)


def _linear_names(module: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what ``target_modules`` matches); not
    the adapters' own (``lora_A.default``) nor the frozen layers beside them (``base_layer``)."""
    from transformers.pytorch_utils import Conv1D

    names = set()
    for name, layer in module.named_modules():
        parts = name.split(".")
        if isinstance(layer, torch.nn.Linear | Conv1D) and not {BASE, *LORA_PARTS} & set(parts):
            names.add(parts[-1])
    return sorted(names)


def _output_head(model: Any) -> Any:
    try:
        return model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
