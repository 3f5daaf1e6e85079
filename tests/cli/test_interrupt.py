"""Ctrl-C ends any ``omni-cache`` command at once: one line on stderr, exit 130, no traceback,
and no TLC (java) process left running behind ``omni-cache verify``; SIGTERM (``kill``,
``timeout``, a cancelled job) the same way, exit 143. A reader of stdout that leaves (``| head``)
ends a command quietly with a shell's SIGPIPE status, 141, also where the output is a rich table.

The verify test interrupts a real ``omni-cache verify`` subprocess while its TLC JVMs run (it
waits for a java child, a bounded wait on a condition, then sends SIGINT to the Python process
alone, as ``kill -INT`` does; a terminal's Ctrl-C reaches the JVMs too, which only helps). "At
once" is 2 s on an idle machine; on a loaded one the bound scales with what the same
interpreter takes, measured in the same test, to start, import the CLI and exit (never a fixed
wall-clock figure that a busy CI box can miss: verify's TLC runs take far longer than either).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from omni_cache.verify.testing import require_tlc

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


# The child's first line puts SIGINT at Python's own handler, as under a terminal: a shell's
# background job (``cmd &``, ``nohup``) inherits SIGINT ignored, and Python then installs none.
# (Set in the child itself: a pre-exec hook is unsafe in a parent that runs threads.)
_SIGINT_AS_IN_A_TERMINAL = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
_MAIN = _SIGINT_AS_IN_A_TERMINAL + "import sys\nfrom omni_cache.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def _children(pid: int) -> set[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def _java_children(pid: int) -> set[int]:
    out = set()
    for child in _children(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and os.path.basename(cmd[0]) == b"java":
            out.add(child)
    return out


def _start_and_exit_s() -> float:
    """Seconds this machine takes right now to start the CLI's interpreter, import verify and exit."""
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", _SIGINT_AS_IN_A_TERMINAL + "import omni_cache.cli, omni_cache.verify.tlc"],
                   cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=120)
    return time.monotonic() - began


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


SIGNALS = [pytest.param(signal.SIGINT, 130, "interrupted", id="ctrl-c"),
           pytest.param(signal.SIGTERM, 143, "terminated", id="sigterm")]


@pytest.mark.tlc
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from Linux /proc")
@pytest.mark.parametrize(("sig", "code", "word"), SIGNALS)
def test_ctrl_c_or_sigterm_ends_verify_at_once_with_one_line_and_its_tlc_processes_gone(
    sig: signal.Signals, code: int, word: str,
) -> None:
    require_tlc()
    baseline = _start_and_exit_s()
    proc = subprocess.Popen([sys.executable, "-c", _MAIN, "verify", "--jobs", "2"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        java: set[int] = set()
        while not java and proc.poll() is None and time.monotonic() < deadline:
            java = _java_children(proc.pid)
            time.sleep(0.05)
        assert java, "no TLC JVM started within 120 s"
        time.sleep(0.5)  # let the runs get going (the test holds either way)
        java |= _java_children(proc.pid)
        start = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, (proc.returncode, out[-800:], err[-800:])
    assert err.strip().splitlines() == [f"omni-cache verify: {word}"], err[-2000:]
    # The load now, measured twice around the run (it changes while it runs): the bound is 2 s or
    # five times the slower of the two, whichever is larger.
    load = max(baseline, _start_and_exit_s())
    bound = max(2.0, 5 * load)
    assert elapsed < bound, (f"verify took {elapsed:.1f} s to end after SIGINT; the bound is {bound:.1f} s "
                             f"(starting, importing and exiting the same interpreter took {load:.1f} s)")
    deadline = time.monotonic() + 5  # reaping a killed JVM is not instant
    while any(_alive(p) for p in java) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in java if _alive(p)], "TLC processes outlived omni-cache verify"


# Send the signal (argv[1]) to the process at the moment the command starts importing torch.
_SIGNAL_AT_TORCH = _SIGINT_AS_IN_A_TERMINAL + """
import builtins, os, signal, sys
real_import = builtins.__import__
sig = signal.Signals[sys.argv.pop(1)]
def interrupting_import(name, *args, **kwargs):
    if name == "torch" or name.startswith("torch."):
        builtins.__import__ = real_import
        os.kill(os.getpid(), sig)
    return real_import(name, *args, **kwargs)
builtins.__import__ = interrupting_import
from omni_cache.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("sig", "code", "word"), SIGNALS)
@pytest.mark.parametrize("argv", [["simulate", "--requests", "2"], ["bench", "--quick"]])
def test_ctrl_c_or_sigterm_while_torch_loads_is_one_line_not_a_traceback(
    argv: list[str], sig: signal.Signals, code: int, word: str,
) -> None:
    done = subprocess.run([sys.executable, "-c", _SIGNAL_AT_TORCH, sig.name, *argv], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == code, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip().splitlines() == [f"omni-cache {argv[0]}: {word}"], done.stderr[-2000:]


@pytest.mark.parametrize("async_mode", [False, True], ids=["eager", "async"])
def test_an_interrupted_simulation_stops_its_threads_and_logs_nothing(async_mode: bool,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Ctrl-C in the middle of ``simulate``, right after a save returned (raised there, deterministic
    where a signal's timing is not): the interrupt goes on up to the CLI's one line, the builder
    thread and the cache are shut down, and the step id the interrupt left unconsumed is not logged
    (it is what an interrupt leaves, not news)."""
    import threading

    from omni_cache.harness.sim_engine.config import SimConfig
    from omni_cache.harness.sim_engine.engine import Simulation
    from omni_cache.runtime.manager import OmniPrefixCacheManager

    class InterruptedAfterFiveSaves(OmniPrefixCacheManager):
        saves = 0

        def save_outputs(self, *args: Any, **kwargs: Any) -> int:
            step_id = super().save_outputs(*args, **kwargs)
            self.saves += 1
            if self.saves == 5:
                raise KeyboardInterrupt  # the step is saved and never handed to the builder
            return step_id

    sim = Simulation(SimConfig(requests=48, eager=not async_mode),
                     manager_factory=lambda config, eager: InterruptedAfterFiveSaves(config, eager=eager))
    caplog.set_level("DEBUG")
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    assert len(sim.manager.staging.unconsumed()) == 1  # what the interrupt left
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not any(t.name == "omni-sim-builder" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(Exception, match="shut down"):
        sim.manager.check_usable("save_outputs")


# stdout is a pipe whose reader has already left (``omni-cache ... | head`` once head exits).
_READER_GONE = """
import os, sys
r, w = os.pipe()
os.close(r)
os.dup2(w, 1)
from omni_cache.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["diagram"], ["diagram", "--machine", "write"], ["simulate", "--requests", "2"]])
def test_a_reader_that_leaves_is_no_error(argv: list[str]) -> None:
    """``| head``: the command stops with a shell's SIGPIPE status (141) and says nothing on stderr
    (before: ``error: BrokenPipeError``, exit 1, the code of a failed check; and rich's own handling
    of a table's broken pipe, ``simulate``'s, exit 1 too)."""
    done = subprocess.run([sys.executable, "-c", _READER_GONE, *argv], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (141, ""), (done.returncode, done.stderr[-2000:])


# A command whose own work raises BrokenPipeError (a dead worker's pipe), stdout a regular file.
_OTHER_PIPE = """
import sys
from omni_cache.cli import diagram, main
def broken(args):
    raise BrokenPipeError(32, "a worker's pipe")
diagram.run = broken
sys.exit(main(["diagram", *sys.argv[1:]]))
"""


def test_a_broken_pipe_that_is_not_stdout_is_a_failure(tmp_path: Path) -> None:
    """Only stdout's own reader leaving is quiet: any other broken pipe is an error line and exit 1,
    and ``--debug`` shows its traceback."""
    with open(tmp_path / "out.txt", "w") as out:
        done = subprocess.run([sys.executable, "-c", _OTHER_PIPE], cwd=ROOT, env=ENV, stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=120)
        debug = subprocess.run([sys.executable, "-c", _OTHER_PIPE, "--debug"], cwd=ROOT, env=ENV, stdout=out,
                               stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "omni-cache diagram: error: BrokenPipeError: [Errno 32] a worker's pipe (--debug shows the traceback)"]
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "a worker's pipe" in debug.stderr, debug.stderr


def test_a_closed_stdout_is_no_crash() -> None:
    """``omni-cache diagram >&-``: Python has no stdout; the command still ends without a traceback."""
    done = subprocess.run(["bash", "-c", f'exec "{sys.executable}" -c "$0" diagram >&-', _MAIN], cwd=ROOT, env=ENV,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-2000:])


def test_main_run_in_process_leaves_the_sigterm_handler_as_it_found_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The command line turns SIGTERM into an interrupt only while it runs: a caller that runs
    ``main`` in its own process (a test, an embedding tool) gets its own handler back."""
    from omni_cache.cli import main

    before = signal.getsignal(signal.SIGTERM)
    assert main(["diagram"]) == 0
    capsys.readouterr()
    assert signal.getsignal(signal.SIGTERM) is before
