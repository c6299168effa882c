"""trellis.engine.packing: pack/unpack, the block mask, exact packed forward passes, micro-batches."""

from __future__ import annotations

import pytest
import torch
from test_engine_grouped_attention import saved_bytes

from trellis.algorithms.logprobs import logprobs_from_logits
from trellis.engine.packing import (
    VARLEN_SDPA,
    PackedBatch,
    pack,
    register_varlen_sdpa,
    restore_order,
    split_by_token_budget,
    unpack,
)

PAD = 0


def padded_batch(lengths, width, side, seed=0):
    """(input_ids, attention_mask) with rows of ``lengths`` real tokens, padded on ``side``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        span = slice(width - length, width) if side == "left" else slice(0, length)
        ids[row, span] = torch.randint(5, 300, (length,), generator=generator)
        mask[row, span] = 1
    return ids, mask


# ---------------------------------------------------------------- pack / unpack


@pytest.mark.parametrize("side", ["left", "right"])
def test_pack_keeps_real_tokens_row_by_row(side):
    lengths = [3, 0, 5, 1]
    ids, mask = padded_batch(lengths, 5, side)
    packed = pack(ids, mask)

    assert packed.batch_shape == (4, 5)
    assert packed.total == 9
    assert packed.max_seqlen == 5
    assert packed.input_ids.shape == packed.position_ids.shape == (1, 9)
    expected = torch.cat([ids[row][mask[row].bool()] for row in range(4)])
    assert torch.equal(packed.input_ids[0], expected)
    # the empty row has no sequence: three sequences of 3, 5 and 1 tokens
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 8, 9]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    assert packed.indices.dtype == torch.int64
    if side == "left":
        assert packed.indices.tolist() == [2, 3, 4, 10, 11, 12, 13, 14, 19]
    else:
        assert packed.indices.tolist() == [0, 1, 2, 10, 11, 12, 13, 14, 15]


@pytest.mark.parametrize("side", ["left", "right"])
def test_unpack_round_trips_and_fills_padding(side):
    ids, mask = padded_batch([3, 0, 5, 1], 5, side)
    packed = pack(ids, mask.bool())

    assert torch.equal(unpack(packed.input_ids, packed, fill=PAD), ids)  # (1, total) input
    values = torch.arange(1.0, 10.0)
    out = unpack(values, packed, fill=-1.0)  # (total,) input
    assert out.shape == (4, 5)
    assert torch.equal(out[mask.bool()], values)
    assert (out[~mask.bool()] == -1.0).all()
    assert (out[1] == -1.0).all()  # the empty row


def test_unpack_keeps_trailing_dims_and_gradients():
    ids, mask = padded_batch([2, 4], 4, "left")
    packed = pack(ids, mask)
    values = torch.randn(1, 6, 3, requires_grad=True)
    out = unpack(values, packed)
    assert out.shape == (2, 4, 3)
    assert torch.equal(out[0, :2], torch.zeros(2, 3))
    out.sum().backward()
    assert torch.equal(values.grad, torch.ones(1, 6, 3))


def test_pack_uses_given_position_ids():
    ids, mask = padded_batch([2, 3], 4, "left")
    positions = torch.arange(8).view(2, 4) + 100
    packed = pack(ids, mask, position_ids=positions)
    assert packed.position_ids[0].tolist() == [102, 103, 105, 106, 107]


def test_pack_of_only_empty_rows():
    packed = pack(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    assert packed.total == 0 and packed.max_seqlen == 0
    assert packed.cu_seqlens.tolist() == [0]
    assert torch.equal(unpack(torch.empty(0), packed, fill=7.0), torch.full((2, 3), 7.0))


def test_attention_mask_is_block_diagonal_causal():
    ids, mask = padded_batch([2, 0, 3], 3, "right")
    mask4d = pack(ids, mask).attention_mask(torch.float32)
    low = torch.finfo(torch.float32).min
    allowed = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert mask4d.shape == (1, 1, 5, 5) and mask4d.dtype == torch.float32
    assert torch.equal(mask4d[0, 0], torch.where(allowed, 0.0, low))
    assert pack(ids, mask).attention_mask(torch.bfloat16).dtype == torch.bfloat16


def test_model_inputs_per_attention_implementation():
    ids, mask = padded_batch([2, 3], 3, "left")
    packed = pack(ids, mask)
    for name in ("sdpa", "eager", "trellis_eager"):
        kwargs = packed.model_inputs(name, torch.float32)
        assert set(kwargs) == {"input_ids", "position_ids", "attention_mask"}
        assert kwargs["attention_mask"].shape == (1, 1, 5, 5)
    kwargs = packed.model_inputs("flash_attention_2", torch.bfloat16)
    assert "attention_mask" not in kwargs
    assert kwargs["cu_seq_lens_q"].tolist() == kwargs["cu_seq_lens_k"].tolist() == [0, 2, 5]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 3
    with pytest.raises(ValueError, match=r"attn_implementation 'flex_attention' is not supported.*'sdpa'"):
        packed.model_inputs("flex_attention", torch.float32)


# ---------------------------------------------------------------- errors


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(
        ValueError, match=r"attention_mask of shape \(2, 4\) does not match input_ids of shape \(2, 5\)"
    ):
        pack(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(
        ValueError, match=r"position_ids of shape \(2, 3\) do not match input_ids of shape \(2, 5\)"
    ):
        pack(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), position_ids=torch.zeros(2, 3))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"input_ids must be a \(batch, seq\) tensor, got \(5,\)"):
        pack(torch.zeros(5, dtype=torch.long), torch.ones(5))
    with pytest.raises(ValueError, match=r"only 0 \(padding\) and 1 \(real token\), found 2"):
        pack(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[1, 2, 0]]))
    packed = pack(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"values of shape \(4,\) do not match the packed batch of 3 tokens"):
        unpack(torch.zeros(4), packed)
    with pytest.raises(ValueError, match=r"dtype must be floating point.*torch\.int64"):
        packed.attention_mask(torch.int64)


# ---------------------------------------------------------------- exact packed forward passes


def next_token_logprobs_padded(model, ids, mask):
    """(bs, L) log p(token t+1 | ...) at position t, from one padded forward."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return logprobs_from_logits(logits[:, :-1], ids[:, 1:])


def next_token_logprobs_packed(model, packed, **model_kwargs):
    """(bs, L - 1) like the padded version, from one packed forward (unpacked afterwards)."""
    logits = unpack(model(**model_kwargs, use_cache=False).logits, packed)
    ids = unpack(packed.input_ids, packed)
    return logprobs_from_logits(logits[:, :-1], ids[:, 1:])


@pytest.fixture(scope="module")
def left_padded():
    ids, mask = padded_batch([7, 12, 3, 9], 12, "left", seed=1)
    # the next token must be real too: real positions whose successor is real
    compare = (mask[:, :-1] * mask[:, 1:]).bool()
    return ids, mask, compare


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", "trellis_eager"])
def test_packed_forward_matches_padded(tiny_model_path, left_padded, attn_implementation):
    from transformers import AutoModelForCausalLM

    from trellis.engine.grouped_attention import register_grouped_eager

    register_grouped_eager()
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_path, attn_implementation=attn_implementation
    ).eval()
    ids, mask, compare = left_padded
    packed = pack(ids, mask)
    with torch.no_grad():
        padded_lp = next_token_logprobs_padded(model, ids, mask)
        packed_lp = next_token_logprobs_packed(
            model, packed, **packed.model_inputs(attn_implementation, torch.float32)
        )
        # Without the block mask (position ids restart, but every token is "real" to the
        # model) the rows attend to each other: the mask is what makes packing exact.
        leaky_lp = next_token_logprobs_packed(
            model,
            packed,
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=torch.ones_like(packed.input_ids),
        )
    assert compare.sum() == 7 + 12 + 3 + 9 - 4
    torch.testing.assert_close(packed_lp[compare], padded_lp[compare], atol=1e-5, rtol=0)
    leak = (leaky_lp[compare] - padded_lp[compare]).abs()
    first = slice(0, 6)  # the first packed row sees no other row: equal either way
    assert leak[first].max() < 1e-5
    assert leak.max() > 1e-2


def test_varlen_sdpa_matches_padded_with_gradients(tiny_model_path, left_padded):
    from transformers import AutoModelForCausalLM

    assert register_varlen_sdpa() == VARLEN_SDPA
    assert register_varlen_sdpa() == VARLEN_SDPA  # idempotent
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=VARLEN_SDPA)
    assert model.config._attn_implementation == VARLEN_SDPA
    ids, mask, compare = left_padded
    packed = pack(ids, mask)

    padded_lp = next_token_logprobs_padded(reference, ids, mask)
    packed_lp = next_token_logprobs_packed(model, packed, **packed.model_inputs(VARLEN_SDPA, torch.float32))
    torch.testing.assert_close(packed_lp[compare], padded_lp[compare], atol=1e-5, rtol=0)
    padded_lp[compare].sum().backward()
    packed_lp[compare].sum().backward()
    for (name, expected), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-4, rtol=1e-4, msg=name)
    # without cu_seq_lens it is plain sdpa, padding mask included
    with torch.no_grad():
        torch.testing.assert_close(
            next_token_logprobs_padded(model, ids, mask)[compare],
            padded_lp.detach()[compare],
            atol=1e-6,
            rtol=0,
        )


def test_varlen_sdpa_refuses_what_it_cannot_do():
    from types import SimpleNamespace

    from transformers import AttentionInterface

    attention = AttentionInterface()[register_varlen_sdpa()]
    cu_seqlens = torch.tensor([0, 2, 4], dtype=torch.int32)
    query = key = value = torch.zeros(1, 2, 4, 8)
    plain = SimpleNamespace(training=False)
    output, weights = attention(plain, query, key, value, None, cu_seq_lens_q=cu_seqlens)
    assert output.shape == (1, 4, 2, 8) and weights is None
    with pytest.raises(ValueError, match="sliding-window attention is not supported on packed sequences"):
        attention(SimpleNamespace(sliding_window=128), query, key, value, None, cu_seq_lens_q=cu_seqlens)
    with pytest.raises(ValueError, match=r"batch size 1, got query of shape \(2, 2, 4, 8\)"):
        attention(plain, torch.zeros(2, 2, 4, 8), key, value, None, cu_seq_lens_q=cu_seqlens)


def test_varlen_sdpa_reads_grouped_heads_without_copies_on_the_cpu():
    # 6 query heads on 2 key/value heads: padded with a mask (transformers' sdpa repeats the heads then)
    # and packed; the same outputs and gradients, and no repeated keys and values kept for backward
    from types import SimpleNamespace

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attention = AttentionInterface()[register_varlen_sdpa()]
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 5, 8, generator=gen).requires_grad_()
    key, value = (torch.randn(2, 2, 7, 8, generator=gen).requires_grad_() for _ in range(2))
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool).tril(diagonal=2)
    mask[0, ..., :2] = False  # row 0: two padding keys
    probe = torch.randn(2, 5, 6, 8, generator=gen)

    def run(fn):
        output = fn()[0]
        return output.detach(), torch.autograd.grad((output * probe).sum(), (query, key, value))

    ours, ours_grads = run(lambda: attention(module, query, key, value, mask, scaling=0.3))
    theirs, their_grads = run(lambda: sdpa_attention_forward(module, query, key, value, mask, scaling=0.3))
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    for mine, expected in zip(ours_grads, their_grads, strict=True):
        torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)
    repeated = 2 * 2 * 6 * 7 * 8 * 4  # keys and values repeated to (2, 6, 7, 8), float32
    own = 2 * 2 * 2 * 7 * 8 * 4
    ours_saved = saved_bytes(lambda: attention(module, query, key, value, mask, scaling=0.3))
    their_saved = saved_bytes(lambda: sdpa_attention_forward(module, query, key, value, mask, scaling=0.3))
    assert their_saved - ours_saved == repeated - own

    # packed: sequences of 3 and 4 tokens, each causal on its own; the reference has the heads repeated
    cu_seqlens = torch.tensor([0, 3, 7], dtype=torch.int32)
    query = torch.randn(1, 6, 7, 8, generator=gen).requires_grad_()
    key, value = (torch.randn(1, 2, 7, 8, generator=gen).requires_grad_() for _ in range(2))
    probe = torch.randn(1, 7, 6, 8, generator=gen)

    def packed(k, v):
        return attention(module, query, k, v, None, cu_seq_lens_q=cu_seqlens)

    ours, ours_grads = run(lambda: packed(key, value))
    theirs, their_grads = run(lambda: packed(key.repeat_interleave(3, 1), value.repeat_interleave(3, 1)))
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    for mine, expected in zip(ours_grads, their_grads, strict=True):
        torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)
    repeated, own = 2 * 6 * 7 * 8 * 4, 2 * 2 * 7 * 8 * 4
    their_saved = saved_bytes(lambda: packed(key.repeat_interleave(3, 1), value.repeat_interleave(3, 1)))
    assert their_saved - saved_bytes(lambda: packed(key, value)) == repeated - own


# ---------------------------------------------------------------- micro-batches


def check_groups(groups, lengths, budget):
    assert sorted(row for group in groups for row in group) == list(range(len(lengths)))
    assert all(group == sorted(group) for group in groups)
    assert all(sum(lengths[row] for row in group) <= budget for group in groups)


def test_split_by_token_budget_hand_cases():
    # fits lightest-first into ceil(27 / 10) = 3 groups of 9
    assert split_by_token_budget([8, 1, 7, 2, 6, 3], 10) == [[0, 1], [2, 3], [4, 5]]
    # lightest-first fails with 2 groups (5|5, 4+3|5+3); first fit finds 5+5 | 4+3+3
    assert split_by_token_budget([5, 5, 4, 3, 3], 10) == [[0, 1], [2, 3, 4]]
    # one group when everything fits
    assert split_by_token_budget(torch.tensor([3, 1, 2]), 100) == [[0, 1, 2]]
    assert split_by_token_budget([], 10) == []


def test_split_by_token_budget_random_batches_stay_within_budget_and_balanced():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        lengths = torch.randint(0, 513, (32,), generator=generator).tolist()
        groups = split_by_token_budget(lengths, 1024)
        check_groups(groups, lengths, 1024)
        # few groups: at most one more than the lower bound
        assert len(groups) <= -(-sum(lengths) // 1024) + 1
        loads = [sum(lengths[row] for row in group) for group in groups]
        assert max(loads) - min(loads) <= max(lengths)


def test_split_by_token_budget_min_micro_batches():
    lengths = [4, 4, 4, 4, 1]
    groups = split_by_token_budget(lengths, 100, min_micro_batches=3)
    assert len(groups) == 3
    check_groups(groups, lengths, 100)
    assert sorted(sum(lengths[row] for row in group) for group in groups) == [4, 5, 8]
    assert len(split_by_token_budget([1, 1, 1], 100, min_micro_batches=3)) == 3
    with pytest.raises(ValueError, match="cannot make min_micro_batches=4 micro-batches from 3 rows"):
        split_by_token_budget([1, 1, 1], 100, min_micro_batches=4)


def test_split_by_token_budget_errors():
    with pytest.raises(ValueError, match="row 2 has 600 tokens, more than the budget of 512 tokens"):
        split_by_token_budget([10, 20, 600], 512)
    with pytest.raises(ValueError, match="max_tokens must be a positive int, got 0"):
        split_by_token_budget([1], 0)
    with pytest.raises(ValueError, match="row 1 has a negative length -3"):
        split_by_token_budget([1, -3], 10)
    with pytest.raises(ValueError, match=r"the length of row 0 must be an int, got 1\.5"):
        split_by_token_budget([1.5], 10)
    with pytest.raises(ValueError, match="min_micro_batches must be a positive int, got 0"):
        split_by_token_budget([1], 10, min_micro_batches=0)


def test_restore_order_inverts_grouping():
    lengths = [8, 1, 7, 2, 6, 3, 5]
    groups = split_by_token_budget(lengths, 10)
    rows = torch.tensor(lengths) * 10
    outputs = torch.cat([rows[group] for group in groups])
    assert torch.equal(outputs[restore_order(groups)], rows)
    assert torch.equal(restore_order([[2, 0], [1]]), torch.tensor([1, 2, 0]))
    with pytest.raises(ValueError, match="row 1 appears in more than one place"):
        restore_order([[0, 1], [1]])
    with pytest.raises(ValueError, match="row 3 is out of range for 2 rows"):
        restore_order([[0], [3]])


def test_packed_batch_is_a_plain_dataclass():
    packed = pack(*padded_batch([2], 2, "left"))
    assert isinstance(packed, PackedBatch)
    assert PackedBatch(**vars(packed)).total == 2
