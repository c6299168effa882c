"""The ``hf`` replica's per-row sampler: each row's next token under its own params, and its log-prob.

Shared by the two ways the replica decodes (one ``model.generate`` per batch, and continuous
batching, :mod:`trellis.rollout.hf_continuous`), so a request gets the same tokens either way.

- greedy rows (``temperature == 0``) take the argmax;
- sampled rows divide the logits by their temperature, apply their top-k / top-p (only the rows
  that ask for one pay for the sort) and draw by inverse CDF: the first token whose cumulative
  probability (summed in float64) exceeds ``u * total``, ``u ~ U[0, 1)``, one uniform per row
  and step (see :mod:`trellis.rollout.hf` for why not the exponential race);
- a row's uniforms are its own stream (:func:`uniform_streams`): a seeded row reads
  ``torch.Generator(seed)`` from its token offset on, so it gets the same tokens whatever it is
  batched with; the other rows draw theirs from the replica's generator when they start.

Log-probs are ``log_softmax(logits / T)[token]`` before top-k / top-p truncation (``T = 1`` for
greedy rows), what vLLM returns by default.
"""

from __future__ import annotations

from typing import Any

from trellis.rollout.sampling import SamplingParams

# u < 1 - 2**-52 keeps u * total strictly below the total mass in float64 rounding, so the
# inverse-CDF search never runs past the last token of positive probability
_MAX_UNIFORM = 1 - 2**-52


def uniform_streams(
    params: list[SamplingParams], generator: Any, steps: int, offsets: list[int] | None = None
) -> Any:
    """``(rows, steps)`` float64 uniforms on the CPU: row ``i``'s ``t``-th token uses column ``t``.

    Seeded rows read their own ``torch.Generator(seed)`` stream from number ``offsets[i]`` on (a
    response resumed after ``offsets[i]`` tokens); unseeded sampled rows draw from ``generator``;
    greedy rows get zeros (unused).
    """
    import torch

    uniforms = torch.zeros((len(params), steps), dtype=torch.float64)
    unseeded = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
    if unseeded:
        uniforms[unseeded] = torch.rand((len(unseeded), steps), generator=generator, dtype=torch.float64)
    for i, p in enumerate(params):
        if not p.greedy and p.seed is not None:
            offset = offsets[i] if offsets is not None else 0
            row_generator = torch.Generator(device="cpu").manual_seed(p.seed)
            stream = torch.rand(offset + steps, generator=row_generator, dtype=torch.float64)
            uniforms[i] = stream[offset:]
    return uniforms.clamp_(max=_MAX_UNIFORM)


class RowRule:
    """How each row of a batch picks its token: temperatures, greedy rows, top-k / top-p rows."""

    def __init__(self, params: list[SamplingParams], device: Any) -> None:
        import torch

        self.greedy_only = all(p.greedy for p in params)
        temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        self.temps = (
            None if all(t == 1.0 for t in temps) else torch.tensor(temps, device=device)[:, None]
        )  # (batch, 1)
        greedy = [p.greedy for p in params]
        self.greedy_rows = torch.tensor(greedy, device=device) if any(greedy) and not all(greedy) else None
        filtered = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1)]
        self.filtered_rows = torch.tensor(filtered, dtype=torch.long, device=device) if filtered else None
        # per filtered row: k (a huge k when top-k is off) and the nucleus mass (inf when top-p is off)
        self.top_k = torch.tensor(
            [params[i].top_k if params[i].top_k > 0 else 2**62 for i in filtered], device=device
        )[:, None]
        self.top_p = torch.tensor(
            [params[i].top_p if params[i].top_p < 1 else float("inf") for i in filtered], device=device
        )[:, None]

    def pick(self, scores: Any, uniforms: Any) -> tuple[Any, Any]:
        """``(chosen, log_probs)``, each ``(batch,)``, from raw logits ``(batch, vocab)`` and each row's
        uniform ``(batch, 1)`` (float64; ignored when every row is greedy)."""
        import torch

        logits = scores.float()  # float32 logits pass through without a copy
        if self.temps is not None:
            logits = logits / self.temps
        if self.greedy_only:
            lse = torch.logsumexp(logits, -1, keepdim=True)
            chosen = logits.argmax(-1)
        else:
            # one exp pass for both: unnormalised probabilities (the search below scales u by their
            # total) and the log-normaliser, logsumexp's own max + log(sum(exp(x - max)))
            top = logits.amax(-1, keepdim=True)
            probs = (logits - top).exp_()
            lse = probs.sum(-1, keepdim=True).log_().add_(top)
            if self.filtered_rows is not None:
                probs[self.filtered_rows] = self._truncate(probs[self.filtered_rows])
            # inverse CDF: the first token whose cumulative mass exceeds u * total (float64 sums)
            cdf = probs.cumsum(-1, dtype=torch.float64)
            target = uniforms * cdf[:, -1:]
            chosen = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
            if self.greedy_rows is not None:
                chosen = torch.where(self.greedy_rows, logits.argmax(-1), chosen)
        return chosen, (logits.gather(1, chosen[:, None]) - lse)[:, 0]

    def _truncate(self, probs: Any) -> Any:
        """``probs`` of the filtered rows with the tokens outside each row's top-k / top-p zeroed."""
        import torch

        sorted_probs, order = probs.sort(-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)
        sorted_probs = sorted_probs.masked_fill(rank >= self.top_k, 0.0)
        # nucleus: drop a token once the mass kept before it reaches top_p of the top-k mass
        before = sorted_probs.cumsum(-1) - sorted_probs
        total = sorted_probs.sum(-1, keepdim=True)
        sorted_probs = sorted_probs.masked_fill(before >= self.top_p * total, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def stop_string_cut(tokenizer: Any, tokens: list[int], stop: tuple[str, ...], start: int = 0) -> int | None:
    """Number of tokens up to and including the first one whose decoded prefix contains a stop string.

    Only cuts after the first ``start`` tokens are looked at (a resumed response's prefix, already
    checked).
    """
    for n in range(start + 1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n], skip_special_tokens=False)
        if any(s in text for s in stop):
            return n
    return None
