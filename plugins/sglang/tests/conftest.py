"""Shared setup: one torch thread, a tiny model on disk, and the fake SGLang (helpers: sglang_helpers.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from trellis_sglang.replica import SGLangRolloutReplica
from trellis_sglang.testing import FakeSGLang

torch.set_num_threads(1)  # shared cores: oversubscribed OpenMP threads are many times slower


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from trellis.testing.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def hf(tiny_model_path: str) -> tuple[Any, Any]:
    """The tiny model (eval mode, float32) and its tokenizer, as Hugging Face loads them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeSGLang:
    """A fresh fake SGLang that every SGLangRolloutReplica built in the test uses."""
    fake = FakeSGLang()
    monkeypatch.setattr(SGLangRolloutReplica, "load_sglang", staticmethod(lambda: fake.api))
    return fake
