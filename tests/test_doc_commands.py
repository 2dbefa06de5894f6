"""scripts/doc_commands.py: every command of README.md and docs/ is found, marked and exists;
the short ones (README and docs) run as written on a fresh clone."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "doc_commands.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("doc_commands", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["doc_commands"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


docs = load_script()


def test_every_page_parses_and_every_command_exists() -> None:
    commands = docs.all_commands()
    assert {c.page for c in commands} >= {"README.md", "docs/federation.md"}
    assert {c.kind for c in commands} <= set(docs.KINDS)
    assert docs.check(commands) == []
    # the README gives short commands that run as written, and its test command is marked
    readme = [c for c in commands if c.page == "README.md"]
    assert any(c.kind == "short" for c in readme)
    assert any(c.kind == "setup" and "python -m pytest" in c.text for c in readme)


def page(tmp_path: Path, text: str) -> Path:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "scripts").mkdir(exist_ok=True)
    (tmp_path / "scripts" / "here.py").write_text("")
    (tmp_path / "README.md").write_text("# r\n")
    path = tmp_path / "docs" / "p.md"
    path.write_text(text)
    return path


def test_blocks_marks_continuations_and_comments(tmp_path: Path) -> None:
    text = (
        "text\n\n```bash\npython scripts/here.py --a \\\n    --b   # a comment\n\n"
        "car-fl run -c 'x=\"# not a comment\"'\n```\n\n"
        "<!-- other comment -->\n<!-- commands: long -->\n<!-- test-command:begin -->\n"
        "  ```bash\n  python -m car_fl.sweep -m a=1\n  ```\n\n```python\nprint(1)\n```\n"
    )
    found = docs.commands_of(page(tmp_path, text), tmp_path)
    assert [(c.line, c.kind, c.text) for c in found] == [
        (4, "short", "python scripts/here.py --a --b"),
        (7, "short", "car-fl run -c 'x=\"# not a comment\"'"),
        (14, "long", "python -m car_fl.sweep -m a=1"),
    ]


def test_a_gone_program_or_an_unknown_mark_is_named(tmp_path: Path) -> None:
    text = (
        "```bash\npython scripts/gone.py\npython -m car_fl.nope\ncar-fl fly\n"
        "no-such-program-here --x && python scripts/here.py\n"
        "car-fl retrieve --checkpoint runs/<date>/best hi\n"
        "python -m car_fl.sweep -m model=minilm\ncar-fl train dataset.path=../shared/d.tsv\n"
        "sudo -u flwr-node car-fl fly\n```\n"
    )
    found = docs.commands_of(page(tmp_path, text), tmp_path)
    assert docs.check(found, tmp_path) == [
        "docs/p.md:2: no script scripts/gone.py: python scripts/gone.py",
        "docs/p.md:3: no module car_fl.nope: python -m car_fl.nope",
        "docs/p.md:4: car-fl has no subcommand 'fly': car-fl fly",
        "docs/p.md:5: no program 'no-such-program-here' on PATH: "
        "no-such-program-here --x && python scripts/here.py",
        "docs/p.md:7: reads ../shared or starts a sweep (minutes), so it is not short: mark its "
        "block <!-- commands: long -->: python -m car_fl.sweep -m model=minilm",
        "docs/p.md:8: reads ../shared or starts a sweep (minutes), so it is not short: mark its "
        "block <!-- commands: long -->: car-fl train dataset.path=../shared/d.tsv",
        "docs/p.md:9: car-fl has no subcommand 'fly': sudo -u flwr-node car-fl fly",
    ]
    with pytest.raises(ValueError, match=r"docs/p.md:\d+: unknown mark 'slowish'"):
        docs.commands_of(page(tmp_path, "<!-- commands: slowish -->\n```bash\nls\n```\n"), tmp_path)
    with pytest.raises(ValueError, match="not closed"):
        docs.commands_of(page(tmp_path, "```bash\nls\n"), tmp_path)


def test_short_commands_run_and_a_failure_is_one_line(tmp_path: Path) -> None:
    ok = docs.Command("README.md", 1, "short", "echo hi > made.txt && cat made.txt")
    skipped = docs.Command("README.md", 2, "long", "false")
    bad = docs.Command("README.md", 3, "short", "ls made.txt && echo 'went wrong' >&2 && false")
    assert docs.run_short([ok, skipped, bad], tmp_path) == ["README.md:3: exit 1: went wrong"]


@pytest.mark.slow
def test_the_short_commands_of_the_readme_and_docs_run_on_a_fresh_clone() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert " 0 failed" in done.stderr
