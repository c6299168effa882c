"""The tool-calling tiny model's exchange (see :mod:`trellis.recipes.calculator`), shared by the
agent-loop, gateway and openai_agent tests (the ``calculator_model`` fixture of conftest.py)."""

from trellis.recipes.calculator import ANSWER, CALL, QUESTION, TOOLS, train_calculator_model

__all__ = ["ANSWER", "CALL", "QUESTION", "TOOLS", "train_calculator_model"]
