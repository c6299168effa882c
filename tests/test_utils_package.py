"""trellis.utils as a package: lazy public names, and importing it stays cheap."""

from __future__ import annotations

import pytest

import trellis.utils

PUBLIC = {
    "copy": "trellis.utils.fs",
    "makedirs": "trellis.utils.fs",
    "is_non_local": "trellis.utils.fs",
    "copy_to_local": "trellis.utils.fs",
    "hf_tokenizer": "trellis.utils.tokenizer",
    "hf_processor": "trellis.utils.tokenizer",
    "normalize_token_ids": "trellis.utils.tokenizer",
    "print_rank_0": "trellis.utils.logging",
    "log_with_rank": "trellis.utils.logging",
    "get_rank": "trellis.utils.logging",
    "timer": "trellis.utils.timing",
    "marked_timer": "trellis.utils.timing",
    "profile": "trellis.utils.profiling",
    "rss_bytes": "trellis.utils.memory",
    "peak_rss_bytes": "trellis.utils.memory",
    "reset_peak_rss": "trellis.utils.memory",
    "physical_memory_bytes": "trellis.utils.memory",
    "trim_malloc_heaps": "trellis.utils.memory",
}


@pytest.mark.parametrize(("name", "module"), sorted(PUBLIC.items()))
def test_public_names_resolve_to_their_modules(name, module):
    assert getattr(trellis.utils, name).__module__ == module


def test_all_and_unknown_names():
    assert set(PUBLIC) <= set(trellis.utils.__all__) <= set(dir(trellis.utils))
    # device memory needs the device backend, a layer above utils: trellis.device.memory has it
    assert not {"device_memory_usage", "log_device_memory_usage", "aggressive_empty_cache"} & set(
        trellis.utils.__all__
    )
    with pytest.raises(AttributeError, match=r"module 'trellis\.utils' has no attribute 'nope'"):
        trellis.utils.nope  # noqa: B018


def test_importing_utils_and_its_modules_imports_no_heavy_package(python):
    proc = python(
        "import sys, trellis.utils\n"
        "from trellis.utils import copy_to_local, hf_tokenizer, marked_timer, print_rank_0\n"
        "import trellis.utils.fs, trellis.utils.tokenizer, trellis.utils.logging, trellis.utils.timing\n"
        "import trellis.utils.profiling, trellis.utils.memory\n"
        "with trellis.utils.timer('t', {}), marked_timer('m', {}):\n"
        "    print_rank_0('ok')\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy', 'fsspec') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok\n[]\n"
