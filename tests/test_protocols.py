"""trellis.protocols: the structural checks registries apply to what they load."""

from __future__ import annotations

import functools

from trellis.protocols import CallableProtocol, ClassProtocol

ADV = CallableProtocol("fn(r, m, *, index=None)", positional=("r", "m"), keywords=("index",))


def test_callable_fits_with_exact_or_catch_all_signatures():
    def exact(r, m, *, index=None):
        return r

    def catch_all(*args, **kwargs):
        return args

    def renamed_positional(rewards, mask, index=None):  # positional names are free
        return rewards

    for fn in (exact, catch_all, renamed_positional, functools.partial(exact), lambda r, m, **kw: r):
        assert ADV.problems(fn) == [], fn


def test_callable_missing_keyword_or_positional():
    def no_index(r, m):
        return r

    def one_positional(r, *, index=None):
        return r

    (problem,) = ADV.problems(no_index)
    assert problem == (
        "its signature no_index(r, m) cannot be called that way (got an unexpected keyword argument 'index')"
    )
    (problem,) = ADV.problems(one_positional)
    assert "one_positional(r, *, index=None)" in problem and "too many positional arguments" in problem


def test_callable_rejects_classes_and_non_callables():
    assert ADV.problems(int) == ["it is a type, not a function"]
    assert ADV.problems(3) == ["it is a int, not a function"]


def test_async_functions_are_callables_too():
    async def score(r, m, *, index=None):
        return r

    assert ADV.problems(score) == []


TOOL = ClassProtocol(
    "a tool", methods=("schema",), async_methods=("execute",), attributes=("name", "server_address")
)


def test_class_protocol_accepts_a_fitting_class_including_inherited_members():
    class Base:
        server_address = None  # None is a value, not a missing attribute

        async def execute(self, params):
            return params

    class Tool(Base):
        name: str

        @staticmethod
        def schema():
            return {}

    assert TOOL.problems(Tool) == []


def test_class_protocol_lists_every_problem():
    class Half:
        name = "half"

        def execute(self, params):  # must be async
            return params

    assert TOOL.problems(Half) == [
        "method 'schema' is missing",
        "method 'execute' must be 'async def'",
        "attribute 'server_address' is missing",
    ]
    assert TOOL.problems(Half()) == ["it is a Half, not a class"]


def test_object_methods_do_not_count_as_defined():
    call = ClassProtocol("callable instances", methods=("__call__",))

    class Manager:
        def __call__(self, data):
            return data

    class Plain:
        pass

    assert call.problems(Manager) == []
    assert call.problems(Plain) == ["method '__call__' is missing"]


def test_class_protocol_with_base_class():
    from collections import OrderedDict

    protocol = ClassProtocol("a dict", base="builtins:dict")
    assert protocol.problems(OrderedDict) == []
    assert protocol.problems(list) == ["it does not subclass builtins:dict"]
