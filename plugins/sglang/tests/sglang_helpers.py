"""Helpers of the sglang plugin's tests: build a replica, run a body on a started one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from trellis_sglang.replica import SGLangRolloutReplica

from trellis.config.schema import ModelConfig, RolloutConfig


def make_replica(
    model_path: str | None, *, rank: int = 0, rollout: dict[str, Any] | None = None, **engine_kwargs: Any
) -> SGLangRolloutReplica:
    settings = {"seed": 0, **(rollout or {})}
    return SGLangRolloutReplica(
        rank,
        RolloutConfig(engine_kwargs=engine_kwargs, **settings),
        ModelConfig(path=model_path, dtype="float32"),
    )


def run(
    model_path: str,
    body: Callable[[SGLangRolloutReplica], Awaitable[Any]],
    mode: str = "colocated",
    *,
    model: Any = None,
    rollout: dict[str, Any] | None = None,
    **engine_kwargs: Any,
) -> Any:
    """``await body(replica)`` on a started replica inside one ``asyncio.run``, then shut it down."""

    async def main() -> Any:
        replica = make_replica(model_path, rollout=rollout, **engine_kwargs)
        await replica.init(mode, model=model)
        try:
            return await body(replica)
        finally:
            await replica.shutdown()

    return asyncio.run(main())


def live_threads() -> set[threading.Thread]:
    """This process's threads, after starting those that live as long as the process once started: the
    one a first CPU tensor sent to another process starts, and tqdm's monitor (a first progress bar).

    The fake's serializer pickles CPU tensors as SGLang's does CUDA ones; the first such tensor
    starts multiprocessing's resource sharer, a thread that then lives as long as the process.
    """
    import io

    import torch
    from tqdm import tqdm
    from trellis_sglang.testing import serialize

    serialize([("warm-up", torch.zeros(1))])
    tqdm(total=0, file=io.StringIO()).close()  # tqdm's monitor thread, too, lives as long as the process
    return set(threading.enumerate())
