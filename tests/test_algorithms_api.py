"""trellis.algorithms: the public names, exported lazily (``import trellis`` stays cheap)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import trellis.algorithms as algorithms


def test_the_names_a_verl_user_looks_for_are_there():
    from trellis.algorithms import agg_loss, get_adv_estimator_fn, kl_penalty, register_adv_est

    assert agg_loss.__module__ == "trellis.algorithms.aggregation"
    assert kl_penalty.__module__ == "trellis.algorithms.kl"
    assert get_adv_estimator_fn("grpo") is algorithms.compute_grpo_outcome_advantage
    assert algorithms.get_policy_loss_fn("vanilla") is algorithms.compute_policy_loss_vanilla
    assert callable(register_adv_est) and callable(algorithms.register_policy_loss)
    for name in ("logprobs_from_logits", "entropy_from_logits", "actor_loss", "critic_loss", "requires"):
        assert callable(getattr(algorithms, name)), name


def test_every_exported_name_resolves_and_every_registered_builtin_is_exported():
    from importlib.metadata import entry_points

    for name in algorithms.__all__:
        assert getattr(algorithms, name) is not None, name
    for group in ("trellis.advantage_estimators", "trellis.policy_losses"):
        for ep in entry_points(group=group):
            if ep.value.startswith("trellis.algorithms."):
                assert getattr(algorithms, ep.value.split(":")[1]) is ep.load(), ep.name
    assert set(dir(algorithms)) >= set(algorithms.__all__)
    with pytest.raises(AttributeError, match=r"module 'trellis\.algorithms' has no attribute 'nope'"):
        algorithms.nope  # noqa: B018


def _fresh(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_the_package_imports_no_torch_and_trellis_imports_fast():
    out = _fresh("import sys, trellis.algorithms; print('torch' in sys.modules)")
    assert out.split() == ["False"]
    # best of 3 fresh interpreters: `import trellis` itself (the interpreter's start excluded)
    code = "import time; t = time.perf_counter(); import trellis; print(time.perf_counter() - t)"
    seconds = min(float(_fresh(code)) for _ in range(3))
    assert seconds < 0.3, f"import trellis took {seconds:.3f} s"
