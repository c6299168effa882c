"""Recipes: ready-made runs assembled on top of the trainer.

``trellis.recipes.presets`` (``trellis train --preset NAME``), ``trellis.recipes.demo`` (``python -m
trellis.recipes.demo``) and ``trellis.recipes.tiny`` (the offline tiny tokenizer and model the ``tiny``
preset and the tests build). They sit above :mod:`trellis.trainer` and below :mod:`trellis.cli` and
:mod:`trellis.testing`, so the trainer never imports them (import-linter checks it; see pyproject.toml).
"""
