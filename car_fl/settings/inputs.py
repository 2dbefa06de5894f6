"""What goes into the encoder: the dataset and how it is split, the frozen model and its pooling."""

from __future__ import annotations

from dataclasses import dataclass, field

from car_fl.heads.config import Similarity
from car_fl.settings.choices import (
    BLOCKS,
    DTYPES,
    PADDING_SIDES,
    FeatureNorm,
    Pooling,
    Reader,
    Split,
    Standardize,
    one_of,
)


@dataclass
class DatasetConfig:
    """Where the examples come from (``path`` before ``hub_id``) and how they are split."""

    name: str = "sms_spam"
    reader: Reader = Reader.SMS_SPAM
    hub_id: str | None = "ucirvine/sms_spam"
    hub_config: str | None = None
    path: str | None = None
    test_path: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    test_fraction: float = 0.2
    #: Share of the training examples held out for model selection (0: none, best = final).
    val_fraction: float = 0.1
    #: Collapse duplicate (normalised) texts before splitting; conflicting labels are dropped.
    dedupe: bool = True
    #: seeded: a seeded permutation (stratified with ``stratify``); hash: a keyed hash of each
    #: text, so one record moves no other (without a subsample or a label filter; ``dedupe``
    #: keeps each normalised text and label once, conflicts kept).
    split: Split = Split.SEEDED
    stratify: bool = True
    min_examples_per_label: int = 1
    max_examples: int | None = None
    #: Each label's document text (MIPS compares queries with it); a label without one: its name.
    label_texts: dict[str, str] = field(default_factory=dict)
    #: reader=corpus: the documents file (JSONL: id, text, optional title and metadata; or a
    #: CSV/TSV with id and text columns); ``path`` is then the queries file (query, document
    #: id, optional split). Labels are the documents, in this file's order.
    documents_path: str | None = None
    #: reader=corpus: share of the documents held out as *new documents* (their training
    #: queries dropped: they arrive after training), chosen with the run's seed.
    new_fraction: float = 0.0
    #: reader=corpus: the metadata field naming a document's topic (fl.partitioning=topic).
    topic_key: str = "category"
    #: reader=corpus: windows of each document's own words added as training queries
    #: (:mod:`car_fl.data.pseudo_queries`), none for new documents; 0: none.
    pseudo_queries: int = 0
    #: The length of a pseudo-query, in words.
    pseudo_query_words: int = 12
    #: reader=corpus: a queries file ``car-fl generate-queries`` wrote, added to the training
    #: queries (other readers ignore it).
    generated_queries_path: str | None = None

    def __post_init__(self) -> None:
        self.reader = Reader.parse("dataset.reader", self.reader)
        self.split = Split.parse("dataset.split", self.split)
        if self.split is Split.HASH:
            # each of these places a record by the others: one record would move many
            moved = {
                "dataset.max_examples": self.max_examples is not None,
                "dataset.min_examples_per_label": self.min_examples_per_label > 1,
                "dataset.reader=corpus": self.reader is Reader.CORPUS,
            }
            if any(moved.values()):
                raise ValueError(
                    "dataset.split=hash places each record by its own text alone; "
                    f"{', '.join(k for k, v in moved.items() if v)} would place records by "
                    "the others (a subsample's draw, a label's count, a corpus's documents). "
                    "Set dataset.max_examples=null and dataset.min_examples_per_label=1, or "
                    "use dataset.split=seeded"
                )
        if self.path is None and self.hub_id is None:
            raise ValueError(
                f"dataset {self.name!r} has neither dataset.path (a local file) nor "
                "dataset.hub_id (a Hugging Face dataset); set one of them"
            )
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"dataset.test_fraction must be in (0, 1), got {self.test_fraction!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(
                f"dataset.val_fraction must be in [0, 1) (e.g. 0.1), got {self.val_fraction!r}"
            )
        if self.min_examples_per_label < 1:
            raise ValueError(
                f"dataset.min_examples_per_label must be >= 1, got {self.min_examples_per_label}"
            )
        if self.max_examples is not None and self.max_examples < 2:
            raise ValueError(f"dataset.max_examples must be >= 2 or null, got {self.max_examples}")
        if not 0.0 <= self.new_fraction < 1.0:
            raise ValueError(
                f"dataset.new_fraction must be in [0, 1) (e.g. 0.1), got {self.new_fraction!r}"
            )
        if self.pseudo_queries < 0 or self.pseudo_query_words < 1:
            raise ValueError(
                "dataset.pseudo_queries must be >= 0 and dataset.pseudo_query_words >= 1, got "
                f"{self.pseudo_queries} and {self.pseudo_query_words}"
            )
        if self.pseudo_queries and self.reader is not Reader.CORPUS:
            raise ValueError(
                f"dataset.pseudo_queries={self.pseudo_queries} takes windows of a corpus's "
                f"documents; dataset.reader={self.reader} has none. Use a corpus (dataset=corpus) "
                "or dataset.pseudo_queries=0"
            )
        if self.reader is Reader.CORPUS and self.path is not None and not self.documents_path:
            raise ValueError(
                "dataset.reader=corpus needs dataset.documents_path (the documents file) beside "
                "dataset.path (the queries file)"
            )

    @property
    def label(self) -> str:
        """What logs, folder names and plots call the data: the local file's name, else the
        Hub dataset (``name`` is the reader's format, also for a synthetic file)."""
        if self.path is not None:
            return self.path.rstrip("/").rsplit("/", 1)[-1]
        return str(self.hub_id or self.name)


@dataclass
class ModelConfig:
    """The frozen encoder: which model, where it runs, how its output is pooled."""

    name: str = "tinyllama"
    name_or_path: str = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    revision: str | None = None
    dtype: str = "auto"
    pooling: Pooling = Pooling.EOS
    #: Which hidden layer is pooled: -1 the final one (after the model's last norm), 0 the
    #: embeddings, k the output of block k; negative counts from the end, as in Python.
    layer: int = -1
    #: A template around every text the encoder reads, ``{text}`` where it goes, e.g. PromptEOL's
    #: ``This sentence : "{text}" means in one word:"`` (with ``pooling: last``).
    prompt: str | None = None
    #: Per-example scaling of the pooled vector (:class:`FeatureNorm`).
    normalize: FeatureNorm = FeatureNorm.NONE
    #: Per-dimension standardisation after pooling (:class:`Standardize`): ``documents`` uses
    #: the corpus's statistics, never a client's queries; needs a corpus of documents.
    standardize: Standardize = Standardize.NONE
    #: The similarity the encoder was trained for (cosine for MiniLM); MIPS and kNN's default.
    similarity: Similarity = Similarity.DOT
    max_length: int = 128
    #: Token limit of document texts (document heads, MIPS over a corpus); null: max_length.
    document_max_length: int | None = None
    padding_side: str = "auto"
    trust_remote_code: bool = False
    #: ``local``: the node runs the transformer blocks; ``remote``: a blocks service does
    #: (``car-fl serve-blocks``) and the node keeps the embeddings, adapter, norm and head.
    blocks: str = "local"
    #: The blocks service's address (``http://127.0.0.1:8200/blocks``). Node-local: a node sets
    #: it (``--node-config blocks-service=URL``) and refuses a run config that does.
    blocks_service: str | None = None

    def __post_init__(self) -> None:
        one_of("model.dtype", self.dtype, DTYPES)
        self.pooling = Pooling.parse("model.pooling", self.pooling)
        self.normalize = FeatureNorm.parse("model.normalize", self.normalize)
        self.standardize = Standardize.parse("model.standardize", self.standardize)
        self.similarity = Similarity.parse("model.similarity", self.similarity)
        if self.prompt is not None and self.prompt.count("{text}") != 1:
            raise ValueError(
                f"model.prompt={self.prompt!r} must hold {{text}} exactly once (where the text "
                'goes), e.g. \'This sentence : "{text}" means in one word:"\''
            )
        one_of("model.padding_side", self.padding_side, PADDING_SIDES)
        one_of("model.blocks", self.blocks, BLOCKS)
        if self.max_length < 2:
            raise ValueError(f"model.max_length must be >= 2, got {self.max_length}")
        if self.document_max_length is not None and self.document_max_length < 2:
            raise ValueError(
                f"model.document_max_length must be >= 2 or null, got {self.document_max_length}"
            )
