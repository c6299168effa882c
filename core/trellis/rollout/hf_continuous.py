"""Continuous batching for the ``hf`` replica: requests join and leave the running batch between steps.

One :class:`ContinuousDecoder` runs in the replica's worker thread for as long as it has rows to
decode. Its loop, once per decoding step:

1. **admits** requests waiting in the session's inbox (up to the replica's ``max_batch_size``
   rows): one prefill forward pass over the newcomers, left-padded, whose KV cache then joins
   the running one; their first token is sampled from that pass;
2. **decodes** one token for every running row (one forward pass of the whole batch over its
   last tokens);
3. **retires** every row that met its stop id, stop string or ``max_tokens``: its result goes to
   its caller at once (not when the batch ends) and its KV rows are dropped, so the next step
   runs a smaller batch.

KV layout. The running batch holds one ``transformers.DynamicCache`` whose rows are left-padded
to a shared width (every row's last token sits in the last column), with a ``(rows, width)``
attention mask marking each row's real tokens and explicit position ids per row, so padding
never shifts a row's positions. A prefill runs the tokens its distinct contexts all begin with (a
system prompt, at least :data:`MIN_COMMON_PREFIX`) once, in front of the rows' own left-padded
tokens: those rows read ``[shared start | padding | own tokens]``, the padding a hole the mask skips.
A newcomer's cache is padded on the left to the wider of the two widths (or the running rows are)
and concatenated along the batch; when rows leave, columns that are padding in every remaining row
are cut from the left. A row's log-probs are those of a
teacher-forced forward pass of its own tokens (padding is masked out), to float rounding. For
Llama-family models the decoding steps skip the ``transformers`` forward
(:class:`~trellis.rollout.hf_lean.LeanDecoder`): the cache is then per-layer buffers with room for
the rows' remaining tokens (:class:`~trellis.rollout.hf_lean.KVBuffers`), written in place instead
of concatenated every step; a join copies them once, a retirement moves only the rows that stay past
the new last row into the freed slots (so the running rows change order, and their state with them).

Sampling is :class:`~trellis.rollout.hf_sampling.RowRule` with each row's own uniform stream, as
in the ``generate`` path, so a seeded request gets the same tokens either way; unseeded rows draw
their stream from the replica's generator when they are admitted.

Which models. Decoder-only models whose cache is plain full attention (``DynamicCache`` of
``DynamicLayer``); others (sliding-window or linear-attention layers, vision-language models,
requests with images) keep the one-``generate``-per-batch path (:func:`supports_continuous`).

Admission stops (the running rows finish, the decoder returns, the rest wait) while a weight
update waits for the replica (``hold()``); with partial rollout the update's interrupt event ends
the running rows after their current token instead.
"""

from __future__ import annotations

import collections
import inspect
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from trellis.engine import shared_prompt
from trellis.rollout.hf_lean import KVBuffers, LeanDecoder
from trellis.rollout.hf_sampling import RowRule, uniform_streams
from trellis.rollout.sampling import SamplingParams, StopReason, TokenOutput

MIN_COMMON_PREFIX = 16
"""Leading tokens the distinct contexts of one prefill must share before they are run once (one more,
small forward pass). A chat template's system prompt is longer: SmolLM2's is 24 tokens, repeated in
every prompt of the demo."""


def supports_continuous(model: Any) -> bool:
    """Whether ``model`` can decode with :class:`ContinuousDecoder`: a decoder-only text model whose
    ``DynamicCache`` is made of plain full-attention ``DynamicLayer`` layers."""
    return shared_prompt.plain_kv_cache(model)


@dataclass
class DecodeStats:
    """Counters a replica keeps across its continuous sessions, updated as each step runs."""

    steps: int = 0  # decoding steps (prefills not counted)
    prefills: int = 0  # admissions: prefill passes of newcomers
    peak_rows: int = 0  # most rows decoded at once
    shared_prefill_rows: int = 0  # admitted rows whose context another row of their prefill computed
    shared_prefix_tokens: int = 0  # context tokens not prefilled: a common start computed once per prefill
    lean_steps: int = 0  # decoding steps run by the LeanDecoder (the rest by the transformers forward)
    weight_layout: str = "plain"  # the layout the last session's LeanDecoder multiplied the large weights in
    weight_copies: int = 0  # weights that LeanDecoder multiplied through a copy in that layout


@dataclass
class Session:
    """The meeting point of the event loop (which offers requests) and the decoder thread.

    ``offer`` is called on the event loop thread, ``take`` and ``close_if_idle`` in the decoder's;
    both hold ``lock``, so a request offered while the decoder closes is either taken or refused
    (and then queued by the caller), never lost. ``hold`` says whether admission is paused (a weight
    update or a request the decoder cannot serve waits).
    """

    hold: Callable[[], bool]
    inbox: collections.deque = field(default_factory=collections.deque)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)  # shutdown: return after this step
    open: bool = True
    waiting_outside: int = 0  # requests queued for a later batch (images): admission stops for them

    def held(self) -> bool:
        """Whether admission is paused: a weight update or a request the session cannot take waits."""
        return self.waiting_outside > 0 or self.hold()

    def offer(self, request: Any) -> bool:
        """Queue ``request`` for admission; False once the session closed (queue it elsewhere)."""
        with self.lock:
            if not self.open:
                return False
            self.inbox.append(request)
            return True

    def take(self, n: int) -> list[Any]:
        with self.lock:
            return [self.inbox.popleft() for _ in range(min(n, len(self.inbox)))]

    def close_if_idle(self) -> bool:
        """Close when nothing waits to be admitted, or admission is held (the rest wait elsewhere)."""
        with self.lock:
            if self.inbox and not self.held():
                return False
            self.open = False
            return True

    def leftovers(self) -> list[Any]:
        """Close the session and hand back what it never admitted."""
        with self.lock:
            self.open = False
            items = list(self.inbox)
            self.inbox.clear()
            return items


@dataclass
class _Row:
    """One request in the running batch."""

    request: Any
    params: SamplingParams  # this segment's (max_tokens less a resumed prefix)
    stops: set[int]
    prefix: list[int]  # tokens of earlier segments (stop strings span them)
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)

    def output(self, reason: StopReason, version: int) -> TokenOutput:
        n = len(self.tokens)
        log_probs = self.log_probs if self.params.wants_logprobs else None
        return TokenOutput(self.tokens, log_probs, reason, weight_versions=[version] * n)


class ContinuousDecoder:
    """Decodes a changing set of rows in one thread; see the module docstring.

    Args:
        model: the causal LM (in eval mode, under ``torch.no_grad``: the caller's job).
        device: where its inputs go.
        eos: the model's eos ids (every row stops at them, besides its own stop ids).
        pad: the id left padding uses (masked out, its value never matters).
        generator: the replica's generator (uniforms of unseeded rows).
        tokenizer: decodes responses for stop strings (None when no request has one).
        max_rows: most rows decoded at once.
        version: the weight version stamped on every token.
        session: the inbox of later requests.
        deliver: ``deliver(request, segment, finished)``, called from this thread as each row ends
            (``finished`` False: a weight update interrupted it).
        interrupt: set while a partial-rollout weight update waits: every row stops after its
            current token, unfinished.
        admitted: a list each request taken from the session is appended to (the caller fails them
            all if the decoder raises).
        stats: counters to update (a fresh one when None).
        lean: decode steps with this :class:`~trellis.rollout.hf_lean.LeanDecoder` over in-place
            :class:`~trellis.rollout.hf_lean.KVBuffers` (None: the model's own forward and cache).
    """

    def __init__(
        self,
        model: Any,
        device: Any,
        *,
        eos: set[int],
        pad: int,
        generator: Any,
        tokenizer: Any,
        max_rows: int,
        version: int,
        session: Session,
        deliver: Callable[[Any, TokenOutput, bool], None],
        interrupt: threading.Event | None = None,
        admitted: list[Any] | None = None,
        stats: DecodeStats | None = None,
        lean: LeanDecoder | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.eos = eos
        self.pad = pad
        self.generator = generator
        self.tokenizer = tokenizer
        self.max_rows = max_rows
        self.version = version
        self.session = session
        self.deliver = deliver
        self.interrupt = interrupt
        self.admitted = admitted if admitted is not None else []
        self.rows: list[_Row] = []
        self.lean = lean
        self.cache: Any = None  # the running rows' KVBuffers (lean) or DynamicCache
        self.mask: Any = None  # (rows, width) long: 1 on real tokens
        self.positions: Any = None  # (rows,) long: each row's next position id
        self.last: Any = None  # (rows,) long: each row's last sampled token (the next step's input)
        self.uniforms: Any = None  # (rows, steps) float64: each row's stream
        self.rule: RowRule | None = None  # for the rows as they are now (rebuilt when they change)
        self.stats = stats if stats is not None else DecodeStats()
        accepted = inspect.signature(type(model).forward).parameters  # the class: wrappers hide it
        self._keeps_logits = "logits_to_keep" in accepted
        self._cache_arg = shared_prompt.cache_argument(model)

    # ------------------------------------------------------------------ the loop

    def run(self, first: list[Any]) -> None:
        """Decode ``first`` and whatever the session admits, until no row is left to decode."""
        for _ in self.iterate(first):
            pass

    def iterate(self, first: list[Any]) -> Generator[None, None, None]:
        """:meth:`run` one admission and/or decoding step at a time: yields after each, so a caller on
        the event loop's thread can let the loop run (offer requests, deliver results) in between."""
        pending = list(first)
        while not self.session.stop.is_set():
            yield
            if self.interrupt is not None and self.interrupt.is_set() and self.rows:
                for row in self.rows:  # partial rollout: resume later under the new weights
                    self.deliver(row.request, row.output("length", self.version), False)
                self.rows = []
                break
            room = self.max_rows - len(self.rows) - len(pending)
            if room > 0 and not self.session.held():
                taken = self.session.take(room)
                self.admitted.extend(taken)
                pending += taken
            if pending:
                self._admit(pending)
                pending = []
            if not self.rows:
                if self.session.close_if_idle():
                    break
                continue
            self._step()

    def _admit(self, requests: list[Any]) -> None:
        """Prefill ``requests`` (left-padded together; equal contexts once; the start all share once), join
        their cache to the running one, and sample each one's first token."""
        import torch

        contexts = [r.prompt_ids + r.prefix_ids for r in requests]
        ids, mask = left_padded(contexts, self.pad)
        kwargs = {"logits_to_keep": 1} if self._keeps_logits else {}
        # requests with the same context (the rollout.n samples of a prompt) are prefilled once
        shared = shared_prompt.prompt_groups(ids, mask)
        pick = shared[0] if shared is not None else torch.arange(len(requests))
        common = _common_prefix([contexts[i] for i in pick.tolist()])
        past: dict[str, Any] = {}
        if common >= MIN_COMMON_PREFIX:  # and the distinct contexts their common start (a system prompt)
            ids, mask, past = self._prefill_prefix(contexts, common, len(pick))
        positions = (mask.cumsum(1) - 1).clamp_(min=0)[:, mask.shape[1] - ids.shape[1] :]
        out = self.model(
            input_ids=ids[pick].to(self.device),
            attention_mask=mask[pick].to(self.device),
            position_ids=positions[pick].to(self.device),
            use_cache=True,
            **past,
            **kwargs,
        )
        cache, logits = shared_prompt.cache_of(out), out.logits[:, -1, :]
        if shared is not None:
            inverse = shared[1].to(self.device)
            cache, logits = shared_prompt.expand_cache(cache, inverse), logits.index_select(0, inverse)
            self.stats.shared_prefill_rows += len(requests) - len(shared[0])
        params = [r.segment_params() for r in requests]
        rows = [
            _Row(r, p, self.eos | set(p.stop_token_ids), list(r.prefix_ids))
            for r, p in zip(requests, params, strict=True)
        ]
        streams = uniform_streams(
            params, self.generator, max(p.max_tokens for p in params), [len(r.prefix_ids) for r in requests]
        ).to(self.device)
        first = len(self.rows)
        self._join(cache, mask.to(self.device), streams, rows)
        self.rows += rows
        self.positions = torch.cat([self.positions, mask.sum(1).to(self.device)])
        self.last = torch.cat([self.last, torch.zeros(len(rows), dtype=torch.long, device=self.device)])
        self.stats.prefills += 1
        self.stats.peak_rows = max(self.stats.peak_rows, len(self.rows))
        self._sample(logits, first)

    def _prefill_prefix(
        self, contexts: list[list[int]], common: int, rows: int
    ) -> tuple[Any, Any, dict[str, Any]]:
        """Prefill the first ``common`` tokens every context shares, once, for ``rows`` prefill rows.

        Returns the contexts' remaining tokens left-padded ``(len(contexts), width)`` and their mask
        with the shared columns in front, ``(len(contexts), common + width)``: each row reads
        ``[shared tokens | its padding | its own tokens]``, the padding a hole the mask skips. The
        third item is the keyword that hands the shared tokens' KV cache, copied to ``rows`` rows, to
        the prefill of the rest.
        """
        import torch

        self.stats.shared_prefix_tokens += common * (rows - 1)
        head = torch.tensor([contexts[0][:common]], dtype=torch.long)
        out = self.model(
            input_ids=head.to(self.device),
            attention_mask=torch.ones_like(head).to(self.device),
            position_ids=torch.arange(common)[None].to(self.device),
            use_cache=True,
            **({"logits_to_keep": 1} if self._keeps_logits else {}),
        )
        index = torch.zeros(rows, dtype=torch.long, device=self.device)
        cache = shared_prompt.expand_cache(shared_prompt.cache_of(out), index)
        ids, own = left_padded([c[common:] for c in contexts], self.pad)
        mask = torch.cat([torch.ones((len(contexts), common), dtype=torch.long), own], dim=1)
        return ids, mask, {self._cache_arg: cache}

    def _step(self) -> None:
        """One decoding step of every running row."""
        import torch

        ones = torch.ones((len(self.rows), 1), dtype=torch.long, device=self.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        if self.lean is not None:
            logits = self.lean.step(self.last, self.positions, self.mask, self.cache)
            self.positions += 1
            self.stats.steps += 1
            self.stats.lean_steps += 1
            self._sample(logits, 0)
            return
        out = self.model(
            input_ids=self.last[:, None],
            attention_mask=self.mask,
            position_ids=self.positions[:, None],
            use_cache=True,
            **{self._cache_arg: self.cache},
        )
        self.cache = shared_prompt.cache_of(out)
        self.positions += 1
        self.stats.steps += 1
        self._sample(out.logits[:, -1, :], 0)

    def _sample(self, logits: Any, first: int) -> None:
        """Sample the next token of rows ``first..`` from their ``logits``; retire the rows that end."""
        import torch

        rows = self.rows[first:]
        if first == 0:
            if self.rule is None:
                self.rule = RowRule([r.params for r in self.rows], self.device)
            rule = self.rule
        else:  # newcomers only
            rule = RowRule([r.params for r in rows], self.device)
        counts = torch.tensor([len(r.tokens) for r in rows], device=self.device)
        uniforms = self.uniforms[first:].gather(1, counts[:, None])
        chosen, log_probs = rule.pick(logits, uniforms)
        self.last[first:] = chosen
        tokens = chosen.tolist()
        lps = log_probs.tolist() if any(r.params.wants_logprobs for r in rows) else None
        done: list[int] = []
        for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
            row.tokens.append(token)
            if lps is not None:
                row.log_probs.append(lps[i])
            reason = self._stop_reason(row, token)
            if reason is not None:
                self.deliver(row.request, row.output(reason, self.version), True)
                done.append(first + i)
        if done:
            self._retire(done)

    def _stop_reason(self, row: _Row, token: int) -> StopReason | None:
        if token in row.stops:
            return "stop"
        if row.params.stop:
            text = self.tokenizer.decode(row.prefix + row.tokens, skip_special_tokens=False)
            if any(s in text for s in row.params.stop):
                return "stop"
        if len(row.tokens) >= row.params.max_tokens:
            return "length"
        return None

    # ------------------------------------------------------------------ the KV rows

    def _join(self, cache: Any, mask: Any, streams: Any, joining: list[_Row]) -> None:
        """Append the prefilled cache of the rows ``joining`` (with their mask and uniform streams) to
        the running rows."""
        import torch
        import torch.nn.functional as F

        self.rule = None
        if not self.rows:
            self.mask, self.uniforms = mask, streams
            self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
            self.last = torch.zeros(0, dtype=torch.long, device=self.device)
            self.cache = cache
            if self.lean is not None:
                self.cache = KVBuffers(_pairs(cache), mask.shape[1] + _room(joining))
            return
        old, new = self.mask.shape[1], mask.shape[1]
        width = max(old, new)
        pairs = [
            (torch.cat([_left_pad(k, width - old), _left_pad(k2, width - new)]),
             torch.cat([_left_pad(v, width - old), _left_pad(v2, width - new)]))
            for (k, v), (k2, v2) in zip(_pairs(self.cache), _pairs(cache), strict=True)
        ]  # fmt: skip
        self._store(pairs, width + _room(self.rows + joining))
        self.mask = torch.cat([F.pad(self.mask, (width - old, 0)), F.pad(mask, (width - new, 0))])
        steps = max(self.uniforms.shape[1], streams.shape[1])
        self.uniforms = torch.cat(
            [
                F.pad(self.uniforms, (0, steps - self.uniforms.shape[1])),
                F.pad(streams, (0, steps - streams.shape[1])),
            ]
        )

    def _retire(self, done: list[int]) -> None:
        """Drop rows ``done`` from the batch, and the columns left holding only padding."""
        import torch

        self.rule = None
        gone = set(done)
        order = [i for i in range(len(self.rows)) if i not in gone]  # the old index of each row kept
        if not order:
            self.rows = []
            self.cache = self.mask = self.uniforms = self.positions = self.last = None
            return
        keep = torch.tensor(order, dtype=torch.long, device=self.device)
        lead = int(self.mask[keep].any(0).int().argmax())  # first column some row still uses
        if isinstance(self.cache, KVBuffers):  # in place: only rows moving into freed slots are copied
            order = self.cache.retire(order, lead)  # which reorders the rows
            keep = torch.tensor(order, dtype=torch.long, device=self.device)
        else:
            self._store([(k[keep, :, lead:], v[keep, :, lead:]) for k, v in _pairs(self.cache)], 0)
        self.rows = [self.rows[i] for i in order]
        self.mask = self.mask[keep][:, lead:]
        self.positions = self.positions[keep]
        self.last = self.last[keep]
        self.uniforms = self.uniforms[keep]

    def _store(self, pairs: list[tuple[Any, Any]], capacity: int) -> None:
        """Make ``pairs`` (per layer keys and values) the running rows' cache, with room for
        ``capacity`` columns when decoding lean."""
        if self.lean is not None:
            self.cache = KVBuffers(pairs, capacity)
            return
        for layer, (keys, values) in zip(self.cache.layers, pairs, strict=True):
            layer.keys, layer.values = keys, values


def _pairs(cache: Any) -> list[tuple[Any, Any]]:
    """Per layer ``(keys, values)`` of a ``DynamicCache`` or :class:`KVBuffers` (the used columns)."""
    if isinstance(cache, KVBuffers):
        return cache.pairs()
    return [(layer.keys, layer.values) for layer in cache.layers]


def left_padded(seqs: list[list[int]], pad: int) -> tuple[Any, Any]:
    """``seqs`` left-padded with ``pad`` to the longest one's length (each ends in the last column):
    ``(ids, mask)``, both ``(len(seqs), width)`` long, the mask 1 on each sequence's own tokens."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return ids, mask


def _common_prefix(contexts: list[list[int]]) -> int:
    """How many leading tokens all of ``contexts`` (two or more) share, leaving each at least its last
    token (whose logits pick its first new token); 0 for fewer than two contexts."""
    if len(contexts) < 2:
        return 0
    shortest = min(len(c) for c in contexts) - 1
    first = contexts[0]
    n = 0
    while n < shortest and all(c[n] == first[n] for c in contexts):
        n += 1
    return n


def _room(rows: list[_Row]) -> int:
    """The most decoding steps any of ``rows`` can still take (columns its cache may need)."""
    return max((r.params.max_tokens - len(r.tokens) for r in rows), default=0)


def _left_pad(x: Any, n: int) -> Any:
    """``x`` (batch, heads, width, dim) with ``n`` zero columns in front."""
    import torch.nn.functional as F

    return F.pad(x, (0, 0, n, 0)) if n else x
