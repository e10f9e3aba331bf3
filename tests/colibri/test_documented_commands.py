"""Every `colibri SUBCOMMAND ...` line of the docs' code blocks (README.md, docs/*.md) parses with today's flags: a
flag renamed or removed, or a value a choice no longer takes, fails here instead of in a reader's shell."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from colibri import cli

ROOT = Path(__file__).resolve().parents[2]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `colibri`) of each command line in a fenced block; `[--a X]` taken as given, `a|b` as a,
    up to a `;`."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        in_block, pending, start = False, "", 0
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_block, pending = not in_block, ""
                continue
            if not in_block:
                continue
            text = line.strip()
            if not pending:
                text = re.sub(r"^(\$ |\.venv/bin/)", "", text)
                if not re.match(r"colibri [a-z-]+ ", text + " "):  # not `colibri verify: error: ...` output
                    continue
                start = number
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            lexer = shlex.shlex(pending + text, posix=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            argv = []
            for token in lexer:  # up to a `;` (`colibri verify DIR; echo $?`)
                argv.append(token.removesuffix(";").strip("[]").split("|")[0])
                if token.endswith(";"):
                    break
            found.append((f"{doc.relative_to(ROOT)}:{start}", [a for a in argv[1:] if a]))
            pending = ""
    return found


COMMANDS = documented_commands()


def test_the_docs_show_colibri_commands():
    assert len(COMMANDS) >= 20, COMMANDS  # the extraction still finds them


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_colibri_command_parses(where, argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["colibri", *argv])  # build_parser adds the options of sys.argv's subcommand
    try:
        cli.build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: colibri {shlex.join(argv)}: exit {e.code}: {capsys.readouterr().err.strip()}")
