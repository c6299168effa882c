"""trellis.engine.grouped_attention: eager attention on grouped key/value heads without repeating them.

The same outputs, attention weights and gradients as transformers' eager attention; fewer bytes kept
for backward; eager loads as trellis_eager where the heads are grouped, and the model's own eager runs
where this one does not apply."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from trellis.config.schema import ModelConfig
from trellis.engine import grouped_attention
from trellis.engine.grouped_attention import GROUPED_EAGER, grouped_eager_forward, register_grouped_eager
from trellis.engine.models import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


class Attention(torch.nn.Module):
    """What the attention functions read from the module: the head counts and the training flag."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads


def qkv(b=2, heads=6, kv_heads=2, q=5, k=8, d=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(b, heads, q, d, generator=gen),
        torch.randn(b, kv_heads, k, d, generator=gen),
        torch.randn(b, kv_heads, k, d, generator=gen),
    ]
    mask = torch.zeros(b, 1, q, k)
    mask[0, :, :, :3] = torch.finfo(torch.float32).min  # row 0: its first 3 keys are padding
    mask[1] = torch.triu(torch.full((q, k), torch.finfo(torch.float32).min), diagonal=k - q + 1)
    return [t.to(dtype).requires_grad_() for t in tensors], mask


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (6, 1), (4, 4)])
def test_outputs_weights_and_gradients_equal_eager(heads, kv_heads):
    (query, key, value), mask = qkv(heads=heads, kv_heads=kv_heads)
    module = Attention(heads, kv_heads).eval()
    ours, ours_weights = grouped_eager_forward(module, query, key, value, mask, scaling=0.7)
    theirs, their_weights = eager_attention_forward(module, query, key, value, mask, scaling=0.7)
    assert ours.shape == theirs.shape == (2, 5, heads, 4) and ours.is_contiguous()
    assert ours_weights.shape == their_weights.shape == (2, heads, 5, 8)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_weights, their_weights, atol=1e-6, rtol=0)
    assert float(ours_weights[0, :, :, :3].detach().abs().max()) == 0.0  # padding keys get no weight
    probe = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    ours_grads = torch.autograd.grad((ours * probe).sum(), (query, key, value))
    their_grads = torch.autograd.grad((theirs * probe).sum(), (query, key, value))
    for mine, expected in zip(ours_grads, their_grads, strict=True):
        torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)


def test_bfloat16_and_a_longer_mask_and_the_default_scale():
    # bf16 inputs, a mask wider than the keys (sliced as eager's callers did), no scaling: d ** -0.5
    (query, key, value), mask = qkv(dtype=torch.bfloat16)
    wide = torch.cat([mask, torch.zeros(2, 1, 5, 3)], dim=-1)
    module = Attention(6, 2).eval()
    ours, _ = grouped_eager_forward(module, query, key, value, wide)
    theirs, _ = eager_attention_forward(module, query, key, value, mask, scaling=0.5)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), atol=1e-2, rtol=0)


def test_dropout_follows_the_training_flag():
    (query, key, value), mask = qkv()
    module = Attention(6, 2).eval()
    _, weights = grouped_eager_forward(module, query, key, value, mask, scaling=0.5, dropout=0.5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 6, 5), atol=1e-6, rtol=0)  # eval: none dropped
    torch.manual_seed(3)
    _, dropped = grouped_eager_forward(module.train(), query, key, value, mask, scaling=0.5, dropout=0.5)
    live = weights != 0
    gone = (dropped == 0) & live
    assert 0.3 < float(gone.sum() / live.sum()) < 0.7  # about half of the weights dropped, the rest x 2
    kept = (dropped != 0) & live
    torch.testing.assert_close(dropped[kept], 2 * weights[kept], atol=1e-6, rtol=0)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``fn`` runs."""
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(seen.values())


def test_keeps_no_repeated_key_value_heads_for_backward():
    # 8 query heads on 2 key/value heads, 64 keys: eager keeps its 4x repeated keys and values
    (query, key, value), mask = qkv(heads=8, kv_heads=2, q=16, k=64, d=32)
    module = Attention(8, 2).eval()
    ours = saved_bytes(lambda: grouped_eager_forward(module, query, key, value, mask, scaling=0.2))
    theirs = saved_bytes(lambda: eager_attention_forward(module, query, key, value, mask, scaling=0.2))
    repeated = 2 * 2 * 8 * 64 * 32 * 4  # keys and values repeated to (2, 8, 64, 32), float32
    as_they_are = 2 * 2 * 2 * 64 * 32 * 4
    assert theirs - ours == repeated - as_they_are


def test_special_attention_runs_the_modeling_files_own_eager(monkeypatch):
    # a module defined in a modeling file with its own eager: soft-capping, sinks and ungrouped heads go there
    calls = []
    modeling = types.ModuleType("fake_modeling_capped")

    def own_eager(module, query, key, value, attention_mask, **kwargs):
        calls.append(sorted(kwargs))
        return query.transpose(1, 2), None

    modeling.eager_attention_forward = own_eager
    capped = type("CappedAttention", (Attention,), {"__module__": modeling.__name__})
    monkeypatch.setitem(sys.modules, modeling.__name__, modeling)
    (query, key, value), mask = qkv()
    grouped_eager_forward(capped(6, 2), query, key, value, mask, scaling=0.5, softcap=30.0)
    grouped_eager_forward(capped(6, 2), query, key, value, mask, scaling=0.5, s_aux=torch.zeros(6))
    grouped_eager_forward(capped(6, 6), query[:, :2], key, value, mask, scaling=0.5)
    assert calls == [
        ["dropout", "scaling", "softcap"],
        ["dropout", "s_aux", "scaling"],
        ["dropout", "scaling"],
    ]
    output, _ = grouped_eager_forward(capped(6, 2), query, key, value, mask, scaling=0.5)
    assert len(calls) == 3 and output.shape == (2, 5, 6, 4)  # the grouped path itself


def test_eager_loads_as_trellis_eager_where_heads_are_grouped(tiny_model_path):
    # the tiny model: 2 query heads on 1 key/value head; the same logits as transformers' eager, padded
    from transformers import AutoModelForCausalLM

    model = load_model(ModelConfig(path=tiny_model_path, attn_implementation="eager"))
    assert model.config._attn_implementation == GROUPED_EAGER
    sdpa = ModelConfig(path=tiny_model_path, attn_implementation="sdpa", use_remove_padding=False)
    assert load_model(sdpa).config._attn_implementation == "sdpa"
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="eager")
    ids = torch.randint(4, 300, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        theirs = reference(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)


def test_is_grouped_reads_the_text_config():
    plain = types.SimpleNamespace(num_attention_heads=8, num_key_value_heads=8)
    grouped = types.SimpleNamespace(num_attention_heads=8, num_key_value_heads=2)
    nested = types.SimpleNamespace(get_text_config=lambda: grouped)
    assert grouped_attention.is_grouped(grouped) and grouped_attention.is_grouped(nested)
    assert not grouped_attention.is_grouped(plain)
    assert not grouped_attention.is_grouped(types.SimpleNamespace(num_attention_heads=8))
    assert register_grouped_eager() == register_grouped_eager() == GROUPED_EAGER
