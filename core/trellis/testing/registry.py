"""Contract tests for any registry entry: installed, loads, fits its protocol, documented."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any, ClassVar


class RegistryEntryContract:
    """Proves that the entry ``name`` of ``registry`` is a well-formed plugin component.

    Class attributes to set in the subclass:
        registry: the registry's short name (``"tools"``) or group (``"trellis.tools"``).
        name: the name the plugin registers.
        require_entry_point: whether the name must come from an installed distribution's
            entry point (default True; set False to check an in-process registration).
    """

    registry: ClassVar[str]
    name: ClassVar[str]
    require_entry_point: ClassVar[bool] = True

    def _registry(self) -> Any:
        from trellis.registries import get_registry

        return get_registry(self.registry)

    def _component(self) -> Any:
        return self._registry().get(self.name)

    def test_is_listed(self) -> None:
        registry = self._registry()
        assert self.name in registry.names(), (
            f"{self.name!r} is not among the {registry.kind} names {registry.names()}; is the plugin "
            f"installed, with an entry point in group {registry.group!r}?"
        )
        if self.require_entry_point:
            providers = [e.provider for e in registry.entries() if e.name == self.name]
            assert any(p != "(in-process)" for p in providers), (
                f"{self.name!r} is registered in-process only; declare it as an entry point in group "
                f"{registry.group!r} so it resolves in every process."
            )

    def test_loads(self) -> None:
        assert self._component() is not None

    def test_fits_protocol(self) -> None:
        registry = self._registry()
        if registry.protocol is not None:
            problems = registry.protocol.problems(self._component())
            assert not problems, f"{self.name!r} does not fit the {registry.kind} protocol: {problems}"

    def test_has_docstring(self) -> None:
        doc = inspect.getdoc(self._component())
        assert doc and doc.strip(), f"{self.name!r} has no docstring; say what it does and its shapes/units."

    def test_resolves_in_fresh_process(self) -> None:
        if not self.require_entry_point:
            import pytest

            pytest.skip("in-process registrations exist only in the process that made them")
        code = (
            "import sys; from trellis.registries import get_registry; "
            f"obj = get_registry({self.registry!r}).get({self.name!r}); "
            "print(getattr(obj, '__module__', '?') + ':' + getattr(obj, '__qualname__', '?'))"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{self.name!r} does not resolve in a fresh process:\n{done.stderr}"
        obj = self._component()
        assert done.stdout.strip() == f"{obj.__module__}:{obj.__qualname__}"
