"""The hf replica's lean decoding step (``trellis.rollout.hf_lean``): the same logits as the
``transformers`` forward over left-padded rows, step after step, for Llama and Qwen2 (biases), with
and without transposed weight copies; the models it refuses, and why; the replica's ``decode_step``."""

from __future__ import annotations

import asyncio

import pytest
import torch

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.rollout import SamplingParams, hf_lean
from trellis.rollout.hf import HFRolloutReplica
from trellis.rollout.hf_continuous import left_padded
from trellis.rollout.hf_lean import GROWTH, KVBuffers, LeanDecoder, lean_unsupported

SMALL = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2
)


pytestmark = pytest.mark.usefixtures("one_thread")


def llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **{**SMALL, **overrides})).eval()


def qwen2(**overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, **{**SMALL, **overrides})).eval()
    with torch.no_grad():  # transformers initialises biases to zero: a step that dropped them would pass
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18], [19, 20, 21, 22, 23]]


def _compare(model, layout, steps=6, prompts=PROMPTS):
    """Logits of ``steps`` decoding steps: the transformers forward vs the lean step, same tokens fed."""
    ids, mask = left_padded(prompts, 0)
    n = len(prompts)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache = out.past_key_values
        kv = KVBuffers([(layer.keys, layer.values) for layer in cache.layers], ids.shape[1] + 2)
        lean = LeanDecoder(model, layout=layout)
        nxt, pos = out.logits[:, -1].argmax(-1), mask.sum(1)
        diffs = []
        for _ in range(steps):  # capacity 2 past the prompt: the third step grows the buffers
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], 1)
            ref = model(
                input_ids=nxt[:, None], attention_mask=mask, position_ids=pos[:, None],
                cache=cache, use_cache=True,
            ).logits[:, -1]  # fmt: skip
            got = lean.step(nxt, pos, mask, kv)
            diffs.append(float((ref - got).abs().max()))
            assert got.shape == ref.shape == (n, model.config.vocab_size)
            nxt, pos = ref.argmax(-1), pos + 1
    assert kv.width == ids.shape[1] + steps
    assert kv.capacity == ids.shape[1] + 2 + (GROWTH if steps > 2 else 0)
    return diffs, lean


@pytest.mark.parametrize("build", [llama, qwen2], ids=["llama", "qwen2"])
def test_the_lean_step_gives_the_transformers_logits(build):
    model = build()
    if build is qwen2:
        assert model.model.layers[0].self_attn.q_proj.bias.abs().min() > 0  # the biases are used
    diffs, lean = _compare(model, "plain")
    assert max(diffs) < 1e-5 and lean.weight_copies == 0


def test_bf16_attention_runs_on_float32_copies_on_the_cpu(monkeypatch):
    # torch's CPU attention kernel is about 2x slower in bf16 than on float32 copies at decoding's shapes
    real, seen = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    diffs, _ = _compare(llama().to(torch.bfloat16), "plain", steps=3)
    # 2 layers x 3 steps in float32 (the lean step's); the transformers reference's stay bf16
    assert seen.count((torch.float32,) * 3) == 6 and (torch.bfloat16,) * 3 in seen
    assert max(diffs) < 0.05  # the reference computes its attention in bf16
    assert hf_lean.attention_upcast(torch.zeros(1, dtype=torch.float32)) is None
    assert hf_lean.attention_upcast(torch.zeros(1, dtype=torch.float16)) == torch.float32


def test_transposed_weight_copies_give_the_same_logits(monkeypatch):
    assert LeanDecoder(llama(), layout="transposed").weight_copies == 0  # all under TRANSPOSE_MIN_ELEMENTS
    wide = llama(vocab_size=2048)  # lm_head 2048 x 32 = TRANSPOSE_MIN_ELEMENTS: copied
    lean = LeanDecoder(wide, layout="transposed")
    assert lean.weight_copies == 1 and lean._copies[id(wide.lm_head.weight)].stride() == (2048, 1)
    assert LeanDecoder(wide).weight_copies == 0  # plain unless asked
    monkeypatch.setattr(hf_lean, "TRANSPOSE_MIN_ELEMENTS", 1)
    for model in (llama(), qwen2()):  # qwen2: the q/k/v biases go through addmm
        diffs, lean = _compare(model, "transposed")
        assert lean.weight_copies == 2 * 7 + 1 and max(diffs) < 1e-5  # 7 projections a layer + lm_head
    calls = []
    monkeypatch.setattr(torch, "mm", lambda *a: calls.append(a[0].shape[0]) or torch.matmul(*a))
    monkeypatch.setattr(torch, "addmm", lambda b, x, w: calls.append(x.shape[0]) or torch.matmul(x, w) + b)
    _compare(llama(), "transposed", steps=1)
    assert calls == [5] * (2 * 7 + 1)  # five rows: every projection through its transposed copy
    calls.clear()
    _compare(llama(), "transposed", steps=1, prompts=PROMPTS[:3])
    assert calls == []  # three rows: under TRANSPOSE_MIN_ROWS, the original layout (a GEMV)


needs_onednn = pytest.mark.skipif(not hf_lean.packed_layout_available(), reason="torch without oneDNN")


@needs_onednn
def test_packed_weight_copies_give_the_same_logits(monkeypatch):
    assert LeanDecoder(llama(), layout="packed").weight_copies == 0  # all under PACK_MIN_ELEMENTS
    wide = llama(vocab_size=4096)  # lm_head 4096 x 32 = PACK_MIN_ELEMENTS: packed
    assert LeanDecoder(wide, layout="packed").weight_copies == 1
    assert LeanDecoder(llama(vocab_size=4095), layout="packed").weight_copies == 0
    monkeypatch.setattr(hf_lean, "PACK_MIN_ELEMENTS", 1)
    for model in (llama(), qwen2()):  # qwen2: the q/k/v biases go into the joined packed linear
        diffs, lean = _compare(model, "packed")
        # a layer: q/k/v joined, gate/up joined, o_proj, down_proj; + lm_head
        assert (lean.weight_copies, lean.joined_copies) == (2 * 4 + 1, 2 * 2) and max(diffs) < 1e-5
    no_k_bias = qwen2()
    no_k_bias.model.layers[1].self_attn.k_proj.bias = None  # joins as zeros between q's and v's biases
    diffs, lean = _compare(no_k_bias, "packed")
    assert max(diffs) < 1e-5
    joined_bias = lean._joined[(id(no_k_bias.model.layers[1].self_attn), "q_proj")][1]
    assert joined_bias.shape == (32 + 16 + 16,) and not joined_bias[32:48].any() and joined_bias[48:].any()
    bf16 = llama().to(torch.bfloat16)
    plain, _ = _compare(bf16, "plain", steps=3)
    packed, lean = _compare(bf16, "packed", steps=3)
    # bf16 weights are packed where this CPU's oneDNN packs them (not on AVX2 alone)
    bf16_copies = 9 if "bfloat16" in hf_lean.packed_dtypes() else 0
    assert lean.weight_copies == bf16_copies and max(packed) < 0.05 and max(plain) < 0.05
    mixed = llama()
    mixed.model.layers[0].self_attn.k_proj.to(torch.bfloat16)  # not joined with q and v: packed apart
    assert LeanDecoder(mixed, layout="packed").joined_copies == 3
    half = llama().to(torch.float16)  # not a dtype packed: the original layout
    assert LeanDecoder(half, layout="packed").weight_copies == 0
    real, calls = torch.ops.mkldnn._linear_pointwise, []

    class Ops:  # records the rows of each packed multiply (torch.ops' namespaces are read-only)
        @staticmethod
        def _linear_pointwise(x, *args):
            calls.append(x.shape[0])
            return real(x, *args)

        _reorder_linear_weight = torch.ops.mkldnn._reorder_linear_weight

    monkeypatch.setattr(torch.ops, "mkldnn", Ops)
    _compare(llama(), "packed", steps=1)
    assert calls == [5] * (2 * 4 + 1)  # five rows: every projection through its (joined) packed copy
    calls.clear()
    _compare(llama(), "packed", steps=1, prompts=PROMPTS[:1])
    assert calls == [1] * (2 * 4 + 1)  # one row too: packed copies serve any number of rows


@needs_onednn
def test_bf16_keeps_its_layout_where_onednn_refuses_to_pack_it(monkeypatch):
    """On a CPU with AVX2 alone oneDNN's bf16 reorder raises; packed_dtypes finds that out once and the
    bf16 weights keep their original layout (float32 ones are still packed)."""
    real = torch.ops.mkldnn._reorder_linear_weight

    class Ops:  # oneDNN as on an AVX2-only CPU (torch.ops' namespaces are read-only)
        _linear_pointwise = torch.ops.mkldnn._linear_pointwise

        @staticmethod
        def _reorder_linear_weight(weight, *args):
            if weight.dtype == torch.bfloat16:
                raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs avx_ne_convert")
            return real(weight, *args)

    monkeypatch.setattr(torch.ops, "mkldnn", Ops)
    hf_lean.packed_dtypes.cache_clear()
    try:
        assert hf_lean.packed_dtypes() == ("float32",)
        monkeypatch.setattr(hf_lean, "PACK_MIN_ELEMENTS", 1)
        diffs, lean = _compare(llama().to(torch.bfloat16), "packed", steps=3)
        assert lean.weight_copies == 0 and max(diffs) < 0.05
        assert LeanDecoder(llama(), layout="packed").weight_copies == 2 * 4 + 1  # float32: packed
    finally:
        monkeypatch.undo()
        hf_lean.packed_dtypes.cache_clear()
    assert "float32" in hf_lean.packed_dtypes()


def test_layouts_refused_by_name():
    with pytest.raises(
        ValueError, match=r"layout must be one of \('plain', 'transposed', 'packed'\), got 'fast'"
    ):
        LeanDecoder(llama(), layout="fast")


def test_models_the_lean_step_does_not_take_are_named_with_the_reason():
    assert lean_unsupported(llama()) is None and lean_unsupported(qwen2()) is None
    sliding = qwen2(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 2)
    assert lean_unsupported(sliding) == "a sliding-window attention layer"
    dynamic = llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "rope_type 'dynamic'" in lean_unsupported(dynamic)
    assert lean_unsupported(llama(hidden_act="gelu")) == "hidden_act is 'gelu'"
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    assert lean_unsupported(gpt2) == "model_type 'gpt2' is not one of ('llama', 'qwen2')"
    from peft import LoraConfig, get_peft_model

    adapted = llama()
    get_peft_model(adapted, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # wraps in place
    reason = "a projection is a peft.tuners.lora.layer.Linear, not a torch.nn.Linear (adapters?)"
    assert lean_unsupported(adapted) == reason
    with pytest.raises(ValueError, match="LeanDecoder cannot decode this model: hidden_act is 'gelu'"):
        LeanDecoder(llama(hidden_act="gelu"))


def _replica_run(model, tok_ids, **engine_kwargs):
    async def main():
        replica = HFRolloutReplica(0, RolloutConfig(seed=0, engine_kwargs=engine_kwargs), ModelConfig())
        await replica.init("hybrid", model=model, tokenizer=None)
        try:
            out = await replica.generate(tok_ids, SamplingParams(max_tokens=5, seed=3), "r0")
            return out, replica.decode_stats
        finally:
            await replica.shutdown()

    return asyncio.run(main())


def test_decode_step_chooses_the_path_and_lean_refuses_a_model_it_cannot_take():
    model = llama()
    model.generation_config.eos_token_id = model.config.vocab_size  # runs to max_tokens
    lean, lean_stats = _replica_run(model, [5, 6, 7], decode_step="lean")
    hf, hf_stats = _replica_run(model, [5, 6, 7], decode_step="hf")
    assert lean.token_ids == hf.token_ids and len(lean.token_ids) == 5
    assert (lean_stats.lean_steps, hf_stats.lean_steps) == (4, 0) and hf_stats.steps == 4
    gelu = llama(hidden_act="gelu")
    gelu.generation_config.eos_token_id = gelu.config.vocab_size
    auto, auto_stats = _replica_run(gelu, [5, 6, 7])  # "auto": the model's own forward
    assert len(auto.token_ids) == 5 and (auto_stats.steps, auto_stats.lean_steps) == (4, 0)
    with pytest.raises(ValueError, match=r'decode_step="lean" cannot decode this model: hidden_act is .gelu'):
        _replica_run(gelu, [5, 6, 7], decode_step="lean")
    with pytest.raises(ValueError, match=r'decode_step must be "auto", "lean" or "hf", got .fast.'):
        HFRolloutReplica(0, RolloutConfig(engine_kwargs={"decode_step": "fast"}), ModelConfig())


@pytest.mark.parametrize("layout", ["plain", "transposed", "packed"])
def test_the_replica_decodes_alike_in_every_weight_layout(layout):
    if layout == "packed" and not hf_lean.packed_layout_available():
        pytest.skip("torch without oneDNN")
    wide = llama(vocab_size=4096)  # lm_head 4096 x 32: copied in both copying layouts
    wide.generation_config.eos_token_id = wide.config.vocab_size
    plain, _ = _replica_run(wide, [5, 6, 7], weight_layout="plain")
    out, stats = _replica_run(wide, [5, 6, 7], weight_layout=layout)
    assert out.token_ids == plain.token_ids and stats.lean_steps == 4
    assert (stats.weight_layout, stats.weight_copies) == (layout, 0 if layout == "plain" else 1)


def test_weight_layout_auto_packs_on_the_cpu_and_bad_values_are_refused(monkeypatch):
    wide = llama(vocab_size=4096)
    _, stats = _replica_run(wide, [5, 6, 7])
    expected = "packed" if hf_lean.packed_layout_available() else "plain"
    assert stats.weight_layout == expected and stats.weight_copies == (expected == "packed")
    monkeypatch.setattr("trellis.rollout.hf.packed_layout_available", lambda: False)
    _, stats = _replica_run(wide, [5, 6, 7])
    assert (stats.weight_layout, stats.weight_copies) == ("plain", 0)  # auto without oneDNN
    with pytest.raises(ValueError, match=r'weight_layout="packed" needs torch built with oneDNN'):
        _replica_run(wide, [5, 6, 7], weight_layout="packed")
    with pytest.raises(
        ValueError, match=r'weight_layout must be "auto", "plain", "transposed" or "packed", got .yes.'
    ):
        HFRolloutReplica(0, RolloutConfig(engine_kwargs={"weight_layout": "yes"}), ModelConfig())
    with pytest.raises(
        ValueError,
        match=r"transpose_weights was replaced by engine_kwargs.weight_layout: write weight_layout: .tra",
    ):
        HFRolloutReplica(0, RolloutConfig(engine_kwargs={"transpose_weights": True}), ModelConfig())


def test_a_cpu_weight_layout_is_refused_for_a_model_elsewhere_at_init():
    async def main():
        replica = HFRolloutReplica(
            0, RolloutConfig(engine_kwargs={"weight_layout": "transposed"}), ModelConfig()
        )
        await replica.init("hybrid", model=llama().to("meta"), tokenizer=None)

    with pytest.raises(
        ValueError, match=r"weight_layout='transposed' is a CPU layout; this model is on meta"
    ):
        asyncio.run(main())


def test_kv_buffers_keep_rows_cut_leading_columns_and_grow():
    keys = torch.arange(5 * 2 * 5 * 3, dtype=torch.float32).view(5, 2, 5, 3)
    kv = KVBuffers([(keys, -keys)], capacity=7)
    assert (kv.width, kv.capacity) == (5, 7) and torch.equal(kv.pairs()[0][0], keys)
    storage = kv.layers[0][0].untyped_storage().data_ptr()
    order = kv.retire([1, 3, 4], lead=2)  # rows 3 and 4 (past the new end) move into 0's and 2's slots
    assert order == [3, 1, 4]
    k, v = kv.pairs()[0]
    assert (kv.width, kv.capacity) == (3, 5)
    assert torch.equal(k, keys[order][:, :, 2:]) and torch.equal(v, -keys[order][:, :, 2:])
    assert kv.layers[0][0].untyped_storage().data_ptr() == storage  # in place: no new buffers
    assert kv.retire([0, 1], lead=0) == [0, 1] and torch.equal(kv.pairs()[0][0], keys[[3, 1]][:, :, 2:])
    kv.width = kv.capacity  # full: the next step's column is past the end
    before = kv.pairs()[0][0].clone()
    kv.make_room()
    assert kv.capacity == 5 + GROWTH and torch.equal(kv.pairs()[0][0], before)
