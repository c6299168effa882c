"""Per-token log-probabilities and entropies of a categorical over the vocabulary, in chunks.

For logits z of one token (a row of ``V`` numbers) and its label y:

    log p(y) = z_y − logsumexp(z)
    H        = logsumexp(z) − Σ_j p_j z_j                 with p = softmax(z)

The naive ``torch.log_softmax(logits.float(), -1).gather(...)`` materialises a full float32
``(N, V)`` log-softmax and keeps it for backward, and its backward adds two more buffers of that
size: at ``N = 4096`` tokens and ``V = 49152`` each is 805 MB. The functions here flatten the
leading dimensions to ``N`` rows and go through the rows ``chunk_size`` at a time; the
float32 temporaries never exceed a few chunks. Forward keeps only the logits (which exist
anyway), the labels and one or two float32 numbers per row; backward recomputes the softmax
chunk by chunk and writes the gradient into one buffer of the logits' shape and dtype — or,
with ``inplace_backward=True``, into the logits themselves.

Gradients (each multiplied by the upstream gradient of its row):

    ∂ log p(y) / ∂z_j = onehot(y)_j − p_j
    ∂H / ∂z_j         = −p_j (z_j − Σ_k p_k z_k)

Double backward (differentiating these gradients, after ``create_graph=True``) is not
supported: attempting it raises a RuntimeError that says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

_Outputs = tuple[torch.Tensor | None, torch.Tensor | None]

# Bytes of one float32 chunk (chunk rows × vocab × 4) when ``chunk_size`` is None. At most
# three such buffers are alive at once, so the temporaries stay under ~25 MB whatever the
# batch. On 2 CPU cores at V = 49152, forward + backward with chunks of 1 to 24 MiB took within
# ~15% of each other (best near 6-12 MiB): smaller chunks pay Python overhead per chunk,
# larger ones fall out of the caches between the passes made over a chunk.
DEFAULT_CHUNK_BYTES = 8 * 2**20


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk when none is given: a float32 chunk of about ``DEFAULT_CHUNK_BYTES``."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * max(1, vocab_size)))


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """log softmax(logits)[label] per token, computed ``chunk_size`` rows at a time.

    Args:
        logits: ``(..., V)`` floating point, any leading dimensions (``(bs, T, V)``, packed
            ``(N, V)``), any strides. float16/bfloat16 are upcast to float32 chunk by chunk.
        labels: ``(...)`` integer token ids in ``[0, V)``, the leading shape of ``logits``.
        chunk_size: rows per chunk; default :func:`default_chunk_size` (``V``).
        inplace_backward: backward writes the gradient into ``logits``' own storage instead of
            a fresh buffer, saving one logits-sized allocation. Only for logits that nothing
            else reads afterwards (e.g. the lm-head output); their values are destroyed. Autograd
            raises if another op saved the same logits for its own backward.

    Returns:
        ``(...)`` float32 log-probabilities (float64 for float64 logits).

    Raises:
        ValueError: logits with fewer than 2 dims or not floating point, labels not integer,
            on another device or not of shape ``logits.shape[:-1]``, a label outside
            ``[0, V)``, a chunk size below 1, ``inplace_backward`` on a leaf tensor.
    """
    flat_labels = _check(logits, labels, chunk_size, inplace_backward, "logprobs_from_logits")
    logprobs, _ = _stats(logits, flat_labels, chunk_size, True, False, inplace_backward)
    return cast(torch.Tensor, logprobs).view(logits.shape[:-1])


def entropy_from_logits(
    logits: torch.Tensor, chunk_size: int | None = None, inplace_backward: bool = False
) -> torch.Tensor:
    """Entropy of softmax(logits) per token, in nats, computed ``chunk_size`` rows at a time.

    Args, errors: as :func:`logprobs_from_logits` (without labels). Logits of −inf (masked
    tokens) contribute 0 to the entropy and get a 0 gradient, as with
    ``torch.distributions.Categorical``.

    Returns:
        ``(...)`` float32 entropies (float64 for float64 logits), ``logits.shape[:-1]``.
    """
    _check(logits, None, chunk_size, inplace_backward, "entropy_from_logits")
    _, entropy = _stats(logits, None, chunk_size, False, True, inplace_backward)
    return cast(torch.Tensor, entropy).view(logits.shape[:-1])


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs_from_logits(...), entropy_from_logits(...))`` in one pass over the logits.

    Both share each chunk's softmax in forward and in backward; the gradient is the sum of
    both outputs' gradients, written once. Args, returns and errors as the two functions.
    """
    flat_labels = _check(logits, labels, chunk_size, inplace_backward, "logprobs_and_entropy_from_logits")
    logprobs, entropy = _stats(logits, flat_labels, chunk_size, True, True, inplace_backward)
    return cast(torch.Tensor, logprobs).view(logits.shape[:-1]), cast(torch.Tensor, entropy).view(
        logits.shape[:-1]
    )


def _stats(*args: Any) -> _Outputs:
    """``_LogSoftmaxStats.apply``, typed: torch's stubs leave ``Function.apply`` untyped."""
    return cast(Callable[..., _Outputs], _LogSoftmaxStats.apply)(*args)


def _check(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    chunk_size: int | None,
    inplace_backward: bool,
    name: str,
) -> torch.Tensor | None:
    """Validate the arguments; return the labels flattened to ``(N,)`` int64."""
    if logits.dim() < 2:
        raise ValueError(
            f"{name}: logits must have shape (..., vocab) with at least 2 dims, "
            f"got shape {tuple(logits.shape)}."
        )
    if not logits.is_floating_point():
        raise ValueError(f"{name}: logits must be floating point, got dtype {logits.dtype}.")
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(f"{name}: logits have an empty vocabulary dimension (shape {tuple(logits.shape)}).")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(
            f"{name}: chunk_size must be a positive int (rows per chunk) or None, got {chunk_size!r}."
        )
    if inplace_backward and logits.requires_grad and logits.is_leaf:
        raise ValueError(
            f"{name}: inplace_backward=True would overwrite a leaf tensor's values with its gradient; "
            "use it only on computed logits (e.g. the lm-head output) that nothing else reads."
        )
    if labels is None:
        return None
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"{name}: labels must be integer token ids, got dtype {labels.dtype}.")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"{name}: labels of shape {tuple(labels.shape)} do not match logits of shape "
            f"{tuple(logits.shape)}; labels must have the logits' leading shape {tuple(logits.shape[:-1])}."
        )
    if labels.device != logits.device:
        raise ValueError(f"{name}: labels are on {labels.device} but logits on {logits.device}.")
    if labels.numel() > 0:
        bounds = labels.aminmax()
        low, high = int(bounds.min), int(bounds.max)  # one device sync for both bounds
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(
                f"{name}: label {bad} is outside the vocabulary [0, {vocab}) (vocab size {vocab})."
            )
    return labels.reshape(-1).long()


def _row_blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` (..., V) as 2-D ``(rows, V)`` views, in row-major order, without copying.

    One view when the leading dims merge (contiguous tensors, most slices); otherwise (e.g.
    ``logits[:, :-1]``) one per index of the first dim, recursively.
    """
    if x.dim() == 2:
        return [x]
    try:
        return [x.view(-1, x.shape[-1])]
    except RuntimeError:  # strides that cannot merge: split along dim 0
        return [block for sub in x.unbind(0) for block in _row_blocks(sub)]


def _chunks(x: torch.Tensor, chunk_size: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(row_start, rows)`` over ``x`` (..., V): ``rows`` a ``(<= chunk_size, V)`` view."""
    start = 0
    for block in _row_blocks(x):
        for first in range(0, block.shape[0], chunk_size):
            rows = block[first : first + chunk_size]
            yield start + first, rows
        start += block.shape[0]


class _Workspace:
    """Reusable ``(chunk_size, V)`` buffers, so the chunk loop does not allocate per chunk."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = (rows, vocab), dtype, device
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.buffers[name][:rows]


class _LogSoftmaxStats(torch.autograd.Function):
    """Chunked log p(label) and/or entropy of softmax(logits) over the last dim.

    Returns ``(logprobs (N,) or None, entropy (N,) or None)``; saves the logits, the labels,
    logsumexp(z) per row and, for the entropy, Σ p z per row.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        chunk_size: int | None,
        want_logprobs: bool,
        want_entropy: bool,
        inplace_backward: bool,
    ) -> _Outputs:
        vocab = logits.shape[-1]
        rows_total = logits.numel() // vocab
        chunk_size = chunk_size or default_chunk_size(vocab)
        compute = torch.promote_types(logits.dtype, torch.float32)
        workspace = _Workspace(min(chunk_size, rows_total), vocab, compute, logits.device)
        lse = torch.empty(rows_total, dtype=compute, device=logits.device)
        logprobs = torch.empty_like(lse) if want_logprobs else None
        entropy = torch.empty_like(lse) if want_entropy else None
        mean_z = torch.empty_like(lse) if want_entropy else None
        fmin = torch.finfo(compute).min
        for start, rows in _chunks(logits, chunk_size):
            n, stop = rows.shape[0], start + rows.shape[0]
            z = rows if rows.dtype == compute else workspace.get("z", n).copy_(rows)
            top = z.amax(dim=-1, keepdim=True)
            shifted = torch.sub(z, top, out=workspace.get("shifted", n))  # y = z − max z <= 0
            if logprobs is not None and labels is not None:
                label_shifted = shifted.gather(-1, labels[start:stop, None]).squeeze(-1)
            exp = torch.exp(shifted, out=workspace.get("exp", n)) if want_entropy else shifted.exp_()
            total = exp.sum(dim=-1)  # Σ e^y;  logsumexp(z) = max z + log Σ e^y
            log_total = total.log()
            torch.add(top.squeeze(-1), log_total, out=lse[start:stop])
            if logprobs is not None:
                # log p(y) = y_label − log Σ e^y
                torch.sub(label_shifted, log_total, out=logprobs[start:stop])
            if entropy is not None and mean_z is not None:
                # E_p[y] = Σ e^y y / Σ e^y;  H = log Σ e^y − E_p[y]. A −inf logit has e^y = 0;
                # clamping y to the dtype's minimum makes its term 0 instead of 0·(−inf) = NaN.
                mean_y = exp.mul_(shifted.clamp_(min=fmin)).sum(dim=-1).div_(total)
                torch.sub(log_total, mean_y, out=entropy[start:stop])
                torch.add(top.squeeze(-1), mean_y, out=mean_z[start:stop])  # Σ p z = max z + E_p[y]
        ctx.set_materialize_grads(False)
        ctx.chunk_size, ctx.inplace_backward = chunk_size, inplace_backward
        ctx.save_for_backward(logits, labels, lse, mean_z)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        create_graph = torch.is_grad_enabled()  # only under backward(create_graph=True)
        with torch.no_grad():
            grad = _gradient(ctx, grad_logprobs, grad_entropy)
        if create_graph and grad is not None:
            no_double = cast(Callable[[torch.Tensor], torch.Tensor], _NoDoubleBackward.apply)
            grad = no_double(grad.detach().requires_grad_())
        return grad, None, None, None, None, None


class _NoDoubleBackward(torch.autograd.Function):
    """Identity on the gradient that raises if the gradient itself is differentiated."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "trellis.algorithms.logprobs: double backward (differentiating the gradient of "
            "logprobs_from_logits / entropy_from_logits, e.g. after create_graph=True) is not supported."
        )


def _gradient(
    ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
) -> torch.Tensor | None:
    """∂(Σ g_lp·log p(y) + Σ g_H·H)/∂logits, chunk by chunk; None when neither output has a gradient."""
    saved: tuple[torch.Tensor, ...] = ctx.saved_tensors  # ctx is torch's untyped FunctionCtx
    logits, labels, lse, mean_z = saved
    if grad_logprobs is None and grad_entropy is None:
        return None
    vocab, rows_total, compute = logits.shape[-1], lse.shape[0], lse.dtype
    fmin = torch.finfo(compute).min
    workspace = _Workspace(min(ctx.chunk_size, rows_total), vocab, compute, logits.device)
    if grad_logprobs is not None:
        grad_logprobs = grad_logprobs.reshape(-1, 1).to(compute)
    if grad_entropy is not None:
        grad_entropy = grad_entropy.reshape(-1, 1).to(compute)
    # The gradient goes chunk by chunk into `grad`: a fresh contiguous buffer, or the logits
    # themselves when in place (their version counter then tells any other op that saved
    # them for its backward that they changed).
    if ctx.inplace_backward:
        grad = logits
    else:
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_flat = grad.view(-1, vocab)
    for start, rows in _chunks(logits, ctx.chunk_size):
        n, stop = rows.shape[0], start + rows.shape[0]
        grad_rows = rows if ctx.inplace_backward else grad_flat[start:stop]
        if rows.dtype == compute:
            # Written straight into the gradient, which may be `rows` itself (in place): every
            # read of z below comes before the write into `out` that overwrites it.
            z, out = rows, grad_rows
        else:
            z = out = workspace.get("z", n).copy_(rows)  # the upcast copy doubles as output
        lse_rows = lse[start:stop, None]
        if grad_entropy is None:
            assert grad_logprobs is not None  # the early return above: at least one has a gradient
            # g·(onehot(y) − p): first −g·p, into `out` directly
            torch.sub(z, lse_rows, out=out).exp_().mul_(grad_logprobs[start:stop].neg())
        else:
            # −g_H·p·(z − Σp z) − g_lp·p. Multiplying by p before anything else keeps a −inf
            # logit (p = 0, z clamped to the dtype's minimum) at exactly 0, with no overflow.
            p = torch.sub(z, lse_rows, out=workspace.get("p", n)).exp_()
            torch.sub(z, mean_z[start:stop, None], out=out).clamp_(min=fmin)
            out.mul_(p).mul_(grad_entropy[start:stop].neg())
            if grad_logprobs is not None:
                out.addcmul_(p, grad_logprobs[start:stop], value=-1)
        if grad_logprobs is not None:
            # + g·onehot(y), by index: no one-hot tensor
            out.scatter_add_(1, labels[start:stop, None], grad_logprobs[start:stop])
        if out is not grad_rows:
            grad_rows.copy_(out)
    return grad
