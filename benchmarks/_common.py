"""Helpers the benchmark scripts share (not a benchmark itself: nox -s bench skips _-prefixed files)."""

from __future__ import annotations


def smollm2_or_note(skip: bool) -> tuple[str | None, str]:
    """``(path, "")`` of the cached SmolLM2-135M-Instruct folder, or ``(None, why it is skipped)``."""
    if skip:
        return None, "SmolLM2 skipped (--no-smollm2)."
    try:
        from trellis.utils.demo_model import smollm2_path

        return smollm2_path(), ""
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        return None, f"SmolLM2 skipped: {exc}"


def training_only(preset: str, steps: int, name: str) -> list[str]:
    """Overrides that train ``preset`` for ``steps`` steps with no validation and no checkpoints,
    logging to jsonl under ``trainer.experiment_name=name`` (the preset's own overrides first)."""
    from trellis.recipes.presets import preset_overrides

    return [
        *preset_overrides(preset),
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=-1",
        "trainer.trackers=[jsonl]",
        f"trainer.experiment_name={name}",
    ]
