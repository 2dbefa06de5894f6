"""The commands of README.md and docs/: listed, checked, and the short ones run on a fresh clone.

    python scripts/doc_commands.py list     # every command: page, line and kind
    python scripts/doc_commands.py check    # every program exists (seconds)
    python scripts/doc_commands.py run      # the short ones, as written, in a clone of HEAD

How a page marks its commands (docs/conventions.md): a command is a line of a ```bash block (a
line ending in ``\\`` goes on onto the next; a trailing ``#`` comment is dropped). An HTML
comment ``<!-- commands: KIND -->`` among the comment lines just above the block's fence gives
the kind of all its commands: ``long`` (minutes or more, or leaves a service running, such
as Flower's local SuperLink), ``hub`` (needs the Hugging Face Hub), ``machines`` (needs other
machines or a running deployment), ``setup`` (makes an environment, installs from PyPI),
``placeholder`` (holds values the reader fills in: ``<date>``). A block without one is
short: ``run`` runs it as written, in page order in one fresh clone (a block may use what an
earlier block of its page made), offline, with this environment's ``python`` and ``car-fl``,
and fails when any command fails. ``check`` says which program (a script, a ``python -m``
module, a ``car-fl`` subcommand, an executable) is gone, for commands of every kind, and which
unmarked command reads ``../shared`` or starts a sweep (minutes: it must be marked ``long``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The kinds a block may be marked with; "short" is a block without a mark.
KINDS = ("short", "long", "hub", "machines", "setup", "placeholder")
#: What the reader fills in: ``<date>``, ``<this repository>``.
PLACEHOLDER = re.compile(r"<[\w ]+>")
MARK = re.compile(r"<!--\s*commands:\s*(\w+)\s*-->")
COMMENT = re.compile(r"<!--.*-->")
FENCE = re.compile(r"^```(bash|sh|shell)\s*$")
#: Seconds one short command may take.
TIMEOUT = 600
#: What no short command does: read the real data beside the clone, or start a sweep (minutes).
NOT_SHORT = re.compile(r"\.\./shared/|car_fl\.sweep\b")


@dataclass(frozen=True)
class Command:
    page: str  # relative to the repository root
    line: int  # of the command's first line
    kind: str
    text: str

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def commands_of(page: Path, root: Path = ROOT) -> list[Command]:
    """The commands of one page; ``ValueError`` for an unknown mark or an unclosed block."""
    name = str(page.relative_to(root))
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Command] = []
    i = 0
    while i < len(lines):
        if not FENCE.match(lines[i].strip()):
            i += 1
            continue
        kind = "short"
        above = i - 1
        while above >= 0 and COMMENT.fullmatch(lines[above].strip()):  # the comments just above
            mark = MARK.fullmatch(lines[above].strip())
            kind = mark.group(1) if mark else kind
            above -= 1
        if kind not in KINDS:
            raise ValueError(f"{name}:{i}: unknown mark {kind!r}; the kinds: {', '.join(KINDS)}")
        i += 1
        pending: list[str] = []
        start = i
        while i < len(lines) and not lines[i].strip().startswith("```"):
            text = lines[i].rstrip()
            if not pending:
                start = i
            if text.endswith("\\"):
                pending.append(text[:-1].rstrip())
            else:
                pending.append(text)
                command = strip_comment(" ".join(part.strip() for part in pending))
                if command:
                    found.append(Command(name, start + 1, kind, command))
                pending = []
            i += 1
        if i == len(lines):
            raise ValueError(f"{name}:{start}: a ```bash block is not closed")
        i += 1
    return found


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# ...`` comment (outside quotes)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        kept = list(lexer)
    except ValueError:  # unbalanced quotes: leave the line to the shell
        return line.strip()
    if not kept:
        return ""
    # cut the raw text where the comment starts (keeps the quoting as written)
    for match in re.finditer(r"\s#", line):
        head = line[: match.start()]
        try:
            if shlex.split(head) == kept:
                return head.strip()
        except ValueError:
            continue
    return line.strip()


def all_commands(root: Path = ROOT) -> list[Command]:
    return [command for page in pages(root) for command in commands_of(page, root)]


def programs(text: str) -> list[list[str]]:
    """The simple commands of a line (split at ``&&``, ``||``, ``;``, ``|`` outside quotes), as
    words, without leading ``VAR=value`` assignments."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: the shell will say so
        return []
    found: list[list[str]] = [[]]
    for token in tokens:
        if token and set(token) <= set("&|;()<>"):
            found.append([])
        else:
            found[-1].append(token)
    simple = []
    for words in found:
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]
        if words:
            simple.append(words)
    return simple


def problem(words: list[str], root: Path) -> str | None:
    """Why this simple command cannot run here as written, or ``None``."""
    from car_fl.cli import COMMANDS

    program = words[0]
    if program in (".", "source", "cd", "export", "git", "echo"):
        return None
    if program == "sudo":  # what it runs must exist (sudo itself is the reader's)
        rest = words[1:]
        while rest and rest[0].startswith("-"):
            rest = rest[2:] if rest[0] in ("-u", "-g") else rest[1:]
        return problem(rest, root) if rest else "sudo without a command"
    if program == "car-fl":
        names = {command.NAME for command in COMMANDS}
        given = next((w for w in words[1:] if not w.startswith("-")), None)
        return None if given in names else f"car-fl has no subcommand {given!r}"
    if program in ("python", "python3") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            module = words[2]
            local = root / (module.replace(".", "/") + ".py")
            found = local.is_file() or (root / module.replace(".", "/")).is_dir()
            return None if found or importlib.util.find_spec(module) else f"no module {module}"
        if words[1].endswith(".py"):
            script = root / words[1]
            return None if script.is_file() else f"no script {words[1]}"
        return None
    # this environment's own programs count whether or not it is activated
    here = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return None if shutil.which(program, path=here) else f"no program {program!r} on PATH"


def check(commands: list[Command], root: Path = ROOT) -> list[str]:
    """One line for each command whose program does not exist or that is short but cannot be."""
    failures = []
    for command in commands:
        if command.kind == "short" and NOT_SHORT.search(command.text):
            failures.append(
                f"{command.where()}: reads ../shared or starts a sweep (minutes), so it is not "
                f"short: mark its block <!-- commands: long -->: {command.text}"
            )
        for words in programs(PLACEHOLDER.sub("X", command.text)):
            reason = problem(words, root)
            if reason:
                failures.append(f"{command.where()}: {reason}: {command.text}")
    return failures


def fresh_clone(root: Path, into: Path) -> Path:
    """A clone of ``root``'s HEAD in ``into``/car-fl, with ``../shared`` beside it as CI has."""
    clone = into / "car-fl"
    subprocess.run(["git", "clone", "--quiet", str(root), str(clone)], check=True)
    shared = root.parent / "shared"
    if shared.is_dir():
        (into / "shared").symlink_to(shared.resolve())
    return clone


def run_short(commands: list[Command], clone: Path, *, timeout: float = TIMEOUT) -> list[str]:
    """Run each short command in ``clone`` (offline); one line per failure."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    failures = []
    for command in commands:
        if command.kind != "short":
            continue
        tick = time.monotonic()
        print(f"== {command.where()}: {command.text}", flush=True)
        try:
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", command.text],
                cwd=clone,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            failures.append(f"{command.where()}: not done after {timeout:g} s: {command.text}")
            continue
        seconds = time.monotonic() - tick
        if done.returncode != 0:
            last = (done.stderr.strip() or done.stdout.strip() or "(no output)").splitlines()[-1]
            failures.append(f"{command.where()}: exit {done.returncode}: {last}")
            print(f"   FAILED after {seconds:.1f} s: {last}", flush=True)
        else:
            print(f"   ok, {seconds:.1f} s", flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("list", "check", "run"))
    parser.add_argument("--page", action="append", help="only these pages (e.g. README.md)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per command")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="car-fl-docs-") as folder:
        root = fresh_clone(ROOT, Path(folder)) if args.action == "run" else ROOT
        try:
            commands = all_commands(root)
        except ValueError as err:
            print(f"doc_commands.py: {err}", file=sys.stderr)
            return 1
        if args.page:
            commands = [c for c in commands if c.page in args.page]
        if args.action == "list":
            for command in commands:
                print(f"{command.where():28} {command.kind:8} {command.text}")
            return 0
        failures = check(commands, root)
        if args.action == "run" and not failures:
            failures = run_short(commands, root, timeout=args.timeout)
    for failure in failures:
        print(f"doc_commands.py: {failure}", file=sys.stderr)
    short = sum(c.kind == "short" for c in commands)
    print(f"{len(commands)} commands ({short} short): {len(failures)} failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
