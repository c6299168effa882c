"""trellis.algorithms.logprobs: chunked log-probs and entropies equal the naive torch expressions."""

from __future__ import annotations

import pytest
import torch

from trellis.algorithms.logprobs import (
    default_chunk_size,
    entropy_from_logits,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
)

VOCAB = 50
CHUNK_SIZES = [None, 1, 4, 8, 21, 100]  # default, one row, not dividing 21 rows, all rows, more than N


def naive_logprobs(logits, labels):
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)


def naive_entropy(logits):
    return torch.distributions.Categorical(logits=logits.float()).entropy()


def make(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, generator=generator) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=generator)
    return logits, labels


def grad_of(outputs, upstreams, logits):
    """∂(Σ_i upstream_i · output_i)/∂logits: a different weight for every token."""
    total = sum((output * upstream).sum() for output, upstream in zip(outputs, upstreams, strict=True))
    return torch.autograd.grad(total, logits)[0]


def upstream_like(values, seed=1):
    return torch.randn(values.shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_logprobs_and_gradient_match_log_softmax_gather(chunk_size):
    logits, labels = make(3, 7, VOCAB)
    ours, reference = logprobs_from_logits(logits, labels, chunk_size), naive_logprobs(logits, labels)
    assert ours.shape == (3, 7) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    upstream = upstream_like(ours)
    torch.testing.assert_close(
        grad_of([ours], [upstream], logits), grad_of([reference], [upstream], logits), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_entropy_and_gradient_match_categorical(chunk_size):
    logits, _ = make(3, 7, VOCAB)
    ours, reference = entropy_from_logits(logits, chunk_size), naive_entropy(logits)
    assert ours.shape == (3, 7) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    upstream = upstream_like(ours)
    torch.testing.assert_close(
        grad_of([ours], [upstream], logits), grad_of([reference], [upstream], logits), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_fused_equals_both_and_sums_their_gradients(chunk_size):
    logits, labels = make(3, 7, VOCAB)
    logprobs, entropy = logprobs_and_entropy_from_logits(logits, labels, chunk_size)
    reference = naive_logprobs(logits, labels), naive_entropy(logits)
    torch.testing.assert_close(logprobs, reference[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, reference[1], atol=1e-5, rtol=0)
    # A policy-gradient-like mix: −A·log p − β·H, with a different weight per token.
    upstreams = [upstream_like(logprobs, seed=1), upstream_like(entropy, seed=2)]
    torch.testing.assert_close(
        grad_of([logprobs, entropy], upstreams, logits),
        grad_of(list(reference), upstreams, logits),
        atol=1e-5,
        rtol=0,
    )
    # Only one of the two outputs in the loss: the other one's gradient is absent, not zero-filled.
    logprobs, entropy = logprobs_and_entropy_from_logits(logits, labels, chunk_size)
    torch.testing.assert_close(
        grad_of([entropy], upstreams[1:], logits),
        grad_of([naive_entropy(logits)], upstreams[1:], logits),
        atol=1e-5,
        rtol=0,
    )


def non_contiguous_cases():
    full, labels = make(3, 8, VOCAB)
    transposed, labels_t = make(7, 3, VOCAB, seed=3)
    strided, labels_s = make(3, 7, 2 * VOCAB, seed=4)
    return {
        "response slice logits[:, :-1]": (full[:, :-1], labels[:, :-1], full),
        "transposed (T, bs) -> (bs, T)": (transposed.transpose(0, 1), labels_t.t(), transposed),
        "vocab stride 2": (strided[..., ::2], labels_s % VOCAB, strided),
    }


@pytest.mark.parametrize("case", sorted(non_contiguous_cases()))
def test_non_contiguous_logits_give_the_same_values_and_gradients(case):
    logits, labels, leaf = non_contiguous_cases()[case]
    assert not logits.is_contiguous()
    logprobs, entropy = logprobs_and_entropy_from_logits(logits, labels, chunk_size=4)
    reference = naive_logprobs(logits, labels), naive_entropy(logits)
    torch.testing.assert_close(logprobs, reference[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, reference[1], atol=1e-5, rtol=0)
    upstreams = [upstream_like(logprobs, seed=1), upstream_like(entropy, seed=2)]
    torch.testing.assert_close(
        grad_of([logprobs, entropy], upstreams, leaf),
        grad_of(list(reference), upstreams, leaf),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("shape", [(21, VOCAB), (2, 3, 4, VOCAB), (1, 1, VOCAB)])
def test_any_leading_dims(shape):
    logits, labels = make(*shape)
    logprobs, entropy = logprobs_and_entropy_from_logits(logits, labels, chunk_size=5)
    assert logprobs.shape == entropy.shape == shape[:-1]
    torch.testing.assert_close(logprobs, naive_logprobs(logits, labels), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, naive_entropy(logits), atol=1e-5, rtol=0)


def test_bfloat16_is_computed_in_float32():
    # Reference: the fp32 expressions on an fp32 copy of the same bf16 values. Values agree to
    # 1e-5 (both are fp32 math); the gradient comes back in bf16, rounded once from fp32, so it
    # is within half a bf16 step (2**-9 relative) of the fp32 reference gradient.
    logits, labels = make(3, 7, VOCAB, dtype=torch.bfloat16)
    logprobs, entropy = logprobs_and_entropy_from_logits(logits, labels, chunk_size=4)
    assert logprobs.dtype == entropy.dtype == torch.float32
    as_float = logits.detach().float().requires_grad_(True)
    reference = naive_logprobs(as_float, labels), naive_entropy(as_float)
    torch.testing.assert_close(logprobs, reference[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, reference[1], atol=1e-5, rtol=0)
    upstreams = [upstream_like(logprobs, seed=1), upstream_like(entropy, seed=2)]
    ours = grad_of([logprobs, entropy], upstreams, logits)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(
        ours.float(), grad_of(list(reference), upstreams, as_float), atol=1e-6, rtol=2**-8
    )


def test_gradcheck_in_float64():
    logits, labels = make(2, 3, 5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, labels, chunk_size=4), (logits,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_size=4), (logits,))
    assert torch.autograd.gradcheck(lambda z: logprobs_and_entropy_from_logits(z, labels, 4), (logits,))
    assert logprobs_from_logits(logits, labels).dtype == torch.float64


def test_masked_minus_inf_logits_count_as_absent_tokens():
    # A −inf logit (e.g. a padded vocabulary) has p = 0: the same values and gradients as the
    # naive expressions on the remaining 40 columns, and a gradient of exactly 0 itself.
    # (Categorical's own gradient is NaN there once an upstream gradient exceeds 1.)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, 40:] = float("-inf")
    logits.requires_grad_(True)
    kept = logits.detach()[:, :40].clone().requires_grad_(True)
    labels = torch.tensor([0, 5, 39, 17])
    logprobs, entropy = logprobs_and_entropy_from_logits(logits, labels, chunk_size=3)
    reference = naive_logprobs(kept, labels), naive_entropy(kept)
    torch.testing.assert_close(logprobs, reference[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, reference[1], atol=1e-5, rtol=0)
    upstreams = [upstream_like(logprobs, seed=1) * 3, upstream_like(entropy, seed=2) * 3]
    ours = grad_of([logprobs, entropy], upstreams, logits)
    assert (ours[:, 40:] == 0).all()
    torch.testing.assert_close(ours[:, :40], grad_of(list(reference), upstreams, kept), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy_from_logits(logits), naive_entropy(logits), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_inplace_backward_writes_the_gradient_into_the_logits(dtype, with_entropy):
    leaf, labels = make(3, 7, VOCAB, dtype=dtype)
    upstreams = [upstream_like(labels.float(), seed=1), upstream_like(labels.float(), seed=2)]
    as_float = leaf.detach().float().requires_grad_(True)
    reference = [naive_logprobs(as_float, labels)] + ([naive_entropy(as_float)] if with_entropy else [])
    expected = grad_of(reference, upstreams[: len(reference)], as_float).to(dtype)
    logits = leaf * 1  # a computed tensor, like an lm-head output
    if with_entropy:
        outputs = list(logprobs_and_entropy_from_logits(logits, labels, chunk_size=4, inplace_backward=True))
    else:
        outputs = [logprobs_from_logits(logits, labels, chunk_size=4, inplace_backward=True)]
    grad = grad_of(outputs, upstreams[: len(outputs)], logits)
    assert grad.data_ptr() == logits.data_ptr() and grad.dtype == dtype
    tolerance = {"atol": 1e-5, "rtol": 0} if dtype == torch.float32 else {"atol": 1e-6, "rtol": 2**-7}
    torch.testing.assert_close(grad, expected, **tolerance)
    torch.testing.assert_close(logits.detach(), expected, **tolerance)  # the logits' values are gone


def test_inplace_backward_is_refused_on_a_leaf_and_caught_when_logits_are_reused():
    leaf, labels = make(3, 7, VOCAB)
    with pytest.raises(ValueError, match="would overwrite a leaf tensor's values"):
        logprobs_from_logits(leaf, labels, inplace_backward=True)
    logits = leaf * 1.0
    logprobs = logprobs_from_logits(logits, labels, inplace_backward=True)
    entropy = entropy_from_logits(logits, inplace_backward=True)  # saved the same logits
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (logprobs.sum() + entropy.sum()).backward()


def test_double_backward_raises_a_clear_error():
    logits, labels = make(2, 3, VOCAB, dtype=torch.float64)
    (grad,) = torch.autograd.grad(logprobs_from_logits(logits, labels).sum(), logits, create_graph=True)
    with pytest.raises(RuntimeError, match=r"double backward .* is not supported"):
        grad.sum().backward()


def test_inference_and_empty_batches():
    logits, labels = make(3, 7, VOCAB)
    with torch.no_grad():
        logprobs = logprobs_from_logits(logits, labels)
    assert not logprobs.requires_grad
    torch.testing.assert_close(logprobs, naive_logprobs(logits, labels).detach(), atol=1e-5, rtol=0)
    empty = torch.zeros(0, 5, VOCAB, requires_grad=True)
    logprobs, entropy = logprobs_and_entropy_from_logits(empty, torch.zeros(0, 5, dtype=torch.long))
    assert logprobs.shape == entropy.shape == (0, 5)
    assert grad_of([logprobs, entropy], [logprobs, entropy], empty).shape == (0, 5, VOCAB)


def test_default_chunk_is_a_few_megabytes_of_float32():
    assert default_chunk_size(49152) == 42  # 42 rows × 49152 × 4 B ≈ 8 MiB
    assert default_chunk_size(10**9) == 1


def test_errors_name_the_bad_input():
    logits, labels = make(3, 7, VOCAB)
    with pytest.raises(ValueError, match=r"at least 2 dims, got shape \(50,\)"):
        logprobs_from_logits(logits[0, 0], labels[0, 0])
    mismatch = r"labels of shape \(3, 6\) do not match logits of shape \(3, 7, 50\)"
    with pytest.raises(ValueError, match=mismatch):
        logprobs_from_logits(logits, labels[:, :6])
    with pytest.raises(ValueError, match=r"labels must be integer token ids, got dtype torch\.float32"):
        logprobs_from_logits(logits, labels.float())
    with pytest.raises(ValueError, match=r"label 50 is outside the vocabulary \[0, 50\) \(vocab size 50\)"):
        logprobs_from_logits(logits, torch.full((3, 7), VOCAB))
    with pytest.raises(ValueError, match=r"label -100 is outside the vocabulary \[0, 50\)"):
        logprobs_and_entropy_from_logits(logits, torch.full((3, 7), -100))
    with pytest.raises(ValueError, match=r"logits must be floating point, got dtype torch\.int64"):
        entropy_from_logits(labels[..., None].expand(3, 7, 4))
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int .* got 0"):
        entropy_from_logits(logits, chunk_size=0)


@pytest.mark.parametrize("kind", ["logprobs", "entropy"])
def test_forward_and_backward_allocate_one_gradient_instead_of_several_log_softmaxes(kind):
    """Peak bytes held through torch's CPU allocator during forward + backward (profiler events)."""
    pytest.importorskip("torch.profiler")
    logits, labels = make(64, 1024)
    upstream = upstream_like(labels.float())
    size = logits.numel() * logits.element_size()

    def chunked():
        if kind == "logprobs":
            out = logprobs_from_logits(logits, labels, chunk_size=8)
        else:
            out = entropy_from_logits(logits, chunk_size=8)
        return torch.autograd.grad(out, logits, upstream)

    def naive():
        out = naive_logprobs(logits, labels) if kind == "logprobs" else naive_entropy(logits)
        return torch.autograd.grad(out, logits, upstream)

    ours, theirs = peak_allocated(chunked), peak_allocated(naive)
    assert ours <= 1.3 * size  # the gradient + an 8-row chunk or two
    assert theirs >= 2.9 * size  # log-softmax (or softmax ...) + its gradients


def peak_allocated(fn) -> int:
    """Peak of the bytes allocated minus freed through torch's CPU allocator while ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        roots = prof.profiler.kineto_results.experimental_event_tree()
    except AttributeError:
        pytest.skip("this torch's profiler has no event tree to read allocations from")
    events, stack = [], list(roots)
    while stack:
        node = stack.pop()
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    if not events:
        pytest.skip("this torch's profiler recorded no allocation events")
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak
