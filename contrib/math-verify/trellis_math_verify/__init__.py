"""trellis-math-verify: the ``math_verify`` reward function (see :mod:`trellis_math_verify.reward`)."""
