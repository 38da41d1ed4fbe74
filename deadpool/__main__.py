"""``python -m deadpool ...`` is the ``deadpool`` command (for installs without scripts on PATH)."""

import sys

from deadpool.cli import main

sys.exit(main())
