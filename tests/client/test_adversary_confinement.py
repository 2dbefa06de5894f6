"""``car-fl worker --supernode-group`` against a server that ships the ClientApp's code.

Each test plays the FAB's code confined as the docs ask (an account of its own, here ``nobody``
in ``nogroup``, holding the worker's secret) against a worker started by the node's owner, and
fails while the confined code gets more than what the worker releases under the owner's
policy, its fixed failure codes and timing (docs/privacy.md, "What a server that controls the
code can still do"; docs/deployment.md, 5b'). Found by a review; each failed before its fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, RecordDict
from transformers import AutoTokenizer  # noqa: F401  # imported once here, not inside a test

from car_fl.client import worker_link
from car_fl.client.worker import NodeWorker
from car_fl.client.worker_link import WorkerFailed
from car_fl.model.retriever import build_retriever
from car_fl.protocol.failures import Failure
from car_fl.protocol.messages import to_record
from car_fl.settings.compose import conf_dir, fingerprint, load_settings, settings_from_yaml
from car_fl.testing.tiny import synthetic_examples, write_tsv
from tests.client.test_worker import serving
from tests.helpers import NOBODY, NOGROUP, as_nobody

NODE = {"partition-id": 1, "num-partitions": 2, "device": "cpu"}
LABELS = ["topic0", "topic1", "topic2", "topic3"]

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="runs code as another account")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every account may write (as /tmp): where the confined code leaves files."""
    folder = Path(tempfile.mkdtemp(prefix="cf-rev-", dir="/tmp"))
    folder.chmod(0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def private_data() -> Iterator[Path]:
    """The owner's data file, 0600 in a folder of the owner's alone."""
    folder = Path(tempfile.mkdtemp(prefix="cf-own-", dir="/tmp"))
    folder.chmod(0o700)
    try:
        data = write_tsv(folder / "data.tsv", synthetic_examples(24))
        data.chmod(0o600)
        yield data
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def confined_worker(
    folder: Path, node_config: Mapping[str, Any], respond: Any = None
) -> Iterator[NodeWorker]:
    """The owner's worker, confined for ``nogroup``, in a thread (``respond``: a stand-in for
    the round; ``None``: the real :meth:`Node.respond`)."""
    with serving(folder, respond, node_config, group=NOGROUP) as worker:
        yield worker


def train_content(fingerprint_: str | None = None) -> RecordDict:
    config: dict[str, Any] = {"server-round": 1, "labels": LABELS}
    if fingerprint_ is not None:
        config["fingerprint"] = fingerprint_
    return RecordDict({"arrays": to_record({}), "config": ConfigRecord(config)})


def failure_code(folder: Path, run_config: Mapping[str, Any], content: RecordDict) -> str:
    """As the confined code: hand the worker a round; its fixed code (or 'released')."""

    def hand() -> str:
        try:
            worker_link.hand_over(folder, run_id=7, run_config=run_config, content=content)
        except WorkerFailed as err:
            return err.failure.name
        return "released"

    return as_nobody(hand)


# ---------------------------------------------------------------- 1. code that runs as the owner
@root_only
def test_a_confined_supernode_cannot_make_the_worker_run_a_model_folder_s_code(
    short_dir: Path, open_dir: Path, private_data: Path, owner_policy: Path
) -> None:
    """The worker of docs/deployment.md 5b' (no privacy policy) loads the encoder the run
    config names, with the run config's ``model.trust_remote_code``: a model folder the confined
    code wrote in /tmp then runs as the owner, beside the data. Here it copies the data file
    where ``nobody`` reads it."""
    model, loot = open_dir / "model", open_dir / "loot"
    payload = (
        "import gc, shutil, os\n"
        "for o in gc.get_objects():\n"
        "    if type(o).__name__ == 'NodeWorker':\n"
        f"        shutil.copy(o.node_config['data-path'], {str(loot)!r})\n"
        f"        os.chmod({str(loot)!r}, 0o644)\n"
        "        break\n"
        "raise RuntimeError('enough')\n"
    )

    def plant() -> str:  # what the FAB's code writes, as nobody, where it may
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "x", "auto_map": {}}))
        auto = {"auto_map": {"AutoTokenizer": ["loader.Tokenizer", None]}}
        (model / "tokenizer_config.json").write_text(json.dumps(auto))
        (model / "loader.py").write_text(payload)
        return "planted"

    assert as_nobody(plant) == "planted"
    overrides = (
        f"model=local model.name_or_path={model} model.trust_remote_code=true dataset=tsv "
        "dataset.path=/nowhere.tsv fl.clients=2 mode=adapter progress=false"
    )
    node = {**NODE, "data-path": str(private_data), "privacy-policy": str(owner_policy)}
    with confined_worker(short_dir, node):
        stated = fingerprint(load_settings(overrides))
        code = failure_code(short_dir, {"overrides": overrides}, train_content(stated))
    stolen = as_nobody(lambda: loot.read_text())
    assert code == "POLICY_REFUSED", code  # the node's config does not say trust-remote-code
    assert private_data.read_text()[:20] not in stolen, (
        f"the worker ran the confined account's code as the owner (answer {code}); that code "
        f"handed nobody the data file: {stolen[:40]!r}"
    )


# --------------------------------------------------- 2. configuration files the run config names
@root_only  # Hydra warns of the file's name; a worker outside pytest does not stop for it
@pytest.mark.filterwarnings("ignore:(?s).*validated against ConfigStore schema:UserWarning")
@pytest.mark.parametrize("names_the_file", ["hydra.searchpath", "a group's option as a path"])
def test_a_run_config_cannot_make_the_worker_compose_yaml_of_the_supernode_s_account(
    short_dir: Path,
    open_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    owner_policy: Path,
    names_the_file: str,
) -> None:
    """``hydra.searchpath`` is accepted in a run config's overrides, and so is a config group's
    option given as a relative path (``+experiment=../../tmp/x``): the worker composes a
    YAML the confined code wrote, whose ``${oc.env:...}`` (refused in a run config itself) then
    reads the worker's environment. Whether a guess of a variable is right shows in the fixed
    code (CONFIG_MISMATCH, or a round that went on): an oracle on the owner's secrets."""
    monkeypatch.setenv("CAR_FL_REVIEW_TOKEN", "hf_owner_secret")
    conf = open_dir / "conf"

    def plant() -> str:
        (conf / "approach").mkdir(parents=True)
        lines = [  # approach=mips's own, and one line more
            "# @package _global_",
            "head: {kind: mips, lexical: none}",
            "train: {mode: classifier}",
            "dataset: {topic_key: '${oc.env:CAR_FL_REVIEW_TOKEN,unset}'}",
        ]
        (conf / "approach" / "mips.yaml").write_text("\n".join(lines) + "\n")
        return "planted"

    assert as_nobody(plant) == "planted"
    common = "dataset=tsv dataset.path=/nowhere.tsv fl.clients=2 progress=false approach=mips"
    planted = os.path.relpath(conf / "approach" / "mips", conf_dir() / "experiment")
    run_config = {
        "overrides": f"hydra.searchpath=[file://{conf}] {common}"
        if names_the_file == "hydra.searchpath"
        else f"{common} +experiment={planted}"
    }

    def fingerprint_of(guess: str) -> str:  # the server's: approach=mips, the guess as a value
        plain = load_settings(common)
        return fingerprint(replace(plain, dataset=replace(plain.dataset, topic_key=guess)))

    codes = {}
    with confined_worker(short_dir, {**NODE, "privacy-policy": str(owner_policy)}):
        for guess in ("hf_wrong_guess", "hf_owner_secret"):
            codes[guess] = failure_code(short_dir, run_config, train_content(fingerprint_of(guess)))
    assert codes["hf_wrong_guess"] == codes["hf_owner_secret"], (
        "the worker composed the confined account's YAML and resolved ${oc.env:...} in its own "
        f"environment: a wrong guess gets {codes['hf_wrong_guess']}, the owner's secret "
        f"{codes['hf_owner_secret']}"
    )


# ---------------------------------------------------------- 3. the exposure check and the kernel
def posix_acl(owner: int, named_user: tuple[int, int], group: int, mask: int, other: int) -> bytes:
    """An access ACL in the kernel's xattr form (what ``setfacl -m u:UID:PERM`` writes)."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, owner, undefined), (0x02, named_user[1], named_user[0])]
    entries += [(0x04, group, undefined), (0x10, mask, undefined), (0x20, other, undefined)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


@root_only
def test_the_worker_refuses_to_start_while_an_acl_lets_the_supernode_read_its_data(
    short_dir: Path, private_data: Path, owner_policy: Path
) -> None:
    """``confinement.readable`` reads the mode bits only; an access ACL (say one that let the
    SuperNode's account read the data before it was confined) keeps the file readable to it
    while its mode says 0640 in another group."""
    try:  # u:nobody:--x on the folder, u:nobody:r-- on the file (mode bits: owner only)
        os.setxattr(
            private_data.parent, "system.posix_acl_access", posix_acl(7, (NOBODY, 1), 0, 1, 0)
        )
        os.setxattr(private_data, "system.posix_acl_access", posix_acl(6, (NOBODY, 4), 0, 4, 0))
    except OSError as err:
        pytest.skip(f"no POSIX ACLs here: {err}")
    read = as_nobody(lambda: private_data.read_text()[:10])
    assert read == private_data.read_text()[:10]  # the kernel lets the SuperNode's account read
    try:
        node = {**NODE, "data-path": str(private_data), "privacy-policy": str(owner_policy)}
        worker = NodeWorker(short_dir, node, group=NOGROUP)
    except ValueError as err:
        assert "the data file" in str(err)
    else:
        pytest.fail(
            f"a confined worker (group {worker.group}) started while nobody reads its data "
            f"file through an ACL ({read!r}); modes {oct(private_data.stat().st_mode)}"
        )


@root_only
def test_the_worker_refuses_to_start_while_the_supernode_can_read_its_policy(
    short_dir: Path, open_dir: Path, private_data: Path
) -> None:
    """The policy is the owner's (docs/privacy.md: without an account of its own the
    ClientApp 'can read the data file, the feature cache, the policy and the ledger'), but the
    exposure check leaves it out: a 0644 policy in an open folder starts a confined worker."""
    folder = open_dir / "etc"
    folder.mkdir(mode=0o755)
    policy = folder / "policy.toml"
    ledger = private_data.parent / "ledger"  # the owner's
    policy.write_text(
        'modes = ["fixed"]\nmin-noise-multiplier = 1.3\nlifetime-epsilon = 4\n'
        f'ledger = "{ledger}"\n'
    )
    policy.chmod(0o644)
    node = {**NODE, "data-path": str(private_data), "privacy-policy": str(policy)}
    read = as_nobody(lambda: policy.read_text())
    assert "lifetime-epsilon = 4" in read  # the confined account reads the owner's policy
    try:
        NodeWorker(short_dir, node, group=NOGROUP)
    except ValueError as err:
        assert "policy" in str(err)
    else:
        pytest.fail("a confined worker started while nobody reads its privacy policy")


# ----------------------------------------------------------------- 4. text beyond the fixed codes
@root_only
def test_a_confined_supernode_gets_no_text_of_the_worker_s_node_config(
    short_dir: Path, private_data: Path
) -> None:
    """A round whose header names another policy is refused with text that names the worker's
    own ``privacy-policy`` path, also to a ClientApp of another account."""
    folder = Path(tempfile.mkdtemp(prefix="cf-alice-private-", dir="/tmp"))
    try:
        folder.chmod(0o700)
        policy = folder / "policy.toml"
        policy.write_text('modes = ["fixed"]\n')
        policy.chmod(0o600)
        node = {**NODE, "data-path": str(private_data), "privacy-policy": str(policy)}

        def hand() -> str:
            try:
                worker_link.hand_over(
                    short_dir, run_id=1, run_config={}, content=train_content(), policy="/x.toml"
                )
            except WorkerFailed as err:
                return f"{err.failure.name}: {err}"
            return "released"

        with confined_worker(short_dir, node, respond=lambda *a, **k: RecordDict()):
            said = as_nobody(hand)
        assert said.startswith(Failure.NODE_CONFIG.name)
        assert str(folder) not in said, f"the confined ClientApp read: {said}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------ a second review
COMMON = "dataset=tsv dataset.path=/nowhere.tsv fl.clients=2 progress=false"
SECRET_VAR, SECRET = "CAR_FL_REVIEW2_TOKEN", "hf_owner_secret"


def node_of(data: Path) -> dict[str, object]:
    return {**NODE, "data-path": str(data)}


def guess_fingerprint(guess: str) -> str:
    """The server's fingerprint of COMMON with ``dataset.topic_key`` set to ``guess``."""
    plain = load_settings(COMMON)
    return fingerprint(replace(plain, dataset=replace(plain.dataset, topic_key=guess)))


def oracle(folder: Path, run_config: dict[str, str]) -> dict[str, str]:
    """The confined code's answer for a wrong guess and for the owner's secret."""
    return {
        guess: failure_code(folder, run_config, train_content(guess_fingerprint(guess)))
        for guess in ("hf_wrong_guess", SECRET)
    }


# ------------------------------------------- 1. interpolations that the run-config check misses
@root_only
def test_a_run_config_cannot_smuggle_an_interpolation_past_the_check_with_hydra_escapes(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, owner_policy: Path
) -> None:
    """``run_inputs`` refuses ``${`` in an override, but Hydra's grammar unescapes ``$\\{...\\}``
    into ``${...}`` after that check: the worker resolves ``${oc.env:...}`` in its own
    environment, and the fixed code answers whether a guess of the owner's variable is right."""
    monkeypatch.setenv(SECRET_VAR, SECRET)
    smuggled = f"dataset.topic_key=$\\{{oc.env:{SECRET_VAR}\\}}"
    run_config = {"overrides": f"{COMMON} {shlex.quote(smuggled)}"}
    with confined_worker(short_dir, {**NODE, "privacy-policy": str(owner_policy)}):
        codes = oracle(short_dir, run_config)
    assert codes["hf_wrong_guess"] == codes[SECRET], (
        "the worker resolved ${oc.env:...} from a run config's override written $\\{...\\}: a "
        f"wrong guess of the owner's {SECRET_VAR} gets {codes['hf_wrong_guess']}, the right one "
        f"{codes[SECRET]}"
    )


@root_only
def test_a_run_config_s_settings_yaml_cannot_smuggle_an_interpolation_with_yaml_escapes(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, owner_policy: Path
) -> None:
    """The run config's ``settings`` YAML is checked for ``${`` as text, before YAML reads
    ``"\\u0024{...}"`` as ``${...}``: the same oracle on the worker's environment."""
    monkeypatch.setenv(SECRET_VAR, SECRET)
    yaml = "\n".join(
        [
            "dataset: {name: tsv, reader: table, hub_id: null, path: /nowhere.tsv,",
            f'  topic_key: "\\u0024{{oc.env:{SECRET_VAR},unset}}"}}',
            "fl: {clients: 2}",
            "progress: false",
        ]
    )
    assert "${" not in yaml
    run_config = {"settings": yaml}
    plain = load_settings(COMMON)

    def fingerprint_of(guess: str) -> str:  # the server's, of the YAML with the guess as text
        mine = settings_from_yaml(yaml.replace(f"\\u0024{{oc.env:{SECRET_VAR},unset}}", guess))
        return fingerprint(replace(mine, dataset=replace(mine.dataset, path=plain.dataset.path)))

    with confined_worker(short_dir, {**NODE, "privacy-policy": str(owner_policy)}):
        codes = {
            guess: failure_code(short_dir, run_config, train_content(fingerprint_of(guess)))
            for guess in ("hf_wrong_guess", SECRET)
        }
    assert codes["hf_wrong_guess"] == codes[SECRET], (
        "the worker resolved ${oc.env:...} written \\u0024{...} in a run config's settings YAML: "
        f"a wrong guess gets {codes['hf_wrong_guess']}, the owner's secret {codes[SECRET]}"
    )


# -------------------------------------------- 2. files of the owner's that the run config names
@root_only
def test_a_confined_worker_reads_no_owner_file_that_the_run_config_names(
    short_dir: Path, private_data: Path, tiny_llama: Path, owner_policy: Path
) -> None:
    """A worker without a policy took the run's ``dataset.test_path``: it read, as its owner,
    a file the confined account cannot even stat, and dropped the training texts it holds
    (``drop_texts_in``), so the released ``num-examples`` counted how many of the node's
    records that file holds. A confined worker now needs a policy, which ignores a run's
    test file: whatever that file holds, the confined code gets the same answer."""
    with pytest.raises(ValueError, match="needs a privacy policy"):
        NodeWorker(short_dir, {**NODE, "data-path": str(private_data)}, group=NOGROUP)
    secret_dir = Path(tempfile.mkdtemp(prefix="cf-owner-only-", dir="/tmp"))
    secret_dir.chmod(0o700)
    other = secret_dir / "other.tsv"  # another file of the owner's: the worker never names it
    records = private_data.read_text().splitlines(keepends=True)
    overrides = (
        f"model=local model.name_or_path={tiny_llama} dataset=tsv dataset.path=/nowhere.tsv "
        f"dataset.test_path={other} fl.clients=2 mode=classifier dp=none progress=false"
    )

    settings = load_settings(overrides)
    initial = build_retriever(settings, len(LABELS)).trainable_state_dict()
    config = ConfigRecord(
        {"server-round": 1, "labels": LABELS, "fingerprint": fingerprint(settings)}
    )
    content = RecordDict({"arrays": to_record(initial), "config": config})

    def released() -> str:
        def hand() -> str:
            try:
                reply = worker_link.hand_over(
                    short_dir, run_id=7, run_config={"overrides": overrides}, content=content
                )
            except WorkerFailed as err:
                return err.failure.name
            return str(reply.metric_records["metrics"]["num-examples"])

        return as_nobody(hand)

    try:
        answers = {}
        node = {**NODE, "data-path": str(private_data), "privacy-policy": str(owner_policy)}
        with confined_worker(short_dir, node):
            assert as_nobody(lambda: str(other.exists())).startswith("PermissionError")
            answers["absent"] = released()
            other.write_text("".join(records[:2]))
            answers["2 of the node's records"] = released()
            other.write_text("".join(records[:8]))
            answers["8 of the node's records"] = released()
    finally:
        shutil.rmtree(secret_dir, ignore_errors=True)
    # the policy's reading: a test file the run names and the node does not is refused
    assert set(answers.values()) == {"READING_DIFFERS"}, answers
    assert len(set(answers.values())) == 1, (
        "a run config made the confined worker read a file of the owner's that only the owner "
        f"can reach (dataset.test_path); what the confined code got: {answers}"
    )


# ------------------------------------------- 3. the exposure check: owners and writable folders
@root_only
def test_the_worker_refuses_to_start_while_the_supernode_s_account_owns_its_data(
    short_dir: Path, open_dir: Path, owner_policy: Path
) -> None:
    """``confinement.readable`` reads the group's and others' bits only: a data file owned by
    the SuperNode's account (say it fetched the data before it was confined), mode 0600, in a
    folder it may enter, passes the check; the kernel lets its owner read it."""
    folder = open_dir / "data"
    folder.mkdir(mode=0o711)
    folder.chmod(0o711)
    data = write_tsv(folder / "data.tsv", synthetic_examples(24))
    os.chown(data, NOBODY, NOGROUP)
    data.chmod(0o600)
    read = as_nobody(lambda: data.read_text()[:10])
    assert read == data.read_text()[:10]  # the SuperNode's account reads the data
    try:
        NodeWorker(short_dir, {**node_of(data), "privacy-policy": str(owner_policy)}, group=NOGROUP)
    except ValueError as err:
        assert "the data file" in str(err)
    else:
        pytest.fail(f"a confined worker started while nobody owns and reads its data ({read!r})")


@root_only
def test_the_worker_refuses_to_start_while_the_supernode_s_group_can_replace_its_data(
    short_dir: Path, open_dir: Path, owner_policy: Path
) -> None:
    """A data file 0600 in a folder the SuperNode's group may write (0730, no listing) passes
    the check, which asks only who may read. That account then swaps the data file for a
    symbolic link to any file of the owner's (here one it cannot read), and the worker, which
    reopens an edited data file, trains on and releases that file as its data."""
    folder = open_dir / "data"
    folder.mkdir()
    os.chown(folder, 0, NOGROUP)
    folder.chmod(0o730)
    data = write_tsv(folder / "data.tsv", synthetic_examples(24))
    data.chmod(0o600)
    secret_dir = Path(tempfile.mkdtemp(prefix="cf-owner-only-", dir="/tmp"))
    try:
        secret_dir.chmod(0o700)
        secret = write_tsv(secret_dir / "private.tsv", synthetic_examples(30, seed=9))
        secret.chmod(0o600)

        def swap() -> str:
            os.rename(data, folder / ".old")
            os.symlink(secret, data)
            return "swapped"

        try:
            NodeWorker(
                short_dir, {**node_of(data), "privacy-policy": str(owner_policy)}, group=NOGROUP
            )
        except ValueError as err:
            assert "the data file" in str(err)
            return
        swapped = as_nobody(swap)
        assert swapped == "swapped", swapped
        assert data.read_text() == secret.read_text()  # what the owner's worker now reads
        pytest.fail(
            "a confined worker started while the SuperNode's group may replace its data file: "
            "it swapped in a link to a file of the owner's it cannot read, the worker's next "
            "round reads that file as the node's data"
        )
    finally:
        shutil.rmtree(secret_dir, ignore_errors=True)
