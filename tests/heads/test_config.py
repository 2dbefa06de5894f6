"""car_fl.heads.config: each head kind's one registration, and the head's settings sections."""

from __future__ import annotations

import subprocess
import sys

import pytest

from car_fl.heads.config import (
    APPROACHES,
    HEADS,
    HeadConfig,
    HeadKind,
    Lexical,
    MoEConfig,
    approach_of,
)


def test_the_registrations_and_the_settings_that_read_them_import_no_torch() -> None:
    """The settings check a run against the heads' traits before anything is built: reading
    them costs no torch (a worker's ClientApp and the command line stay light)."""
    code = "import sys, car_fl.settings.compose; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_approach_comes_from_one_heads_registration() -> None:
    """``approach=<name>`` and the reports' names are the heads' own: each name once, with
    the head that forms it; one approach per head, adapter and lexical index."""
    names = [name for spec in HEADS.values() for name in spec.approaches]
    assert names == list(APPROACHES) and len(set(names)) == len(names)
    for name, (kind, spec) in APPROACHES.items():
        assert HEADS[kind].approaches[name] is spec
        assert approach_of(kind, spec.adapter, spec.lexical) == name
        assert name.isidentifier()  # a Hydra option name
    assert approach_of(HeadKind.DOCUMENT, False, Lexical.BM25) == "fusion"
    with pytest.raises(ValueError, match=r"head\.kind=moe with the adapter .* is no approach"):
        approach_of(HeadKind.MOE, True)


def test_bad_head_and_experts_settings_say_what_is_valid() -> None:
    assert HeadConfig(kind="knn").kind is HeadKind.KNN  # type: ignore[arg-type]  # as composed
    with pytest.raises(ValueError, match=r"head.kind='nope' is not valid; choose one of cla"):
        HeadConfig(kind="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"head.query_map='full' is not valid"):
        HeadConfig(query_map="full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"moe.route must be in \[1, moe.experts=4\]"):
        MoEConfig(experts=4, route=5)
