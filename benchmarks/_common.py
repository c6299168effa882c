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
