"""The docs cannot drift: every `deadpool` command they show parses with the current command line, and the figures
are what the results files give.

The commands come from the fenced ```bash blocks of README.md and every page of the documentation site
(docs/), the getting-started page first among them.  A line (joined across backslash continuations) is
split on the shell's separators (``&&``, ``||``, ``;``, ``|``, ``&``); each part that runs DeadPool
(``deadpool ...``, ``python3 -m deadpool ...``, ``python -m deadpool ...``, after any ``VAR=value``
assignments) is parsed by the very parser ``deadpool.tools.cli.main`` builds, in this process: the
parse is intercepted once the parser has accepted the arguments, so nothing runs, and no process or
socket is started.  Shell plumbing around it (``pip install ...``, ``export``, ``$(...)``) is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from deadpool.tools import cli  # type: ignore[import-not-found]  (tools/ is installed as deadpool.tools)

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
PAGES = REQUIRED + sorted(p for p in (ROOT / "docs").rglob("*.md") if p not in REQUIRED)
FENCE = re.compile(r"^(\s*)```bash\s*$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SUBSTITUTION = re.compile(r"\$\([^)]*\)")  # $(hostname -s): one word, whatever it prints
SEPARATORS = {"&&", "||", ";", "|", "&", ";;", "|&"}
ENTRY_POINTS = (("deadpool",), ("python3", "-m", "deadpool"), ("python", "-m", "deadpool"))


@dataclass(frozen=True)
class Command:
    """One DeadPool command of a page: where it is, the text shown, and the arguments after the program."""

    where: str  # file:line
    text: str
    argv: tuple[str, ...]


def bash_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, logical line) of every fenced bash block, continuations joined."""
    inside, pending, start = False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not inside:
            inside = bool(FENCE.match(line))
            continue
        if line.strip().startswith("```"):
            inside = False
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def deadpool_parts(line: str) -> Iterator[tuple[str, ...]]:
    """The arguments of each DeadPool invocation on one shell line (the program itself left out)."""
    lexer = shlex.shlex(SUBSTITUTION.sub("SUBSTITUTED", line), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    part: list[str] = []
    for token in [*lexer, ";"]:
        if token not in SEPARATORS:
            part.append(token)
            continue
        while part and ASSIGNMENT.match(part[0]):
            part.pop(0)
        for entry in ENTRY_POINTS:
            if tuple(part[: len(entry)]) == entry:
                yield tuple(part[len(entry):])
                break
        part = []


def commands(path: Path) -> list[Command]:
    text = path.read_text()
    found = []
    for number, line in bash_lines(text):
        for argv in deadpool_parts(line):
            found.append(Command(f"{path.relative_to(ROOT)}:{number}", line.strip(), argv))
    return found


class _Parsed(Exception):
    """Raised in place of running the command once its arguments parsed."""


def parse(argv: tuple[str, ...]) -> str | None:
    """None if `argv` parses with the current CLI; otherwise argparse's complaint (names the bad flag)."""
    original = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        parsed = original(self, args, namespace)
        if self.prog == "deadpool" and getattr(parsed, "command", None) == "coordinator":
            return parsed  # cli.main hands the rest to the coordinator's own parser: parse that one too
        raise _Parsed

    stderr, stdout = io.StringIO(), io.StringIO()
    try:
        with (pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr),
              contextlib.redirect_stdout(stdout)):
            patch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
            cli.main(list(argv))
    except _Parsed:
        return None
    except SystemExit as exit:
        if exit.code in (0, None) and ("-h" in argv or "--help" in argv):
            return None  # `deadpool ... --help`
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        return lines[-1] if lines else f"exit status {exit.code}"
    return "the command ran past its argument parsing (it was not intercepted)"


def all_commands() -> list[Command]:
    return [command for page in PAGES for command in commands(page)]


def test_required_pages_show_commands() -> None:
    for page in REQUIRED:
        assert commands(page), f"{page.relative_to(ROOT)} shows no deadpool command in a ```bash block"


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: c.where)
def test_command_parses(command: Command) -> None:
    complaint = parse(command.argv)
    assert complaint is None, (
        f"{command.where}: `{command.text}` does not parse with the current deadpool CLI: {complaint}")


def test_a_flag_the_cli_does_not_have_is_named() -> None:
    page = "```bash\nFOO=1 python3 -m pip install -e . && python3 -m deadpool launch --nproc 4 --no-such-flag 3 " \
           "demos/train_gpt.py --steps 40 | tee log\n```\n"
    (argv,) = [argv for _, line in bash_lines(page) for argv in deadpool_parts(line)]
    assert argv[:2] == ("launch", "--nproc")
    complaint = parse(argv)
    assert complaint is not None and "--no-such-flag" in complaint


def test_plumbing_is_skipped_and_continuations_joined() -> None:
    page = ("```bash\nexport DEADPOOL_SECRET=abc   # a comment\npip install -e . ; deadpool status --json &\n"
            "deadpool launch --nnodes 2 --node-rank 1 --host-name $(hostname -s) \\\n"
            "    --coordinator tcp://10.0.0.10:29400 train.py\n```\n")
    found = [argv for _, line in bash_lines(page) for argv in deadpool_parts(line)]
    assert found == [("status", "--json"),
                     ("launch", "--nnodes", "2", "--node-rank", "1", "--host-name", "SUBSTITUTED", "--coordinator",
                      "tcp://10.0.0.10:29400", "train.py")]
    assert all(parse(argv) is None for argv in found)


def test_figures_match_the_results_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/performance.md and the README's figure table are what `python bench/figures.py` makes of docs/results."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import figures  # type: ignore[import-not-found]

    runs = figures.load()
    assert runs, "docs/results/ holds no results file"
    readme = (ROOT / "README.md").read_text()
    assert (ROOT / "docs" / "performance.md").read_text() == figures.performance_page(runs), \
        "docs/performance.md is stale: run python bench/figures.py"
    assert readme == figures.readme_text(readme, runs), "README.md's figure table is stale: run python bench/figures.py"
