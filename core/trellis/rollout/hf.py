"""The ``hf`` rollout replica: transformers ``generate``, with concurrent requests coalesced into batches.

Requests from concurrent :meth:`HFRolloutReplica.generate` calls wait in a queue. A background
task takes everything queued (up to ``max_batch_size``, after a ``batch_wait_s`` window for
stragglers), left-pads the prompts and runs *one* ``model.generate`` (KV cache on) in a worker
thread, so the event loop stays responsive. One batch runs at a time per replica; requests that
arrive meanwhile form the next batch.

Every request in a batch may have its own sampling parameters: sampling is done per row by a
logits processor (:class:`_RowSampler`) that applies that row's temperature, top-k, top-p and
seed and hands ``generate`` a one-hot choice (``generate`` itself runs greedy), and a stopping
criterion ends each row at its own ``max_tokens``, stop ids or stop strings. A seeded request
therefore gets the same tokens whatever it is batched with.

Log-probs: each returned log-prob is ``log_softmax(logits / T)[token]`` of the model's raw
logits at that step, with ``T`` the request's temperature (``T = 1`` for greedy), i.e. the
temperature-scaled distribution before top-k / top-p truncation (what vLLM returns by
default). A teacher-forced forward pass of the same model, scaled by the same ``T``, gives
the same numbers.

Modes on this backend: ``hybrid`` serves the model object the caller passes (the training
worker's own weights); ``colocated`` and ``standalone`` both load a private copy from
``model_config.path`` into this process (there is no separate server process).

``engine_kwargs`` understood: ``max_batch_size`` (default 256), ``batch_wait_s`` (0.002).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trellis.rollout.base import RolloutReplica
from trellis.rollout.sampling import SamplingParams, TokenOutput

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    future: asyncio.Future = field(repr=False)


class HFRolloutReplica(RolloutReplica):
    """Generation with transformers ``model.generate``, batching concurrent requests; runs anywhere.

    See the module docstring for batching, per-row sampling, log-probs and modes.
    ``sleep`` on an accelerator moves a private copy's weights to the CPU (hybrid: only frees
    the allocator cache, since the weights belong to training); on the CPU there is no cache to
    free, so it only marks the replica asleep. ``generate`` while asleep raises RuntimeError.
    """

    def __init__(self, replica_rank: int, rollout_config: Any, model_config: Any) -> None:
        super().__init__(replica_rank, rollout_config, model_config)
        kwargs = dict(getattr(rollout_config, "engine_kwargs", None) or {})
        self.max_batch_size = int(kwargs.get("max_batch_size", 256))
        self.batch_wait_s = float(kwargs.get("batch_wait_s", 0.002))
        if self.max_batch_size < 1:
            raise ValueError(f"engine_kwargs.max_batch_size must be >= 1, got {self.max_batch_size}.")
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = None
        self.asleep = False
        self.generate_calls = 0  # batched model.generate calls so far (tests and benchmarks read it)
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._generator: Any = None

    # ------------------------------------------------------------------ lifecycle

    async def init(
        self, mode: str = "hybrid", *, model: Any = None, tokenizer: Any = None, device: Any = None
    ) -> None:
        import torch

        self.mode = self.check_mode(mode)
        if mode == "hybrid":
            if model is None:
                raise ValueError(
                    "hybrid mode serves the training worker's model: pass init(..., model=module)."
                )
            self.model = model
        else:
            path = getattr(self.model_config, "path", None)
            if model is not None:
                self.model = model
            elif not path:
                raise ValueError(f"{mode} mode loads its own weights: set model.path (got {path!r}).")
            else:
                self.model = await asyncio.to_thread(self._load_model, path)
        if tokenizer is None:
            tok_path = getattr(self.model_config, "tokenizer_path", None) or getattr(
                self.model_config, "path", None
            )
            if tok_path:
                from transformers import AutoTokenizer

                tokenizer = await asyncio.to_thread(
                    AutoTokenizer.from_pretrained,
                    tok_path,
                    trust_remote_code=bool(getattr(self.model_config, "trust_remote_code", False)),
                )
        self.tokenizer = tokenizer
        if device is not None:
            self.device = torch.device(device)
            if mode != "hybrid":
                self.model.to(self.device)
        else:
            self.device = next(self.model.parameters()).device
        if mode != "hybrid":
            self.model.eval()  # hybrid: training owns the module's mode; _run_batch switches it per batch
        seed = getattr(self.rollout_config, "seed", None)
        self._generator = torch.Generator(device="cpu")
        if seed is not None:
            self._generator.manual_seed(int(seed) + self.replica_rank)
        else:
            self._generator.seed()
        self.asleep = False

    def _load_model(self, path: str) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        mc = self.model_config
        dtype = getattr(torch, _DTYPES.get(getattr(mc, "dtype", "float32"), "float32"))
        attn = getattr(mc, "attn_implementation", "sdpa")
        if attn not in ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"):
            attn = "sdpa"  # trellis' own varlen kernels are for training forward passes
        return AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=attn,
            trust_remote_code=bool(getattr(mc, "trust_remote_code", False)),
        )

    @property
    def _offloads(self) -> bool:
        """Whether sleep moves the weights to host memory: only a private copy on an accelerator."""
        return (
            self.model is not None
            and self.mode != "hybrid"
            and self.device is not None
            and self.device.type != "cpu"
        )

    async def sleep(self) -> None:
        async with self._get_lock():
            import torch

            if self._offloads:
                self.model.to("cpu")
            gc.collect()
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.asleep = True

    async def wake_up(self) -> None:
        async with self._get_lock():
            if self._offloads:
                self.model.to(self.device)
            self.asleep = False

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy each ``(name, tensor)`` into the parameter or buffer of that HF name, in place.

        Raises:
            KeyError: a name the model does not have (the message lists a few it has).
            ValueError: a tensor whose shape differs from the parameter's.
        """
        import torch

        async with self._get_lock():
            targets = dict(self.model.named_parameters(remove_duplicate=False))
            targets.update(dict(self.model.named_buffers(remove_duplicate=False)))
            with torch.no_grad():
                for name, tensor in named_tensors:
                    target = targets.get(name)
                    if target is None:
                        raise KeyError(
                            f"update_weights: the model has no parameter {name!r}; it has e.g. "
                            f"{sorted(targets)[:5]}."
                        )
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise ValueError(
                            f"update_weights: {name!r} has shape {tuple(target.shape)}, "
                            f"got {tuple(tensor.shape)}."
                        )
                    target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    async def shutdown(self) -> None:
        """Stop the batching task; requests still queued resolve with ``stop_reason="abort"``."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        while self._queue is not None and not self._queue.empty():
            req = self._queue.get_nowait()
            if not req.future.done():
                req.future.set_result(_aborted(req))

    # ------------------------------------------------------------------ generation

    async def generate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, request_id: str
    ) -> TokenOutput:
        if self.model is None:
            raise RuntimeError("HFRolloutReplica.generate before init(): await replica.init(mode) first.")
        if self.asleep:
            raise RuntimeError("HFRolloutReplica is asleep: await replica.wake_up() before generate.")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}."
            )
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError(f"request {request_id!r}: prompt_ids is empty; give at least one token.")
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer; pass one to init().")
        loop = asyncio.get_running_loop()
        worker = self._worker
        if self._queue is None or worker is None or worker.done() or worker.get_loop() is not loop:
            # first request, or the replica moved to another event loop (e.g. a later asyncio.run)
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._batch_loop())
        req = _Request(prompt_ids, sampling_params, request_id, loop.create_future())
        await self._queue.put(req)
        return await req.future

    def _get_lock(self) -> asyncio.Lock:
        # one lock per event loop: asyncio locks bind to the loop they first wait in
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    async def _batch_loop(self) -> None:
        assert self._queue is not None  # set by generate before the task starts
        while True:
            batch = [await self._queue.get()]
            if self.batch_wait_s > 0:
                await asyncio.sleep(self.batch_wait_s)  # let requests issued together join
            while len(batch) < self.max_batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                async with self._get_lock():
                    outputs = await asyncio.to_thread(self._run_batch, batch)
            except asyncio.CancelledError:  # shutdown: the batch taken but not served is aborted
                for req in batch:
                    if not req.future.done():
                        req.future.set_result(_aborted(req))
                raise
            except Exception as exc:  # hand the failure to every waiting caller
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
                continue
            for req, out in zip(batch, outputs, strict=True):
                if not req.future.done():
                    req.future.set_result(out)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (
            getattr(self.model, "generation_config", None),
            getattr(self.model, "config", None),
            self.tokenizer,
        ):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else list(eos))
                break
        return ids

    def _pad_id(self) -> int:
        for source in (
            self.tokenizer,
            getattr(self.model, "generation_config", None),
            getattr(self.model, "config", None),
        ):
            pad = getattr(source, "pad_token_id", None)
            if pad is not None:
                return int(pad)
        eos = sorted(self._eos_ids())
        return eos[0] if eos else 0

    def _run_batch(self, batch: list[_Request]) -> list[TokenOutput]:
        """One ``model.generate`` over ``batch`` (blocking; runs in a worker thread)."""
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        self.generate_calls += 1
        eos = self._eos_ids()
        pad = self._pad_id()
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every prompt ends at column width - 1
            input_ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids) :] = 1
        params = [r.params for r in batch]
        stops = [eos | set(p.stop_token_ids) for p in params]
        sampler = _RowSampler(params, self._generator)
        stopper = _RowStopper(params, stops, width, self.tokenizer)
        config = GenerationConfig(
            max_new_tokens=max(p.max_tokens for p in params),
            do_sample=False,  # _RowSampler already chose each token; greedy picks its choice
            num_beams=1,
            pad_token_id=pad,
            eos_token_id=sorted(eos) or None,
            output_logits=any(p.wants_logprobs for p in params),  # (steps, batch, V) kept: only on demand
            return_dict_in_generate=True,
            use_cache=True,
        )
        was_training = self.model.training
        self.model.eval()  # no dropout while generating, whatever mode training left the module in
        try:
            with torch.no_grad():
                out = self.model.generate(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention.to(self.device),
                    generation_config=config,
                    logits_processor=LogitsProcessorList([sampler]),
                    stopping_criteria=StoppingCriteriaList([stopper]),
                )
        finally:
            self.model.train(was_training)
        new = out.sequences[:, width:]
        token_lp = None
        if out.logits:  # log_softmax(logits / T)[token] for every row and step at once: (batch, steps)
            logits = torch.stack(out.logits, dim=1).float()  # (batch, steps, V)
            logits /= sampler.temps.to(logits.device)[:, None, None]
            token_lp = torch.log_softmax(logits, -1).gather(-1, new[:, : logits.shape[1], None])[..., 0].cpu()
        new = new.cpu()
        results = []
        for i, p in enumerate(params):
            row = new[i].tolist()
            n, reason = min(len(row), p.max_tokens), "length"
            for t, tok in enumerate(row[:n]):
                if tok in stops[i]:
                    n, reason = t + 1, "stop"
                    break
            if p.stop:
                cut = _stop_string_cut(self.tokenizer, row[:n], p.stop)
                if cut is not None:
                    n, reason = cut, "stop"
            tokens = row[:n]
            log_probs = token_lp[i, :n].tolist() if p.wants_logprobs else None
            results.append(TokenOutput(tokens, log_probs, reason))
        return results


def _aborted(req: _Request) -> TokenOutput:
    return TokenOutput([], [] if req.params.wants_logprobs else None, "abort")


def _stop_string_cut(tokenizer: Any, tokens: list[int], stop: tuple[str, ...]) -> int | None:
    """Number of tokens up to and including the first one whose decoded prefix contains a stop string."""
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n], skip_special_tokens=False)
        if any(s in text for s in stop):
            return n
    return None


class _RowSampler:
    """Logits processor: picks each row's next token under that row's sampling params.

    Returns scores that are 0 at the chosen token and -inf elsewhere, so greedy ``generate``
    takes exactly the choice made here. Rows with a seed draw from their own generator.
    """

    def __init__(self, params: list[SamplingParams], generator: Any) -> None:
        import torch

        self.params = params
        self.generator = generator
        self.greedy = [p.greedy for p in params]
        self.temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
        self.top_k = [p.top_k for p in params]
        self.top_p = torch.tensor([float(p.top_p) for p in params])
        self.filter = any(p.top_k > 0 or p.top_p < 1 for p in params)
        self.row_generators = {}
        for i, p in enumerate(params):
            if p.seed is not None and not p.greedy:
                g = torch.Generator(device="cpu")
                g.manual_seed(p.seed)
                self.row_generators[i] = g
        self.unseeded = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
        self.unseeded_rows = torch.tensor(self.unseeded, dtype=torch.long)
        self.sampled_rows = torch.tensor([i for i, p in enumerate(params) if not p.greedy], dtype=torch.long)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        scores = scores.float()
        chosen = scores.argmax(-1).cpu()
        if not all(self.greedy):
            logits = scores.cpu() / self.temps[:, None]
            if self.filter:
                logits = self._truncate(logits)
            probs = torch.softmax(logits, -1)
            # Exponential race: argmax_j p_j / E_j with E_j ~ Exp(1) is a draw from p (exact, and one
            # vectorised op where torch.multinomial is several times slower on small batches).
            noise = torch.empty_like(probs)
            if self.unseeded:
                noise[self.unseeded_rows] = noise[self.unseeded_rows].exponential_(generator=self.generator)
            for i, g in self.row_generators.items():
                noise[i].exponential_(generator=g)
            sampled = (probs / noise).argmax(-1)
            chosen[self.sampled_rows] = sampled[self.sampled_rows]
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, chosen.to(scores.device)[:, None], 0.0)
        return out

    def _truncate(self, logits: Any) -> Any:
        import torch

        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(-1, descending=True)
        rank = torch.arange(vocab)[None, :]
        k = torch.tensor([k if k > 0 else vocab for k in self.top_k])[:, None]
        drop = rank >= k
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), -1)
        # nucleus: drop a token when the mass before it already reaches top_p (the first always stays)
        drop |= (probs.cumsum(-1) - probs) >= self.top_p[:, None]
        return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


class _RowStopper:
    """Stopping criterion: a row is done at its own max_tokens, stop id or stop string."""

    def __init__(
        self, params: list[SamplingParams], stops: list[set[int]], prompt_width: int, tokenizer: Any
    ) -> None:
        import torch

        self.params = params
        self.width = prompt_width
        self.tokenizer = tokenizer
        self.max_tokens = torch.tensor([p.max_tokens for p in params])
        # (row, stop id) pairs, checked against each row's last token in one comparison
        pairs = [(i, t) for i, ids in enumerate(stops) for t in ids]
        self.stop_rows = torch.tensor([i for i, _ in pairs], dtype=torch.long)
        self.stop_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)
        self.string_rows = [i for i, p in enumerate(params) if p.stop]

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:

        n = input_ids.shape[1] - self.width
        last = input_ids[:, -1].cpu()
        done = self.max_tokens <= n
        if len(self.stop_ids):
            hit = last[self.stop_rows] == self.stop_ids
            done[self.stop_rows[hit]] = True
        for i in self.string_rows:
            if not done[i]:
                text = self.tokenizer.decode(input_ids[i, self.width :].tolist(), skip_special_tokens=False)
                done[i] = any(s in text for s in self.params[i].stop)
        return done.to(input_ids.device)
