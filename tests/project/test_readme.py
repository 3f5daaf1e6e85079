"""The README stays true: its worked example runs and prints what it checked, .ci/run runs its
test command, and every command it prints exists and parses.

The command check reads whatever the README prints when it runs (nothing is listed here):
every line of its shell blocks (indented or fenced, not ``python``) and every inline code span
that starts with ``omni-cache`` or ``.venv/bin/omni-cache``. ``a|b`` means "either" (each
alternative is parsed), ``[...]`` an optional part, ``<Name>`` a placeholder.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import shlex

import pytest

from omni_cache.cli import parse_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _command_after(heading: str) -> str:
    match = re.search(rf"\*\*{re.escape(heading)}\*\*.*?\n\n    (.+?)\n", README, re.S)
    assert match, f"README has no indented command after **{heading}**"
    return match.group(1).strip()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    command = _command_after("Run the tests")
    lines = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    assert command in lines
    assert "torch==2.13.0" in command and "pytest" in command


def test_main_job_command_pins_torch_and_runs_simulate() -> None:
    command = _command_after("Run the main job")
    assert "torch==2.13.0" in command and command.endswith(".venv/bin/omni-cache simulate")


EXAMPLE_OUTPUT = [
    "step 1: A served 48 rows: 0 from the cache + 48 computed this step; matched: True",
    "step 2: B served 40 rows: 32 from the cache + 8 computed this step; matched: True",
]


def test_worked_example_runs_and_prints_a_line_per_step() -> None:
    match = re.search(r"## The per-step protocol in (\d+) lines\n\n```python\n(.*?)```", README, re.S)
    assert match
    stated, code = int(match.group(1)), match.group(2)
    assert len(code.splitlines()) == stated, "the heading's line count is stale"
    assert 20 <= stated <= 32
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    assert printed.getvalue().splitlines() == EXAMPLE_OUTPUT
    for line in EXAMPLE_OUTPUT:  # the README shows the same output under the example
        assert line in README


# ---------------------------------------------------------------------------------------------
# Every command the README prints
# ---------------------------------------------------------------------------------------------

_SHELL_LINE = re.compile(r"^(?:    |\t)(?!\s)(.+)$")
_TOOLS = ("omni-cache", "python", "python3", "pytest", "pip")


def _shell_lines() -> list[str]:
    """Lines of indented blocks and of fenced blocks that are not Python."""
    lines: list[str] = []
    fence: str | None = None
    prev_blank = True
    for raw in README.splitlines():
        stripped = raw.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "sh")
            continue
        if fence is not None:
            if fence in ("sh", "bash", "console", "shell") and stripped:
                lines.append(stripped)
            continue
        match = _SHELL_LINE.match(raw)
        if match and prev_blank and not raw.lstrip().startswith(("-", "|", "*")):
            lines.append(match.group(1).strip())
            continue  # an indented block continues while lines stay indented
        prev_blank = not stripped or (bool(match) and prev_blank)
    return lines


def _inline_commands() -> list[str]:
    """Inline spans that run omni-cache with arguments (a bare ``omni-cache`` in prose is a name)."""
    return [m.group(1) for m in re.finditer(r"`((?:\.venv/bin/)?omni-cache [^`]+)`", README)]


def _parts(line: str) -> list[str]:
    line = re.sub(r"\s#\s.*$", "", line)  # a trailing comment
    return [p.strip() for p in line.split("&&") if p.strip()]


def _words(part: str) -> list[str]:
    words = shlex.split(part.replace("[", " ").replace("]", " ").replace("<Name>", "Name"))
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
        words = words[1:]
    return words


def _variants(argv: list[str]) -> list[list[str]]:
    """``a|b`` alternatives: variant i takes alternative i of every such word."""
    options = [w.split("|") if "|" in w and not w.startswith("|") else [w] for w in argv]
    width = max((len(o) for o in options), default=1)
    return [[o[i % len(o)] for o in options] for i in range(width)]


def _omni_cache_argv(words: list[str]) -> list[str] | None:
    if words and words[0].endswith("omni-cache"):
        return words[1:]
    if len(words) >= 3 and words[0].endswith(("python", "python3")) and words[1:3] == ["-m", "omni_cache.cli"]:
        return words[3:]
    return None


def _parse_problem(argv: list[str]) -> str | None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):  # --help exits 0
            return err.getvalue().strip().splitlines()[-1]
    return None


def test_every_omni_cache_command_the_readme_prints_exists_and_its_flags_parse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)  # paths in the README are relative to the repository root
    commands = [p for line in _shell_lines() for p in _parts(line)] + _inline_commands()
    checked, problems = 0, []
    for part in commands:
        argv = _omni_cache_argv(_words(part))
        if argv is None:
            continue
        for variant in _variants(argv):
            checked += 1
            problem = _parse_problem(variant)
            if problem:
                problems.append(f"{part!r} as omni-cache {' '.join(variant)}: {problem}")
    assert checked >= 10, f"found only {checked} omni-cache commands in the README: is the extraction broken?"
    assert not problems, "README commands that do not parse:\n" + "\n".join(problems)


def test_readme_shell_commands_run_as_printed_after_the_set_up() -> None:
    """Tools come from the set-up's .venv (nothing else is on PATH), and files they name exist."""
    problems = []
    for line in _shell_lines():
        for part in _parts(line):
            words = _words(part)
            if not words:
                continue
            tool = words[0]
            if tool in _TOOLS and words[:3] != ["python3", "-m", "venv"]:
                problems.append(f"{part!r}: {tool} is not on PATH after the set-up; write .venv/bin/{tool}")
            for word in words[1:]:
                if re.match(r"^(tests|tools|tla|docs|spec|\.ci)/[\w./-]+$", word) and "Big" not in word:
                    target = ROOT / word
                    if not (target.exists() or (word.endswith((".png", ".svg")) and target.parent.is_dir())):
                        problems.append(f"{part!r}: {word} does not exist")
            if tool == "bash" and len(words) > 1 and not (ROOT / words[1]).exists():
                problems.append(f"{part!r}: {words[1]} does not exist")
    assert not problems, "\n".join(problems)


def test_the_command_extraction_sees_blocks_and_spans() -> None:
    """The checks above cannot pass vacuously: the README's known commands are found."""
    lines = _shell_lines()
    assert any(line.startswith("python3 -m venv .venv") for line in lines)
    assert any("omni-cache bench" in line for line in lines)
    assert any("omni-cache diagram" in line for line in lines)
    assert any(c.endswith("omni-cache selfcheck") for c in _inline_commands())
    assert _parse_problem(["simulate", "--no-such-flag"]) is not None
    assert _variants(["--eager|--async", "x"]) == [["--eager", "x"], ["--async", "x"]]


_MAKING = re.compile(r"\b(this|the previous|the last|the next|an earlier|other) sessions?\b|\bsessions'", re.I)


def test_the_docs_describe_the_product_not_its_making() -> None:
    """The README and docs/ speak of the product (its runs, commits, measurements), never of the
    sessions that made it ("this session", "the previous session's runs")."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for n, line in enumerate(path.read_text().splitlines(), 1) if _MAKING.search(line)]
    assert not found, "\n".join(found)
