"""Turn ``reward.function`` (a name, a reference, a callable or null) into the function to call."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from trellis.reward.builtin import default_compute_score


def resolve_reward_function(
    function: str | Callable[..., Any] | None = None, **function_kwargs: Any
) -> Callable[..., Any]:
    """The scoring function named by ``function``, with ``function_kwargs`` bound.

    ``function`` is a name in ``trellis.reward_functions`` (``"gsm8k"``), a reference
    (``"package.module:fn"`` or ``"./file.py:fn"``), a callable, or None for
    :func:`~trellis.reward.builtin.default_compute_score` (chosen per sample by data_source).
    Names and references are checked against the reward-function protocol; the result is called
    as ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)``.

    Raises:
        UnknownComponentError, InvalidReferenceError, PluginLoadError, ProtocolMismatchError:
            from the registry, for a bad name or reference.
        TypeError: ``function`` is neither a string, a callable nor None.
    """
    if function is None:
        fn: Callable[..., Any] = default_compute_score
    elif isinstance(function, str):
        from trellis.registries import reward_functions

        fn = reward_functions.get(function)
    elif callable(function):
        fn = function
    else:
        raise TypeError(
            f"reward function must be a registered name, a 'module:fn' reference, a callable or None, "
            f"got {type(function).__name__} {function!r}."
        )
    return functools.partial(fn, **function_kwargs) if function_kwargs else fn
