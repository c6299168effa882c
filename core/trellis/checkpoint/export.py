"""Export a training checkpoint as a Hugging Face model folder.

    export_to_hf("runs/p/e/checkpoints/global_step_200", "exported/")    # or: trellis export CKPT --to DIR

The result (``config.json``, tokenizer files, ``model.safetensors``) loads with
``AutoModelForCausalLM.from_pretrained`` (a critic's with ``AutoModelForTokenClassification``).

Each rank's shard of the role's part (``actor/rank_R.pt``; in a checkpoint without parts,
``rank_R.pt``) holds its engine's model state (:meth:`TrainingEngine.state_dict`) under the
role's name. A ``single`` engine's is whole. An ``fsdp`` engine's holds that rank's shard of every parameter:
FSDP2 splits each tensor along dim 0 into ``torch.chunk(tensor, world_size)`` pieces (ranks
past the last piece get empty ones), so the whole tensor is the concatenation of the non-empty
shards in rank order; tensors FSDP does not shard (buffers) are whole on every rank. The whole
shapes come from the model's config (the architecture built on the meta device, no memory),
which tells the two cases apart and checks the result.

The config and tokenizer come from the checkpoint's ``hf/`` folder (saved with
``hf_files=`` of ``CheckpointManager.publish`` or ``save``) or, for checkpoints saved without it, from
``base_model``.

LoRA (``model.lora``): an engine with adapters saves only them (peft's names, ``...q_proj.lora_A.
default.weight``; the critic's head as ``score.modules_to_save.default.*``) and records its
settings in its state (``"lora"``: ``rank``, ``alpha``, ``base_model``, ...). Export loads the
base weights from ``base_model`` (if given) or the recorded one (the run's ``model.path``), puts
the adapters on them with peft, merges them (``W + (alpha / rank) · B A``) and writes the whole
model under the base model's own names: a plain Hugging Face folder, no adapters left.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from trellis.checkpoint.training import (
    HF_DIR,
    MANIFEST,
    Store,
    checkpoint_parts,
    hf_file_contents,
    load_rank_file,
    verify_checkpoint,
)
from trellis.errors import CheckpointError

__all__ = ["export_to_hf", "merge_model_shards"]

ROLES = ("actor", "critic", "ref")

_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
"""Name parts of peft's low-rank matrices (as :data:`trellis.engine.lora.LORA_PARTS`)."""


def export_to_hf(
    ckpt_dir: str | os.PathLike[str],
    hf_dir: str | os.PathLike[str],
    *,
    role: str = "actor",
    base_model: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> str:
    """Write the ``role`` model of checkpoint ``ckpt_dir`` as a Hugging Face folder ``hf_dir``.

    Args:
        ckpt_dir: a ``global_step_N`` folder (local path or fsspec URL).
        hf_dir: the folder to create (local path or URL); it must not exist or be empty.
        role: the entry of the saved states to export (``"actor"``, ``"critic"``, ``"ref"``).
        base_model: a Hugging Face folder to take the config and tokenizer from, when the
            checkpoint has no ``hf/`` folder (or to override it).
        overwrite: allow a non-empty ``hf_dir`` (files of the same names are replaced).

    Returns:
        ``hf_dir``.

    Raises:
        CheckpointError: ``ckpt_dir`` is not a complete checkpoint, holds no ``role`` model, has no
            config (and no ``base_model``), its shards do not fit the config, or ``hf_dir`` is not
            empty; the message names the path and the fix.
    """
    import torch

    ckpt_dir, hf_dir = os.fspath(ckpt_dir), os.fspath(hf_dir)
    if role not in ROLES:
        raise CheckpointError(f"Cannot export role={role!r} of {ckpt_dir!r}: use one of {list(ROLES)}.")
    manifest = verify_checkpoint(ckpt_dir)
    out = Store(hf_dir)
    if not overwrite and out.listdir():
        raise CheckpointError(
            f"Cannot export to {hf_dir!r}: the folder is not empty. Choose a new folder, or pass "
            "overwrite=True (--force)."
        )
    metadata = _metadata_files(ckpt_dir, manifest, base_model)
    parts = checkpoint_parts(manifest)
    if parts is not None and role not in parts:
        raise CheckpointError(
            f"Checkpoint {ckpt_dir!r} holds no {role!r} model; it holds the parts {sorted(parts)}. Pass "
            "role= (--role) one of those."
        )
    shards: list[dict[str, torch.Tensor]] = []
    kinds = set()
    lora: dict[str, Any] | None = None
    for rank in range(manifest["world_size"] if parts is None else parts[role]):
        states = load_rank_file(ckpt_dir, rank, part=role, manifest=manifest)
        engine_state = _role_state(states, role, ckpt_dir, rank)
        kinds.add(engine_state.get("engine"))
        lora = engine_state.get("lora") or lora
        shards.append(dict(engine_state["model"]))
        del states  # keep one rank's optimizer state in memory at a time
    if lora is None and any(_is_adapter_entry(name) for name in shards[0]):
        raise CheckpointError(
            f"Checkpoint {ckpt_dir!r} ({role}) holds LoRA adapters but not their settings (the engine state "
            "has no 'lora' entry: rank, alpha, base model); export it with a Trellis that records them."
        )

    def write(folder: str) -> None:
        for name, data in metadata.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        model = _meta_model(folder, role, ckpt_dir)
        full_shapes = {key: value.shape for key, value in model.state_dict().items()}
        try:
            if lora is None:
                merged = merge_model_shards(shards, full_shapes)
            else:
                merged = _merge_lora(shards, lora, role, base_model, ckpt_dir)
        except CheckpointError as exc:
            raise CheckpointError(
                f"Cannot export {ckpt_dir!r} ({role}, engine {sorted(map(str, kinds))}): {exc}"
            ) from None
        shards.clear()
        model.load_state_dict(merged, strict=True, assign=True)
        model.tie_weights()  # assign=True unties shared weights (e.g. tied embeddings); tie them again
        model.save_pretrained(folder)

    if out.local:
        os.makedirs(out.full(), exist_ok=True)
        write(out.full())
    else:  # write locally, then upload
        from trellis.utils.fs import copy

        with tempfile.TemporaryDirectory(prefix="trellis-export-") as staging:
            write(staging)
            copy(staging, hf_dir)
    return hf_dir


def merge_model_shards(
    shards: Sequence[Mapping[str, Any]], full_shapes: Mapping[str, Sequence[int]]
) -> dict[str, Any]:
    """The whole model state from every rank's model state, in rank order.

    A tensor of the whole shape on every rank is taken from rank 0 (unsharded: one rank, or a
    buffer); otherwise the non-empty shards are concatenated along dim 0 (FSDP2's ``Shard(0)``).

    Args:
        shards: each rank's ``{name: tensor}``.
        full_shapes: ``{name: whole shape}`` of every entry of the model.

    Raises:
        CheckpointError: a name missing from (or unknown to) the shards, or shards that do not
            make the whole shape; the message names the tensor and the shapes.
    """
    import torch

    if not shards:
        raise CheckpointError("No rank states to merge.")
    for rank, shard in enumerate(shards):
        missing = sorted(set(full_shapes) - set(shard))
        unexpected = sorted(set(shard) - set(full_shapes))
        if missing or unexpected:
            raise CheckpointError(
                f"rank {rank}'s model state does not match the model of the config: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}. Export with the config of the model that was trained "
                "(--base-model)."
            )
    merged: dict[str, Any] = {}
    for key, shape in full_shapes.items():
        shape = torch.Size(shape)
        parts = [shard[key] for shard in shards]
        if all(part.shape == shape for part in parts):
            merged[key] = parts[0]
            continue
        pieces = [part for part in parts if part.numel() > 0]
        whole = torch.cat(pieces, dim=0) if pieces and all(p.dim() == len(shape) for p in pieces) else None
        if whole is None or whole.shape != shape:
            raise CheckpointError(
                f"the shards of {key!r} ({[tuple(p.shape) for p in parts]}) do not make its shape "
                f"{tuple(shape)} along dim 0."
            )
        merged[key] = whole
    return merged


def _merge_lora(
    shards: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any],
    role: str,
    base_model: Any,
    ckpt_dir: str,
) -> dict[str, Any]:
    """The whole model state of a LoRA checkpoint: its adapters (merged over the ranks) put on the base
    weights with peft, merged in, under the base model's own names.

    The adapted layers are exactly those the checkpoint holds adapters for; the critic's head
    (``modules_to_save``) replaces the base model's.

    Raises:
        CheckpointError: no base model to load (none recorded, none given), or adapters that do not fit it.
    """
    import re
    import warnings

    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoConfig, AutoModelForTokenClassification

    from trellis.utils.auto_model import policy_auto_class

    path = os.fspath(base_model) if base_model is not None else settings.get("base_model")
    if not path:
        raise CheckpointError(
            f"Checkpoint {ckpt_dir!r} holds LoRA adapters, and no base model is recorded for them; pass the "
            "Hugging Face folder of the run's model.path as base_model (--base-model PATH)."
        )
    layers = sorted({layer for name in shards[0] if (layer := _adapted_module(name)) is not None})
    saved = sorted({module for name in shards[0] if (module := _saved_module(name)) is not None})
    value_model = role == "critic"
    try:
        base_config = AutoConfig.from_pretrained(path)
        auto_class: Any = AutoModelForTokenClassification if value_model else policy_auto_class(base_config)
        if value_model:  # the engine's value model (trellis.engine.models.load_model); its head is saved
            base_config.num_labels, base_config.classifier_dropout = 1, 0.0
        base = auto_class.from_pretrained(path, config=base_config, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"The base model {path!r} of LoRA checkpoint {ckpt_dir!r} does not load ({exc}); pass the "
            "Hugging Face folder of the run's model.path as base_model (--base-model PATH)."
        ) from exc
    config = LoraConfig(
        r=int(settings["rank"]),
        lora_alpha=settings["alpha"],  # a float: peft scales by lora_alpha / r
        # exactly the layers the checkpoint has adapters for (a pattern matches whole module names)
        target_modules="|".join(f"(?:{re.escape(layer)})" for layer in layers) if layers else None,
        modules_to_save=saved or None,
        task_type=TaskType.TOKEN_CLS if value_model else TaskType.CAUSAL_LM,
        fan_in_fan_out=bool(settings.get("fan_in_fan_out", False)),
        bias="none",
    )
    with warnings.catch_warnings():  # peft reads a property transformers has renamed
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        model = get_peft_model(base, config)
    adapter_shapes = {key: value.shape for key, value in model.state_dict().items() if _is_adapter_entry(key)}
    adapters = merge_model_shards(shards, adapter_shapes)
    model.load_state_dict(adapters, strict=False)
    return dict(model.merge_and_unload().state_dict())


def _is_adapter_entry(name: str) -> bool:
    """A trained entry of a LoRA model's state (as :func:`trellis.engine.lora.is_adapter_entry`)."""
    parts = name.split(".")
    return "modules_to_save" in parts or any(part in _LORA_PARTS for part in parts)


def _adapted_module(name: str) -> str | None:
    """The adapted layer of an adapter entry: ``model.layers.0.mlp.up_proj`` of
    ``base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight``; None for other entries."""
    parts = name.removeprefix("base_model.model.").split(".")
    at = next((i for i, part in enumerate(parts) if part in _LORA_PARTS), None)
    return None if at is None else ".".join(parts[:at])


def _saved_module(name: str) -> str | None:
    """``score`` of ``base_model.model.score.modules_to_save.default.weight`` (a module trained whole)."""
    parts = name.removeprefix("base_model.model.").split(".")
    return ".".join(parts[: parts.index("modules_to_save")]) if "modules_to_save" in parts else None


def _metadata_files(ckpt_dir: str, manifest: dict[str, Any], base_model: Any) -> dict[str, bytes]:
    """Config and tokenizer files by name: from ``base_model`` if given, else the checkpoint's ``hf/``."""
    if base_model is not None:
        return dict(hf_file_contents(os.fspath(base_model)))
    prefix = f"{HF_DIR}/"
    names = [rel[len(prefix) :] for rel in manifest["files"] if rel.startswith(prefix)]
    if "config.json" not in names:
        raise CheckpointError(
            f"Checkpoint {ckpt_dir!r} has no {HF_DIR}/config.json (it was saved without hf_files=). Pass the "
            "Hugging Face folder of the trained model as base_model (trellis export ... --base-model PATH)."
        )
    store = Store(ckpt_dir)
    return {name: store.read_bytes(f"{prefix}{name}") for name in names}


def _role_state(states: Any, role: str, ckpt_dir: str, rank: int) -> dict[str, Any]:
    if not isinstance(states, dict) or role not in states:
        have = (
            [k for k, v in states.items() if isinstance(v, dict) and "model" in v]
            if isinstance(states, dict)
            else []
        )
        raise CheckpointError(
            f"Checkpoint {ckpt_dir!r} (rank {rank}) holds no {role!r} model; it holds {sorted(have)}. Pass "
            "role= (--role) one of those."
        )
    state = states[role]
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(
            f"Checkpoint {ckpt_dir!r} (rank {rank}): entry {role!r} is not an engine state (no 'model' "
            f"dict); save engine.state_dict() under it. (Its {MANIFEST} lists what was saved.)"
        )
    return state


def _meta_model(config_dir: str, role: str, ckpt_dir: str) -> Any:
    """The architecture of ``config_dir`` on the meta device (shapes only, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    from trellis.utils.auto_model import policy_auto_class

    try:
        config = AutoConfig.from_pretrained(config_dir)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"The config of checkpoint {ckpt_dir!r} does not load: {exc}") from exc
    auto_class: Any = policy_auto_class(config)
    if role == "critic":  # the engine's value model (trellis.engine.models.load_model)
        config.num_labels = 1
        config.classifier_dropout = 0.0
        auto_class = AutoModelForTokenClassification
    with torch.device("meta"):
        return auto_class.from_config(config, dtype=torch.float32)
