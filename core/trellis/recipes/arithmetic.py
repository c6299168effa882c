"""The demo's task: one-step arithmetic word problems, generated on the fly and seeded.

Problems add, take away or multiply, such as "Mia has 7 marbles and gets 5 more. How many marbles
does Mia have now? Answer with the number only.", and are scored by the built-in ``arithmetic``
reward (1 when the last integer of the response is the answer, else 0). The held-out problems use
operand pairs that no training problem uses, so held-out accuracy is not recall of a sum seen in
training. The ``demo`` preset (:mod:`trellis.recipes.presets`) writes them as its dataset.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

DATA_SOURCE = "arithmetic"
"""The ``data_source`` of every problem: the built-in ``arithmetic`` reward scores it."""

INSTRUCTION = "Answer with the number only."

NAMES = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Zoe", "Noah", "Ava")
ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "cookies", "cards", "shells", "stamps")

TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        "There are {a} {item} in a box. {name} puts {b} more {item} in the box. How many {item} are in "
        "the box now?",
    ),
    "sub": (
        "{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
        "There are {a} {item} on the table. {name} takes {b} of them. How many {item} are left on the table?",
    ),
    "mul": (
        "{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?",
        "{name} buys {a} packs of {item}. Each pack holds {b} {item}. How many {item} does {name} buy?",
    ),
}
"""Question templates per kind of problem; ``{a}`` and ``{b}`` are the operands."""

KINDS = tuple(TEMPLATES)


@dataclass(frozen=True)
class Problem:
    """One word problem: its question (instruction included), its answer, and what it computes."""

    question: str
    answer: int
    kind: str
    a: int
    b: int

    @property
    def key(self) -> tuple[str, int, int]:
        """``(kind, a, b)``: problems with the same key are the same sum, however they are worded."""
        return (self.kind, self.a, self.b)

    def row(self) -> dict[str, Any]:
        """The problem as a dataset row: chat prompt, ``data_source``, ``reward_model.ground_truth``."""
        return {
            "prompt": [{"role": "user", "content": self.question}],
            "data_source": DATA_SOURCE,
            "reward_model": {"ground_truth": str(self.answer)},
        }


def all_keys() -> list[tuple[str, int, int]]:
    """Every ``(kind, a, b)`` the generator uses: ``a + b`` (1..20 each), ``a - b`` (0 < b < a <= 30),
    ``a * b`` (2..9 each)."""
    add = [("add", a, b) for a in range(1, 21) for b in range(1, 21)]
    sub = [("sub", a, b) for a in range(2, 31) for b in range(1, a)]
    mul = [("mul", a, b) for a in range(2, 10) for b in range(2, 10)]
    return add + sub + mul


def _answer(kind: str, a: int, b: int) -> int:
    return {"add": a + b, "sub": a - b, "mul": a * b}[kind]


def make_problem(kind: str, a: int, b: int, rng: random.Random) -> Problem:
    """The problem ``a <op> b`` of ``kind`` (``add``, ``sub`` or ``mul``), worded with ``rng``'s choices.

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in TEMPLATES:
        raise ValueError(f"Unknown kind of problem {kind!r}; kinds: {', '.join(KINDS)}.")
    template = rng.choice(TEMPLATES[kind])
    text = template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    return Problem(f"{text} {INSTRUCTION}", _answer(kind, a, b), kind, a, b)


def make_problems(
    n_train: int = 1024, n_heldout: int = 200, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """Training and held-out problems, the same for the same arguments.

    Held-out problems are distinct sums, drawn uniformly from :func:`all_keys`; no training problem
    computes any of them, so held-out accuracy is not recall of a sum seen in training. Training
    problems are drawn uniformly from the other sums (a sum may repeat, worded differently).

    Raises:
        ValueError: ``n_heldout`` is over half of all sums (too few would be left to train on).
    """
    keys = all_keys()
    if not 0 <= n_heldout <= len(keys) // 2:
        raise ValueError(f"n_heldout must be between 0 and {len(keys) // 2}, got {n_heldout}.")
    rng = random.Random(seed)
    held = rng.sample(keys, n_heldout)
    heldout = [make_problem(kind, a, b, rng) for kind, a, b in held]
    taken = set(held)
    remaining = [key for key in keys if key not in taken]
    train = [make_problem(*rng.choice(remaining), rng) for _ in range(n_train)]
    return train, heldout
