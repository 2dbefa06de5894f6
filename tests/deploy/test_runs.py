"""car_fl.deploy.runs: reading ``flwr run`` / ``flwr ls`` JSON output; the folder given to
``flwr run``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

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


@pytest.mark.filterwarnings("ignore::DeprecationWarning:pathspec")  # Flower's own build
@pytest.mark.parametrize("own_include", [True, False], ids=["fab-include", "flowers-defaults"])
def test_flwr_run_is_given_the_fab_files_alone_and_builds_the_same_fab(
    tmp_path: Path, own_include: bool
) -> None:
    """The FAB from the staged folder is the very bytes Flower builds from the project, with
    car-fl's ``fab-include`` and with Flower's defaults (which take every ``.py``, ``.md``,
    ...): a nested ``.venv``, a symbolic link and a file ``.gitignore`` names are treated as
    Flower treats them; the top-level ``.venv`` is never read."""
    project = tmp_path / "app"
    project.mkdir()
    for name in ("server_app.py", "client_app.py"):
        shutil.copy(PROJECT / name, project / name)
    shutil.copytree(PROJECT / "conf", project / "conf")
    (project / "car_fl" / "sub").mkdir(parents=True)
    (project / "car_fl" / "__init__.py").write_text("x = 1\n")
    (project / "car_fl" / "sub" / "mod.py").write_text("y = 2\n")
    pyproject = (PROJECT / "pyproject.toml").read_text(encoding="utf-8")
    if not own_include:
        pyproject = "\n".join(x for x in pyproject.splitlines() if not x.startswith("fab-include"))
    (project / "pyproject.toml").write_text(pyproject, encoding="utf-8")
    for name in (".venv/lib/site.py", "venv/a.py", "nested/.venv/b.py", "docs/notes.md"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("z = 3\n")
    (project / "secret.json").write_text("{}")
    (project / ".gitignore").write_text("secret.json\n")
    (project / "car_fl" / "link.py").symlink_to(project / "car_fl" / "__init__.py")
    with fab_folder(project) as staged:
        assert staged != project and not (staged / ".venv").exists()
        assert build_fab_from_disk(staged) == build_fab_from_disk(project)
        taken = {p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()}
    assert not staged.exists()  # removed once flwr run has the FAB
    assert ("nested/.venv/b.py" in taken) is (not own_include)  # Flower takes it by default
    assert "car_fl/sub/mod.py" in taken and "secret.json" not in taken
    assert "car_fl/link.py" not in taken


def test_a_project_flower_would_refuse_is_given_to_flwr_run_as_it_is(tmp_path: Path) -> None:
    """No pyproject.toml: ``flwr run`` gets the project itself and says what is wrong."""
    with fab_folder(tmp_path) as folder:
        assert folder == tmp_path
