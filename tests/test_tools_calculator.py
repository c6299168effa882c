"""trellis.tools.calculator: exact arithmetic by recursive descent; errors become messages."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest

from trellis import registries
from trellis.tools.calculator import CalculatorError, CalculatorTool, evaluate, format_number


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("2 ** 3 ** 2", 512),  # right-associative
        ("-2 ** 2", -4),  # ** binds tighter than unary minus
        ("2 ** -1", Fraction(1, 2)),
        ("--3", 3),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("1 / 3 + 1 / 6", Fraction(1, 2)),
        ("0.1 + 0.2", Fraction(3, 10)),  # exact, not 0.30000000000000004
        (".5 * 4", 2),
        ("1e3 + 1", 1001),
        ("sqrt(16)", 4),
        ("sqrt(9/4)", Fraction(3, 2)),
        ("abs(-3) + min(4, 2, 8) + max(1, 5)", 10),
        ("round(2.675, 2)", Fraction(268, 100)),  # exact: 2.675 is a tie, rounded half-even
        ("round(7 / 2)", 4),
        ("floor(-2.5) + ceil(2.1)", 0),
        ("123456789 * 987654321", 121932631112635269),
    ],
)
def test_values(expression, value):
    assert evaluate(expression) == value


def test_inexact_falls_back_to_float():
    assert evaluate("sqrt(2)") == pytest.approx(2**0.5)
    assert isinstance(evaluate("2 ** 0.5"), float)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (Fraction(42), "42"),
        (Fraction(-1, 8), "-0.125"),
        (Fraction(3, 10), "0.3"),
        (Fraction(1, 3), "1/3 ≈ 0.333333333333"),
        (1.5, "1.5"),
    ],
)
def test_format(value, text):
    assert format_number(value) == text


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", r"division by zero"),
        ("5 % 0", r"division by zero"),
        ("0 ** -1", r"division by zero"),
        ("1 +", r"unexpected end of expression"),
        ("(1 + 2", r"unexpected end of expression"),
        ("(1 + 2,", r"expected '\)', got ','"),
        ("1 2", r"unexpected '2' after a complete expression"),
        ("2 ^ 3", r"unexpected character '\^' at position 2 \(use \*\* for powers\)"),
        ("__import__(1)", r"unknown name '__import__'"),
        ("sqrt(-1)", r"sqrt of a negative number"),
        ("(-8) ** 0.5", r"not a real number"),
        ("9 ** 9 ** 9", r"exponent \d+ is too large"),
        ("2 ** 5000", r"result is too large"),
        ("10.0 ** 400.5", r"result is too large"),
        ("min()", r"unexpected '\)'"),
        ("", r"empty expression"),
        ("(" * 200 + "1" + ")" * 200, r"nested too deeply"),
    ],
)
def test_errors(expression, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)


def test_tool_returns_messages_not_exceptions():
    tool = CalculatorTool({"max_length": 20})
    assert registries.tools.get("calculator") is CalculatorTool
    assert tool.name == "calculator"
    assert tool.get_openai_tool_schema().function.parameters.required == ["expression"]

    async def main():
        iid, _ = await tool.create()
        ok = await tool.execute(iid, {"expression": "(3 + 4) * 2 / 7"})
        bad = await tool.execute(iid, {"expression": "1/0"})
        long = await tool.execute(iid, {"expression": "1+" * 20 + "1"})
        missing = await tool.execute(iid, {})
        await tool.release(iid)
        return ok, bad, long, missing

    ok, bad, long, missing = asyncio.run(main())
    assert (ok[0].text, ok[1], ok[2]) == ("2", 0.0, {"calculator/errors": 0})
    assert bad[0].text == "Error: division by zero" and bad[2] == {"calculator/errors": 1}
    assert long[0].text == "Error: expression is longer than 20 characters"
    assert missing[0].text == "Error: expression must be a string, got NoneType"
