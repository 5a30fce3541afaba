"""The README and docs/ against the tree: every relative link leads to a file (and an anchor
to a heading of it), every `unicron ...` command shown in a shell block parses with the real
CLI's parser, and every `make ...` names a target of the Makefile."""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from unicron import cli, faults

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"sh", "bash", "console", "shell"}

FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) or ![alt](target); the text may wrap onto the next line.
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
UNICRON_SPAN = re.compile(r"^(?:\S*/)?unicron\s+([a-z][a-z-]*)")
MAKE_SPAN = re.compile(r"^make\s+(\S+)")
MAKE_RULE = re.compile(r"^([A-Za-z0-9_.-]+(?:[ \t]+[A-Za-z0-9_.-]+)*)[ \t]*:(?!=)")
# Commands named in a sentence that do not exist, reported but in a page this test's author
# may not edit: (page, the inline code). Remove an entry once its page is fixed.
KNOWN_WRONG: set[tuple[str, str]] = set()  # (page, command) to skip while a page is being fixed


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the block's first line of code, 1-based
    lang: str
    text: str


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def split(page: Path) -> tuple[str, list[Block]]:
    """The page's prose (fenced code blanked out, line numbers kept) and its fenced blocks."""
    prose: list[str] = []
    blocks: list[Block] = []
    fence = ""
    lang = ""
    body: list[str] = []
    start = 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if not fence and match:
            fence, lang, body, start = match.group(1), match.group(2).lower(), [], number + 1
            prose.append("")
        elif fence and line.strip().startswith(fence):
            blocks.append(Block(page, start, lang, "\n".join(body)))
            fence = ""
            prose.append("")
        elif fence:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert not fence, f"{rel(page)}: a code block opened at line {start - 1} is never closed"
    return "\n".join(prose), blocks


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts as its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    prose, _ = split(page)
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(out)


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every link in the page's prose, outside inline code."""
    prose, _ = split(page)
    # Blank inline code but keep its newlines, so that line numbers stay right.
    prose = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)
    return [(prose.count("\n", 0, m.start()) + 1, m.group(2)) for m in LINK.finditer(prose)]


def link_problem(page: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
        return None  # http:, https:, mailto: ...: not this test's business
    path_part, _, anchor = target.partition("#")
    dest = (page.parent / path_part).resolve() if path_part else page
    if not dest.exists():
        return f"{path_part} does not exist"
    if not dest.is_relative_to(ROOT):
        return f"{path_part} is outside the repository"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{rel(dest)} has no heading whose anchor is #{anchor}"
    return None


def test_the_pages_are_there() -> None:
    names = {rel(p) for p in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/trainer-library.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_lead_somewhere(page: Path) -> None:
    problems = [
        f"{rel(page)}:{line}: ({target}) {problem}"
        for line, target in links(page)
        if (problem := link_problem(page, target)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_the_slug_is_githubs() -> None:
    assert github_slug("Converting a Megatron-Core script") == "converting-a-megatron-core-script"
    assert github_slug("The Megatron-Core level: `pretrain`") == "the-megatron-core-level-pretrain"
    assert github_slug("Many hosts: the cluster tests") == "many-hosts-the-cluster-tests"
    assert github_slug("Who owns which state") == "who-owns-which-state"


def commands(block: Block) -> list[tuple[int, str]]:
    """(line, command) of each command of a shell block: prompts dropped, continuations joined."""
    out: list[tuple[int, str]] = []
    pending = ""
    first = 0
    for offset, raw in enumerate(block.text.splitlines()):
        line = raw.rstrip()
        if not pending:
            first = block.line + offset
            if block.lang == "console":
                if not line.startswith("$ "):
                    continue  # output, not a command
                line = line[2:]
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((first, pending + line))
        pending = ""
    if pending:
        out.append((first, pending))
    return out


def words(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:
        return []


def shown_commands(program: str) -> list[tuple[str, list[str]]]:
    """Every `program ...` of the pages' shell blocks, as (where, its arguments), leaving out
    those with placeholders (`<...>`, `...`)."""
    found = []
    for page in PAGES:
        for block in split(page)[1]:
            if block.lang not in SHELL_LANGS:
                continue
            for line, command in commands(block):
                for part in re.split(r"&&|\|\||;|\|", command):
                    argv = words(part)
                    while argv and (argv[0] in {"sudo", "env"} or "=" in argv[0]):
                        argv = argv[1:]  # sudo, VAR=value ahead of the program
                    if not argv or not (argv[0] == program or argv[0].endswith("/" + program)):
                        continue
                    if any("<" in w or w == "..." for w in argv[1:]):
                        continue
                    found.append((f"{rel(page)}:{line}", argv[1:]))
    return found


@cache
def parser_choices() -> frozenset[str]:
    parser = cli.build_parser(simulate=True)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return frozenset(action.choices)
    raise AssertionError("unicron's parser has no subcommands")


def parse_problem(args: list[str]) -> str | None:
    """What the real `unicron` parser says of these arguments, or None when it takes them."""
    parser = cli.build_parser(simulate=True)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parsed = parser.parse_args(args)
    except SystemExit as exc:
        return None if exc.code == 0 else err.getvalue().strip().splitlines()[-1]
    if parsed.command == "inject":
        try:
            faults.parse_fault(parsed.fault, parsed.rank)
        except Exception as exc:  # noqa: BLE001 - any refusal is the finding
            return f"fault {parsed.fault!r}: {exc}"
    return None


def test_shell_blocks_show_unicron_commands() -> None:
    assert len(shown_commands("unicron")) >= 10


def test_every_unicron_command_shown_parses() -> None:
    problems = [
        f"{where}: unicron {shlex.join(args)}: {problem}"
        for where, args in shown_commands("unicron")
        if (problem := parse_problem(args)) is not None
    ]
    assert not problems, "\n".join(problems)


@cache
def make_targets() -> frozenset[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = MAKE_RULE.match(line)
        if match:
            targets.update(name for name in match.group(1).split() if not name.startswith("."))
    return frozenset(targets)


def test_the_makefile_has_the_two_commands() -> None:
    assert {"demo", "test", "test-e2e"} <= make_targets()


def test_every_make_target_shown_exists() -> None:
    shown = shown_commands("make")
    assert shown, "no make command in any shell block"
    problems = [
        f"{where}: make {shlex.join(args)}: no target {target!r} in the Makefile"
        for where, args in shown
        for target in args
        if not target.startswith("-") and "=" not in target and target not in make_targets()
    ]
    assert not problems, "\n".join(problems)


def inline_spans(page: Path) -> list[tuple[int, str]]:
    prose, _ = split(page)
    return [
        (prose.count("\n", 0, m.start()) + 1, " ".join(m.group(0).strip("`").split()))
        for m in INLINE_CODE.finditer(prose)
    ]


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_commands_named_in_the_text_exist(page: Path) -> None:
    """`unicron get`, `make bench-sim` in a sentence: the subcommand or target exists."""
    problems = []
    for line, span in inline_spans(page):
        if (rel(page), span) in KNOWN_WRONG:
            continue
        if match := UNICRON_SPAN.match(span):
            if match.group(1) not in parser_choices():
                problems.append(f"{rel(page)}:{line}: `{span}`: unicron has no subcommand {match.group(1)!r}")
        elif (match := MAKE_SPAN.match(span)) and "=" not in match.group(1):
            # `make bench-*` names a family of targets: one of them will do.
            if not fnmatch.filter(make_targets(), match.group(1)):
                problems.append(f"{rel(page)}:{line}: `{span}`: the Makefile has no target {match.group(1)!r}")
    assert not problems, "\n".join(problems)
