"""The tiny offline tokenizer and model for plugins' tests: :mod:`trellis.recipes.tiny`, re-exported.

It lives in ``trellis.recipes`` because the ``tiny`` preset builds it too, and the conformance kit
(``trellis.testing``) sits above the recipes; plugins' tests keep importing it from here.
"""

from trellis.recipes.tiny import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    save_tiny_model,
)

__all__ = ["CHATML_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_model", "build_tiny_tokenizer", "save_tiny_model"]
