"""trellis/__init__.py: public names are lazy attributes; unknown names are clear errors."""

from __future__ import annotations

import pytest

import trellis


def test_lazy_public_names_resolve_to_their_modules():
    from trellis.config import load_config
    from trellis.data.protocol import DataProto
    from trellis.hooks import get_plugin_manager
    from trellis.registry import Registry

    assert trellis.DataProto is DataProto
    assert trellis.load_config is load_config
    assert trellis.Registry is Registry
    assert trellis.get_plugin_manager is get_plugin_manager
    assert {"DataProto", "load_config", "registries", "__version__"} <= set(dir(trellis))


def test_unknown_attribute():
    with pytest.raises(AttributeError, match=r"module 'trellis' has no attribute 'DataProtocol'"):
        trellis.DataProtocol  # noqa: B018


def test_data_package_is_lazy_too(python):
    done = python(
        "import sys, trellis.data\n"
        "light = 'trellis.data.dataset' not in sys.modules and 'torch' not in sys.modules\n"
        "from trellis.data import RLDataset, DataProto\n"
        "print(light, RLDataset.__module__, DataProto.__module__)"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "trellis.data.dataset", "trellis.data.protocol"]
