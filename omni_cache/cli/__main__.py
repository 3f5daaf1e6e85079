"""``python -m omni_cache.cli`` runs the ``omni-cache`` command."""

import sys

from omni_cache.cli import main

sys.exit(main())
