"""trellis.engine.sequence_parallel: Ulysses all-to-alls, slicing and gathering, the attention wrapper.

Four gloo processes on loopback run every distributed check twice: ranks 0-1 as a group of 2,
then all four as a group of 4. Each rank writes what it computed; the tests compare it with the
same computation in this process on the whole sequence (P = 1): the all-to-alls' outputs and
gradients, the slices and the gathered outputs with their gradients, and tiny Llama / Qwen2 /
Qwen3 models (grouped-query attention with fewer key/value heads than ranks included) whose
gathered logits and log-probs, and parameter gradients summed over the group, must equal the
one-process forward and backward to 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _spawn import init_gloo, load_results, run_ranks

from trellis.engine.packing import VARLEN_SDPA
from trellis.engine.sequence_parallel import (
    SP_GROUP_KWARG,
    attention_kwargs,
    check_sp_size,
    gather_outputs,
    heads_to_seq,
    register_ulysses_attention,
    seq_to_heads,
    slice_packed,
)

WORLD = 4
SIZES = (2, 4)
ULYSSES = "ulysses_" + VARLEN_SDPA

A2A_SHAPE = (1, 8, 12, 3)  # (batch, heads, seq, head_dim): 8 heads and 12 tokens split 2 or 4 ways
GATHER_LENGTHS = [5, 1, 3]  # 9 tokens: 1 pad token for 2 ranks, 3 for 4; one sequence shorter than P
GRAD_SCALE = 2.5
MODEL_LENGTHS = [7, 2, 5, 1]  # 15 tokens: padded to 16

# name -> (model_type, config overrides, gradient checkpointing)
MODELS = {
    "llama": ("llama", {"num_key_value_heads": 2}, False),  # GQA; 2 kv heads < 4 ranks
    "llama-checkpointed": ("llama", {"num_key_value_heads": 2}, True),  # recomputed in backward
    "qwen2": ("qwen2", {"num_key_value_heads": 1}, False),  # one kv head, attention biases
    "qwen3": ("qwen3", {"num_key_value_heads": 2, "head_dim": 16}, False),  # q/k norms
}


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    settings = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "max_position_embeddings": 64,
        **overrides,
    }
    return AutoConfig.for_model(model_type, **settings)


def load(path: str, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    if attn_implementation.startswith("ulysses_"):
        register_ulysses_attention(VARLEN_SDPA)
    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn_implementation, dtype=torch.float32
    )


def packed_tokens(lengths, seed=0):
    """``(input_ids, position_ids, cu_seqlens, labels, valid)`` of packed sequences of ``lengths``.

    ``labels[p]`` is the token after ``p`` in its sequence (0 at a sequence's last token, where
    ``valid`` is False).
    """
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(1, 128, (1, total), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    valid = torch.ones(1, total, dtype=torch.bool)
    valid[0, cu_seqlens[1:] - 1] = False
    labels = torch.where(valid, ids.roll(-1, dims=1), 0)
    return ids, positions, cu_seqlens, labels, valid


def token_log_probs(logits, labels):
    """``(n,)`` log-probability of ``labels (n,)`` under ``logits (n, V)``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- what each rank runs


def _a2a(group, rank, size):
    """seq_to_heads on (batch, heads, seq, d) and heads_to_seq on (batch, seq, heads, d), with gradients."""
    x, w = randn(A2A_SHAPE, 1), randn(A2A_SHAPE, 2)
    seq = slice(rank * A2A_SHAPE[2] // size, (rank + 1) * A2A_SHAPE[2] // size)
    heads = slice(rank * A2A_SHAPE[1] // size, (rank + 1) * A2A_SHAPE[1] // size)
    local = x[:, :, seq].clone().requires_grad_()
    gathered = seq_to_heads(local, group, seq_dim=2, head_dim=1)
    back = heads_to_seq(gathered, group, seq_dim=2, head_dim=1)
    # Σ over ranks of Σ x² w over each rank's heads is Σ x² w: the gradient is 2 x w
    (gathered**2 * w[:, heads]).sum().backward()

    z, v = randn(A2A_SHAPE, 3).transpose(1, 2), randn(A2A_SHAPE, 4).transpose(1, 2)  # (1, seq, heads, d)
    mine = z[:, :, heads].clone().requires_grad_()  # after attention: all tokens, this rank's heads
    scattered = heads_to_seq(mine, group, seq_dim=1, head_dim=2)
    (scattered**3 * v[:, seq]).sum().backward()
    return {
        "gathered": gathered.detach(),
        "round_trip": torch.equal(back, local),
        "grad": local.grad,
        "scattered": scattered.detach(),
        "grad_heads": mine.grad,
    }


def _gather(group):
    ids, positions, cu_seqlens, _, _ = packed_tokens(GATHER_LENGTHS, seed=5)
    values = randn((ids.shape[1], 2), 6)
    local, sp = slice_packed(
        {"input_ids": ids, "position_ids": positions, "values": values.unsqueeze(0)}, cu_seqlens, group
    )
    x_local = local["values"][0].clone().requires_grad_()
    out = gather_outputs(x_local, sp, group, grad_scale=GRAD_SCALE)
    (out * randn(out.shape, 7)).sum().backward()
    return {"local": local, "sp": sp, "out": out.detach(), "grad": x_local.grad}


def _model(path, checkpointed, group):
    model = load(path, ULYSSES)
    if checkpointed:
        model.gradient_checkpointing_enable()
        model.train()
    ids, positions, cu_seqlens, labels, valid = packed_tokens(MODEL_LENGTHS, seed=8)
    local, sp = slice_packed(
        {"input_ids": ids, "position_ids": positions, "labels": labels}, cu_seqlens, group
    )
    out = model(
        input_ids=local["input_ids"],
        position_ids=local["position_ids"],
        use_cache=False,
        **attention_kwargs(sp, group),
    )
    logits = out.logits[0]
    log_probs = gather_outputs(token_log_probs(logits, local["labels"][0]), sp, group)
    log_probs[valid[0]].sum().backward()
    names = [name for name, _ in model.named_parameters()]
    flat = torch.cat([param.grad.reshape(-1) for _, param in model.named_parameters()])
    torch.distributed.all_reduce(flat, group=group)  # sum over the group: grad_scale 1
    sizes = [param.numel() for _, param in model.named_parameters()]
    return {
        "logits": gather_outputs(logits.detach(), sp, group),
        "log_probs": log_probs.detach(),
        "grads": dict(zip(names, flat.split(sizes), strict=True)),
    }


def _head_count_error(group):
    from transformers import AutoModelForCausalLM

    register_ulysses_attention(VARLEN_SDPA)
    config = tiny_config("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ULYSSES)
    ids, positions, cu_seqlens, _, _ = packed_tokens(MODEL_LENGTHS)
    local, sp = slice_packed({"input_ids": ids, "position_ids": positions}, cu_seqlens, group)
    try:
        model(**local, use_cache=False, **attention_kwargs(sp, group))
    except ValueError as exc:
        return str(exc)
    return None


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    """One of the WORLD ranks; writes its results per group size to ``out_dir/rank{rank}.pt``."""
    import torch.distributed as dist

    with init_gloo(rank, port, WORLD, timeout_s=120):
        groups = {size: dist.new_group(list(range(size))) for size in SIZES}  # every rank creates every group
        results = {}
        for size, group in groups.items():
            if rank >= size:
                continue
            results[size] = {
                "a2a": _a2a(group, rank, size),
                "gather": _gather(group),
                "models": {
                    name: _model(str(Path(model_dir) / name), checkpointed, group)
                    for name, (_, _, checkpointed) in MODELS.items()
                },
            }
            if size == 4:
                results[size]["head_error"] = _head_count_error(group)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny models of MODELS, saved once (random weights, seeded)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sp_models")
    for name, (model_type, overrides, _) in MODELS.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory):
    """Run the WORLD ranks as fresh interpreters; ``{size: [results of rank 0 .. size-1]}``."""
    out_dir = tmp_path_factory.mktemp("sp_ranks")
    run_ranks("test_sequence_parallel", WORLD, model_dir, out_dir)
    results = load_results(out_dir, WORLD)
    return {size: [results[rank][size] for rank in range(size)] for size in SIZES}


def _reference(path):
    """The P = 1 forward and backward of ``_model``: logits, log-probs, parameter gradients."""
    model = load(path, ULYSSES)  # no group: exactly trellis_varlen_sdpa
    ids, positions, cu_seqlens, labels, valid = packed_tokens(MODEL_LENGTHS, seed=8)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    out = model(
        input_ids=ids,
        position_ids=positions,
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=longest,
        max_length_k=longest,
        use_cache=False,
    )
    log_probs = token_log_probs(out.logits[0], labels[0])
    log_probs[valid[0]].sum().backward()
    grads = {name: param.grad.reshape(-1) for name, param in model.named_parameters()}
    return {"logits": out.logits[0].detach(), "log_probs": log_probs.detach(), "grads": grads}


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("size", SIZES)
def test_all_to_alls_round_trip_and_match_one_process_gradients(ranks, size):
    x, w = randn(A2A_SHAPE, 1).requires_grad_(), randn(A2A_SHAPE, 2)
    (x**2 * w).sum().backward()  # the whole computation in one process
    z, v = randn(A2A_SHAPE, 3).transpose(1, 2).requires_grad_(), randn(A2A_SHAPE, 4).transpose(1, 2)
    (z**3 * v).sum().backward()
    n_seq, n_heads = A2A_SHAPE[2] // size, A2A_SHAPE[1] // size
    for rank, result in enumerate(ranks[size]):
        seq = slice(rank * n_seq, (rank + 1) * n_seq)
        heads = slice(rank * n_heads, (rank + 1) * n_heads)
        out = result["a2a"]
        assert out["gathered"].shape == (1, n_heads, A2A_SHAPE[2], 3)
        assert torch.equal(out["gathered"], x.detach()[:, heads])  # all tokens, this rank's heads
        assert out["round_trip"]  # heads_to_seq(seq_to_heads(x)) is x, bit for bit
        torch.testing.assert_close(out["grad"], x.grad[:, :, seq], rtol=0, atol=1e-6)
        assert torch.equal(out["scattered"], z.detach()[:, seq])  # this rank's tokens, all heads
        torch.testing.assert_close(out["grad_heads"], z.grad[:, :, heads], rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", SIZES)
def test_slices_gather_back_with_scaled_slice_gradients(ranks, size):
    ids, positions, _, _, _ = packed_tokens(GATHER_LENGTHS, seed=5)
    total = ids.shape[1]  # 9
    pad = {2: 1, 4: 3}[size]
    values = randn((total, 2), 6)
    incoming = randn((total, 2), 7)
    padded_incoming = torch.cat([incoming, torch.zeros(pad, 2)])
    local_len = (total + pad) // size
    for rank, result in enumerate(ranks[size]):
        out, sp = result["gather"], result["gather"]["sp"]
        assert (sp.sp_size, sp.rank, sp.total, sp.pad, sp.local_len) == (size, rank, total, pad, local_len)
        assert (sp.start, sp.stop) == (rank * local_len, (rank + 1) * local_len)
        # the padding is a sequence of its own after the last real one
        assert sp.cu_seqlens.tolist() == [0, 5, 6, 9, 9 + pad] and sp.cu_seqlens.dtype == torch.int32
        assert sp.max_seqlen == 5
        assert torch.equal(out["out"], values)  # gathered, padding dropped
        expected_grad = GRAD_SCALE * padded_incoming[sp.start : sp.stop]  # 0 on padding
        assert torch.equal(out["grad"], expected_grad)
    # the ranks' slices, in rank order, are the padded packed tensors (id 0, position 0 on padding)
    local = [result["gather"]["local"] for result in ranks[size]]
    assert all(part["input_ids"].shape == (1, local_len) for part in local)
    torch.testing.assert_close(
        torch.cat([part["input_ids"] for part in local], dim=1),
        torch.cat([ids, torch.zeros(1, pad)], 1).long(),
    )
    torch.testing.assert_close(
        torch.cat([part["position_ids"] for part in local], dim=1),
        torch.cat([positions, torch.zeros(1, pad)], 1).long(),
    )


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("size", SIZES)
def test_models_on_sp_ranks_match_one_process(ranks, model_dir, size, name):
    expected = _reference(str(model_dir / name))
    for rank, result in enumerate(ranks[size]):
        got = result["models"][name]
        torch.testing.assert_close(got["logits"], expected["logits"], rtol=0, atol=1e-5, msg=f"rank {rank}")
        torch.testing.assert_close(got["log_probs"], expected["log_probs"], rtol=0, atol=1e-5)
        assert got["grads"].keys() == expected["grads"].keys()
        for param, grad in expected["grads"].items():
            torch.testing.assert_close(
                got["grads"][param], grad, rtol=0, atol=1e-5, msg=f"rank {rank} {param}"
            )
        assert any(grad.abs().sum() > 0 for grad in got["grads"].values())


def test_head_count_not_divisible_by_sp_size_is_a_clear_error(ranks):
    for result in ranks[4]:
        message = result["head_error"]
        assert message is not None, "6 heads on 4 ranks ran"
        assert "6 attention heads" in message and "sequence-parallel size 4" in message
        assert "choose a sequence-parallel size that divides num_attention_heads=6" in message
        assert "[1, 2, 3, 6]" in message


# ---------------------------------------------------------------- one process


def test_check_sp_size():
    check_sp_size(4, 4)
    check_sp_size(4, 2)
    with pytest.raises(
        ValueError, match=r"14 attention heads are not divisible by the sequence-parallel size 4"
    ):
        check_sp_size(14, 4)


def test_no_group_is_the_identity():
    x = randn((1, 4, 6, 2), 0)
    assert seq_to_heads(x, None, seq_dim=2, head_dim=1) is x
    assert heads_to_seq(x, None, seq_dim=2, head_dim=1) is x
    ids, positions, cu_seqlens, _, _ = packed_tokens(GATHER_LENGTHS)
    local, sp = slice_packed({"input_ids": ids, "position_ids": positions}, cu_seqlens, None)
    assert torch.equal(local["input_ids"], ids) and torch.equal(local["position_ids"], positions)
    assert (sp.sp_size, sp.pad, sp.start, sp.stop, sp.max_seqlen) == (1, 0, 0, 9, 5)
    assert torch.equal(sp.cu_seqlens, cu_seqlens)
    kwargs = attention_kwargs(sp, None)
    assert kwargs[SP_GROUP_KWARG] is None and kwargs["max_length_q"] == 5
    values = randn((9, 3), 1).requires_grad_()
    out = gather_outputs(values, sp, None, grad_scale=3.0)
    assert torch.equal(out, values)
    out.sum().backward()
    assert torch.equal(values.grad, torch.full((9, 3), 3.0))


def test_bad_inputs_are_named():
    ids, positions, cu_seqlens, _, _ = packed_tokens(GATHER_LENGTHS)
    with pytest.raises(ValueError, match=r"position_ids has shape \(1, 8\)"):
        slice_packed({"input_ids": ids, "position_ids": positions[:, :8]}, cu_seqlens, None)
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 5, 6\] must run from 0 to the 9 tokens"):
        slice_packed({"input_ids": ids}, cu_seqlens[:3], None)
    _, sp = slice_packed({"input_ids": ids}, cu_seqlens, None)
    with pytest.raises(ValueError, match=r"x_local of shape \(8,\) does not hold this rank's 9 tokens"):
        gather_outputs(torch.zeros(8), sp, None)
    with pytest.raises(ValueError, match=r"'sdpa' is not supported; use one of"):
        register_ulysses_attention("sdpa")


def test_without_a_group_the_wrapper_is_its_inner_attention(model_dir):
    path = str(model_dir / "llama")
    ids, positions, cu_seqlens, _, _ = packed_tokens(MODEL_LENGTHS)
    kwargs = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": 7, "max_length_k": 7}
    inner = load(path, VARLEN_SDPA)(input_ids=ids, position_ids=positions, use_cache=False, **kwargs).logits
    wrapped = load(path, ULYSSES)(input_ids=ids, position_ids=positions, use_cache=False, **kwargs).logits
    assert torch.equal(wrapped, inner)
