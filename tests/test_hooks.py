"""trellis.hooks: hookspecs, hook modules from entry points, isolation of broken ones."""

from __future__ import annotations

import json
import warnings

import pytest

from trellis.hooks import GROUP, PROJECT, TrellisHookSpecs, get_plugin_manager, hookimpl, new_plugin_manager

LIFECYCLE = [
    "trellis_config_loaded",
    "trellis_train_start",
    "trellis_step_end",
    "trellis_validation_end",
    "trellis_checkpoint_saved",
    "trellis_train_end",
]


def test_every_lifecycle_hook_is_specified_and_documented():
    specs = [name for name in vars(TrellisHookSpecs) if name.startswith("trellis_")]
    assert specs == LIFECYCLE
    for name in specs:
        assert len(getattr(TrellisHookSpecs, name).__doc__.strip()) > 40, name
    assert (PROJECT, GROUP) == ("trellis", "trellis.hooks")


@pytest.fixture
def manager():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = new_plugin_manager()
    pm.caught_warnings = caught
    return pm


def test_hook_modules_load_from_entry_points_and_receive_events(manager):
    from trellis_fixture_good import hooks as good_hooks

    names = [name for name, _ in manager.list_name_plugin()]
    assert names == ["trellis-fixture-good:fixture_good"]
    good_hooks.EVENTS.clear()
    manager.hook.trellis_step_end(step=3, metrics={"reward/mean": 0.5})
    manager.hook.trellis_checkpoint_saved(step=3, path="/tmp/ckpt/step_3")
    manager.hook.trellis_train_end(step=3, metrics={}, run_dir="/tmp")  # the fixture does not implement it
    assert good_hooks.EVENTS == [
        {"hook": "step_end", "step": 3, "metrics": {"reward/mean": 0.5}},
        {"hook": "checkpoint_saved", "step": 3, "path": "/tmp/ckpt/step_3"},
    ]


def test_broken_hook_module_is_skipped_with_a_warning_and_recorded(manager):
    (error,) = manager.load_errors
    expected = (
        "hook module 'fixture_broken = trellis_fixture_broken.bad_hooks' from distribution "
        "'trellis-fixture-broken' failed to load: RuntimeError: trellis_fixture_broken.bad_hooks "
        "is broken on purpose"
    )
    assert str(error) == expected
    messages = [str(w.message) for w in manager.caught_warnings]
    assert messages == [f"Skipping {expected}. Fix or uninstall 'trellis-fixture-broken'."]


def test_in_process_hook_implementations_take_any_subset_of_arguments(manager):
    seen = []

    class Recorder:
        @hookimpl
        def trellis_validation_end(self, metrics):
            seen.append(metrics["val/reward"])

    manager.register(Recorder())
    manager.hook.trellis_validation_end(step=10, metrics={"val/reward": 0.75})
    assert seen == [0.75]


def test_unknown_hook_implementation_is_rejected(manager):
    from pluggy import PluginValidationError

    class Typo:
        @hookimpl
        def trellis_step_ended(self, step):
            pass

    manager.register(Typo())
    with pytest.raises(PluginValidationError, match="trellis_step_ended"):
        manager.check_pending()


def test_get_plugin_manager_is_loaded_once_per_process():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = get_plugin_manager()
    assert get_plugin_manager() is first
    assert [name for name, _ in first.list_name_plugin()] == ["trellis-fixture-good:fixture_good"]


def test_hooks_fire_in_a_fresh_process(python, tmp_path):
    log = tmp_path / "events.jsonl"
    done = python(
        "import warnings; warnings.simplefilter('ignore')\n"
        "from trellis import get_plugin_manager\n"
        "get_plugin_manager().hook.trellis_step_end(step=1, metrics={'loss': 2.0})\n",
        env={"TRELLIS_FIXTURE_HOOK_LOG": str(log)},
    )
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"hook": "step_end", "step": 1, "metrics": {"loss": 2.0}}
    ]
