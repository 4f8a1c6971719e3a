"""``python -m nopad ...``: the same as the ``nopad`` command."""

import sys

from nopad._apps.cli import main

sys.exit(main())
