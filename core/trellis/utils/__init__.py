"""Utilities every layer uses: files anywhere, tokenizers, logging, timing, profiling, memory,
settings, coroutines. The bottom import layer: ``trellis.utils`` imports only ``trellis.errors``.

Importing ``trellis.utils`` is cheap: it imports neither torch nor transformers. The public
names below are attributes that import their module on first access; the modules
themselves import torch, transformers and fsspec only inside the functions that need them.

==============================  ================================================================
module                          public names
==============================  ================================================================
``trellis.utils.fs``            ``copy``, ``makedirs``, ``is_non_local``, ``copy_to_local``
``trellis.utils.tokenizer``     ``hf_tokenizer``, ``hf_processor``, ``normalize_token_ids``
``trellis.utils.logging``       ``print_rank_0``, ``log_with_rank``, ``get_rank``
``trellis.utils.timing``        ``timer``, ``marked_timer``
``trellis.utils.profiling``     ``profile``
``trellis.utils.memory``        ``rss_bytes``, ``peak_rss_bytes``, ``reset_peak_rss``,
                                ``physical_memory_bytes``, ``trim_malloc_heaps``,
                                ``host_memory``, ``set_host_memory``
``trellis.utils.settings``      ``config_value``, ``setting``
``trellis.utils.coroutines``    ``run_coroutine``
``trellis.utils.lazy``          ``lazy_attributes``
==============================  ================================================================

A device's memory (on the selected backend) is one layer up, in :mod:`trellis.device.memory`.
"""

from __future__ import annotations

from trellis.utils.lazy import lazy_attributes

# public name -> "module:attr" (or "module" for a submodule), imported on first access
_LAZY: dict[str, str] = {
    "copy": "trellis.utils.fs:copy",
    "makedirs": "trellis.utils.fs:makedirs",
    "is_non_local": "trellis.utils.fs:is_non_local",
    "copy_to_local": "trellis.utils.fs:copy_to_local",
    "hf_tokenizer": "trellis.utils.tokenizer:hf_tokenizer",
    "hf_processor": "trellis.utils.tokenizer:hf_processor",
    "normalize_token_ids": "trellis.utils.tokenizer:normalize_token_ids",
    "print_rank_0": "trellis.utils.logging:print_rank_0",
    "log_with_rank": "trellis.utils.logging:log_with_rank",
    "get_rank": "trellis.utils.logging:get_rank",
    "timer": "trellis.utils.timing:timer",
    "marked_timer": "trellis.utils.timing:marked_timer",
    "profile": "trellis.utils.profiling:profile",
    "rss_bytes": "trellis.utils.memory:rss_bytes",
    "peak_rss_bytes": "trellis.utils.memory:peak_rss_bytes",
    "reset_peak_rss": "trellis.utils.memory:reset_peak_rss",
    "physical_memory_bytes": "trellis.utils.memory:physical_memory_bytes",
    "trim_malloc_heaps": "trellis.utils.memory:trim_malloc_heaps",
    "host_memory": "trellis.utils.memory:host_memory",
    "set_host_memory": "trellis.utils.memory:set_host_memory",
    "config_value": "trellis.utils.settings:config_value",
    "setting": "trellis.utils.settings:setting",
    "run_coroutine": "trellis.utils.coroutines:run_coroutine",
    "lazy_attributes": "trellis.utils.lazy:lazy_attributes",
    "fs": "trellis.utils.fs",
    "tokenizer": "trellis.utils.tokenizer",
    "logging": "trellis.utils.logging",
    "timing": "trellis.utils.timing",
    "profiling": "trellis.utils.profiling",
    "memory": "trellis.utils.memory",
    "settings": "trellis.utils.settings",
    "coroutines": "trellis.utils.coroutines",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_attributes("trellis.utils", _LAZY, globals())
