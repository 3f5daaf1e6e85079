"""A delivery directory of its own for the tests of ``DeliveryPaths`` and ``DeliveryStore``.

Owns: the server nonce those tests name files under (``NONCE``), a fresh 0700 directory resolved
to its real path (``new_root``; imported as ``_root``), and what a directory holds besides the
store's own claim on it (``delivered``). Shared by tests/integration/test_delivery_names.py,
test_delivery_files.py and test_delivery_retention.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from omni_cache.integration.delivery_files import CLAIM_NAME

NONCE = "0123456789ab"


def new_root(tmp_path: Path, name: str = "root") -> str:
    root = tmp_path / name
    root.mkdir(mode=0o700)
    return os.path.realpath(root)


def delivered(root: str | Path) -> list[str]:
    """What ``root`` holds besides the store's own claim on it."""
    return [n for n in os.listdir(root) if n != CLAIM_NAME]
