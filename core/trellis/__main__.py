"""``python -m trellis`` is the ``trellis`` command."""

import sys

from trellis.cli import main

sys.exit(main())
