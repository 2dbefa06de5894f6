"""car_fl.deploy.runs: reading ``flwr run`` / ``flwr ls`` JSON output; the folder given to
``flwr run``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.cli.build import build_fab_from_disk

from car_fl.deploy import runs
from car_fl.deploy.runs import fab_folder, json_reply, run_id_from, status_from

PROJECT = Path(__file__).resolve().parents[2]


def test_json_reply_skips_lines_before_the_object() -> None:
    stdout = 'Loading project configuration...\n{"success": true, "run-id": 42}\n'
    assert json_reply(stdout) == {"success": True, "run-id": 42}
    assert json_reply("no json here") is None
    assert json_reply("{broken") is None


def test_run_id_from_a_successful_run() -> None:
    assert run_id_from('🎊 Successfully built\n{"success": true, "run-id": 1234}') == "1234"


@pytest.mark.parametrize(
    ("stdout", "returncode"),
    [
        ('{"success": false, "error-message": "no connection"}', 0),
        ('{"success": true, "run-id": 1}', 1),
        ("Traceback ...", 1),
    ],
)
def test_run_id_from_a_failed_run_raises_with_the_output(stdout: str, returncode: int) -> None:
    with pytest.raises(RuntimeError, match=f"flwr run failed \\({returncode}\\)"):
        run_id_from(stdout, "stderr text", returncode)


def test_status_from_flwr_ls() -> None:
    reply = {
        "success": True,
        "runs": [{"run-id": "7", "status": "finished:failed", "status-details": "ValueError"}],
    }
    assert status_from(json.dumps(reply)) == {
        "status": "finished:failed",
        "status-details": "ValueError",
    }
    assert status_from('{"success": true, "runs": []}') == {
        "status": "unknown",
        "status-details": "no such run",
    }
    assert status_from("connection refused", "err") == {
        "status": "unknown",
        "status-details": "connection refusederr",
    }


def fab_or_refusal(folder: Path) -> bytes | str:
    """The FAB ``flwr run`` would build from ``folder``, or Flower's reason for refusing it."""
    try:
        return build_fab_from_disk(folder)
    except ValueError as err:  # Flower's refusals, as flwr run reports them
        return f"{type(err).__name__}: {err}"


def make_app(project: Path, pyproject: str, files: dict[str, str]) -> Path:
    """An app folder: car-fl's two apps and configs, ``pyproject``, and ``files``."""
    project.mkdir()
    for name in ("server_app.py", "client_app.py"):
        shutil.copy(PROJECT / name, project / name)
    shutil.copytree(PROJECT / "conf", project / "conf")
    (project / "pyproject.toml").write_text(pyproject, encoding="utf-8")
    for name, text in {"car_fl/__init__.py": "x = 1\n", **files}.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text, encoding="utf-8")
    return project


OURS = (PROJECT / "pyproject.toml").read_text(encoding="utf-8")
DEFAULTS = "\n".join(x for x in OURS.splitlines() if not x.startswith("fab-include"))
DEEP = "venv/lib/python3.11/site-packages/a/b/c/d/e/f/g/h.py"
CASES = {  # name: (pyproject, extra files, whether flwr run gets a temporary folder)
    "fab-include": (OURS, {}, True),
    "flowers-defaults": (DEFAULTS, {"nested/.venv/b.py": "", "docs/notes.md": ""}, True),
    "fab-exclude": (
        OURS.replace("fab-include", 'fab-exclude = ["notes/**"]\nfab-include'),
        {"notes/a.py": ""},
        True,
    ),
    "include-that-flower-drops": (
        OURS.replace('"conf/**/*.yaml"]', '"conf/**/*.yaml", "tests/**"]'),
        {"tests/test_a.py": ""},
        True,
    ),
    "too-deep": (DEFAULTS, {DEEP: ""}, False),
    "ignored-pyproject": (OURS, {".gitignore": "pyproject.toml\n"}, False),
    "legacy-federations": (OURS + '\n[tool.flwr.federations]\ndefault = "x"\n', {}, False),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning:pathspec")  # Flower's own build
@pytest.mark.parametrize("case", CASES)
def test_flwr_run_gets_a_folder_that_builds_the_same_fab_or_the_same_refusal(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower's FAB, or its refusal, is the same from the temporary folder as from the project:
    with car-fl's ``fab-include`` and with Flower's defaults (which take every ``.py``, ``.md``,
    ...), a ``fab-exclude``, an include Flower's own rules then refuse, a path too deep, an
    ignored pyproject.toml and a legacy federations table (Flower edits that project's file:
    it gets the project). A symbolic link and an ignored file are treated as Flower treats
    them; the top-level ``.venv`` is never read."""
    pyproject, extra, staged_expected = CASES[case]
    project = make_app(
        tmp_path / "app",
        pyproject,
        {".venv/lib/site.py": "", "secret.json": "{}", "car_fl/sub/mod.py": "y = 2\n", **extra},
    )
    if ".gitignore" not in extra:
        (project / ".gitignore").write_text("secret.json\n")
    (project / "car_fl" / "link.py").symlink_to(project / "car_fl" / "__init__.py")
    walked: list[str] = []
    walk = os.walk

    def recording_walk(top: str, **kw: Any) -> Iterator[tuple[str, list[str], list[str]]]:
        for entry in walk(top, **kw):
            walked.append(entry[0])
            yield entry

    with contextlib.ExitStack() as stack:
        with monkeypatch.context() as patch:  # fab_folder's own reading, not Flower's below
            patch.setattr(os, "walk", recording_walk)
            folder = stack.enter_context(fab_folder(project))
        assert (folder != project) is staged_expected
        fab = fab_or_refusal(project)
        assert fab_or_refusal(folder) == fab
        assert isinstance(fab, bytes) is (case not in ("too-deep", "ignored-pyproject"))
    assert not any(".venv" in Path(w).relative_to(project.resolve()).parts[:1] for w in walked)
    if staged_expected:
        assert not folder.exists()  # removed once flwr run has the FAB


def test_submit_hands_flwr_run_the_temporary_folder_and_names_the_project_in_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = make_app(tmp_path / "app", OURS, {".venv/lib/site.py": ""})
    seen: list[Path] = []

    def fake_flwr(cmd: list[str], env: object, *, cwd: Path | None = None) -> object:
        app = Path(cmd[2])
        seen.append(app)
        assert (app / "pyproject.toml").is_file() and not (app / ".venv").exists()
        return subprocess.CompletedProcess(cmd, 1, f"bad app in {app}/pyproject.toml", "")

    monkeypatch.setattr(runs, "_flwr", fake_flwr)
    with pytest.raises(RuntimeError) as err:
        runs.submit(project, "local", [])
    assert seen and seen[0] != project and not seen[0].exists()
    assert f"bad app in {project}/pyproject.toml" in str(err.value)


def test_a_project_flower_would_refuse_is_given_to_flwr_run_as_it_is(tmp_path: Path) -> None:
    """No pyproject.toml: ``flwr run`` gets the project itself and says what is wrong."""
    with fab_folder(tmp_path) as folder:
        assert folder == tmp_path
