"""trellis.recipes.tiny: the offline tokenizer and model tests build (re-exported by trellis.testing.tiny)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import trellis.recipes.tiny
import trellis.testing.tiny
from trellis.recipes.tiny import (
    MANIFEST,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    cached_tiny_model,
)


def test_tokenizer_round_trips_any_text_and_has_chatml():
    tokenizer = build_tiny_tokenizer()
    text = "Héllo, wörld! 12 + 7 = 19 ✓"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|pad|>"
    assert tokenizer.padding_side == "left"
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_model_shapes_and_determinism(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert tokenizer.padding_side == "left"  # survives the reload
    config = model.config
    shape = (config.hidden_size, config.num_hidden_layers, config.head_dim, config.num_key_value_heads)
    assert shape == (64, 2, 32, 1)
    assert 50_000 < sum(p.numel() for p in model.parameters()) < 200_000
    ids = torch.tensor([tokenizer("What is 2 + 3?")["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    again = build_tiny_model(build_tiny_tokenizer(), seed=0)
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_testing_tiny_re_exports_the_recipes_module():
    """Plugins' tests import the builders from trellis.testing.tiny: the same objects, nothing more."""
    names = [
        "CHATML_TEMPLATE",
        "SPECIAL_TOKENS",
        "build_tiny_model",
        "build_tiny_tokenizer",
        "save_tiny_model",
    ]
    assert sorted(trellis.testing.tiny.__all__) == names
    for name in names:
        assert getattr(trellis.testing.tiny, name) is getattr(trellis.recipes.tiny, name)


@pytest.fixture
def builds(monkeypatch):
    """The folders :func:`cached_tiny_model` built (through save_tiny_model) while the test ran."""
    built = []
    save = trellis.recipes.tiny.save_tiny_model

    def counting(path, **kwargs):
        built.append(path)
        return save(path, **kwargs)

    monkeypatch.setattr(trellis.recipes.tiny, "save_tiny_model", counting)
    return built


def test_cached_tiny_model_is_built_once_then_reused(tmp_path, builds, tiny_model_path):
    folder = cached_tiny_model(tmp_path)
    assert cached_tiny_model(tmp_path) == folder and len(builds) == 1
    assert os.listdir(tmp_path) == [os.path.basename(folder)]  # no temporary folder left behind
    # what save_tiny_model writes, file for file, plus the manifest of their SHA-256
    names = sorted(os.listdir(tiny_model_path))
    assert sorted(os.listdir(folder)) == sorted([*names, MANIFEST])
    for name in names:
        with (
            open(os.path.join(folder, name), "rb") as a,
            open(os.path.join(tiny_model_path, name), "rb") as b,
        ):
            assert a.read() == b.read(), name
    with open(os.path.join(folder, MANIFEST)) as f:
        assert sorted(json.load(f)) == names


def test_cached_tiny_model_keys_on_its_recipe(tmp_path, builds):
    default = cached_tiny_model(tmp_path)
    other = cached_tiny_model(tmp_path, seed=1)
    wider = cached_tiny_model(tmp_path, intermediate_size=256)
    assert len({default, other, wider}) == 3 and len(builds) == 3
    assert cached_tiny_model(tmp_path, seed=1) == other and len(builds) == 3


@pytest.mark.parametrize("damage", ["truncated weights", "missing manifest", "extra file", "bad manifest"])
def test_a_damaged_cached_tiny_model_is_built_again(tmp_path, builds, damage):
    folder = cached_tiny_model(tmp_path)
    weights = os.path.join(folder, "model.safetensors")
    with open(weights, "rb") as f:
        intact = f.read()
    if damage == "truncated weights":
        with open(weights, "wb") as f:
            f.write(intact[:1000])
    elif damage == "missing manifest":
        os.remove(os.path.join(folder, MANIFEST))
    elif damage == "extra file":
        open(os.path.join(folder, "stray.bin"), "wb").close()
    else:
        with open(os.path.join(folder, MANIFEST), "w") as f:
            f.write("[not a manifest")
    assert cached_tiny_model(tmp_path) == folder and len(builds) == 2
    with open(weights, "rb") as f:
        assert f.read() == intact
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(folder)]
