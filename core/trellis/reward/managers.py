"""Reward managers: score every response of a batch and put each score on its last token.

All three are built as ``Manager(tokenizer, compute_score=None, reward_fn_key="data_source",
num_examine=0, timeout_seconds=60.0, num_workers=1, **function_kwargs)`` and called as
``manager(data, return_dict=False)``. They differ only in how the scoring function is called:

* ``naive``: once per sample, in order, in this process (async functions run on an event loop);
* ``batch``: once per batch, with lists (``solution_strs=[...]`` ...);
* ``async``: concurrently, each call under ``timeout_seconds``; plain (CPU-bound) functions run in a
  pool of ``num_workers`` processes that is killed and replaced when a call overruns.

A call that raises or overruns scores 0 and is counted in the ``reward/errors`` and
``reward/timeouts`` metrics; the step goes on. Errors of configuration (any ``TrellisError``, e.g. an
unknown data_source) are raised, since they would zero every reward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import math
import multiprocessing
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import torch

from trellis.config.base import schema_default
from trellis.config.schema import DataConfig, RewardConfig
from trellis.data.protocol import DataProto
from trellis.errors import TrellisError
from trellis.reward.resolve import resolve_reward_function
from trellis.reward.workers import set_memory_limit, warm_up, worker_score
from trellis.utils.coroutines import run_coroutine
from trellis.utils.deadline import CallTimeout, call_with_deadline

logger = logging.getLogger(__name__)


@dataclass
class ScoreOutcome:
    """What one scoring call gave: the reward, the other fields of a dict result, what went wrong."""

    score: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False


def outcome_of(result: Any) -> ScoreOutcome:
    """A scoring function's result (a number, or a dict with ``"score"``) as a :class:`ScoreOutcome`.

    Raises:
        TypeError: the result is neither a number nor a dict holding a numeric ``"score"``.
    """
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(
                f"a reward function returned a dict without a 'score' key: {result!r}. "
                "Put the reward under 'score'; other keys are logged."
            )
        extra = {k: v for k, v in result.items() if k != "score"}
        return ScoreOutcome(score=_as_float(result["score"]), extra=extra)
    return ScoreOutcome(score=_as_float(result))


def _as_float(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"a reward function returned {value!r} ({type(value).__name__}); return a number or "
            "a dict with a numeric 'score'."
        ) from None
    if not math.isfinite(number):  # a NaN would turn every advantage of its group into NaN
        raise ValueError(f"a reward function returned {number} (not finite); return a finite number.")
    return number


class _RewardManager:
    """What the managers share: reading samples out of a DataProto and writing scores back."""

    def __init__(
        self,
        tokenizer: Any,
        compute_score: str | Callable[..., Any] | None = None,
        reward_fn_key: str = schema_default(DataConfig, "reward_fn_key"),
        num_examine: int = 0,
        timeout_seconds: float | None = schema_default(RewardConfig, "timeout_seconds"),
        num_workers: int = schema_default(RewardConfig, "num_workers"),
        **function_kwargs: Any,
    ):
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0 or None (no limit), got {timeout_seconds!r}.")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}.")
        self.tokenizer = tokenizer
        self.reward_fn_key = reward_fn_key
        self.num_examine = num_examine
        self.timeout_seconds = timeout_seconds
        self.num_workers = num_workers
        self.function_spec = compute_score
        self.function_kwargs = function_kwargs
        self.compute_score = self._resolve(compute_score, function_kwargs)
        self.last_metrics: dict[str, float] = {}

    def _resolve(self, compute_score: Any, function_kwargs: dict[str, Any]) -> Callable[..., Any]:
        return resolve_reward_function(compute_score, **function_kwargs)

    # -- the call

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        """Score ``data``.

        Reads ``batch["responses"]`` (bs, T), the valid-token mask ``batch["response_mask"]`` (bs, T)
        (or the last T columns of ``batch["attention_mask"]``), ``non_tensor_batch["reward_model"][i]
        ["ground_truth"]``, ``non_tensor_batch[reward_fn_key]`` and ``non_tensor_batch["extra_info"]``.

        Returns:
            ``token_level_scores``, float32 (bs, T): each sample's score on its last valid token,
            zeros elsewhere. With ``return_dict``: ``{"reward_tensor": that, "reward_extra_info":
            {field: [value per sample]}, "metrics": {"reward/errors": n, "reward/timeouts": n}}``.

        Raises:
            ValueError: a needed key is missing from ``data``; the message names it.
        """
        samples, last_index = self._samples(data)
        outcomes = self._score(samples)
        responses = data.tensors["responses"]
        reward = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        for i, (outcome, last) in enumerate(zip(outcomes, last_index, strict=False)):
            if last >= 0:  # an empty response has no token to carry its reward
                reward[i, last] = outcome.score
        fields = list(dict.fromkeys(k for o in outcomes for k in o.extra))
        extra_info = {k: [o.extra.get(k) for o in outcomes] for k in fields}
        errors = [o.error for o in outcomes if o.error is not None]
        metrics = {
            "reward/errors": float(len(errors)),
            "reward/timeouts": float(sum(o.timed_out for o in outcomes)),
        }
        if errors:
            logger.warning("%d of %d reward calls failed; first: %s", len(errors), len(outcomes), errors[0])
        self.last_metrics = metrics
        self._examine(samples, outcomes)
        if return_dict:
            return {"reward_tensor": reward, "reward_extra_info": extra_info, "metrics": metrics}
        return reward

    def _score(self, samples: list[dict[str, Any]]) -> list[ScoreOutcome]:
        raise NotImplementedError

    def _samples(self, data: DataProto) -> tuple[list[dict[str, Any]], list[int]]:
        batch, columns = data.batch, data.non_tensor_batch
        if batch is None or "responses" not in batch:
            raise ValueError("The reward manager needs data.batch['responses'] (bs, T); it is missing.")
        responses = batch["responses"]
        if "response_mask" in batch:
            mask = batch["response_mask"].bool()
        elif "attention_mask" in batch:
            mask = batch["attention_mask"][:, -responses.shape[1] :].bool()
        else:
            raise ValueError(
                "The reward manager needs data.batch['response_mask'] or ['attention_mask'] to find each "
                "response's valid tokens; neither is present."
            )
        size = responses.shape[0]
        if "reward_model" not in columns:
            raise ValueError(
                "The reward manager needs data.non_tensor_batch['reward_model'], one "
                f"{{'ground_truth': ...}} per sample; columns present: {sorted(columns)}."
            )
        if self.reward_fn_key in columns:
            sources = list(columns[self.reward_fn_key])
        elif self.function_spec is None:
            raise ValueError(
                f"No column {self.reward_fn_key!r} (data.reward_fn_key) to pick each sample's reward "
                f"function; "
                f"columns present: {sorted(columns)}. Set data.reward_fn_key or reward.function."
            )
        else:
            sources = [None] * size
        extra_infos = list(columns["extra_info"]) if "extra_info" in columns else [None] * size
        samples, last_index = [], []
        for i in range(size):
            row = columns["reward_model"][i]
            if not isinstance(row, dict) or "ground_truth" not in row:
                raise ValueError(
                    f"data.non_tensor_batch['reward_model'][{i}] must be a dict with 'ground_truth', "
                    f"got {row!r}."
                )
            valid = mask[i].nonzero().flatten()
            text = self.tokenizer.decode(responses[i][mask[i]].tolist(), skip_special_tokens=True)
            last_index.append(int(valid[-1]) if len(valid) else -1)
            samples.append(
                {
                    "data_source": sources[i],
                    "solution_str": text,
                    "ground_truth": row["ground_truth"],
                    "extra_info": extra_infos[i],
                }
            )
        return samples, last_index

    def _examine(self, samples: list[dict[str, Any]], outcomes: list[ScoreOutcome]) -> None:
        shown: dict[Any, int] = {}
        for sample, outcome in zip(samples, outcomes, strict=False):
            source = sample["data_source"]
            if shown.get(source, 0) >= self.num_examine:
                continue
            shown[source] = shown.get(source, 0) + 1
            print(
                f"[reward {source}] response: {sample['solution_str']!r}\n"
                f"[reward {source}] ground truth: {sample['ground_truth']!r} score: {outcome.score} "
                f"{outcome.extra or ''}{' error: ' + outcome.error if outcome.error else ''}"
            )


def _failed(exc: BaseException) -> ScoreOutcome:
    if isinstance(exc, TrellisError):
        raise exc
    return ScoreOutcome(error=f"{type(exc).__name__}: {exc}")


async def _await_result(result: Any, timeout: float | None) -> ScoreOutcome:
    try:
        return outcome_of(await asyncio.wait_for(result, timeout))
    except asyncio.TimeoutError:
        return ScoreOutcome(error=f"timed out after {timeout} s", timed_out=True)
    except Exception as exc:
        return _failed(exc)


class NaiveRewardManager(_RewardManager):
    """One call per sample, in order, in this process.

    Async scoring functions run on one event loop, each under ``timeout_seconds``. Plain functions run
    under it too (:func:`trellis.utils.deadline.call_with_deadline`): on the main thread an alarm
    interrupts an overrunning call; elsewhere the call is abandoned in its thread. Either way the step
    goes on with a 0 for it. For code that only a process kill stops, use the ``async`` manager.
    """

    def _score(self, samples: list[dict[str, Any]]) -> list[ScoreOutcome]:
        if inspect.iscoroutinefunction(self.compute_score):
            return run_coroutine(self._score_on_loop(samples))
        outcomes = []
        for sample in samples:
            try:
                result = call_with_deadline(self.compute_score, sample, self.timeout_seconds)
                if inspect.isawaitable(result):
                    outcomes.append(run_coroutine(_await_result(result, self.timeout_seconds)))
                else:
                    outcomes.append(outcome_of(result))
            except CallTimeout as exc:
                outcomes.append(ScoreOutcome(error=str(exc), timed_out=True))
                if sum(o.timed_out for o in outcomes) == 1:  # said at once, not after the whole batch
                    logger.warning(
                        "A reward call timed out after %s s (sample %d of %d; scored 0, counted in "
                        "reward/timeouts). Every call that hangs costs that long, one after another: lower "
                        "reward.timeout_seconds, or score concurrently (reward.manager=async).",
                        self.timeout_seconds,
                        len(outcomes),
                        len(samples),
                    )
            except Exception as exc:
                outcomes.append(_failed(exc))
        return outcomes

    async def _score_on_loop(self, samples: list[dict[str, Any]]) -> list[ScoreOutcome]:
        outcomes = []
        for sample in samples:
            try:
                result = self.compute_score(**sample)
            except Exception as exc:
                outcomes.append(_failed(exc))
                continue
            outcomes.append(await _await_result(result, self.timeout_seconds))
        return outcomes


def is_batch_function(fn: Callable[..., Any]) -> bool:
    """True when ``fn`` takes lists (a ``solution_strs`` parameter) rather than one sample."""
    try:
        return "solution_strs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def score_each(
    fn: Callable[..., Any],
    data_sources: Sequence[Any],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any],
) -> list[Any]:
    """A per-sample function applied over lists: the batch form of ``fn``."""
    return [
        fn(data_source=d, solution_str=s, ground_truth=g, extra_info=e)
        for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos, strict=False)
    ]


class BatchRewardManager(_RewardManager):
    """One call per batch: ``compute_score(data_sources=[...], solution_strs=[...],
    ground_truths=[...], extra_infos=[...]) -> list`` of numbers or dicts, one per sample.

    ``compute_score`` may be such a function (a callable or a ``module:fn`` reference), or a
    per-sample function (a registered name, or any function without a ``solution_strs`` parameter),
    which is then applied sample by sample. If the call raises, every sample of the batch scores 0
    and counts as an error. The whole call runs under ``timeout_seconds`` (async functions on an event
    loop, plain ones through :func:`trellis.utils.deadline.call_with_deadline`); past it, every sample
    scores 0 and counts as a timeout.
    """

    def _resolve(self, compute_score: Any, function_kwargs: dict[str, Any]) -> Callable[..., Any]:
        from trellis.registry import is_reference, load_reference

        if isinstance(compute_score, str) and is_reference(compute_score):
            fn = load_reference(compute_score)
            fn = functools.partial(fn, **function_kwargs) if function_kwargs else fn
        else:
            fn = resolve_reward_function(compute_score, **function_kwargs)
        return fn if is_batch_function(fn) else functools.partial(score_each, fn)

    def _score(self, samples: list[dict[str, Any]]) -> list[ScoreOutcome]:
        size = len(samples)
        columns = {
            "data_sources": [s["data_source"] for s in samples],
            "solution_strs": [s["solution_str"] for s in samples],
            "ground_truths": [s["ground_truth"] for s in samples],
            "extra_infos": [s["extra_info"] for s in samples],
        }
        try:
            results = call_with_deadline(self.compute_score, columns, self.timeout_seconds)
            if inspect.isawaitable(results):
                results = run_coroutine(asyncio.wait_for(results, self.timeout_seconds))
            results = list(results)
            if len(results) != size:
                raise ValueError(
                    f"the batch reward function returned {len(results)} results for {size} samples"
                )
        except (asyncio.TimeoutError, CallTimeout):
            return [ScoreOutcome(error=f"timed out after {self.timeout_seconds} s", timed_out=True)] * size
        except Exception as exc:
            return [_failed(exc) for _ in range(size)]
        outcomes = []
        for result in results:
            try:
                outcomes.append(outcome_of(result))
            except Exception as exc:
                outcomes.append(_failed(exc))
        return outcomes


# ---------------------------------------------------------------- the async manager's process pool


def _kill_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    # ProcessPoolExecutor has no public way to stop a running call before Python 3.14
    # (kill_workers); its worker processes are in the private `_processes`.
    kill = getattr(pool, "kill_workers", None)
    processes = list((getattr(pool, "_processes", None) or {}).values())
    if kill is not None:
        kill()
    else:
        for process in processes:
            process.kill()
    # No cancel_futures: the killed workers make every pending call fail with BrokenProcessPool,
    # which the callers retry; a cancelled one would cancel the whole gather.
    pool.shutdown(wait=False)
    for process in processes:
        process.join(timeout=5)


class AsyncRewardManager(_RewardManager):
    """Concurrent scoring, each call limited to ``timeout_seconds``.

    Async scoring functions run on an event loop, up to ``max_concurrency`` at a time, under
    ``asyncio.wait_for``. Plain functions, taken to be CPU-bound, run in a pool of ``num_workers``
    processes (forkserver, else spawn), at most one call per process at a time so the limit counts
    from the call's start; an overrunning call has its pool killed and replaced, and calls that the
    kill interrupted are retried once. The function must therefore be importable in a fresh process:
    a registered name, a reference, or a module-level function (or a partial of one).

    Call :meth:`close` (or use ``with``) to stop the pool; it is also stopped when the manager is
    garbage-collected.
    """

    def __init__(
        self, *args: Any, max_concurrency: int = 64, memory_limit_mb: int | None = None, **kwargs: Any
    ):
        super().__init__(*args, **kwargs)
        self.max_concurrency = max_concurrency
        if memory_limit_mb is not None and memory_limit_mb < 64:
            raise ValueError(f"memory_limit_mb={memory_limit_mb!r} must be at least 64 (MiB) or None.")
        self.memory_limit_mb = memory_limit_mb
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._is_async = inspect.iscoroutinefunction(self.compute_score)
        # what a worker process needs to score: a name or reference (with kwargs) it resolves itself,
        # or the function, pickled
        self._payload: tuple[str | None, dict[str, Any]] | Callable[..., Any] | None
        if self._is_async:
            self._payload = None
        elif self.function_spec is None or isinstance(self.function_spec, str):
            self._payload = (self.function_spec, dict(self.function_kwargs))
        else:
            self._payload = self.compute_score
        if self._payload is not None:
            try:
                pickle.dumps(self._payload)
            except Exception as exc:
                raise ValueError(
                    f"compute_score {self.compute_score!r} cannot be sent to worker processes ({exc}). "
                    "Define it at module level, pass it as a 'module:fn' reference or registered name, "
                    "or make it 'async def'."
                ) from exc

    # -- lifecycle

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            _kill_pool(pool)

    def __enter__(self) -> AsyncRewardManager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: best effort
            self.close()

    # -- scoring

    def _score(self, samples: list[dict[str, Any]]) -> list[ScoreOutcome]:
        return run_coroutine(self.score_async(samples))

    async def score_async(self, samples: list[dict[str, Any]]) -> list[ScoreOutcome]:
        """Score ``samples`` (dicts of the reward-function keywords) concurrently, in order."""
        if self._is_async:
            limit = asyncio.Semaphore(self.max_concurrency)
            return list(await asyncio.gather(*(self._score_on_loop(s, limit) for s in samples)))
        self._pool_lock = asyncio.Lock()
        limit = asyncio.Semaphore(self.num_workers)
        return list(await asyncio.gather(*(self._score_in_pool(s, limit) for s in samples)))

    async def _score_on_loop(self, sample: dict[str, Any], limit: asyncio.Semaphore) -> ScoreOutcome:
        async with limit:
            try:
                result = self.compute_score(**sample)
            except Exception as exc:
                return _failed(exc)
            return await _await_result(result, self.timeout_seconds)

    async def _live_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        async with self._pool_lock:
            if self._pool is None:
                methods = multiprocessing.get_all_start_methods()
                context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
                limit = None if self.memory_limit_mb is None else self.memory_limit_mb * 2**20
                pool = concurrent.futures.ProcessPoolExecutor(
                    self.num_workers, mp_context=context, initializer=set_memory_limit, initargs=(limit,)
                )
                # Start every worker and load the function before any call is timed.
                warm = [pool.submit(warm_up, self._payload) for _ in range(self.num_workers)]
                try:
                    await asyncio.gather(*(asyncio.wrap_future(f) for f in warm))
                except Exception as exc:
                    _kill_pool(pool)
                    raise RuntimeError(
                        f"The reward worker processes could not load compute_score "
                        f"{self.function_spec or self.compute_score!r}: {type(exc).__name__}: {exc}. "
                        "Check that it imports in a fresh Python process: its module on sys.path, and "
                        "the main script guarded by `if __name__ == '__main__':`."
                    ) from exc
                self._pool = pool
            return self._pool

    def _discard(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        if self._pool is pool:
            self._pool = None
            _kill_pool(pool)

    async def _score_in_pool(self, sample: dict[str, Any], limit: asyncio.Semaphore) -> ScoreOutcome:
        async with limit:
            outcome = await self._try_in_pool(sample)
            if outcome is None:  # the pool was killed for another call's overrun: retry once
                outcome = await self._try_in_pool(sample)
            return outcome or ScoreOutcome(error="the worker pool broke twice during this call")

    async def _try_in_pool(self, sample: dict[str, Any]) -> ScoreOutcome | None:
        pool = await self._live_pool()
        try:
            future = asyncio.wrap_future(pool.submit(worker_score, self._payload, sample))
        except RuntimeError:  # the pool was shut down between getting it and submitting
            return None
        try:
            result = await asyncio.wait_for(future, self.timeout_seconds)
        except asyncio.TimeoutError:
            self._discard(pool)
            return ScoreOutcome(error=f"timed out after {self.timeout_seconds} s", timed_out=True)
        except BrokenProcessPool:
            self._discard(pool)
            return None
        except MemoryError:  # the call's memory limit: the process may be in any state, so it goes
            self._discard(pool)
            return ScoreOutcome(
                error=f"ran out of its {self.memory_limit_mb} MiB (reward.memory_limit_mb); scored 0"
            )
        except Exception as exc:
            return _failed(exc)
        try:
            return outcome_of(result)
        except Exception as exc:
            return _failed(exc)
