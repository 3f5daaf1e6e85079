"""``python -m omni_cache.cli`` runs the ``omni-cache`` command.

The guard matters: vLLM's worker processes are spawned, and a spawned child
re-imports the parent's main module; unguarded, each worker would run the
command again.

Upholds nothing.
"""

import sys

from omni_cache.cli import main

if __name__ == "__main__":
    sys.exit(main())
