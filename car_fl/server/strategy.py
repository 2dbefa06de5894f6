"""Server-side aggregation: any Flower Message-API strategy, guarded by car-fl's checks.

:class:`GuardedStrategy` wraps one of Flower's strategies and adds, once for all of them:
seeded client sampling; what a valid train reply is, checked on decoded values
(:func:`validate_reply`); the server's own record of which node holds which partition
(:class:`ShardClaims`: a node is pinned to the first partition it claims, any other claim is
refused, and its count is capped by that partition's size or ``fl.max_examples_per_client``);
the bound on a reply's update norm ‖θᵢ − θ‖ (:class:`NormBound`, ``fl.norm_bound``: replies
above it are rejected or clipped); a minimum of valid replies; and what the round saw
(:class:`RoundStats`, its :attr:`history`, which the round recorder reads). Valid replies reach the
wrapped strategy as float64 arrays in node order; its result is cast back to the global
model's dtypes.

Norm-bound modes: ``fixed`` (``fl.max_update_norm``), ``adaptive`` (``fl.norm_bound_factor``
× the round's lower median update norm: of two replies the smaller, so a scaled update cannot
raise its own bound), ``dp`` (under fixed DP per round: the clipped update's bound plus a high
quantile of the noise norm; with ``dp.adapter_clip`` each part's, and each part within its
own; no user input), ``off``;
``auto`` picks ``dp`` under fixed DP per round, else ``fixed`` when ``fl.max_update_norm`` is
set, else ``off``.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from car_fl.privacy.mechanism import split_adapter
from car_fl.protocol.messages import (
    ARRAYS_KEY,
    CONFIG_KEY,
    NUM_EXAMPLES,
    RAW_STYPE,
    decode,
    encode,
    payload_bytes,
)
from car_fl.results.rows import ClientRow, wire_key
from car_fl.server.aggregation import flower_strategy
from car_fl.server.expert_plan import ExpertPlan
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.dp_plan import fixed_noise_std, public_examples
from car_fl.settings.schema import DPConfig, NormBoundAction, NormBoundMode, Settings

Spec = Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]]


def validate_reply(
    content: Any,
    spec: Spec,
    *,
    max_examples: int | None = None,
    optional: frozenset[str] | set[str] = frozenset(),
) -> str | None:
    """``None`` if a train reply may be aggregated, else the reason it may not. Exactly the tensors
    of ``spec`` (those in ``optional`` may be left out), checked on the decoded values, in car-fl's
    wire format only (a ``.npy`` payload can disagree with its metadata)."""
    arrays = content.array_records
    metrics = content.metric_records
    if len(arrays) != 1 or len(metrics) != 1:
        return (
            f"expected one ArrayRecord and one MetricRecord, got {len(arrays)} and {len(metrics)}"
        )
    record = next(iter(arrays.values()))
    missing = sorted(set(spec) - set(record) - set(optional))
    extra = sorted(set(record) - set(spec))
    if missing or extra:
        return f"tensor names differ from the global model: missing {missing}, extra {extra}"
    for name, (shape, dtype) in spec.items():
        if name not in record:  # an optional tensor left out
            continue
        array = record[name]
        if array.stype != RAW_STYPE:
            return f"tensor {name!r} is in format {array.stype!r}; only {RAW_STYPE!r} is accepted"
        try:
            values = decode(array)
        except ValueError as err:
            return f"tensor {name!r} cannot be read: {err}"
        if values.shape != shape:
            return f"tensor {name!r} has shape {values.shape}, expected {shape}"
        if values.dtype != dtype:
            return f"tensor {name!r} has dtype {values.dtype}, expected {dtype}"
        if not np.isfinite(values).all():
            return f"tensor {name!r} has non-finite values"
    count = next(iter(metrics.values())).get(NUM_EXAMPLES)
    if not isinstance(count, int) or isinstance(count, bool):
        return f"'{NUM_EXAMPLES}' must be an integer, got {count!r}"
    if count <= 0:
        return f"'{NUM_EXAMPLES}' must be positive, got {count}"
    if max_examples is not None and count > max_examples:
        return f"'{NUM_EXAMPLES}' = {count} exceeds the cap of {max_examples}"
    return None


def spec_of(record: ArrayRecord) -> Spec:
    """Expected name → (shape, dtype) of every reply, from the global model."""
    return {k: (tuple(v.shape), decode(v).dtype) for k, v in record.items()}


def as_float64(arrays: Mapping[str, np.ndarray[Any, Any]]) -> ArrayRecord:
    """Arrays as Flower's own NumPy arrays in float64: what Flower's strategies compute on."""
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float64)) for k, v in arrays.items()})


@dataclass
class RoundStats:
    """What the strategy saw in one training round."""

    round: int
    started: float
    #: The nodes asked to train this round (sampled from ``connected``).
    asked: list[int] = field(default_factory=list)
    connected: int = 0
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    #: Each valid reply's metrics, under their wire (kebab-case) keys.
    client_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    #: The metrics of every reply that arrived, also those refused: the server's ε counts
    #: them (client_metrics keeps only the valid ones).
    released: dict[int, dict[str, float]] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    #: The error code of each failed node's reply (a lost node, which sent none, has none).
    failure_codes: dict[int, int] = field(default_factory=dict)
    #: ‖θᵢ − θ‖ of every reply that passed validation, and this round's bound (if any).
    update_norms: dict[int, float] = field(default_factory=dict)
    norm_bound: float | None = None
    clipped: list[int] = field(default_factory=list)
    aggregated: bool = False

    def attribute_lost_replies(self) -> None:
        """Name the nodes that never answered: Flower's error reply for a lost node does not
        name it, so pair anonymous errors with silent nodes when unambiguous."""
        answered = {*self.client_metrics, *self.rejected, *self.failed}
        silent = sorted(set(self.bytes_sent) - answered)
        anonymous = [n for n in self.failed if n not in self.bytes_sent]
        if len(silent) == 1 and len(anonymous) == 1:
            self.failed[silent[0]] = self.failed.pop(anonymous[0])
            if anonymous[0] in self.failure_codes:
                self.failure_codes[silent[0]] = self.failure_codes.pop(anonymous[0])
            return
        for node in silent:
            self.failed[node] = "no reply (the node was lost or the round timed out)"

    def weighted(self, key: str) -> float:
        """The example-weighted mean of a client metric (wire key) over the replies that sent
        a finite value with a finite, positive count; NaN if none did (a hostile client's −∞
        or NaN would be the round's figure)."""
        rows = [
            m
            for m in self.client_metrics.values()
            if math.isfinite(m.get(key, math.nan)) and 0 < m.get(NUM_EXAMPLES, 0) < math.inf
        ]
        total = sum(m[NUM_EXAMPLES] for m in rows)
        if not rows or total <= 0:
            return float("nan")
        return sum(m[key] * m[NUM_EXAMPLES] for m in rows) / total


class ShardClaims:
    """Partition ids pinned to node ids, and each node's cap on ``num-examples``."""

    def __init__(
        self, shard_sizes: Mapping[int, int] | None = None, *, max_examples: int | None = None
    ) -> None:
        self.shard_sizes = dict(shard_sizes or {})
        self.max_examples = max_examples
        self.held: dict[int, int] = {}  # node id → partition id

    def cap_for(self, node: int, claimed: Any) -> tuple[int | None, str | None]:
        """(cap, None) if ``node`` may claim partition ``claimed``, else (None, reason)."""
        if self.max_examples is not None or not self.shard_sizes:
            return self.max_examples, None
        if (
            isinstance(claimed, bool)
            or not isinstance(claimed, int | float)
            or not math.isfinite(claimed)
        ):
            return None, f"'partition-id' must be an integer, got {claimed!r}"
        if claimed != int(claimed) or int(claimed) not in self.shard_sizes:
            valid = f"0..{max(self.shard_sizes)}"
            return None, f"'partition-id' = {claimed!r} is not a partition of this run ({valid})"
        pid = int(claimed)
        pinned = self.held.get(node)
        if pinned is not None and pinned != pid:
            return None, f"node {node} holds partition {pinned}, now claims partition {pid}"
        owner = next((n for n, p in self.held.items() if p == pid and n != node), None)
        if owner is not None:
            return None, (
                f"partition {pid} is held by node {owner}; a node started with data-is-shard "
                "needs fl.max_examples_per_client"
            )
        return self.shard_sizes[pid], None

    def pin(self, node: int, claimed: Any) -> None:
        """Record ``node`` as the holder of partition ``claimed`` (after a valid reply)."""
        if self.max_examples is None and self.shard_sizes:
            self.held.setdefault(node, int(claimed))


Arrays = Mapping[str, np.ndarray[Any, Any]]


def update_norm(reply: Arrays, reference: Arrays) -> float:
    """‖θᵢ − θ‖ over all tensors together, in float64; ``inf`` when it is not finite."""
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for name, values in reference.items():
            diff = np.asarray(reply[name], dtype=np.float64) - values.astype(np.float64)
            total += float(np.square(diff).sum())
    return math.sqrt(total) if math.isfinite(total) else math.inf


def clip_update(reply: Arrays, reference: Arrays, *, bound: float, norm: float) -> dict[str, Any]:
    """θ + (θᵢ − θ) · bound/‖θᵢ − θ‖ in float64 (the reply itself when it is within the bound)."""
    if norm <= bound:
        return {k: np.asarray(v, dtype=np.float64) for k, v in reply.items()}
    factor = bound / norm
    return {
        k: reference[k].astype(np.float64) + (reply[k].astype(np.float64) - reference[k]) * factor
        for k in reference
    }


def gaussian_norm_quantile(*, parts: Sequence[tuple[float, int]], tail: float) -> float:
    """An upper bound on the 1 − ``tail`` quantile of ‖X‖, X Gaussian with independent parts of
    ``(std, dim)`` each. The norm is max(std)-Lipschitz in standard noise and
    E‖X‖ ≤ √(Σ dim·std²), so by Gaussian concentration P(‖X‖ ≥ √(Σ dim·std²) + max(std)·t)
    ≤ exp(−t²/2); t = √(2 ln(1/tail))."""
    if not parts or any(std < 0 or dim < 1 for std, dim in parts) or not 0 < tail < 1:
        raise ValueError(f"need parts of std >= 0, dim >= 1, and 0 < tail < 1; got {parts}, {tail}")
    mean = math.sqrt(sum(dim * std**2 for std, dim in parts))
    return mean + max(std for std, _ in parts) * math.sqrt(2.0 * math.log(1.0 / tail))


def released_parts(dp: DPConfig, *, dim: int, adapter_dim: int) -> list[tuple[float, float, int]]:
    """``(clip, noise std, dim)`` of each part a ``dp=fixed`` reply is released in, as the
    client clips and noises them (:meth:`car_fl.client.local_dp.ClientPrivacy.scaled`): one,
    or with ``dp.adapter_clip`` the adapter at its bound and the head at ``dp.clip``, each
    with its share of the noise."""
    std, clip_a = fixed_noise_std(dp), dp.adapter_clip
    if clip_a is None or adapter_dim == 0:
        return [(dp.clip, std, dim)]
    if adapter_dim == dim:  # the adapter alone (MIPS): its own bound, all of the noise
        return [(clip_a, dp.noise_multiplier * clip_a, dim)]
    share = dp.adapter_share
    return [
        (clip_a, dp.noise_multiplier * clip_a / math.sqrt(share), adapter_dim),
        (dp.clip, std / math.sqrt(1.0 - share), dim - adapter_dim),
    ]


def resolve_mode(settings: Settings) -> NormBoundMode:
    """``fl.norm_bound`` with ``auto`` resolved (see the module docstring)."""
    mode = settings.fl.norm_bound
    if mode is not NormBoundMode.AUTO:
        return mode
    if MODES[settings.dp.mode].bounds_replies(settings.dp):
        return NormBoundMode.DP
    return NormBoundMode.FIXED if settings.fl.max_update_norm is not None else NormBoundMode.OFF


#: The parts of a reply :attr:`NormBound.part_values` bounds, in split_adapter's order.
PARTS = ("adapter part", "head part")


@dataclass(frozen=True)
class NormBound:
    """How the server bounds ‖θᵢ − θ‖ in each round."""

    mode: NormBoundMode = NormBoundMode.OFF
    #: The bound itself (``fixed``, ``dp``); unused by ``adaptive``.
    value: float | None = None
    factor: float = 3.0
    action: NormBoundAction = NormBoundAction.REJECT
    #: Rounds without the bound (``dp``: the DP warm-up, when clients do not clip).
    from_round: int = 1
    #: Relative rounding of the wire dtype (``dp``: the bound allows for it).
    wire_eps: float = 0.0
    #: ``dp`` with ``dp.adapter_clip`` and a head: the adapter's part and the head's, each
    #: within its own clip plus its noise's quantile, as the client releases them (else the
    #: joint bound's room could all go to one part: 100× an honest adapter's).
    part_values: tuple[float, float] | None = None

    @classmethod
    def from_settings(cls, settings: Settings, *, dim: int, adapter_dim: int = 0) -> NormBound:
        """The bound for a run whose replies have ``dim`` parameters in all, ``adapter_dim``
        of them the adapter's."""
        fl, dp = settings.fl, settings.dp
        mode = resolve_mode(settings)
        value, from_round, part_values = fl.max_update_norm, 1, None
        if mode is NormBoundMode.DP:  # the clipped update, plus the noise's quantile
            parts = released_parts(dp, dim=dim, adapter_dim=adapter_dim)
            # with two parts, three checks (the whole and each part) share the tail
            tail = fl.norm_bound_tail / (3 if len(parts) == 2 else 1)
            noise = gaussian_norm_quantile(parts=[p[1:] for p in parts], tail=tail)
            value = math.sqrt(sum(clip**2 for clip, _, _ in parts)) + noise
            from_round = dp.warmup_rounds + 1
            if len(parts) == 2:
                adapter, head = (
                    c + gaussian_norm_quantile(parts=[(std, d)], tail=tail) for c, std, d in parts
                )
                part_values = (adapter, head)
        return cls(
            mode=mode,
            value=value,
            factor=fl.norm_bound_factor,
            action=fl.norm_bound_action,
            from_round=from_round,
            wire_eps=float(np.finfo(np.dtype(settings.comm.dtype)).eps),
            part_values=part_values,
        )

    def bound(
        self, server_round: int, norms: Sequence[float], *, reference_norm: float = 0.0
    ) -> float | None:
        """This round's bound given the update norms of its (otherwise valid) replies."""
        if self.mode is NormBoundMode.OFF or server_round < self.from_round:
            return None
        if self.mode is NormBoundMode.ADAPTIVE:
            finite = [n for n in norms if math.isfinite(n)]  # the lower median: of two
            return self.factor * statistics.median_low(finite) if finite else None  # the less
        assert self.value is not None
        if (
            self.mode is NormBoundMode.DP
        ):  # the reply's rounding to the wire dtype may add up to ε·‖θᵢ‖
            return self.value + self.wire_eps * (reference_norm + self.value)
        return self.value


log = logging.getLogger(__name__)

#: What an honest client sends only outside DP (car_fl.client.round: timing is a side channel),
#: with the range an honest value lies in; a value outside it is dropped.
TRAIN_METRICS: Mapping[str, tuple[float, float]] = {
    "train-loss": (0.0, 1e9),
    "train-accuracy": (0.0, 1.0),
    "train-seconds": (0.0, 1e9),
}
#: The reply metrics the server reads (clients.csv's columns from the wire); others are dropped.
REPLY_METRICS = frozenset(wire_key(column) for column in ClientRow.FROM_WIRE)
#: The most characters of a reason that carries a node's text (its error, a value it claimed):
#: clients.csv and the log stay readable (a CSV field reads back up to 131,072).
MAX_REASON = 300


def cut(text: str) -> str:
    """``text`` within :data:`MAX_REASON` characters, saying how many more it had."""
    if len(text) <= MAX_REASON:
        return text
    return f"{text[:MAX_REASON]}… ({len(text) - MAX_REASON} more characters)"


class SampledGrid(Grid):
    """The grid as the wrapped strategy sees it: only this round's sampled nodes."""

    def __init__(self, grid: Grid, nodes: list[int]) -> None:
        self.grid, self.nodes = grid, nodes

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    @property
    def run(self) -> Any:
        return self.grid.run

    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Any:
        return self.grid.send_and_receive(messages, timeout=timeout)


class GuardedStrategy(Strategy):
    """A Flower Message-API strategy with car-fl's sampling, checks and round records."""

    def __init__(
        self,
        inner: FedAvg,
        *,
        spec: Spec,
        min_clients: int = 1,
        sample_size: Any = None,
        seed: int = 0,
        max_examples: int | None = None,
        shard_sizes: Mapping[int, int] | None = None,
        norm_bound: NormBound | None = None,
        min_valid: int = 1,
        min_valid_fraction: float = 0.0,
        experts: ExpertPlan | None = None,
        public_examples: int | None = None,
        private_from: int = 1,
    ) -> None:
        """``inner`` is the Flower strategy that combines the valid replies. From round
        ``private_from`` on, with ``public_examples`` set, every valid reply weighs
        ``public_examples`` whatever count it claims. A round needs at least max(``min_valid``,
        ⌈``min_valid_fraction`` · clients asked⌉) valid replies, else the model stays as it was."""
        self.inner = inner
        # The wrapped strategy sees only the sampled nodes and asks every one of them.
        inner.fraction_train, inner.min_train_nodes, inner.min_available_nodes = 1.0, 1, 1
        inner.arrayrecord_key, inner.configrecord_key = ARRAYS_KEY, CONFIG_KEY
        self.spec = spec
        self.min_clients = min_clients
        self.sample_size = sample_size or (lambda connected: connected)
        self.seed = seed
        self.claims = ShardClaims(shard_sizes, max_examples=max_examples)
        self.norm_bound = norm_bound or NormBound()
        self.min_valid = min_valid
        self.min_valid_fraction = min_valid_fraction
        self.experts = experts
        self.public_examples, self.private_from = public_examples, private_from
        #: This round's tensors per node: those sent, and those its reply may leave out.
        self.expected: dict[int, tuple[list[str], set[str]]] = {}
        self.current: RoundStats | None = None
        self.history: list[RoundStats] = []
        #: The global model sent this round (float64), the reference of every update norm.
        self.reference: dict[str, np.ndarray[Any, Any]] | None = None
        #: Rounds already done before this ``start`` (a resumed run; Flower counts from 1).
        self.round_offset = 0

    @classmethod
    def for_run(
        cls,
        settings: Settings,
        *,
        spec: Spec,
        shard_sizes: Mapping[int, int] | None = None,
        layout: str | None = None,
    ) -> GuardedStrategy:
        """The run's strategy: Flower's ``strategy.name``, guarded as ``settings`` say."""
        fl = settings.fl
        dim = sum(math.prod(shape) for shape, _ in spec.values())
        adapter_dim = sum(math.prod(spec[name][0]) for name in split_adapter(spec)[0])
        return cls(
            flower_strategy(settings.strategy),
            spec=spec,
            min_clients=fl.min_clients,
            sample_size=fl.sample_size,
            seed=settings.seed,
            max_examples=fl.max_examples_per_client,
            shard_sizes=shard_sizes,
            norm_bound=NormBound.from_settings(settings, dim=dim, adapter_dim=adapter_dim),
            min_valid=fl.min_valid_replies,
            min_valid_fraction=fl.min_valid_fraction,
            experts=None if layout is None else ExpertPlan.from_settings(settings, spec, layout),
            public_examples=public_examples(settings) if settings.dp.enabled else None,
            private_from=settings.dp.warmup_rounds + 1,
        )

    spec_of = staticmethod(spec_of)

    def summary(self) -> None:
        log.info(
            "aggregation: %s; update-norm bound %s (%s); replies checked by car-fl",
            type(self.inner).__name__,
            self.norm_bound.mode,
            self.norm_bound.action,
        )
        self.inner.summary()

    def sample(self, server_round: int, grid: Grid) -> tuple[list[int], int]:
        """This round's nodes: a seeded sample of the connected ones, at least ``min_clients``."""
        nodes = sorted(grid.get_node_ids())
        while len(nodes) < self.min_clients:  # like Flower: wait for enough nodes
            log.info("waiting for nodes: %d connected, %d needed", len(nodes), self.min_clients)
            time.sleep(1.0)
            nodes = sorted(grid.get_node_ids())
        size = min(len(nodes), max(self.min_clients, int(self.sample_size(len(nodes)))))
        chosen = random.Random(f"car-fl-sample:{self.seed}:{server_round}").sample(nodes, size)
        return sorted(chosen), len(nodes)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round += self.round_offset
        asked, connected = self.sample(server_round, grid)
        self.reference = {k: decode(v).astype(np.float64) for k, v in arrays.items()}
        # The wrapped strategy computes on float64 NumPy arrays; the wire carries car-fl's own.
        messages = list(
            self.inner.configure_train(
                server_round, as_float64(self.reference), config, SampledGrid(grid, asked)
            )
        )
        self.current = RoundStats(
            round=server_round, started=time.perf_counter(), asked=asked, connected=connected
        )
        self.expected = {}
        for message in messages:
            node = message.metadata.dst_node_id
            sent, optional = list(arrays), set[str]()
            if self.experts is not None:  # public values only: the round and the node's place
                sent = self.experts.sent(server_round, asked.index(node))
                optional = self.experts.optional(sent)
            record = (
                arrays if len(sent) == len(arrays) else ArrayRecord({n: arrays[n] for n in sent})
            )
            # Flower's strategies give every message the same RecordDict: each gets its own
            message.content = RecordDict({**dict(message.content.items()), ARRAYS_KEY: record})
            self.expected[node] = (sent, optional)
            layout = len(self.experts.layout) if self.experts is not None else 0
            self.current.bytes_sent[node] = payload_bytes(record) + layout
        log.info(
            "round %d: asked %d of %d nodes: %s",
            server_round,
            len(asked),
            connected,
            ", ".join(map(str, asked)),
        )
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The aggregate of the valid replies (``None`` keeps the model); the round's statistics
        join :attr:`history` whatever happens (the round recorder reads them)."""
        server_round += self.round_offset
        stats = self.current or RoundStats(round=server_round, started=time.perf_counter())
        self.current = None
        try:
            return self._aggregate_train(server_round, replies, stats)
        finally:
            self.history.append(stats)

    def _aggregate_train(
        self, server_round: int, replies: Iterable[Message], stats: RoundStats
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        checked: dict[int, tuple[dict[str, np.ndarray[Any, Any]], int]] = {}
        originals: dict[int, Message] = {}
        for message in sorted(replies, key=lambda m: m.metadata.src_node_id):
            node = message.metadata.src_node_id
            if message.has_error():
                stats.failed[node] = cut(str(message.error.reason))
                stats.failure_codes[node] = int(message.error.code)
                log.error("round %d: node %d failed: %s", server_round, node, stats.failed[node])
                continue
            try:
                checked_reply = self._check(node, message.content, stats, server_round)
            except Exception as err:  # whatever a client sends must not end the server's run
                stats.rejected[node] = cut(f"malformed reply ({type(err).__name__}: {err})")
                checked_reply = None
            if checked_reply is not None:
                checked[node], originals[node] = checked_reply, message
        valid = self._pin(self._bound_norms(server_round, checked, stats), originals, stats)
        for node in valid:
            record = next(iter(originals[node].content.array_records.values()))
            stats.bytes_received[node] = payload_bytes(record)
        stats.attribute_lost_replies()
        for node, reason in stats.rejected.items():
            log.error("round %d: rejected the reply of node %d: %s", server_round, node, reason)
        asked = max(len(stats.bytes_sent), len(valid) + len(stats.rejected) + len(stats.failed))
        needed = max(self.min_valid, math.ceil(self.min_valid_fraction * asked))
        if len(valid) < needed:
            log.error(
                "round %d: %d valid replies (%d failed, %d rejected) but %d are needed "
                "(fl.min_valid_replies / fl.min_valid_fraction); the global model is kept "
                "unchanged",
                server_round,
                len(valid),
                len(stats.failed),
                len(stats.rejected),
                needed,
            )
            return None, None
        arrays = self._combine(server_round, valid, originals)
        if arrays is None:
            return None, None
        stats.aggregated = True
        summary = MetricRecord({NUM_EXAMPLES: sum(n for _, n in valid.values())})
        if not self._private(server_round):
            for key in ("train-loss", "train-accuracy"):
                summary[key] = _finite(stats.weighted(key))
        return arrays, summary

    def _private(self, server_round: int) -> bool:
        """Whether DP is on in ``server_round`` (honest replies then carry no train metric)."""
        return self.public_examples is not None and server_round >= self.private_from

    def _pin(
        self,
        valid: dict[int, tuple[dict[str, np.ndarray[Any, Any]], int]],
        originals: Mapping[int, Message],
        stats: RoundStats,
    ) -> dict[int, tuple[dict[str, np.ndarray[Any, Any]], int]]:
        """Pin each reply that passed every check, the norm bound too, to the partition it
        claims, in node order; a later claim of a partition pinned in this round is refused."""
        kept = {}
        for node, reply in sorted(valid.items()):
            metrics = next(iter(originals[node].content.metric_records.values()))
            claimed = metrics.get("partition-id")
            _, reason = self.claims.cap_for(node, claimed)
            if reason is not None:
                stats.rejected[node] = cut(reason)
                del stats.client_metrics[node]
                continue
            self.claims.pin(node, claimed)
            kept[node] = reply
        return kept

    def _check(
        self, node: int, content: RecordDict, stats: RoundStats, server_round: int
    ) -> tuple[dict[str, np.ndarray[Any, Any]], int] | None:
        """The decoded arrays and the weight of a valid reply; ``None`` (recorded) if not."""
        metrics = next(iter(content.metric_records.values()), None)
        # Numbers only, and never NaN (ε = inf is honest). Every reply that arrived is a
        # release the server's ε counts, also one refused below.
        numbers = {
            k: float(v)
            for k, v in (metrics or {}).items()
            if k in REPLY_METRICS and isinstance(v, int | float) and not math.isnan(v)
        }
        private = self._private(server_round)  # one a hostile node sends anyway reaches no file
        for key, (low, high) in TRAIN_METRICS.items():
            if key in numbers and (private or not low <= numbers[key] <= high):
                del numbers[key]
        stats.released[node] = numbers
        claimed = metrics.get("partition-id") if metrics is not None else None
        cap, reason = self.claims.cap_for(node, claimed)
        sent, optional = self.expected.get(node, (list(self.spec), set()))
        spec = {name: self.spec[name] for name in sent}
        if reason is None:
            reason = validate_reply(content, spec, max_examples=cap, optional=optional)
        if reason is not None:
            stats.rejected[node] = cut(reason)
            return None
        assert metrics is not None
        record = next(iter(content.array_records.values()))
        arrays = {name: decode(record[name]) for name in spec if name in record}
        stats.client_metrics[node] = numbers
        if self.public_examples is not None and server_round >= self.private_from:
            return arrays, self.public_examples
        return arrays, int(metrics[NUM_EXAMPLES])  # type: ignore[arg-type]

    def _bound_norms(
        self,
        server_round: int,
        checked: dict[int, tuple[dict[str, np.ndarray[Any, Any]], int]],
        stats: RoundStats,
    ) -> dict[int, tuple[dict[str, np.ndarray[Any, Any]], int]]:
        """Apply the update-norm bound: reject (or clip) replies above this round's bound."""
        if self.reference is None or not checked:
            return checked
        reference = self.reference
        norms = {
            node: update_norm(arrays, {k: reference[k] for k in arrays})
            for node, (arrays, _) in checked.items()
        }
        stats.update_norms = norms
        reference_norm = math.sqrt(sum(float(np.square(v).sum()) for v in reference.values()))
        bound = self.norm_bound.bound(
            server_round, list(norms.values()), reference_norm=reference_norm
        )
        stats.norm_bound = bound
        if bound is None:
            return checked
        kept = {}
        for node, (arrays, count) in checked.items():
            norm, own = norms[node], {k: reference[k] for k in arrays}
            over = self._parts_over(arrays, own, server_round)
            if norm <= bound and not over:
                kept[node] = (arrays, count)
            elif self.norm_bound.action is NormBoundAction.CLIP and math.isfinite(norm):
                for _, names, part_norm, part_bound in over:  # each part to its bound first
                    part = clip_update(
                        {k: arrays[k] for k in names},
                        {k: own[k] for k in names},
                        bound=part_bound,
                        norm=part_norm,
                    )
                    arrays = {**arrays, **part}
                norm = update_norm(arrays, own)
                kept[node] = (clip_update(arrays, own, bound=bound, norm=norm), count)
                stats.clipped.append(node)
                log.warning(
                    "round %d: clipped the update of node %d from norm %.4g to %.4g",
                    server_round,
                    node,
                    norms[node],
                    min(norm, bound),
                )
            else:
                what, value, limit = (
                    ("update", norm, bound) if norm > bound else (over[0][0], *over[0][2:])
                )
                stats.rejected[node] = (
                    f"{what} norm {value:.4g} exceeds the bound {limit:.4g} "
                    f"(fl.norm_bound={self.norm_bound.mode})"
                )
                del stats.client_metrics[node]
        return kept

    def _parts_over(
        self, arrays: Arrays, own: Arrays, server_round: int
    ) -> list[tuple[str, tuple[str, ...], float, float]]:
        """The parts whose own norm exceeds their bound (:attr:`NormBound.part_values`): each
        part's label ("adapter" or "head" part), names, norm and bound."""
        values = self.norm_bound.part_values
        if values is None or server_round < self.norm_bound.from_round:
            return []
        over = []
        for label, names, value in zip(PARTS, split_adapter(arrays), values, strict=True):
            part = {k: own[k] for k in names}  # the wire's rounding: of this part's values
            reference_norm = math.sqrt(sum(float(np.square(v).sum()) for v in part.values()))
            limit = value + self.norm_bound.wire_eps * (reference_norm + value)
            norm = update_norm({k: arrays[k] for k in names}, part)
            if names and norm > limit:
                over.append((label, names, norm, limit))
        return over

    def _combine(
        self,
        server_round: int,
        valid: dict[int, tuple[dict[str, np.ndarray[Any, Any]], int]],
        originals: Mapping[int, Message],
    ) -> ArrayRecord | None:
        """The wrapped strategy's aggregate of the valid replies, in the global model's dtypes;
        each tensor over the replies that hold it (one nobody sent keeps its value)."""
        senders: dict[tuple[int, ...], list[str]] = {}
        for name in self.spec:
            holders = tuple(node for node in sorted(valid) if name in valid[node][0])
            senders.setdefault(holders, []).append(name)
        combined: dict[str, np.ndarray[Any, Any]] = {}
        for holders, names in senders.items():
            if not holders:  # nobody sent it: it keeps its value
                assert self.reference is not None
                combined.update({n: self.reference[n] for n in names})
                continue
            clean = []
            for node in holders:  # in node order: arrival order must not matter
                arrays, count = valid[node]
                content = RecordDict(
                    {
                        ARRAYS_KEY: as_float64({n: arrays[n] for n in names}),
                        "metrics": MetricRecord({NUM_EXAMPLES: count}),
                    }
                )
                # Flower's own constructor for a message with given metadata (no overload)
                make = cast(Any, Message)
                clean.append(make(content=content, metadata=originals[node].metadata))
            part, _ = self.inner.aggregate_train(server_round, clean)
            if part is None:
                return None
            combined.update({n: np.asarray(part[n].numpy()) for n in names})
        with np.errstate(over="ignore"):  # overflow to inf is what the check below catches
            out = {
                name: np.asarray(combined[name]).astype(dtype)
                for name, (_, dtype) in self.spec.items()
            }
        bad = [name for name, values in out.items() if not np.isfinite(values).all()]
        if bad:
            log.error(
                "round %d: the aggregate of %s is not finite in the model's dtype; the global "
                "model is kept unchanged",
                server_round,
                ", ".join(bad),
            )
            return None
        return ArrayRecord(array_dict={name: encode(values) for name, values in out.items()})

    # Clients evaluate nothing: the server evaluates the global model itself (evaluate_fn).
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
