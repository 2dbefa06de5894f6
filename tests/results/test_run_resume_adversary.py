"""An adversary of car_fl.results.run.load_resume_point: a folder that is not a whole run of
car-fl (another project's, or one damaged) is refused with an error that names the file at
fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from car_fl.results.run import CENTRALIZED, load_resume_point
from car_fl.settings.compose import load_settings
from car_fl.settings.schema import Settings
from tests.results.test_run_resume import write_run


@pytest.fixture
def settings() -> Settings:
    return load_settings(["fl.rounds=3", "train.epochs=3", "train.patience=2"])


def metrics_as_a_list(folder: Path) -> None:
    (folder / "metrics.json").write_text(json.dumps([{"epoch": 1, "accuracy": 0.5}]))


def metrics_cut_short(folder: Path) -> None:
    text = (folder / "metrics.json").read_text()
    (folder / "metrics.json").write_text(text[: len(text) // 2])


def metrics_of_another_tool(folder: Path) -> None:
    (folder / "metrics.json").write_text(json.dumps({"epoch": 1, "accuracy": 0.5}))


def config_cut_short(folder: Path) -> None:
    text = (folder / "config.yaml").read_text()
    (folder / "config.yaml").write_text(text[: len(text) // 3])


@pytest.mark.parametrize(
    ("damage", "name"),
    [
        (metrics_as_a_list, "metrics.json"),  # AttributeError: 'list' object has no 'get'
        (metrics_cut_short, "metrics.json"),  # JSONDecodeError, no file named
        (metrics_of_another_tool, "metrics.json"),  # "that is None, and this is ..."
        (config_cut_short, "config.yaml"),  # "dataset.val_fraction=None is not a number"
    ],
)
def test_a_foreign_or_damaged_run_folder_is_refused_naming_the_file(
    settings: Settings, tmp_path: Path, damage, name: str
) -> None:
    write_run(tmp_path, settings, kind="centralized", rounds=2)
    damage(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        load_resume_point(tmp_path, settings, CENTRALIZED)
    assert name in str(err.value)


def test_a_federation_is_not_resumed_on_another_encoder(settings: Settings, tmp_path: Path) -> None:
    """Each node's own paths may differ after a resume (they are the node's), but the server's
    encoder is what its rows so far were measured with: another one is refused, as a
    centralised run refuses it."""
    from car_fl.results.run import FEDERATED

    write_run(tmp_path, settings, kind="federated", rounds=2)
    moved = load_settings(["fl.rounds=3", "train.epochs=3", "train.patience=2", "device=cpu"])
    assert load_resume_point(tmp_path, moved, FEDERATED).done == 2  # a node-local key
    other = load_settings(
        ["fl.rounds=3", "train.epochs=3", "train.patience=2", "model.name_or_path=/other/llama"]
    )
    with pytest.raises(ValueError, match=r"other settings \(.*model\.name_or_path="):
        load_resume_point(tmp_path, other, FEDERATED)
