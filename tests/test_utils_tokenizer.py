"""trellis.utils.tokenizer: loading tokenizers and processors, reading token ids from any output."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
import torch
from transformers import BatchEncoding

from trellis.recipes.tiny import build_tiny_tokenizer
from trellis.utils.tokenizer import hf_processor, hf_tokenizer, normalize_token_ids

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return hf_tokenizer(tiny_model_path)


@pytest.fixture
def no_pad_path(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "no-pad")
    return str(tmp_path / "no-pad")


# ---------------------------------------------------------------- hf_tokenizer


def test_hf_tokenizer_keeps_an_existing_pad_token(tiny_model_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokenizer = hf_tokenizer(tiny_model_path)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|pad|>", 3)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.padding_side == "left"
    assert not [w for w in caught if "pad token" in str(w.message)]


def test_hf_tokenizer_pads_with_eos_and_says_so(no_pad_path):
    with pytest.warns(UserWarning) as caught:
        tokenizer = hf_tokenizer(no_pad_path)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    (message,) = [str(w.message) for w in caught if "pad token" in str(w.message)]
    assert message == (
        f"Tokenizer {no_pad_path!r} has no pad token: using its eos token '<|im_end|>' (id 2) as pad "
        "token. Pass correct_pad_token=False to keep it unset."
    )
    # Padding now works on a batch of different lengths.
    batch = tokenizer(["12 + 7", "3"], padding=True)
    assert batch["input_ids"][1][0] == 2


def test_hf_tokenizer_without_pad_correction(no_pad_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of ours
        tokenizer = hf_tokenizer(no_pad_path, correct_pad_token=False)
    assert tokenizer.pad_token is None and tokenizer.pad_token_id is None


def test_hf_tokenizer_passes_kwargs(tiny_model_path):
    assert hf_tokenizer(tiny_model_path, padding_side="right").padding_side == "right"


@pytest.fixture
def gemma_like(tmp_path):
    """A tokenizer with '<end_of_turn>' saved under a Gemma-2 instruct name, and under another name."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<end_of_turn>"]})
    for name in ("gemma-2-2b-it", "llama-3-it"):
        tokenizer.save_pretrained(tmp_path / name)
    return tmp_path


def test_hf_tokenizer_gemma2_uses_end_of_turn_as_eos(gemma_like):
    path = str(gemma_like / "gemma-2-2b-it")
    with pytest.warns(UserWarning) as caught:
        tokenizer = hf_tokenizer(path)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<end_of_turn>", 400)
    assert [str(w.message) for w in caught] == [
        f"Tokenizer {path!r} is a Gemma-2 instruct tokenizer whose eos token is '<|im_end|>', but its chat "
        "turns end with '<end_of_turn>': using '<end_of_turn>' (id 400) as eos token. Pass "
        "correct_gemma2=False to keep the original."
    ]
    assert tokenizer.pad_token == "<|pad|>"  # untouched


def test_hf_tokenizer_gemma2_fix_can_be_declined_or_overridden(gemma_like):
    path = str(gemma_like / "gemma-2-2b-it")
    assert hf_tokenizer(path, correct_gemma2=False).eos_token == "<|im_end|>"
    assert hf_tokenizer(path, eos_token="<|endoftext|>").eos_token == "<|endoftext|>"
    # Not a Gemma-2 name: left alone even though the token exists.
    assert hf_tokenizer(str(gemma_like / "llama-3-it")).eos_token == "<|im_end|>"


# ---------------------------------------------------------------- hf_processor


def test_hf_processor_is_none_for_a_plain_tokenizer(tiny_model_path):
    assert hf_processor(tiny_model_path) is None


def test_hf_processor_is_none_when_there_is_nothing_to_process(tiny_model_path, tmp_path):
    shutil.copy(f"{tiny_model_path}/config.json", tmp_path / "config.json")  # a model, no tokenizer
    assert hf_processor(tmp_path) is None


def test_hf_processor_returns_a_real_processor(tmp_path):
    from transformers import WhisperFeatureExtractor, WhisperProcessor

    WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(), tokenizer=build_tiny_tokenizer()
    ).save_pretrained(tmp_path)
    processor = hf_processor(str(tmp_path))
    assert type(processor).__name__ == "WhisperProcessor"
    assert processor.tokenizer("12 + 7")["input_ids"] == build_tiny_tokenizer()("12 + 7")["input_ids"]


def test_hf_processor_missing_folder_is_an_error(tmp_path):
    with pytest.raises(OSError):
        hf_processor(str(tmp_path / "missing"))


# ---------------------------------------------------------------- normalize_token_ids


def test_chat_template_output_of_this_transformers(tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert expected[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    output = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    assert normalize_token_ids(output) == expected
    tensors = tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert normalize_token_ids(tensors) == expected


@pytest.mark.parametrize(
    "output",
    [
        [5, 6, 7],
        (5, 6, 7),
        [[5, 6, 7]],
        ([5, 6, 7],),
        [np.int64(5), np.int32(6), 7],
        torch.tensor([5, 6, 7]),
        torch.tensor([[5, 6, 7]]),
        list(torch.tensor([5, 6, 7])),  # 0-d integer tensors
        np.array([5, 6, 7]),
        np.array([[5, 6, 7]], dtype=np.uint16),
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},
        {"input_ids": torch.tensor([[5, 6, 7]])},
        BatchEncoding({"input_ids": [5, 6, 7]}),
        BatchEncoding({"input_ids": np.array([[5, 6, 7]])}),
    ],
    ids=lambda o: type(o).__name__,
)
def test_normalize_token_ids_accepts(output):
    ids = normalize_token_ids(output)
    assert ids == [5, 6, 7]
    assert all(type(i) is int for i in ids)


@pytest.mark.parametrize("output", [[], (), [[]], torch.tensor([], dtype=torch.long), np.zeros((1, 0), int)])
def test_normalize_token_ids_empty(output):
    assert normalize_token_ids(output) == []


ACCEPTS = (
    "It accepts a list or tuple of ints, a single nested list like [[1, 2, 3]], a 1-D integer tensor or "
    "numpy array (or 2-D with one row), or a dict / BatchEncoding holding 'input_ids'."
)


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ([[1, 2], [3, 4]], "from a list of 2 items (a batch of 2 sequences: pass one, e.g. output[0])."),
        (
            torch.tensor([[1, 2], [3, 4]]),
            "from a torch.Tensor of shape (2, 2) and dtype torch.int64 (a batch of 2 sequences: "
            "pass one row, e.g. output[0]).",
        ),
        (np.zeros((1, 2, 3), int), "from a numpy.ndarray of shape (1, 2, 3) and dtype int64 (3 dimensions)."),
        (torch.tensor(7), "from a torch.Tensor of shape () and dtype torch.int64 (0 dimensions)."),
        ([1.0, 2.0], "from a list of 2 items (item 0 is 1.0 of type float, not an integer)."),
        (
            torch.tensor([1.5, 2.0]),
            "from a torch.Tensor of shape (2,) and dtype torch.float32 (item 0 is 1.5 of type float, "
            "not an integer).",
        ),
        ([1, True], "from a list of 2 items (item 1 is True of type bool, not an integer)."),
        ([1, "2"], "from a list of 2 items (item 1 is '2' of type str, not an integer)."),
        ("hello", "from a str (text, not token ids: tokenize it first)."),
        ({"ids": [1, 2]}, "from a dict without 'input_ids' (its keys: 'ids')."),
        (
            BatchEncoding({"input_ids": [[1, 2], [3, 4]]}),
            "from a transformers.tokenization_utils_base.BatchEncoding whose 'input_ids' is a list of 2 "
            "items (a batch of 2 sequences: pass one, e.g. output[0]).",
        ),
        (None, "from a NoneType."),
        (5, "from a int."),
    ],
    ids=lambda o: type(o).__name__,
)
def test_normalize_token_ids_rejects(output, message):
    with pytest.raises(TypeError) as info:
        normalize_token_ids(output)
    assert str(info.value) == f"normalize_token_ids cannot read token ids {message} {ACCEPTS}"
