"""``python -m cuinterpose``: the same entry point as the console script."""

import sys

from cuinterpose.cli import main

sys.exit(main())
