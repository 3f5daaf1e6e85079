"""``omni-cache selfcheck`` and the command's dispatcher."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omni_cache.cli import SUBCOMMANDS, build_parser, main


@pytest.mark.parametrize("argv", [["selfcheck"], ["selfcheck", "--async"]])
def test_selfcheck_round_trip(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "selfcheck PASSED" in out and "MISMATCH" not in out
    assert out.count(" OK") == 4 and "hits 1 (32 tokens), misses 1" in out


def test_every_subcommand_is_registered() -> None:
    help_text = build_parser().format_help()
    assert SUBCOMMANDS[0] == "selfcheck"
    for name in SUBCOMMANDS:
        assert name in help_text, name
    with pytest.raises(SystemExit):
        main(["no-such-command"])


def test_console_script_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "omni_cache.cli", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "selfcheck" in done.stdout
