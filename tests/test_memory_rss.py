"""The process's memory stays flat over a training run: 30 GRPO steps of the tiny preset.

After each step the test records the resident set size, the live torch tensors (count and bytes of
their storages) and the number of Python objects the garbage collector tracks. From step 2 on
(the optimizer state exists from step 1) none of them may grow: RSS by under 5%, tensors not at
all, objects by no more than the run's own history (one metrics dict per step) and slack.

Measured (1 thread): RSS 411.0 MiB after step 2, 409.7 after step 30; without the fix 416.0 and
420.6 (+1.1%): the tiny model's heaps are too small for fragmentation to reach 5%.

The demo's growth (SmolLM2-135M: resident set 6.4 -> 7.6 -> 8.0 GiB over three steps, live tensors
flat at 2.5 GiB) was freed activations kept in malloc's heaps; the tiny model's activations are too
small for that to show in its RSS, which is why tensors and objects are pinned too, and why the
fix itself (the ``cpu`` backend's ``empty_cache`` when an engine phase starts and ends, under
``trainer.host_memory=release``) has tests of its own in ``test_device_cpu.py``,
``test_utils_memory.py`` and ``test_engine_base.py``. The run here takes the default policy,
``reuse``: malloc keeps freed memory for the next stage, and the resident set must stay flat too.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import trellis
from trellis.hooks import get_plugin_manager, hookimpl
from trellis.recipes.presets import preset_overrides
from trellis.utils.memory import rss_bytes

STEPS = 30


def live_tensors() -> tuple[int, int]:
    """``(count, bytes)`` of the torch tensors the garbage collector sees; bytes of distinct storages."""
    with warnings.catch_warnings():  # isinstance() on some deprecated torch attributes warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return len(tensors), sum(storages.values())


class Recorder:
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, int]] = {}

    @hookimpl
    def trellis_step_end(self, step: int) -> None:
        gc.collect()
        count, nbytes = live_tensors()
        self.rows[step] = {
            "rss": rss_bytes(),
            "tensors": count,
            "tensor_bytes": nbytes,
            "objects": len(gc.get_objects()),
        }


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # 30 steps, each measured through the garbage collector (~35-55 s)
def test_thirty_steps_keep_rss_tensors_and_objects_flat(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("TRELLIS_CACHE_DIR", str(tmp_path / "cache"))
    recorder = Recorder()
    get_plugin_manager().register(recorder)
    try:
        result = trellis.train(
            overrides=[
                *preset_overrides("tiny"),
                f"trainer.total_training_steps={STEPS}",
                "trainer.val_before_train=false",
                "trainer.test_freq=0",
                "trainer.save_freq=-1",
                "trainer.resume_mode=disable",
                "trainer.trackers=[jsonl]",
                f"trainer.run_dir={tmp_path / 'run'}",
            ]
        )
    finally:
        get_plugin_manager().unregister(recorder)
    assert result.steps == STEPS and sorted(recorder.rows) == list(range(1, STEPS + 1))
    rows = recorder.rows
    second, last = rows[2], rows[STEPS]
    assert last["rss"] < 1.05 * second["rss"], (second, last)
    # alone the count is the same after every step (85); a run's prompts used to stay alive every other
    # step through a kept CancelledError's chained traceback (fixed in trellis.utils.coroutines), so the
    # late steps may hold no more than the early ones did at most, whatever earlier tests left alive
    for key in ("tensors", "tensor_bytes"):
        early, late = (max(rows[step][key] for step in steps) for steps in (range(2, 11), range(21, 31)))
        assert late <= early, (key, early, late)
    # the run keeps one metrics dict per step (result.history); allow that and the odd request in flight
    assert last["objects"] - second["objects"] < 40 * (STEPS - 2), (second, last)
