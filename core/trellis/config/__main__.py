"""``python -m trellis.config``: rewrite ``defaults/trellis.yaml`` from the config dataclasses."""

from trellis.config.render import main

main()
