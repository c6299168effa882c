"""Rare garbage collections while a run starts, and none of the start-up heap after it has started.

Used by ``trellis train`` and by the demo (``python -m trellis.recipes.demo``), which both start a
run in a fresh process and train in it to the end.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

START_UP_GC_THRESHOLDS = (100_000, 50, 1000)
"""The garbage collector's thresholds while a run starts (CPython's are 700, 10, 10)."""


@contextlib.contextmanager
def start_up_gc() -> Iterator[None]:
    """Rare garbage collections while the block starts a run, and none of the start-up heap after.

    Starting a run creates ~400k objects that live as long as the process: the modules of torch and
    transformers, the model, the data. With CPython's default thresholds the collector walks that
    growing heap ~1,100 times while they load (7 times all of it): ~12% of ``trellis train --preset
    tiny`` (docs/performance.md, "Start-up"). Until the first step (the ``trellis_train_start`` hook)
    young collections are 140x rarer (:data:`START_UP_GC_THRESHOLDS`); then one full collection frees
    the start-up garbage, what survives is frozen (``gc.freeze``: later collections skip it) and the
    previous thresholds come back. Full collections during training then walk only what training
    made: the colocated ``hf`` replica's ``sleep`` collects once a step, 0.2 s a step in the demo with
    the heap unfrozen. After the block everything is as before (``gc.unfreeze``), for callers that go
    on in the same process. Nothing a run computes depends on when garbage is collected.
    """
    from trellis.hooks import get_plugin_manager, hookimpl

    thresholds = gc.get_threshold()
    owns_freeze = gc.get_freeze_count() == 0  # someone else's frozen objects stay frozen

    class StartUpEnd:
        @hookimpl
        def trellis_train_start(self) -> None:
            gc.set_threshold(*thresholds)
            if owns_freeze:
                gc.collect()
                gc.freeze()

    plugin = StartUpEnd()
    manager = get_plugin_manager()
    gc.set_threshold(*START_UP_GC_THRESHOLDS)
    manager.register(plugin)
    try:
        yield
    finally:
        manager.unregister(plugin)
        gc.set_threshold(*thresholds)
        if owns_freeze:
            gc.unfreeze()
