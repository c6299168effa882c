"""``calculator``: exact arithmetic on an expression string, parsed by recursive descent (no eval).

Grammar (Python precedence: ``**`` binds tighter than unary minus and is right-associative)::

    expr  := term (('+' | '-') term)*
    term  := unary (('*' | '/' | '//' | '%') unary)*
    unary := ('+' | '-') unary | power
    power := atom ('**' unary)?
    atom  := NUMBER | NAME '(' expr (',' expr)* ')' | '(' expr ')'

Numbers are ``Fraction`` (exact) until a function or power forces a float. Results are bounded
(``max_bits`` per numerator/denominator, ``max_exponent``) so ``9**9**9`` is an error, not a hang.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, ClassVar

from trellis.tools.base import BaseTool
from trellis.tools.schema import ToolResponse

Number = Fraction | float

_TOKEN = re.compile(
    r"\s*(?:(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|(\*\*|//|[-+*/%(),])|([A-Za-z_]\w*))"
)


class CalculatorError(ValueError):
    """The expression is malformed or its value is out of bounds; the message is for the model."""


def tokenize(text: str) -> list[tuple[str, str]]:
    """``[(kind, text), ...]`` with kind in ``num``, ``op``, ``name``. Raises ``CalculatorError``."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            at = len(text) - len(text[pos:].lstrip())
            hint = " (use ** for powers)" if text[at] == "^" else ""
            raise CalculatorError(f"unexpected character {text[at]!r} at position {at}{hint}")
        num, op, name = match.groups()
        tokens.append(("num", num) if num else ("op", op) if op else ("name", name))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(
        self, tokens: list[tuple[str, str]], max_bits: int, max_exponent: int, max_depth: int
    ) -> None:
        self.tokens = tokens
        self.i = 0
        self.max_bits = max_bits
        self.max_exponent = max_exponent
        self.max_depth = max_depth
        self.depth = 0
        self.functions: dict[str, tuple[Callable[..., Number], int, int]] = {
            "sqrt": (self._sqrt, 1, 1),
            "abs": (abs, 1, 1),
            "min": (min, 1, 64),
            "max": (max, 1, 64),
            "round": (self._round, 1, 2),
            "floor": (lambda x: Fraction(math.floor(x)), 1, 1),
            "ceil": (lambda x: Fraction(math.ceil(x)), 1, 1),
        }

    # -- helpers
    def peek(self) -> str | None:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.i >= len(self.tokens):
            raise CalculatorError("unexpected end of expression")
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def expect(self, op: str) -> None:
        kind, text = self.take()
        if text != op or kind != "op":
            raise CalculatorError(f"expected {op!r}, got {text!r}")

    def check(self, value: Number) -> Number:
        if isinstance(value, float):
            if not math.isfinite(value):
                raise CalculatorError("result is not a finite number")
            return value
        if max(value.numerator.bit_length(), value.denominator.bit_length()) > self.max_bits:
            raise CalculatorError(f"result is too large (more than {self.max_bits} bits)")
        return value

    # -- grammar
    def parse(self) -> Number:
        if not self.tokens:
            raise CalculatorError("empty expression")
        value = self.expr()
        if self.i != len(self.tokens):
            raise CalculatorError(f"unexpected {self.tokens[self.i][1]!r} after a complete expression")
        return value

    def expr(self) -> Number:
        self.depth += 1
        if self.depth > self.max_depth:
            raise CalculatorError(f"expression is nested too deeply (more than {self.max_depth} levels)")
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            rhs = self.term()
            value = self.check(value + rhs if op == "+" else value - rhs)
        self.depth -= 1
        return value

    def term(self) -> Number:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op = self.take()[1]
            rhs = self.unary()
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise CalculatorError("division by zero")
            elif op == "/":
                value = value / rhs
            elif op == "//":
                value = Fraction(value // rhs) if not isinstance(value // rhs, float) else value // rhs
            else:
                value = value % rhs
            value = self.check(value)
        return value

    def unary(self) -> Number:
        if self.peek() in ("+", "-"):
            op = self.take()[1]
            self.depth += 1
            if self.depth > self.max_depth:
                raise CalculatorError(f"expression is nested too deeply (more than {self.max_depth} levels)")
            value = self.unary()
            self.depth -= 1
            return -value if op == "-" else value
        return self.power()

    def power(self) -> Number:
        base = self.atom()
        if self.peek() != "**":
            return base
        self.take()
        return self.check(self._pow(base, self.unary()))

    def atom(self) -> Number:
        kind, text = self.take()
        if kind == "num":
            return self.check(Fraction(text))
        if kind == "name":
            if text not in self.functions:
                raise CalculatorError(f"unknown name {text!r}; functions: {', '.join(self.functions)}")
            fn, lo, hi = self.functions[text]
            self.expect("(")
            args = [self.expr()]
            while self.peek() == ",":
                self.take()
                args.append(self.expr())
            self.expect(")")
            if not lo <= len(args) <= hi:
                raise CalculatorError(f"{text}() takes {lo}..{hi} arguments, got {len(args)}")
            return self.check(fn(*args))
        if text == "(":
            value = self.expr()
            self.expect(")")
            return value
        raise CalculatorError(f"unexpected {text!r}")

    # -- functions
    def _pow(self, base: Number, exp: Number) -> Number:
        if isinstance(exp, Fraction) and exp.denominator == 1 and isinstance(base, Fraction):
            e = exp.numerator
            if abs(e) > self.max_exponent:
                raise CalculatorError(f"exponent {e} is too large (limit {self.max_exponent})")
            bits = max(base.numerator.bit_length(), base.denominator.bit_length())
            if bits * abs(e) > self.max_bits + 64:
                raise CalculatorError(f"result is too large (more than {self.max_bits} bits)")
            if base == 0 and e < 0:
                raise CalculatorError("division by zero (0 to a negative power)")
            return base**e
        if base < 0:
            raise CalculatorError("a negative number to a fractional power is not a real number")
        if base == 0 and exp < 0:
            raise CalculatorError("division by zero (0 to a negative power)")
        try:
            return float(base) ** float(exp)
        except OverflowError:
            raise CalculatorError("result is too large") from None

    @staticmethod
    def _sqrt(x: Number) -> Number:
        if x < 0:
            raise CalculatorError("sqrt of a negative number")
        if isinstance(x, Fraction):
            n, d = math.isqrt(x.numerator), math.isqrt(x.denominator)
            if n * n == x.numerator and d * d == x.denominator:
                return Fraction(n, d)
        return math.sqrt(x)

    @staticmethod
    def _round(x: Number, digits: Number = Fraction(0)) -> Number:
        if isinstance(digits, float) or digits.denominator != 1 or abs(digits) > 100:
            raise CalculatorError("round() digits must be a small integer")
        if isinstance(x, Fraction):
            return round(x, int(digits))
        value = round(x, int(digits))
        return Fraction(value) if isinstance(value, int) else value


def evaluate(
    expression: str, *, max_bits: int = 4096, max_exponent: int = 10_000, max_depth: int = 100
) -> Number:
    """The value of ``expression``: a ``Fraction`` when exact, else a float. Raises ``CalculatorError``."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    return _Parser(tokenize(expression), max_bits, max_exponent, max_depth).parse()


def format_number(value: Number) -> str:
    """``42``, ``0.125`` (terminating decimals exactly), ``1/3 ≈ 0.333333333333`` or a float's repr."""
    if isinstance(value, float):
        return repr(value)
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d == 1:  # terminating decimal: print it exactly
        places = 0
        while (value * 10**places).denominator != 1:
            places += 1
        scaled = abs(value.numerator * 10**places // value.denominator)
        digits = str(scaled).rjust(places + 1, "0")
        sign = "-" if value < 0 else ""
        return f"{sign}{digits[:-places]}.{digits[-places:]}"
    return f"{value.numerator}/{value.denominator} ≈ {float(value):.12g}"


class CalculatorTool(BaseTool):
    """Evaluates an arithmetic expression. Config: ``max_length`` (chars, 1000), ``max_bits`` (4096),
    ``max_exponent`` (10000)."""

    default_schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly. Supports + - * / // % ** and "
            "parentheses, and sqrt, abs, min, max, round, floor, ceil.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2 / 7"}},
                "required": ["expression"],
            },
        },
    }

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        expression: Any = parameters.get("expression")  # from the model: evaluate() checks it is a str
        max_length = int(self.config.get("max_length", 1000))
        try:
            if isinstance(expression, str) and len(expression) > max_length:
                raise CalculatorError(f"expression is longer than {max_length} characters")
            value = evaluate(
                expression,
                max_bits=int(self.config.get("max_bits", 4096)),
                max_exponent=int(self.config.get("max_exponent", 10_000)),
            )
        except CalculatorError as exc:
            return ToolResponse(text=f"Error: {exc}"), 0.0, {"calculator/errors": 1}
        except (ValueError, ZeroDivisionError, OverflowError) as exc:
            return ToolResponse(text=f"Error: {exc}"), 0.0, {"calculator/errors": 1}
        return ToolResponse(text=format_number(value)), 0.0, {"calculator/errors": 0}
