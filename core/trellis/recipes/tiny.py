"""A tiny tokenizer and causal LM built from scratch in seconds, for hermetic tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained in memory (every byte is in
its alphabet, so any text round-trips), with ChatML special tokens and chat template; the
model is a 2-layer Llama with hidden size 64, 2 heads of head_dim 32 and 1 KV head (about
0.1M parameters), whose shapes every backend we test (vLLM's CPU attention included) accepts.
Tests build it at test time (:func:`save_tiny_model`); the ``tiny`` preset keeps one in the user
cache, rebuilt whenever its recipe changes (:func:`cached_tiny_model`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from importlib import metadata
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    '</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML; with ``tools`` a system turn lists their schemas, and ``tool`` turns render Qwen-style as user
turns wrapped in ``<tool_response>``."""

_CORPUS = [
    "What is 12 + 7? Let me think step by step. 12 + 7 = 19. The answer is #### 19",
    "Compute 3 * 4 - 5. First 3 * 4 = 12, then 12 - 5 = 7. The final answer is \\boxed{7}.",
    "system You are a helpful assistant. user Please solve the problem. assistant Sure!",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>',
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9",
]


def build_tiny_tokenizer(vocab_size: int = 400, corpus: list[str] | None = None) -> Any:
    """A ``PreTrainedTokenizerFast``: byte-level BPE of ``vocab_size`` tokens, ChatML template.

    eos is ``<|im_end|>``, pad is ``<|pad|>``, padding side is left (as rollout expects).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((corpus or _CORPUS) * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        padding_side="left",  # must be passed here, or it is lost on reload
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(tokenizer: Any, seed: int = 0, **config: Any) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` sized for ``tokenizer``; ``config`` overrides fields."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 32,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1024,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": True,
    }
    settings.update(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**settings))


def save_tiny_model(path: str | os.PathLike[str], seed: int = 0, **config: Any) -> str:
    """Build the tiny tokenizer and model and ``save_pretrained`` both into ``path``; returns it.

    The folder then loads with ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``.
    """
    path = os.fspath(path)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **config)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path


MANIFEST = "trellis_manifest.json"
"""In a :func:`cached_tiny_model` folder: the SHA-256 of each of its files, written last."""


def cached_tiny_model(cache_dir: str | os.PathLike[str] | None = None, seed: int = 0, **config: Any) -> str:
    """A folder holding what ``save_tiny_model(folder, seed, **config)`` writes, built once per recipe.

    The folder is ``<cache_dir>/<key>``, ``cache_dir`` being ``tiny`` in the user cache
    (:func:`trellis.utils.fs.default_cache_dir`) unless given. ``key`` hashes all the build depends on:
    this module's source, ``seed``, ``config`` and the versions of transformers and tokenizers, which
    write the files; so a changed recipe gets a folder of its own, never a stale model. The build goes
    into a temporary folder renamed into place when complete, and the SHA-256 of each file is kept in
    :data:`MANIFEST`, checked on every use (~1 ms): a folder whose files do not match (an edit, a disk
    error, a half-copied cache) is built again. Several processes may ask at once; each gets a whole
    folder.
    """
    if cache_dir is None:
        from trellis.utils.fs import default_cache_dir

        cache_dir = os.path.join(default_cache_dir(), "tiny")
    recipe = {
        "source": _sha256(__file__),
        "seed": seed,
        "config": config,
        "versions": {name: metadata.version(name) for name in ("transformers", "tokenizers")},
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=repr).encode()).hexdigest()[:16]
    folder = os.path.join(os.fspath(cache_dir), key)
    if _intact(folder):
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{folder}.tmp-{uuid.uuid4().hex}"
    try:
        save_tiny_model(tmp, seed=seed, **config)
        digests = {name: _sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(digests, f, indent=1)
        if _intact(folder):  # another process built it meanwhile
            return folder
        if os.path.isdir(folder):  # damaged: moved aside first (a rename onto a folder fails)
            aside = f"{folder}.damaged-{uuid.uuid4().hex}"
            with contextlib.suppress(OSError):  # another process moved it already
                os.replace(folder, aside)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process put its (identical) build in place first
            if not _intact(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _intact(folder: str) -> bool:
    """Whether ``folder`` holds exactly the files its manifest lists, with the listed contents."""
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            digests = json.load(f)
        names = set(os.listdir(folder)) - {MANIFEST}
        return names == set(digests) and all(
            _sha256(os.path.join(folder, name)) == digest for name, digest in digests.items()
        )
    except (OSError, ValueError, TypeError, AttributeError):
        return False
