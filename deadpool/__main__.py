"""``python -m deadpool ...`` is the ``deadpool`` command (for installs without scripts on PATH)."""

import sys

# deadpool.tools is installed from the top-level tools/ (package-dir), which mypy cannot map.
from deadpool.tools.cli import main  # type: ignore[import-not-found]

sys.exit(main())
