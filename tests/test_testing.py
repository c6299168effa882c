"""trellis.testing: the conformance kit, used as a plugin author would and shown to catch faults."""

from __future__ import annotations

import pytest

from trellis.testing import RegistryEntryContract


class TestFixtureReturnsEstimator(RegistryEntryContract):
    registry = "advantage_estimators"
    name = "fixture_returns"


class TestJsonlTracker(RegistryEntryContract):
    registry = "trellis.trackers"
    name = "jsonl"


def run_contract(pytester: pytest.Pytester, body: str):
    """Run a contract test file; returns ({(class, test): outcome}, result)."""
    pytester.makepyfile(test_contract="from trellis.testing import RegistryEntryContract\n" + body)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    reports = result.reprec.getreports("pytest_runtest_logreport")
    return {tuple(r.nodeid.split("::")[-2:]): r.outcome for r in reports if r.when == "call"}, result


def test_contract_catches_a_misfit_component(pytester):
    got, result = run_contract(
        pytester,
        "class TestMisfit(RegistryEntryContract):\n"
        "    registry = 'advantage_estimators'\n    name = 'fixture_misfit'\n",
    )
    assert got == {
        ("TestMisfit", "test_is_listed"): "passed",
        ("TestMisfit", "test_loads"): "failed",
        ("TestMisfit", "test_fits_protocol"): "failed",
        ("TestMisfit", "test_has_docstring"): "failed",
        ("TestMisfit", "test_resolves_in_fresh_process"): "failed",
    }
    result.stdout.fnmatch_lines(["*ProtocolMismatchError: Advantage estimator 'fixture_misfit'*"])


def test_contract_catches_an_unlisted_name(pytester):
    got, result = run_contract(
        pytester,
        "class TestMissing(RegistryEntryContract):\n    registry = 'tools'\n    name = 'not_installed'\n",
    )
    assert got["TestMissing", "test_is_listed"] == "failed"
    assert got["TestMissing", "test_loads"] == "failed"
    result.stdout.fnmatch_lines(["*'not_installed' is not among the tool names*"])


def test_contract_catches_a_missing_docstring_and_in_process_only(pytester):
    body = (
        "from trellis.registries import reward_functions\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 0.0\n"
        "reward_functions.register('contract_undocumented', score, replace=True)\n"
        "class TestUndocumented(RegistryEntryContract):\n"
        "    registry = 'reward_functions'\n    name = 'contract_undocumented'\n"
        "class TestUndocumentedLocal(TestUndocumented):\n"
        "    require_entry_point = False\n"
    )
    try:
        got, result = run_contract(pytester, body)
    finally:
        from trellis.registries import reward_functions

        reward_functions.unregister("contract_undocumented")
    assert got == {
        ("TestUndocumented", "test_is_listed"): "failed",
        ("TestUndocumented", "test_loads"): "passed",
        ("TestUndocumented", "test_fits_protocol"): "passed",
        ("TestUndocumented", "test_has_docstring"): "failed",
        ("TestUndocumented", "test_resolves_in_fresh_process"): "failed",
        ("TestUndocumentedLocal", "test_is_listed"): "passed",
        ("TestUndocumentedLocal", "test_loads"): "passed",
        ("TestUndocumentedLocal", "test_fits_protocol"): "passed",
        ("TestUndocumentedLocal", "test_has_docstring"): "failed",
        ("TestUndocumentedLocal", "test_resolves_in_fresh_process"): "skipped",
    }
    result.stdout.fnmatch_lines(
        [
            "*registered in-process only; declare it as an entry point*",
            "*'contract_undocumented' has no docstring*",
        ]
    )
