"""trellis.registry: in-process registration, lookup errors, references, validation, listing."""

from __future__ import annotations

import textwrap

import pytest

from trellis.errors import (
    DuplicateComponentError,
    InvalidReferenceError,
    PluginLoadError,
    ProtocolMismatchError,
    TrellisError,
    UnknownComponentError,
)
from trellis.protocols import CallableProtocol
from trellis.registry import Entry, Registry, is_reference, load_reference

SCORE = CallableProtocol("score(solution_str, ground_truth)", keywords=("solution_str", "ground_truth"))


def score_exact(solution_str, ground_truth):
    """1.0 on an exact match."""
    return float(solution_str == ground_truth)


def score_prefix(solution_str, ground_truth):
    """1.0 when the response starts with the ground truth."""
    return float(solution_str.startswith(ground_truth))


@pytest.fixture
def registry() -> Registry:
    # A group no distribution provides: only in-process registrations are visible.
    return Registry("scorer", "trellis.test_registry_only", SCORE)


def test_register_direct_and_get(registry):
    assert registry.register("exact", score_exact) is score_exact
    assert registry.get("exact") is score_exact
    assert registry.get("exact")("a", "a") == 1.0
    assert "exact" in registry and "prefix" not in registry
    assert registry.names() == ["exact"]
    assert len(registry) == 1 and list(registry) == ["exact"]


def test_register_as_decorator_returns_the_function(registry):
    @registry.register("prefix")
    def prefix(solution_str, ground_truth):
        """Prefix match."""
        return float(solution_str.startswith(ground_truth))

    assert prefix("abc", "ab") == 1.0  # the decorator hands back the function itself
    assert registry.get("prefix") is prefix


def test_register_twice_without_replace_names_the_holder(registry):
    registry.register("exact", score_exact)
    with pytest.raises(DuplicateComponentError) as info:
        registry.register("exact", score_prefix)
    message = str(info.value)
    assert "Scorer 'exact' is already registered by an in-process register() call" in message
    assert "test_registry:score_exact" in message
    assert "replace=True" in message
    assert registry.get("exact") is score_exact  # the first registration survives


def test_register_with_replace_overrides(registry):
    registry.register("exact", score_exact)
    registry.register("exact", score_prefix, replace=True)
    assert registry.get("exact") is score_prefix
    registry.unregister("exact")
    assert "exact" not in registry


@pytest.mark.parametrize("bad", ["", "a:b", "dir/name", "-lead", "with space", 3])
def test_register_rejects_invalid_names(registry, bad):
    with pytest.raises(ValueError, match=r"Invalid scorer name") as info:
        registry.register(bad, score_exact)
    assert repr(bad) in str(info.value)


def test_register_validates_the_protocol(registry):
    def wrong(text):
        return 0.0

    with pytest.raises(ProtocolMismatchError) as info:
        registry.register("wrong", wrong)
    message = str(info.value)
    assert message.startswith(
        "Scorer 'wrong' (test_registry:test_register_validates_the_protocol.<locals>.wrong)"
    )
    assert "does not fit the scorer protocol" in message
    assert "wrong(text)" in message
    assert "Expected score(solution_str, ground_truth)." in message
    assert "wrong" not in registry


def test_unknown_name_lists_names_and_closest_match(registry):
    registry.register("exact", score_exact)
    registry.register("prefix", score_prefix)
    with pytest.raises(UnknownComponentError) as info:
        registry.get("exakt")
    error = info.value
    assert str(error).startswith("Unknown scorer 'exakt'. Available: exact, prefix. Closest match: 'exact'.")
    assert "entry-point group 'trellis.test_registry_only'" in str(error)
    assert (error.name, error.available, error.closest) == ("exakt", ["exact", "prefix"], "exact")
    assert isinstance(error, LookupError) and isinstance(error, TrellisError)


def test_unknown_name_in_empty_registry_says_none_installed(registry):
    with pytest.raises(UnknownComponentError, match=r"Available: none \(no scorer is installed\)\."):
        registry.get("anything")


def test_entries_describe_in_process_registrations(registry):
    registry.register("exact", score_exact)
    assert registry.entries() == [
        Entry("exact", "trellis.test_registry_only", "(in-process)", None, "test_registry:score_exact", True)
    ]


# ---------------------------------------------------------------- references


def test_is_reference():
    assert is_reference("pkg.mod:fn") and is_reference("./file.py:fn")
    assert not is_reference("grpo")


def test_module_reference_resolves_and_is_validated(registry):
    assert registry.get("test_registry:score_prefix") is score_prefix
    with pytest.raises(ProtocolMismatchError, match=r"Scorer 'os:getcwd' \(os:getcwd\) does not fit"):
        registry.get("os:getcwd")


def test_dotted_attribute_reference():
    assert (
        load_reference("collections:OrderedDict.fromkeys") == __import__("collections").OrderedDict.fromkeys
    )


def test_file_reference_relative_and_absolute(registry, tmp_path, monkeypatch):
    source = tmp_path / "my_reward.py"
    source.write_text(
        textwrap.dedent('''
        CALLS = []

        def score(solution_str, ground_truth):
            """Length ratio."""
            CALLS.append(solution_str)
            return len(solution_str) / max(1, len(ground_truth))
    ''')
    )
    monkeypatch.chdir(tmp_path)
    fn = registry.get("./my_reward.py:score")
    assert fn("abcd", "ab") == 2.0
    # The same file is imported once, whichever way it is named.
    assert registry.get(f"{source}:score") is fn
    assert load_reference("my_reward.py:CALLS") == ["abcd"]


def test_file_reference_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidReferenceError) as info:
        load_reference("./nope.py:score")
    assert "Reference file './nope.py' does not exist" in str(info.value)
    assert str(tmp_path / "nope.py") in str(info.value)

    (tmp_path / "raises.py").write_text("raise ValueError('bad config in raises.py')\n")
    with pytest.raises(PluginLoadError, match=r"importing './raises.py' failed: ValueError\('bad config"):
        load_reference("./raises.py:score")
    # A failed import leaves nothing half-initialised behind: fixing the file fixes the reference.
    (tmp_path / "raises.py").write_text("def score(solution_str, ground_truth):\n    return 1.0\n")
    assert load_reference("./raises.py:score")("a", "b") == 1.0


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("os.path:", "Malformed reference 'os.path:'"),
        (":join", "Malformed reference ':join'"),
        ("os.path:not-valid", "Malformed reference 'os.path:not-valid'"),
        (
            "os.path:jion",
            "Reference 'os.path:jion': 'os.path' has no attribute 'jion' (did you mean 'join'?)",
        ),
        (
            "trellis_no_such_pkg.mod:fn",
            "Reference 'trellis_no_such_pkg.mod:fn': no module named 'trellis_no_such_pkg'",
        ),
    ],
)
def test_bad_references(ref, expected):
    with pytest.raises(InvalidReferenceError) as info:
        load_reference(ref)
    assert str(info.value).startswith(expected)


def test_module_whose_own_import_fails_is_a_load_error(tmp_path, monkeypatch):
    (tmp_path / "trellis_test_needs_dep.py").write_text("import trellis_test_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginLoadError) as info:
        load_reference("trellis_test_needs_dep:fn")
    assert "importing 'trellis_test_needs_dep' failed" in str(info.value)
    assert "trellis_test_absent_dependency" in str(info.value)


def _fake_distribution(root, version: str, entry_point: str) -> None:
    info = root / f"trellis_fake_plugin-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: trellis-fake-plugin\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[trellis.test_registry_fake]\n{entry_point}\n")


def test_a_distribution_found_twice_on_the_path_first_wins(tmp_path, monkeypatch):
    from trellis.registry import entry_points_of, refresh_entry_points

    _fake_distribution(tmp_path / "first", "2.0", "new_score = fake_plugin:new_score")
    _fake_distribution(tmp_path / "second", "1.0", "old_score = fake_plugin:old_score")
    monkeypatch.syspath_prepend(str(tmp_path / "second"))
    monkeypatch.syspath_prepend(str(tmp_path / "first"))
    refresh_entry_points()
    try:
        found = entry_points_of("trellis.test_registry_fake")
        assert list(found) == ["new_score"]
        (ep,) = found["new_score"]
        assert (ep.value, ep.dist.version) == ("fake_plugin:new_score", "2.0")
    finally:
        monkeypatch.undo()
        refresh_entry_points()
    assert entry_points_of("trellis.test_registry_fake") == {}
