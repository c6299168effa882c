"""trellis.recipes.tiny: the offline tokenizer and model tests build (re-exported by trellis.testing.tiny)."""

from __future__ import annotations

import torch

import trellis.recipes.tiny
import trellis.testing.tiny
from trellis.recipes.tiny import SPECIAL_TOKENS, build_tiny_model, build_tiny_tokenizer


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
