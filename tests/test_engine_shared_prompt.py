"""model.share_prompt: rows of a micro-batch with the same prompt run it once; outputs and gradients
equal the plain path's (padded and packed), for fewer tokens through the model."""

from __future__ import annotations

import pytest
import torch
from test_engine_base import assert_close_dicts, batch_of, engine, grads, policy_loss_fn

from trellis.data.protocol import DataProto
from trellis.engine import shared_prompt

PROMPT, RESPONSE = 7, 6


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def grouped_batch(groups=((5, 3), (7, 2), (2, 1), (4, 3)), seed: int = 0) -> DataProto:
    """Rows in groups that share a left-padded prompt (``(prompt length, responses)`` per group), each
    with its own right-padded response of 1..RESPONSE tokens; the padding ids differ between rows of a
    group, which must not split it. Old log-probs and advantages for a PPO loss."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for prompt_len, count in groups:
        prompt = torch.randint(4, 300, (prompt_len,), generator=gen)
        for _ in range(count):
            response_len = int(torch.randint(1, RESPONSE + 1, (1,), generator=gen))
            ids = torch.randint(0, 4, (PROMPT + RESPONSE,), generator=gen)  # padding: any id
            mask = torch.zeros(PROMPT + RESPONSE, dtype=torch.long)
            ids[PROMPT - prompt_len : PROMPT] = prompt
            ids[PROMPT : PROMPT + response_len] = torch.randint(4, 300, (response_len,), generator=gen)
            mask[PROMPT - prompt_len : PROMPT + response_len] = 1
            rows.append((ids, mask))
    ids = torch.stack([r[0] for r in rows])
    mask = torch.stack([r[1] for r in rows])
    return batch_of(ids, mask, gen)


def test_prompt_groups_by_tokens_and_mask_in_order_of_first_appearance():
    ids = torch.tensor([[0, 5, 6], [1, 5, 6], [7, 7, 7], [2, 5, 6], [7, 7, 7]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    first, inverse = shared_prompt.prompt_groups(ids, mask)
    assert first.tolist() == [0, 2]
    assert inverse.tolist() == [0, 0, 1, 0, 1]
    # the same ids with another mask are another prompt; all distinct: nothing to share
    assert shared_prompt.prompt_groups(ids[:3], torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])) is None


def count_tokens(eng) -> list[int]:
    """Record the tokens of each model call of ``eng`` (input_ids elements)."""
    seen: list[int] = []
    forward = eng.model.forward

    def counting(*args, **kwargs):
        seen.append(int(kwargs["input_ids"].numel()))
        return forward(*args, **kwargs)

    eng.model.forward = counting
    return seen


@pytest.mark.parametrize("packed", [False, True])
def test_forward_equals_the_plain_path_with_fewer_tokens(tiny_model_path, packed):
    batch = grouped_batch()
    shared, plain = (engine(tiny_model_path, packed=packed, mbs=9, share_prompt=on) for on in (True, False))
    assert shared.share_prompt and not plain.share_prompt
    calls = count_tokens(shared)
    out = shared.forward(batch, compute_entropy=True)
    expected = plain.forward(batch, compute_entropy=True)
    assert_close_dicts(out, expected)
    assert out["log_probs"].shape == (9, RESPONSE)
    # one pass over the 4 distinct prompts (7 columns), one over the 9 rows' responses less the last token
    assert calls == [4 * PROMPT, 9 * (RESPONSE - 1)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("packed", [False, True])
def test_gradient_equals_the_plain_path(tiny_model_path, packed, attn):
    # micro-batches of 4 cut the groups: shared within each micro-batch only, still equal; eager attention
    # (the demo's, faster on the CPU at its lengths) against the plain path's sdpa
    batch = grouped_batch()
    shared = engine(tiny_model_path, packed=packed, mbs=4, share_prompt=True, attn_implementation=attn)
    plain = engine(tiny_model_path, packed=packed, mbs=4, share_prompt=False)
    # eager on the tiny model's grouped heads (2 query heads, 1 key/value head) is trellis_eager
    assert (shared.attn_implementation == "trellis_eager") == (attn == "eager")
    assert plain.attn_implementation in ("sdpa", "trellis_varlen_sdpa")  # packed: varlen
    loss = policy_loss_fn("token-mean")
    metrics = shared.forward_backward(batch, loss, compute_entropy=True)
    expected = plain.forward_backward(batch, loss, compute_entropy=True)
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert_close_dicts(grads(shared), grads(plain))


def test_rows_without_a_shared_prompt_take_the_plain_path(tiny_model_path):
    batch = grouped_batch(groups=((5, 1), (7, 1), (3, 1)))
    eng = engine(tiny_model_path, mbs=3, share_prompt=True)
    calls = count_tokens(eng)
    eng.forward(batch)
    assert calls == [3 * (PROMPT + RESPONSE)]


def test_where_it_cannot_apply_the_engine_says_so(tiny_model_path):
    assert engine(tiny_model_path, share_prompt=True).share_prompt
    assert not engine(tiny_model_path, share_prompt=True, gradient_checkpointing=True).share_prompt
    assert not engine(tiny_model_path, role="critic", share_prompt=True).share_prompt
    assert engine(tiny_model_path, role="ref", share_prompt=True).share_prompt
