"""The configuration schema: validation, the errors users see, and names kept in one place."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from car_fl.settings.compose import load_settings
from car_fl.settings.schema import (
    APPROACHES,
    DEVICES,
    DTYPES,
    WIRE_DTYPES,
    CommConfig,
    FLConfig,
    HeadKind,
    Lexical,
    OptimizerKind,
    Settings,
    TrainConfig,
    approach_of,
    centralised_only,
    federated_part,
    federation_refusal,
)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "dataset=nope",
            r"dataset=nope is not an option of dataset; choose one of ag_news.*sms_spam",
        ),
        ("model=gpt9", r"model=gpt9 is not an option of model;.*tinyllama"),
        ("model=minilmm", r"did you mean model=minilm\?"),
        ("train.nonsense=1", r"train.nonsense is not a setting;.*\(train's keys: mode, epochs"),
        # a misspelt key: the schema's setting, not Hydra's "+key" hint
        ("fl.round=2", r"^fl.round is not a setting; did you mean fl.rounds\?"),
        ("+fl.round=2", r"^fl.round is not a setting; did you mean fl.rounds\?"),
        ("dataset.pth=x.tsv", r"^dataset.pth is not a setting; did you mean dataset.path\?"),
        ("dpp=record", r"^dpp is not a setting; did you mean dp\?"),
        ("train.lr=abc", r"train.lr=.abc. is not a number; write e.g. train.lr=0.01"),
        ("train.epochs=1.5", r"train.epochs=1.5 is not an integer"),
        ("train.lr=-1", r"train.lr must be > 0"),
        ("train.mode=both", r"train.mode='both' is not valid; choose one of classifier"),
        ("model.pooling=max", r"model.pooling='max' is not valid"),
        ("model.dtype=int8", r"model.dtype='int8' is not valid"),
        ("head.dropout=1.5", r"head.dropout must be in \[0, 1\)"),
        ("dataset.test_fraction=0", r"dataset.test_fraction must be in \(0, 1\)"),
        ("eval.top_k=[0]", r"eval.top_k"),
        ("device=tpu", r"device='tpu' is not valid"),
        ("train.optimizer=lion", r"train.optimizer='lion' is not valid"),
    ],
)
def test_bad_configuration_is_rejected_clearly(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(override)


def test_dataset_without_path_or_hub_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"neither dataset.path.*nor dataset.hub_id"):
        load_settings("dataset=file")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("fl.alpha=0", r"fl.alpha must be > 0"),
        ("fl.alpha=-1", r"fl.alpha must be > 0"),
        ("fl.round_timeout=0", r"fl.round_timeout must be > 0"),
        ("fl.wait_for_nodes=-1", r"fl.wait_for_nodes must be >= 0"),
    ],
)
def test_fl_timeouts_and_dirichlet_alpha_are_validated(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(override)
    key, value = override.removeprefix("fl.").split("=")
    with pytest.raises(ValueError, match=message):
        FLConfig(**{key: float(value)})  # type: ignore[arg-type]


def test_nan_is_refused_for_every_float_setting() -> None:
    """A NaN passes every ``x < low`` check; each float key must refuse it by name (a run
    config is the server's to choose), in every DP mode: a key another mode reads is checked
    too. One key through Hydra's override parser, each of them through the validation."""
    from car_fl.settings.compose import settings_values, to_settings
    from car_fl.settings.flat import flat_settings

    with pytest.raises(ValueError, match=r"noise_multiplier.*nan"):
        load_settings(["dp.noise_multiplier=nan"])
    defaults = load_settings([])
    keys = [k for k, v in flat_settings(defaults).items() if isinstance(v, float)]
    assert len(keys) > 30 and "dp.sample_rate" in keys
    for key in keys:
        *groups, name = key.split(".")
        values = settings_values(defaults)
        node = values
        for group in groups:
            node = node[group]
        node[name] = math.nan
        with pytest.raises(ValueError, match=rf"{name}.*nan"):
            to_settings(values)


def test_fl_edge_values_that_are_valid() -> None:
    fl = FLConfig(alpha=1e-3, round_timeout=1.0, wait_for_nodes=0.0)
    assert fl.sample_size(4) == 4
    assert FLConfig(clients=4, fraction_train=0.5).sample_size(4) == 2


def test_schema_imports_no_torch_hydra_or_omegaconf() -> None:
    code = "import sys, car_fl.settings.schema; print(sorted(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = {m.split(".")[0] for m in json.loads(out.stdout.replace("'", '"'))}
    assert "car_fl" in modules
    assert not {"torch", "hydra", "omegaconf"} & modules


def test_names_come_from_the_code_that_uses_them() -> None:
    import torch

    from car_fl.model.encoder import pick_device, pick_dtype
    from car_fl.protocol.messages import WIRE_DTYPES as RECORD_DTYPES

    optimizers = {name.lower() for name in dir(torch.optim)}
    for kind in OptimizerKind:
        assert TrainConfig(optimizer=kind.value).optimizer is kind  # type: ignore[arg-type]
        assert kind.value in optimizers  # torch.optim's class of that name
    assert set(RECORD_DTYPES) == set(WIRE_DTYPES)
    for dtype in WIRE_DTYPES:
        assert CommConfig(dtype=dtype).dtype == dtype
    cpu = torch.device("cpu")
    assert all(isinstance(pick_dtype(name, cpu), torch.dtype) for name in DTYPES)
    assert pick_device("cpu") == cpu and pick_device("auto").type in DEVICES
    with pytest.raises(ValueError, match=r"device='tpu' is not valid"):
        pick_device("tpu")
    with pytest.raises(ValueError, match=r"model.dtype='int8' is not valid"):
        pick_dtype("int8", cpu)


def test_every_head_mode_and_lexical_index_is_one_approach() -> None:
    pairs = [(kind, spec.adapter, spec.lexical) for kind, spec in APPROACHES.values()]
    assert len(set(pairs)) == len(pairs) == 9
    assert [spec.label for _, spec in APPROACHES.values()][:4] == [
        "MIPS",
        "adapter + MIPS",
        "classifier (CaR)",
        "adapter + classifier (CaR)",
    ]
    assert approach_of(HeadKind.KNN, False) == "knn"
    assert approach_of(HeadKind.DOCUMENT, False) == "document"
    assert approach_of(HeadKind.DOCUMENT, False, Lexical.BM25) == "fusion"
    with pytest.raises(ValueError, match="no approach"):
        approach_of(HeadKind.KNN, True)
    assert Settings().approach == "car"


def test_mips_and_knn_score_as_the_encoder_was_trained_unless_told_otherwise() -> None:
    """Issue 44, 0: MiniLM is trained for cosine; `approach=mips` with nothing else set used
    dot (R@10 0.676 against 0.727 with cosine on 2,000 arXiv papers)."""
    from car_fl.settings.compose import load_settings
    from car_fl.settings.schema import Similarity

    def similarity(*overrides: str) -> Similarity | None:
        return load_settings(["dataset.path=x.tsv", *overrides]).head.similarity

    assert similarity("model=minilm", "approach=mips") is Similarity.COSINE
    assert similarity("model=minilm", "approach=knn") is Similarity.COSINE
    assert similarity("model=minilm", "approach=mips", "head.similarity=dot") is Similarity.DOT
    assert similarity("model=smollm2", "approach=mips") is Similarity.DOT  # a generative LM
    assert similarity("model=smollm2", "model.similarity=cosine") is Similarity.COSINE


def test_a_federated_run_refuses_what_only_a_centralised_run_reads_naming_the_keys() -> None:
    """The linear probe steers car-fl train's epochs; a federated run (which trains fl.rounds
    rounds) would ignore it, so it refuses it, naming the key. Early stopping is read by both
    (epochs there, rounds here), so a federated run takes it."""
    assert federation_refusal(load_settings([])) == ""
    both = load_settings(["train.patience=3", "train.probe_epochs=10", "mode=adapter"])
    assert centralised_only(both) == ["train.probe_epochs=10"]
    reason = federation_refusal(both)
    assert "remove train.probe_epochs from" in reason and "patience" not in reason.split(":")[-1]
    assert "fl.rounds" in reason
    assert federation_refusal(load_settings(["train.patience=3"])) == ""
    assert "nothing to federate" in federation_refusal(load_settings(["head.kind=knn"]))


def test_a_sweeps_federated_job_drops_only_the_centralised_keys() -> None:
    both = load_settings(["train.patience=3", "train.probe_epochs=10", "train.lr=0.01"])
    federated = federated_part(both)
    assert centralised_only(federated) == [] and federation_refusal(federated) == ""
    assert federated.train.lr == 0.01 and federated.train.patience == 3  # kept: rounds here
    assert both.train.probe_epochs == 10  # no mutation
