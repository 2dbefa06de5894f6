"""The settings' choices: every setting with a fixed set of values that no head owns (a head's
are in :mod:`car_fl.heads.config`)."""

from __future__ import annotations

from car_fl.common.choice import Choice, at_least, one_of, positive

__all__ = ["Choice", "at_least", "one_of", "positive"]


class Mode(Choice):
    """What is trained: the head alone on cached features, or the adapter and the head."""

    CLASSIFIER = "classifier"
    ADAPTER_CLASSIFIER = "adapter+classifier"


class Pooling(Choice):
    """How a sequence's hidden states become one vector.

    ``eos``: the state of an EOS token appended to every text (the method's choice for
    generative LMs); ``last``: the state of the text's own last token, nothing appended (what
    PromptEOL-style templates read); ``mean``: the masked mean over the real tokens.
    """

    EOS = "eos"
    LAST = "last"
    MEAN = "mean"


class FeatureNorm(Choice):
    """What each pooled vector is divided by, per example (nothing about other records).

    ``l2``: its Euclidean norm, so every feature has norm 1 (a linear head and DP clipping see
    one scale whatever a model's few very large dimensions do).
    """

    NONE = "none"
    L2 = "l2"


class Standardize(Choice):
    """Per-dimension scaling of pooled features with statistics shared by every party.

    ``documents``: each dimension's mean and deviation over the document corpus's embeddings
    (public to the federation; never a client's queries), applied to queries and documents
    alike (:mod:`car_fl.model.retriever`).
    """

    NONE = "none"
    DOCUMENTS = "documents"


class DPMode(Choice):
    """Local differential privacy: off, fixed clipping bound, adaptive clipping, or DP-SGD.

    ``record``: record-level DP-SGD on each client (:mod:`car_fl.privacy.dpsgd`).
    """

    NONE = "none"
    FIXED = "fixed"
    ADAPTIVE = "adaptive"
    RECORD = "record"


class Reader(Choice):
    """File formats understood by :mod:`car_fl.data.readers`."""

    SMS_SPAM = "sms_spam"
    AG_NEWS = "ag_news"
    ARXIV = "arxiv"
    TABLE = "table"
    #: A document corpus: ``dataset.documents_path`` (documents) and ``dataset.path`` (queries).
    CORPUS = "corpus"


class OptimizerKind(Choice):
    """The ``torch.optim`` optimisers a run may use (``train.optimizer``)."""

    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"


class Granularity(Choice):
    """Local DP: clip and noise once per round, or after every optimizer step (Algorithm 1)."""

    ROUND = "round"
    STEP = "step"


class NoiseRule(Choice):
    """Adaptive DP: noise std z_Δ·Cᵢ (``mechanism``), or Algorithm 1's bound on the raw norm."""

    MECHANISM = "mechanism"
    BOUND = "bound"


class AdaptiveRule(Choice):
    """How an adaptive clipping bound moves (:mod:`car_fl.settings.dp_modes.adaptive`).

    ``geometric``: Andrew et al. (2021), from a noised clipped indicator: private.
    ``linear``: the CaR paper's C ← (1 − β)·C + β·γ·‖Δ‖ on the raw norm: not private.
    """

    GEOMETRIC = "geometric"
    LINEAR = "linear"


class Partitioning(Choice):
    """How the training split is divided among clients."""

    IID = "iid"
    DIRICHLET = "dirichlet"
    #: A corpus's queries, Dirichlet(α) over their documents' topic (``dataset.topic_key``).
    TOPIC = "topic"
    #: IID by a keyed hash of each example's own text: adding or removing a record moves no
    #: other record to another shard (record-level DP on a shared file needs it).
    HASH = "hash"


class Split(Choice):
    """How examples are placed in train, validation and test (:mod:`car_fl.data.splits`)."""

    #: A seeded permutation (stratified by label with ``dataset.stratify``).
    SEEDED = "seeded"
    #: A keyed hash of each example's own text: adding or removing a record moves no other
    #: record to another split (record-level DP on a shared file needs it); not stratified.
    HASH = "hash"


class NormBoundMode(Choice):
    """The server's bound on a reply's update norm (:mod:`car_fl.server.strategy`)."""

    AUTO = "auto"
    OFF = "off"
    FIXED = "fixed"
    ADAPTIVE = "adaptive"
    DP = "dp"


class NormBoundAction(Choice):
    """What the server does with a reply above the update-norm bound."""

    REJECT = "reject"
    CLIP = "clip"


class StrategyName(Choice):
    """``strategy.name``: one ``conf/strategy/<name>.yaml`` each; :mod:`car_fl.server.aggregation`
    builds each one's Flower strategy."""

    FEDAVG = "fedavg"
    MEDIAN = "median"
    TRIMMED_MEAN = "trimmed_mean"
    KRUM = "krum"
    MULTIKRUM = "multikrum"
    FEDADAM = "fedadam"
    FEDYOGI = "fedyogi"
    FEDAVGM = "fedavgm"
    FEDPROX = "fedprox"


#: ``model.dtype``: ``auto`` (see :func:`car_fl.model.encoder.pick_dtype`) or a torch dtype's name.
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: ``device``: ``auto`` (CUDA, then Apple MPS, then CPU; :func:`car_fl.model.encoder.pick_device`).
DEVICES = ("auto", "cpu", "cuda", "mps")
#: ``comm.dtype``: dtypes a tensor may travel in; bfloat16 has no NumPy dtype, so no Array.
WIRE_DTYPES = ("float32", "float16")
PADDING_SIDES = ("auto", "left", "right")
#: ``model.blocks``: the transformer blocks on this machine, or on a blocks service
#: (:mod:`car_fl.blocks`; the service's address is node-local: ``model.blocks_service``).
BLOCKS = ("local", "remote")
