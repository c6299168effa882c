"""The ``hf`` rollout replica: transformers models, concurrent requests batched continuously.

Requests from concurrent :meth:`HFRolloutReplica.generate` calls wait in a queue. A background
task takes everything queued (up to ``max_batch_size``, after a ``batch_wait_s`` window for
stragglers) and decodes it in a worker thread, so the event loop stays responsive:

- ``batching="continuous"`` (the default, for decoder-only text models with a plain KV cache):
  a :class:`~trellis.rollout.hf_continuous.ContinuousDecoder` runs the batch step by step; requests
  that arrive meanwhile join it between steps (up to ``max_batch_size`` rows), and each row leaves
  (its caller gets its result, its KV rows are freed) as soon as it ends. See
  :mod:`trellis.rollout.hf_continuous`.
- ``batching="static"``, requests with images or videos, and models the decoder does not take
  (sliding-window or linear-attention caches, vision-language models): the batch's prompts are
  left-padded into *one* ``model.generate`` (KV cache on); requests that arrive meanwhile form the
  next batch.

Sampling. Every request in a batch may have its own sampling parameters; both paths pick tokens
with :class:`~trellis.rollout.hf_sampling.RowRule`, so a seeded request gets the same tokens either
way. On the generate path one logits processor (:class:`_RowSampler`) picks every row's next token
with a few batched tensor ops on the logits' own device and hands ``generate`` (which itself runs
greedy) a one-hot choice:

- greedy rows (``temperature == 0``) take the argmax;
- sampled rows divide the logits by their temperature, apply their top-k / top-p (only the rows
  that ask for one pay for the sort) and draw by inverse CDF: the first token whose cumulative
  probability (summed in float64) exceeds ``u * total``, ``u ~ U[0, 1)``. That is an exact draw
  and needs one random number per row and step, where the exponential race (``argmax p / E``,
  what ``torch.multinomial`` does for one sample) needs one per vocabulary entry (on
  SmolLM2-135M's 49k-token vocabulary those draws took about a fifth of the whole batch);
- the uniforms are drawn up front for the whole batch: a row with a ``seed`` reads the stream of
  its own ``torch.Generator`` seeded with it (its ``t``-th token uses the stream's ``t``-th
  number), so a seeded request gets the same tokens whatever it is batched with; the other rows
  share the replica's generator (seeded with ``rollout.seed + replica_rank``), so the replica
  seed reproduces a run.

Stopping. When every row has the same ``max_tokens`` and stop ids and none has stop strings (the
usual RL batch), ``generate`` stops natively (eos and stop ids as its ``eos_token_id``,
``max_new_tokens``); otherwise a stopping criterion (:class:`_RowStopper`) ends each row at its
own ``max_tokens``, stop ids or stop strings. Either way the tokens are cut afterwards at each
row's first stop.

Log-probs: each returned log-prob is ``log_softmax(logits / T)[token]`` of the model's logits at
that step, with ``T`` the request's temperature (``T = 1`` for greedy), i.e. the
temperature-scaled distribution before top-k / top-p truncation (what vLLM returns by default).
The sampler computes them from the tensor it samples from (the softmax needs its
``logsumexp`` anyway), so no copy of the full logits is kept per step. A teacher-forced
forward pass of the same model, scaled by the same ``T``, gives the same numbers. ``generate``
is told to apply none of the penalties a model's own ``generation_config`` may set (repetition,
n-gram, minimum length), so the sampler sees the model's logits.

CPU threads. On the CPU, ``generate`` runs in the worker thread, a second OpenMP master beside
the thread that already ran parallel torch ops (training, the caller). GNU OpenMP (torch's Linux
wheels) then counts more threads than cores and all but stops spin-waiting at its barriers, so
every parallel op pays for waking its threads: for a small model, whose ops take microseconds,
that about doubles a decoding step (measured on the 0.1M-parameter test model), while one
intra-op thread has no barrier at all. So by default (``cpu_threads="auto"``) the worker thread
generates with one intra-op thread for models under :data:`AUTO_SINGLE_THREAD_PARAMS`
parameters and with torch's setting for larger ones, whose matrix products gain more from
threads than the barriers cost (SmolLM2-135M: one thread was 15-20% slower). The threshold is a
rule of thumb; set ``cpu_threads`` to override it. ``torch.set_num_threads`` sets the calling
thread's OpenMP and MKL counts and the process-wide default that threads started later read;
the replica restores that default after each batch.

On the CPU the continuous decoder runs on the event loop's own thread by default
(``decode_thread="auto"``): one admission or decoding step at a time, yielding to the loop in
between (so requests still join, and results still reach their callers, between steps). Where that
thread is the one training ran on (a colocated replica under ``trellis train`` or the demo), the
process has one OpenMP master and its threads spin-wait as they should: the demo's generate stage
(SmolLM2-135M, 2 cores, bf16) took 0.84x the time it took in a worker thread in
``benchmarks/settings.py``, 0.76x over a whole demo run. The loop does nothing else
while a step runs (a step of 64 rows is tens of milliseconds there). ``decode_thread="worker"``
decodes in a worker thread, as on accelerators, whose steps wait on the device.

Weight updates and versions. Every batch and every weight load hold the replica's lock, and a
batch reads ``weight_version`` under it: each returned token carries the version of the weights
that generated it (``TokenOutput.weight_versions``). :meth:`~HFRolloutReplica.begin_weight_update`
takes the lock and :meth:`~HFRolloutReplica.end_weight_update` sets the version, then releases it,
so no batch runs between the buckets of one update; ``update_weights`` called in between loads
without locking again (called alone, it takes the lock itself and waits for the batch in flight).
Without ``rollout.partial_rollout``, ``begin`` waits for the batch in flight to finish with the
old weights; a continuous batch stops admitting requests meanwhile (they wait for the new
weights), so an update never waits for more than the rows already running.

Partial rollout (``rollout.partial_rollout``). ``begin`` first sets an event that an extra stopping
criterion checks after each decoding step, so the batch in flight stops after its current token.
Its rows that met a stop or their ``max_tokens`` resolve as usual; the others wait, ahead of the
queue, for the first batch after the update, which resumes each from its prompt plus its tokens so
far, with ``max_tokens`` less those tokens, under the new weights and version. The caller gets one
``TokenOutput`` for the whole response: the segments' tokens, log-probs and versions concatenated,
the last segment's stop reason. A seeded row resuming at token ``o`` reads its stream from number
``o`` on, so an update that leaves the weights as they were leaves the tokens as they were; stop
strings are looked for in the decoded whole response. A batch that gets the lock while an update
waits for it (it queued for the lock before the update began) does not start: its requests wait
for the update as well. ``shutdown`` aborts the requests waiting to resume with the queued ones
(``stop_reason="abort"``, no tokens, even for one interrupted after some).

Modes on this backend: ``hybrid`` serves the model object the caller passes (the training
worker's own weights); ``colocated`` and ``standalone`` both load a private copy from
``model_config.path`` into this process (there is no separate server process).

``engine_kwargs`` understood: ``max_batch_size`` (default 256: rows decoded at once), ``batch_wait_s``
(0.002), ``cpu_threads`` (``"auto"``, or an int >= 1; only used when the model is on the CPU),
``batching`` (``"continuous"``, or ``"static"``: one ``generate`` per batch), ``decode_step``
(``"auto"``: the continuous decoder's steps skip the ``transformers`` forward for Llama-family
models, see :mod:`trellis.rollout.hf_lean`; ``"lean"``: that, or an error naming why the model does
not qualify; ``"hf"``: always the model's own forward), ``weight_layout`` (``"auto"``: ``"packed"``
on the CPU where torch has oneDNN, else ``"plain"``; ``"packed"``: lean steps multiply by copies of
the large weights packed for oneDNN, taken per session: faster decoding for one more copy of those
weights in memory while the session runs; ``"transposed"``: transposed contiguous copies instead;
``"plain"``: no copy. The CPU layouts are refused for a model elsewhere; see
:mod:`trellis.rollout.hf_lean`), ``sleep_level`` (1: ``sleep`` keeps the
weights, moving a private copy on an accelerator to host memory; 2: ``sleep`` frees a private copy's
weights, as vLLM's level 2 does, and the next weight update allocates and loads them again; a batch
that starts before every weight was loaded fails with a RuntimeError saying so; hybrid mode refuses
it, the weights being training's), ``decode_thread`` (``"auto"``: ``"loop"`` on the CPU, ``"worker"``
elsewhere; see CPU threads above).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import gc
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trellis.config.base import schema_default
from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.device.core_share import CoreShare
from trellis.rollout.base import RolloutReplica, has_items
from trellis.rollout.hf_continuous import (
    ContinuousDecoder,
    DecodeStats,
    Session,
    left_padded,
    supports_continuous,
)
from trellis.rollout.hf_lean import WEIGHT_LAYOUTS, LeanDecoder, lean_unsupported, packed_layout_available
from trellis.rollout.hf_sampling import RowRule, stop_string_cut, uniform_streams
from trellis.rollout.sampling import SamplingParams, StopReason, TokenOutput
from trellis.utils.settings import setting

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _setting(config: Any, section: type, key: str) -> Any:
    """``key`` of a config section (or a dict, or None); missing or null: the schema's default."""
    return setting(config, key, schema_default(section, key))


AUTO_SINGLE_THREAD_PARAMS = 10_000_000
"""``cpu_threads="auto"``: models with fewer parameters generate with one intra-op thread on the CPU."""

# generation_config fields whose non-neutral values make generate alter the logits before the
# sampler sees them, with their neutral values (see _neutral_overrides)
_NEUTRAL_LOGITS_SETTINGS: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_length": 0,
    "min_new_tokens": 0,
    "guidance_scale": 1.0,
    "remove_invalid_values": False,
    "renormalize_logits": False,
}


@dataclass
class _Request:
    """One queued request; after an interruption (partial rollout), also what it generated so far."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    future: asyncio.Future = field(repr=False)
    prefix_ids: list[int] = field(default_factory=list)  # tokens of the interrupted segments
    prefix_log_probs: list[float] = field(default_factory=list)  # their log-probs, when asked for
    prefix_versions: list[int] = field(default_factory=list)  # their weight versions
    multi_modal_data: Any = None  # the prompt's images and videos (vision-language models)
    vision: dict[str, Any] = field(default_factory=dict)  # their processor tensors (pixel values, grids)

    def segment_params(self) -> SamplingParams:
        """The params of the next segment: ``max_tokens`` less the tokens already generated."""
        if not self.prefix_ids:
            return self.params
        return dataclasses.replace(self.params, max_tokens=self.params.max_tokens - len(self.prefix_ids))

    def extend(self, segment: TokenOutput) -> None:
        """Append an interrupted segment to the prefix."""
        self.prefix_ids += segment.token_ids
        self.prefix_log_probs += segment.log_probs or []
        self.prefix_versions += segment.weight_versions or []

    def finish(self, segment: TokenOutput) -> TokenOutput:
        """The whole response: the prefix, then the last segment (whose stop reason it takes)."""
        if not self.prefix_ids:
            return segment
        return TokenOutput(
            self.prefix_ids + segment.token_ids,
            None if segment.log_probs is None else self.prefix_log_probs + segment.log_probs,
            segment.stop_reason,
            weight_versions=self.prefix_versions + (segment.weight_versions or []),
        )


class HFRolloutReplica(RolloutReplica):
    """Generation with transformers ``model.generate``, batching concurrent requests; runs anywhere.

    See the module docstring for batching, per-row sampling, log-probs, weight updates (versions,
    partial rollout) and modes.
    ``sleep`` on an accelerator moves a private copy's weights to the CPU (hybrid: only frees
    the allocator cache, since the weights belong to training); on the CPU there is no cache to
    free, so it only marks the replica asleep. With ``engine_kwargs.sleep_level`` 2 it frees a
    private copy's weights instead (on any device), for the next weight update to load.
    ``generate`` while asleep raises RuntimeError.
    """

    def __init__(self, replica_rank: int, rollout_config: Any, model_config: Any) -> None:
        super().__init__(replica_rank, rollout_config, model_config)
        kwargs = dict(_setting(rollout_config, RolloutConfig, "engine_kwargs"))
        self.max_batch_size = int(kwargs.get("max_batch_size", 256))
        self.batch_wait_s = float(kwargs.get("batch_wait_s", 0.002))
        if self.max_batch_size < 1:
            raise ValueError(f"engine_kwargs.max_batch_size must be >= 1, got {self.max_batch_size}.")
        cpu_threads = kwargs.get("cpu_threads", "auto")
        if cpu_threads != "auto" and (
            isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1
        ):
            raise ValueError(f'engine_kwargs.cpu_threads must be "auto" or an int >= 1, got {cpu_threads!r}.')
        self.cpu_threads: int | str = cpu_threads
        batching = kwargs.get("batching", "continuous")
        if batching not in ("continuous", "static"):
            raise ValueError(f'engine_kwargs.batching must be "continuous" or "static", got {batching!r}.')
        self.batching: str = batching
        decode_step = kwargs.get("decode_step", "auto")
        if decode_step not in ("auto", "lean", "hf"):
            raise ValueError(
                f'engine_kwargs.decode_step must be "auto", "lean" or "hf", got {decode_step!r}.'
            )
        self.decode_step: str = decode_step
        if "transpose_weights" in kwargs:
            raise ValueError(
                "engine_kwargs.transpose_weights was replaced by engine_kwargs.weight_layout: write "
                'weight_layout: "transposed" for true, "plain" for false (the default "auto" packs the '
                "weights for oneDNN on the CPU)."
            )
        weight_layout = kwargs.get("weight_layout", "auto")
        if weight_layout not in ("auto", *WEIGHT_LAYOUTS):
            raise ValueError(
                f'engine_kwargs.weight_layout must be "auto", "plain", "transposed" or "packed", got '
                f"{weight_layout!r}."
            )
        self.weight_layout: str = weight_layout
        decode_thread = kwargs.get("decode_thread", "auto")
        if decode_thread not in ("auto", "loop", "worker"):
            raise ValueError(
                f'engine_kwargs.decode_thread must be "auto", "loop" or "worker", got {decode_thread!r}.'
            )
        self.decode_thread: str = decode_thread
        sleep_level = kwargs.get("sleep_level", 1)
        if sleep_level not in (1, 2) or isinstance(sleep_level, bool):
            raise ValueError(f"engine_kwargs.sleep_level must be 1 or 2, got {sleep_level!r}.")
        self.sleep_level: int = sleep_level
        # sleep_level 2: the parameters sleep discarded, by id, with their shape, until a weight update
        # loads each again
        self._discarded: dict[int, tuple[str, tuple[int, ...]]] = {}
        partial = _setting(rollout_config, RolloutConfig, "partial_rollout")
        if not isinstance(partial, bool):
            raise ValueError(f"rollout.partial_rollout must be true or false, got {partial!r}.")
        self.partial_rollout = partial
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = None
        self.generate_calls = 0  # batches (generate calls or continuous sessions) so far; tests read it
        self.decode_stats = DecodeStats()  # continuous sessions' steps, prefills, peak rows (tests read it)
        self._session: Session | None = None  # the continuous session running, if any
        self._continuous: bool | None = None  # whether the model can batch continuously (found on first use)
        self._processor: Any = None  # the multimodal processor, loaded for the first request with images
        self._queue: asyncio.Queue[_Request] | None = None
        # interrupted requests (partial rollout): the next batches take them before the queue
        self._resume: collections.deque[_Request] = collections.deque()
        self._worker: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        # the lock held by the weight update in progress (begin_weight_update to end_weight_update)
        self._update_lock: asyncio.Lock | None = None
        self._updates_waiting = 0  # begin_weight_update calls not yet ended
        self._sleeps_pending = 0  # sleep calls not yet done: a wake_up then waits for them
        self._interrupt = threading.Event()  # partial rollout: set while an update waits or loads
        self._generator: Any = None
        self._num_params = 0  # set by init; cpu_threads="auto" reads it
        self.core_share: CoreShare | None = None  # the machine's cores shared with the trainer (share_cores)

    # ------------------------------------------------------------------ lifecycle

    async def init(
        self, mode: str = "hybrid", *, model: Any = None, tokenizer: Any = None, device: Any = None
    ) -> None:
        import torch

        self.mode = self.check_mode(mode)
        if mode == "hybrid" and self.sleep_level == 2:
            raise ValueError(
                "engine_kwargs.sleep_level=2 discards the replica's own weights while it sleeps; in hybrid "
                "mode the replica serves the training model's weights. Use sleep_level 1 (the default)."
            )
        if mode == "hybrid":
            if model is None:
                raise ValueError(
                    "hybrid mode serves the training worker's model: pass init(..., model=module)."
                )
            self.model = model
        else:
            path = _setting(self.model_config, ModelConfig, "path")
            if model is not None:
                self.model = model
            elif not path:
                raise ValueError(f"{mode} mode loads its own weights: set model.path (got {path!r}).")
            else:
                self.model = await asyncio.to_thread(self._load_model, path)
        if tokenizer is None:
            tok_path = _setting(self.model_config, ModelConfig, "tokenizer_path") or _setting(
                self.model_config, ModelConfig, "path"
            )
            if tok_path:
                from transformers import AutoTokenizer

                tokenizer = await asyncio.to_thread(
                    AutoTokenizer.from_pretrained,
                    tok_path,
                    trust_remote_code=bool(_setting(self.model_config, ModelConfig, "trust_remote_code")),
                )
        self.tokenizer = tokenizer
        if device is not None:
            self.device = torch.device(device)
            if mode != "hybrid":
                self.model.to(self.device)
        else:
            self.device = next(self.model.parameters()).device
        if self.weight_layout not in ("auto", "plain"):
            self._weight_layout()  # refuses a CPU layout elsewhere now, not at the first request
        if mode != "hybrid":
            self.model.eval()  # hybrid: training owns the module's mode; _run_batch switches it per batch
        seed = _setting(self.rollout_config, RolloutConfig, "seed")
        self._generator = torch.Generator(device="cpu")
        if seed is not None:
            self._generator.manual_seed(int(seed) + self.replica_rank)
        else:
            self._generator.seed()
        self._num_params = sum(p.numel() for p in self.model.parameters())
        self.asleep = False

    def _load_model(self, path: str) -> Any:
        import torch
        from transformers import AutoConfig

        from trellis.utils.auto_model import load_pretrained, policy_auto_class

        mc = self.model_config
        dtype = getattr(torch, _DTYPES.get(_setting(mc, ModelConfig, "dtype"), "float32"))
        attn = _setting(mc, ModelConfig, "attn_implementation")
        if attn not in ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"):
            attn = "sdpa"  # trellis' own varlen kernels are for training forward passes
        trust = bool(_setting(mc, ModelConfig, "trust_remote_code"))
        auto_class = policy_auto_class(AutoConfig.from_pretrained(path, trust_remote_code=trust))
        return load_pretrained(
            auto_class, path, dtype=dtype, attn_implementation=attn, trust_remote_code=trust
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
        self._sleeps_pending += 1
        try:
            await self._sleep()
        finally:
            self._sleeps_pending -= 1

    async def _sleep(self) -> None:
        async with self._exclusive():
            import torch

            if self.sleep_level == 2 and self.model is not None:
                self._discard_weights()
            elif self._offloads:
                self.model.to("cpu")
            gc.collect()
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.asleep = True

    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` put away. A replica that is awake (and not about to sleep) returns
        at once: waiting for its lock would wait for its whole running session, which keeps admitting
        requests, before a weight sync could even begin (an async trainer's sync took 0.1 s a step so)."""
        if not self.asleep and not self._sleeps_pending:
            return
        async with self._exclusive():
            if self._offloads and self.sleep_level == 1:
                self.model.to(self.device)
            self.asleep = False

    def _discard_weights(self) -> None:
        """``sleep_level`` 2: free every parameter's storage (the next weight update loads it again);
        buffers (rotary tables) stay."""
        for name, param in self.model.named_parameters():
            if param.numel():  # a discarded one has none
                self._discarded[id(param)] = (name, tuple(param.shape))
                param.data = param.data.new_empty(0)

    def _require_weights(self) -> None:
        """Raise when ``sleep_level`` 2 discarded weights that no update has loaded since."""
        if self._discarded:
            names = sorted(name for name, _ in self._discarded.values())
            raise RuntimeError(
                f"HFRolloutReplica: engine_kwargs.sleep_level=2 discarded the weights when the replica "
                f"slept, and {len(names)} of them (e.g. {names[:3]}) were not loaded again before "
                "generating. Sync the full weights after wake_up (the trainer does at each weight_sync), "
                "or use sleep_level 1."
            )

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy each ``(name, tensor)`` into the parameter or buffer of that HF name, in place.

        Between :meth:`begin_weight_update` and :meth:`end_weight_update` it loads at once (the
        update holds the replica's lock); called alone, it waits for the batch in flight.

        Raises:
            KeyError: a name the model does not have (the message lists a few it has).
            ValueError: a tensor whose shape differs from the parameter's.
        """
        import torch

        async with self._exclusive():
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
                    discarded = self._discarded.get(id(target))
                    shape = discarded[1] if discarded is not None else tuple(target.shape)
                    if shape != tuple(tensor.shape):
                        raise ValueError(
                            f"update_weights: {name!r} has shape {shape}, got {tuple(tensor.shape)}."
                        )
                    if discarded is not None:  # sleep_level 2 freed it: storage of its own again
                        target.data = torch.empty(shape, dtype=target.dtype, device=target.device)
                        del self._discarded[id(target)]
                    target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    async def begin_weight_update(self) -> None:
        """Hold generation until :meth:`end_weight_update`: returns once no batch runs.

        Without ``partial_rollout`` the batch in flight first finishes with the old weights; with
        it, the batch stops after its current step and its unfinished rows wait to resume.
        """
        lock = self._get_lock()
        self._updates_waiting += 1
        if self.partial_rollout:
            self._interrupt.set()
        try:
            await lock.acquire()
        except BaseException:  # cancelled while waiting: this update never began
            self._end_waiting()
            raise
        self._update_lock = lock

    async def end_weight_update(self, version: int | None = None) -> None:
        """Set :attr:`weight_version` (``version``, or one more when None) and let generation go on.

        Without a :meth:`begin_weight_update` before it, it only sets the version.
        """
        lock, self._update_lock = self._update_lock, None
        try:
            await super().end_weight_update(version)
        finally:
            if lock is not None:
                self._end_waiting()
                lock.release()

    def _end_waiting(self) -> None:
        self._updates_waiting -= 1
        if self._updates_waiting == 0:
            self._interrupt.clear()  # later batches run to the end again

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """Hold the replica's lock for the block, unless a weight update already holds it."""
        if self._update_lock is not None:
            yield
            return
        async with self._get_lock():
            yield

    async def shutdown(self) -> None:
        """Stop the batching task; requests still queued or waiting to resume resolve with
        ``stop_reason="abort"``."""
        worker, self._worker = self._worker, None
        if worker is not None and worker.done():
            # ended already, perhaps by a KeyboardInterrupt or SIGTERM's Terminated raised inside a batch,
            # which left the loop where it happened (the requests of that batch saw it): awaiting it would
            # raise it again here and cut the rest of the shutdown (the caller's too) short
            if not worker.cancelled():
                worker.exception()
        elif worker is not None:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        waiting = list(self._resume)
        self._resume.clear()
        while self._queue is not None and not self._queue.empty():
            waiting.append(self._queue.get_nowait())
        for req in waiting:
            if not req.future.done():
                req.future.set_result(_aborted(req))

    # ------------------------------------------------------------------ generation

    supports_multi_modal = True

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        multi_modal_data: Any = None,
    ) -> TokenOutput:
        if self.model is None:
            raise RuntimeError("HFRolloutReplica.generate before init(): await replica.init(mode) first.")
        prompt_ids = self.check_request(prompt_ids, sampling_params, request_id, multi_modal_data)
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer; pass one to init().")
        loop = asyncio.get_running_loop()
        worker = self._worker
        if self._queue is None or worker is None or worker.done() or worker.get_loop() is not loop:
            # first request, or the replica moved to another event loop (e.g. a later asyncio.run)
            self._queue = asyncio.Queue()
            self._resume = collections.deque()
            self._worker = loop.create_task(self._batch_loop())
        req = _Request(prompt_ids, sampling_params, request_id, loop.create_future())
        session = self._session
        if has_items(multi_modal_data):
            self._vision_processor()  # a text-only model refuses here, before the request queues
            req.multi_modal_data = multi_modal_data
            if session is not None:
                session.waiting_outside += 1  # the running session stops admitting, so this one runs soon
        elif session is not None and session.offer(req):  # joins the running batch at its next step
            return await req.future
        await self._queue.put(req)
        return await req.future

    def _get_lock(self) -> asyncio.Lock:
        # one lock per event loop: asyncio locks bind to the loop they first wait in
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    async def _batch_loop(self) -> None:
        queue, resume = self._queue, self._resume
        assert queue is not None  # set by generate before the task starts
        while True:
            batch: list[_Request] = []
            outputs: list[tuple[TokenOutput, bool]] = []
            try:
                if not resume:  # only this task re-queues, so none can appear while it waits here
                    batch.append(await queue.get())
                    if self.batch_wait_s > 0:
                        await asyncio.sleep(self.batch_wait_s)  # let requests issued together join
                async with self._get_lock():
                    held_back = self._interrupt.is_set()  # partial rollout: an update waits to load
                    if held_back:
                        resume.extendleft(reversed(batch))
                        batch = []
                    else:
                        # interrupted requests first, then new ones (those that came during an update too)
                        while len(batch) < self.max_batch_size and resume:
                            batch.append(resume.popleft())
                        while len(batch) < self.max_batch_size and not queue.empty():
                            batch.append(queue.get_nowait())
                        version = self.weight_version  # read under the lock: the version of these weights
                        self._require_weights()
                        with self._generating():
                            batch = await self._with_vision(batch)
                            if batch and self._batches_continuously(batch):
                                # results reach the callers as rows end; batch grows with every admitted one
                                await self._serve_continuously(batch, version, resume)
                                batch = []
                            else:
                                outputs = (
                                    await asyncio.to_thread(self._run_batch, batch, version) if batch else []
                                )
                if held_back:  # the update queued for the lock first, so it gets it now
                    await asyncio.sleep(0)  # (yields even if that update waits on another loop's lock)
                    continue
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
            for req, (segment, finished) in zip(batch, outputs, strict=True):
                _deliver(resume, req, segment, finished)

    def _batches_continuously(self, batch: list[_Request]) -> bool:
        """Whether ``batch`` runs as a continuous session (``batching="continuous"``, a model that
        :func:`supports_continuous`, no images or videos) rather than one ``generate`` call."""
        if self.batching != "continuous" or any(r.vision for r in batch):
            return False
        if self._continuous is None:
            self._continuous = supports_continuous(self.model)
        return self._continuous

    async def _serve_continuously(
        self, batch: list[_Request], version: int, resume: collections.deque[_Request]
    ) -> None:
        """Run a :class:`ContinuousDecoder` over ``batch`` and the requests that join it, on this loop's
        thread between its other tasks or in a worker thread (``decode_thread``).

        Each row's result is delivered (on this loop) as the row ends. Every admitted request is
        appended to ``batch``, so a failure reaches each caller still waiting; requests offered but
        never admitted wait in ``resume`` for the next batch.
        """
        import torch

        loop = asyncio.get_running_loop()
        session = Session(hold=lambda: self._updates_waiting > 0)

        on_loop = self._decodes_on_loop()

        def deliver(req: _Request, segment: TokenOutput, finished: bool) -> None:
            if on_loop:  # at once: an interrupted row is in resume before the session returns
                _deliver(resume, req, segment, finished)
            else:
                loop.call_soon_threadsafe(_deliver, resume, req, segment, finished)

        def decoder() -> ContinuousDecoder:
            return ContinuousDecoder(
                self.model,
                self.device,
                eos=self._eos_ids(),
                pad=self._pad_id(),
                generator=self._generator,
                tokenizer=self.tokenizer,
                max_rows=self.max_batch_size,
                version=version,
                session=session,
                deliver=deliver,
                interrupt=self._interrupt if self.partial_rollout else None,
                admitted=batch,
                stats=self.decode_stats,
                lean=self._lean_decoder(),
            )

        def run() -> None:
            with _eval_mode(self.model), torch.no_grad(), _torch_threads(self._intra_op_threads()):
                decoder().run(list(batch))

        async def run_on_loop() -> None:
            # each step under no_grad and the thread count, which the loop's other tasks must not inherit
            # (read per step: with a core ledger it follows the trainer's state)
            with _eval_mode(self.model):
                steps = decoder().iterate(list(batch))
                try:
                    while True:
                        with torch.no_grad(), _torch_threads(self._intra_op_threads()):
                            if next(steps, _DONE) is _DONE:
                                return
                        await asyncio.sleep(0)
                finally:
                    steps.close()

        self.generate_calls += 1
        self._session = session
        queue, later = self._queue, []
        while queue is not None and not queue.empty():  # queued before the session: they may join it
            req = queue.get_nowait()
            if req.multi_modal_data is None:
                session.offer(req)
            else:
                later.append(req)
        for req in later:  # images wait for a generate batch; admission stops so that one comes soon
            session.waiting_outside += 1
            queue.put_nowait(req)  # type: ignore[union-attr]
        try:
            if on_loop:
                await run_on_loop()
            else:
                await asyncio.to_thread(run)
        except BaseException:
            session.stop.set()  # cancelled (shutdown): the thread returns after its current step
            raise
        finally:
            self._session = None
            resume.extend(session.leftovers())

    def _decodes_on_loop(self) -> bool:
        """Whether continuous decoding runs on the event loop's thread (``decode_thread``; see the module
        docstring): ``"auto"`` does on the CPU."""
        if self.decode_thread == "auto":
            return self.device is not None and self.device.type == "cpu"
        return self.decode_thread == "loop"

    def _lean_decoder(self) -> LeanDecoder | None:
        """A :class:`~trellis.rollout.hf_lean.LeanDecoder` for this session (its weight copies taken now),
        or None (``decode_step="hf"``, or ``"auto"`` and a model it does not take).

        Raises:
            ValueError: ``decode_step="lean"`` and a model it does not take (the reason named).
        """
        if self.decode_step == "hf":
            return None
        reason = lean_unsupported(self.model)
        if reason is not None:
            if self.decode_step == "lean":
                raise ValueError(
                    f'engine_kwargs.decode_step="lean" cannot decode this model: {reason}. '
                    'Use "auto" (falls back to the model\'s forward) or "hf".'
                )
            return None
        lean = LeanDecoder(self.model, layout=self._weight_layout())
        self.decode_stats.weight_layout, self.decode_stats.weight_copies = lean.layout, lean.weight_copies
        return lean

    def _weight_layout(self) -> str:
        """The layout lean steps multiply the large weights in (``weight_layout``; see the module docstring).

        Raises:
            ValueError: ``transposed`` or ``packed`` for a model off the CPU, or ``packed`` where torch
                has no oneDNN.
        """
        on_cpu = self.device is not None and self.device.type == "cpu"
        if self.weight_layout == "auto":
            return "packed" if on_cpu and packed_layout_available() else "plain"
        if self.weight_layout != "plain" and not on_cpu:
            raise ValueError(
                f"engine_kwargs.weight_layout={self.weight_layout!r} is a CPU layout; this model is on "
                f'{self.device}. Use "auto" (plain off the CPU) or "plain".'
            )
        if self.weight_layout == "packed" and not packed_layout_available():
            raise ValueError(
                'engine_kwargs.weight_layout="packed" needs torch built with oneDNN '
                '(torch.backends.mkldnn.is_available() is false here). Use "auto" or "plain".'
            )
        return self.weight_layout

    def _vision_processor(self) -> Any:
        """The model's multimodal processor (loaded from ``model.path`` on first use)."""
        if self._processor is None:
            from trellis.utils.tokenizer import hf_processor

            mc = self.model_config
            path = _setting(mc, ModelConfig, "tokenizer_path") or _setting(mc, ModelConfig, "path")
            processor = hf_processor(
                path, trust_remote_code=bool(_setting(mc, ModelConfig, "trust_remote_code"))
            )
            if processor is None:
                raise ValueError(
                    f"HFRolloutReplica: the request has images or videos, but {path!r} has no multimodal "
                    "processor; serve a vision-language model."
                )
            self._processor = processor
        return self._processor

    async def _with_vision(self, batch: list[_Request]) -> list[_Request]:
        """``batch`` with each request's items processed (:meth:`_request_vision`, in a worker thread, the
        batch at once so that requests issued together still run together); a request whose items do
        not match its prompt fails alone, now, and leaves the batch."""
        todo = [r for r in batch if r.multi_modal_data is not None and not r.vision]
        if not todo:
            return batch

        def process() -> list[BaseException | None]:
            errors: list[BaseException | None] = []
            for r in todo:
                try:
                    r.vision = self._request_vision(r)
                    errors.append(None)
                except Exception as exc:
                    errors.append(exc)
            return errors

        failed = set()
        for r, error in zip(todo, await asyncio.to_thread(process), strict=True):
            if error is not None:
                failed.add(id(r))
                if not r.future.done():
                    r.future.set_exception(error)
        return [r for r in batch if id(r) not in failed]

    def _request_vision(self, req: _Request) -> dict[str, Any]:
        """The processor tensors of ``req``'s items, after checking that its prompt holds exactly their
        tokens (one pad token per image token): otherwise the model would fail mid-batch (transformers
        then raises StopIteration from a worker thread, which asyncio cannot hand back, and the request
        would never resolve).

        Raises:
            ValueError: a text-only model; a prompt whose pad tokens do not match its items (counts named).
        """
        from trellis.data.multimodal import item_tokens, vision_inputs

        processor = self._vision_processor()
        data = req.multi_modal_data
        inputs = vision_inputs(processor, data.get("image") or (), data.get("video") or ())
        config = self.model.config
        for kind in ("image", "video"):
            items = len(data.get(kind) or ())
            token_id = getattr(config, f"{kind}_token_id", None)
            expected = sum(item_tokens(processor, inputs, kind))
            found = sum(t == token_id for t in req.prompt_ids) if token_id is not None else 0
            if found != expected:
                raise ValueError(
                    f"request {req.request_id!r}: the prompt holds {found} {kind} pad tokens but its {items} "
                    f"{kind}(s) make {expected}; widen each item's placeholder with the processor (and keep "
                    f"pad tokens the model generated in earlier turns out of the prompt)."
                )
        return inputs

    def _vision_kwargs(self, batch: list[_Request], input_ids: Any) -> dict[str, Any]:
        """``generate``'s vision inputs for ``batch`` (row order), with each token's modality: pad tokens
        of the prompt stand for items, those a resumed request generated (its prefix) are text."""
        import torch

        from trellis.engine.multimodal import merged_inputs, modality_types

        if not any(r.vision for r in batch):
            return {}
        kwargs = merged_inputs([r.vision for r in batch], self.device)
        prompt = torch.zeros_like(input_ids, dtype=torch.bool)
        width = input_ids.shape[1]
        for i, r in enumerate(batch):  # left-padded: the prompt, then the resumed prefix
            prompt[i, width - len(r.prompt_ids) - len(r.prefix_ids) : width - len(r.prefix_ids)] = True
        kwargs["mm_token_type_ids"] = modality_types(self.model.config, input_ids, prompt).to(self.device)
        return kwargs

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

    def _intra_op_threads(self) -> int | None:
        """Intra-op threads for the generation thread: None leaves torch's setting (see module docstring).
        Where that setting stands and the replica shares the machine's cores (:meth:`share_cores`): its
        own share plus those of the processes idle now, read again at every call."""
        threads = self._fixed_threads()
        if threads is None and self.core_share is not None:
            return self.core_share.threads()
        return threads

    def _fixed_threads(self) -> int | None:
        if self.device is None or self.device.type != "cpu":
            return None
        if self.cpu_threads == "auto":
            return 1 if self._num_params < AUTO_SINGLE_THREAD_PARAMS else None
        return int(self.cpu_threads)

    def share_cores(self, share: CoreShare) -> bool:
        """Take part in the machine's core ledger ``share`` (:mod:`trellis.device.core_share`): the
        replica is marked busy while it generates, so its cores go to the trainer while it waits, and,
        where it generates with torch's thread setting (``cpu_threads`` "auto" on a model of at least
        :data:`AUTO_SINGLE_THREAD_PARAMS` parameters), it decodes on the trainer's cores while the
        trainer waits (every decoding step reads the ledger). Whether it takes part: only on the CPU."""
        if self.device is None or self.device.type != "cpu":
            return False
        self.core_share = share
        return True

    def _generating(self) -> contextlib.AbstractContextManager:
        """Marks the replica busy in its core ledger, if it has one, for the block."""
        return self.core_share.busy() if self.core_share is not None else contextlib.nullcontext()

    def _run_batch(self, batch: list[_Request], version: int = 0) -> list[tuple[TokenOutput, bool]]:
        """One ``model.generate`` over ``batch`` (blocking; runs in a worker thread).

        A request that resumes after an interruption generates its next segment from its prompt
        and prefix, with ``max_tokens`` less the prefix. Returns per request the segment generated
        here (every token stamped ``version``) and whether the response is finished; it is not when
        a weight update interrupted the batch before the row met a stop or its ``max_tokens``.
        """
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        self.generate_calls += 1
        eos = self._eos_ids()
        pad = self._pad_id()
        contexts = [r.prompt_ids + r.prefix_ids for r in batch]
        prefixes = [r.prefix_ids for r in batch]
        input_ids, attention = left_padded(contexts, pad)  # every prompt ends at column width - 1
        width = input_ids.shape[1]
        params = [r.segment_params() for r in batch]
        stops = [eos | set(p.stop_token_ids) for p in params]
        steps = max(p.max_tokens for p in params)
        sampler: _RowSampler | None = None
        processors = LogitsProcessorList()
        if not all(p.greedy for p in params) or any(p.wants_logprobs for p in params):
            offsets = [len(prefix) for prefix in prefixes]
            sampler = _RowSampler(params, self._generator, steps, self.device, offsets=offsets)
            processors.append(sampler)
        criteria = StoppingCriteriaList()
        if _uniform_stopping(params):  # generate's own eos + max_new_tokens check is exact here
            eos_ids = stops[0]
        else:
            eos_ids = eos
            criteria.append(_RowStopper(params, stops, width, self.tokenizer, self.device, prefixes))
        interrupt: _Interrupt | None = None
        if self.partial_rollout:
            interrupt = _Interrupt(self._interrupt)
            criteria.append(interrupt)
        config = GenerationConfig(
            max_new_tokens=steps,
            do_sample=False,  # the sampler already chose each token; greedy picks its choice
            num_beams=1,
            pad_token_id=pad,
            eos_token_id=sorted(eos_ids) or None,
            use_cache=True,
            **_neutral_overrides(self.model),
        )
        was_training = self.model.training
        self.model.eval()  # no dropout while generating, whatever mode training left the module in
        try:
            with torch.no_grad(), _torch_threads(self._intra_op_threads()):
                sequences = self.model.generate(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention.to(self.device),
                    generation_config=config,
                    logits_processor=processors,
                    stopping_criteria=criteria,
                    **self._vision_kwargs(batch, input_ids),
                )
        except StopIteration as exc:  # asyncio cannot hand it back from a thread: the callers would hang
            raise RuntimeError(
                f"model.generate raised StopIteration ({exc!r}) for requests "
                f"{[r.request_id for r in batch]}; a vision-language prompt with more pad tokens than items?"
            ) from exc
        finally:
            self.model.train(was_training)
        new = sequences[:, width:].cpu()
        token_lp = (
            sampler.log_probs[:, : new.shape[1]].cpu()
            if sampler is not None and sampler.log_probs is not None
            else None
        )
        interrupted = interrupt is not None and interrupt.fired
        results = []
        for i, p in enumerate(params):
            row = new[i].tolist()
            reason: StopReason = "length"
            n = min(len(row), p.max_tokens)
            for t, tok in enumerate(row[:n]):
                if tok in stops[i]:
                    n, reason = t + 1, "stop"
                    break
            if p.stop:  # on the whole response: a stop string may span the prefix and this segment
                prefix = prefixes[i]
                cut = stop_string_cut(self.tokenizer, prefix + row[:n], p.stop, start=len(prefix))
                if cut is not None:
                    n, reason = cut - len(prefix), "stop"
            tokens = row[:n]
            log_probs = token_lp[i, :n].tolist() if p.wants_logprobs and token_lp is not None else None
            finished = not (interrupted and reason == "length" and n < p.max_tokens)
            results.append((TokenOutput(tokens, log_probs, reason, weight_versions=[version] * n), finished))
        return results


def _deliver(
    resume: collections.deque[_Request], req: _Request, segment: TokenOutput, finished: bool
) -> None:
    """Hand ``segment`` to ``req``'s caller; an interrupted one (``finished`` False) waits in ``resume``."""
    if req.future.done():  # the caller gave up (cancelled): nothing to resume
        return
    if finished:
        req.future.set_result(req.finish(segment))
    else:  # interrupted by a weight update: resumes in the next batch, with the new weights
        req.extend(segment)
        resume.append(req)


def _aborted(req: _Request) -> TokenOutput:
    return TokenOutput([], [] if req.params.wants_logprobs else None, "abort", weight_versions=[])


def _neutral_overrides(model: Any) -> dict[str, Any]:
    """Neutral values for the logits-altering settings the model's ``generation_config`` sets.

    ``generate`` fills every setting left unset in the config it is given from the model's own
    ``generation_config``; these explicit values keep the model's penalties off the logits.
    """
    own = getattr(model, "generation_config", None)
    return {
        key: neutral
        for key, neutral in _NEUTRAL_LOGITS_SETTINGS.items()
        if getattr(own, key, None) not in (None, neutral)
    }


def _uniform_stopping(params: list[SamplingParams]) -> bool:
    """Whether generate's native stopping (eos ids, max_new_tokens) ends every row where it should."""
    first = params[0]
    return all(
        p.max_tokens == first.max_tokens and set(p.stop_token_ids) == set(first.stop_token_ids) and not p.stop
        for p in params
    )


_DONE = object()
"""What ``next`` returns from a finished decoder's steps."""


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """``model`` in eval mode for the block (no dropout while generating, whatever mode training left the
    module in), then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads in this thread (None: unchanged), then restore."""
    import torch

    before = torch.get_num_threads() if n is not None else None
    if n is None or before is None or before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _RowSampler:
    """Logits processor for ``generate``: picks each row's next token with :class:`RowRule` and records
    its log-prob.

    Called once per decoding step with the raw logits ``(batch, vocab)``. Returns scores that are
    0 at the chosen token and -inf elsewhere, so greedy ``generate`` takes exactly the choice
    made here (or the scores unchanged when every row is greedy: ``generate``'s own argmax is
    then the choice). Row ``i``'s ``t``-th token uses column ``t`` of its uniform stream
    (:func:`uniform_streams`, from ``offsets[i]`` on for a resumed row).

    Attributes:
        log_probs: ``(batch, steps)`` float32, column ``t`` filled at step ``t``, or None when no
            row asked for log-probs.
    """

    def __init__(
        self,
        params: list[SamplingParams],
        generator: Any,
        steps: int,
        device: Any,
        offsets: list[int] | None = None,
    ) -> None:
        import torch

        self.step = 0
        self.rule = RowRule(params, device)
        self.uniforms = uniform_streams(params, generator, steps, offsets).to(device)
        self.log_probs = (
            torch.zeros((len(params), steps), device=device)
            if any(p.wants_logprobs for p in params)
            else None
        )

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        step = self.step
        self.step += 1
        chosen, log_probs = self.rule.pick(scores, self.uniforms[:, step : step + 1])
        if self.log_probs is not None:  # log_softmax(logits / T)[token], before any truncation
            self.log_probs[:, step] = log_probs
        if self.rule.greedy_only:
            return scores
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen[:, None], 0.0)


class _RowStopper:
    """Stopping criterion: a row is done at its own max_tokens, stop id or stop string.

    ``prefixes`` (partial rollout) are the tokens a resumed row generated before this batch: its
    stop strings are looked for in the decoded prefix and new tokens together.
    """

    def __init__(
        self,
        params: list[SamplingParams],
        stops: list[set[int]],
        prompt_width: int,
        tokenizer: Any,
        device: Any,
        prefixes: list[list[int]] | None = None,
    ) -> None:
        import torch

        self.params = params
        self.prefixes = prefixes if prefixes is not None else [[] for _ in params]
        self.width = prompt_width
        self.tokenizer = tokenizer
        self.max_tokens = torch.tensor([p.max_tokens for p in params], device=device)
        # (row, stop id) pairs, checked against each row's last token in one comparison
        pairs = [(i, t) for i, ids in enumerate(stops) for t in ids]
        self.stop_rows = torch.tensor([i for i, _ in pairs], dtype=torch.long, device=device)
        self.stop_ids = torch.tensor([t for _, t in pairs], dtype=torch.long, device=device)
        self.string_rows = [i for i, p in enumerate(params) if p.stop]

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        n = input_ids.shape[1] - self.width
        done = self.max_tokens <= n
        if len(self.stop_ids):
            hit = (input_ids[self.stop_rows, -1] == self.stop_ids).long()
            done |= torch.zeros_like(self.max_tokens).index_add_(0, self.stop_rows, hit) > 0
        for i in self.string_rows:
            if not done[i]:
                tokens = self.prefixes[i] + input_ids[i, self.width :].tolist()
                text = self.tokenizer.decode(tokens, skip_special_tokens=False)
                if any(s in text for s in self.params[i].stop):
                    done[i] = True
        return done


class _Interrupt:
    """Stopping criterion (partial rollout): every row is done once ``event`` is set (a weight update
    waits); ``fired`` records that it ended the batch."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
        self.fired = False

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        if self.event.is_set():
            self.fired = True
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)
