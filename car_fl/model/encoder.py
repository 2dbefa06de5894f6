"""The frozen encoder: any Hugging Face model whose forward accepts ``inputs_embeds``.

Loads a model and its tokenizer by hub id or local folder, places it on a device in a dtype,
freezes it (eval mode, no parameter requires a gradient), tokenizes with an EOS token appended
when the tokenizer does not add one, and pools final hidden states (``eos`` or ``mean``).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import astuple, dataclass
from typing import Any

import torch
from torch import nn

from car_fl.blocks.parts import final_norm_name, get_module
from car_fl.blocks.remote import RemoteBlocks
from car_fl.model.blockless import connect
from car_fl.model.loading import EncoderLoadError, load_error, load_pretrained
from car_fl.settings.schema import DEVICES, DTYPES, FeatureNorm, ModelConfig, Pooling, one_of

log = logging.getLogger(__name__)

#: Incremented on every successful :func:`load_encoder`; tests count loads per process with it.
LOAD_COUNT = 0
#: Encoders loaded by :func:`shared_encoder`, by their model settings and device.
_SHARED: dict[tuple[object, ...], Encoder] = {}


def pick_device(requested: str = "auto") -> torch.device:
    """``auto``: CUDA, then Apple MPS, then CPU. Otherwise the named device, if available."""
    one_of("device", requested, DEVICES)
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was requested but CUDA is not available; use device=auto")
    if requested == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device=mps was requested but Apple MPS is not available; use device=auto")
    return torch.device(requested)


#: CPU features with native bfloat16 matrix instructions, as ``torch.cpu.get_capabilities()``
#: names them: AVX512-BF16 (Zen 4, Cooper Lake and later) and AMX-BF16 (Sapphire Rapids).
NATIVE_BF16_CPU_FEATURES = ("avx512_bf16", "amx_bf16")


def cpu_bf16_features() -> list[str]:
    """The native-bf16 features of this CPU that torch reports (empty: bf16 is emulated)."""
    capabilities: dict[str, object] = getattr(torch.cpu, "get_capabilities", dict)()
    return [name for name in NATIVE_BF16_CPU_FEATURES if capabilities.get(name)]


def dtype_choice(requested: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The frozen model's dtype for ``requested`` on ``device``, and why, in a few words.

    ``auto``: bf16 on CUDA (else fp16), fp16 on MPS, bf16 on a CPU with native bf16, else fp32.
    Only the frozen weights take it; what trains and the pooled features stay float32.
    """
    one_of("model.dtype", requested, DTYPES)
    if requested != "auto":
        dtype: torch.dtype = getattr(torch, requested)
        return dtype, "as set by model.dtype"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: CUDA device with bf16"
        return torch.float16, "auto: CUDA device without bf16"
    if device.type == "mps":
        return torch.float16, "auto: Apple MPS"
    if device.type == "cpu" and (native := cpu_bf16_features()):
        return torch.bfloat16, f"auto: the CPU has native bf16 ({', '.join(native)})"
    return torch.float32, "auto: the CPU has no native bf16 (AVX512-BF16 or AMX)"


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """The frozen model's dtype (:func:`dtype_choice` without its reason)."""
    return dtype_choice(requested, device)[0]


@dataclass
class Tokenized:
    """Token ids per example (no padding), with EOS appended where the tokenizer does not."""

    input_ids: list[list[int]]

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]


class Encoder(nn.Module):
    """A frozen Hugging Face model plus tokenizer, split as ``TKN`` (:meth:`embed`) → (adapter)
    → ``TRF`` (:meth:`transform`) → :meth:`pool`."""

    def __init__(
        self, model: Any, tokenizer: Any, cfg: ModelConfig, *, blocks: RemoteBlocks | None = None
    ) -> None:
        super().__init__()
        self.model: Any = model
        #: The blocks on a service (``model`` then holds only the embeddings and final norm).
        self.blocks = blocks
        self._norm = final_norm_name(model) if blocks is not None else None
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.pooling = cfg.pooling
        self.model.eval()
        self.model.requires_grad_(False)
        params = inspect.signature(self.model.forward).parameters
        if "inputs_embeds" not in params:
            raise EncoderLoadError(
                f"model {cfg.name_or_path!r} ({type(model).__name__}) does not accept "
                "inputs_embeds, so no adapter can sit before its transformer blocks"
            )
        self._takes_position_ids = "position_ids" in params
        self._takes_use_cache = "use_cache" in params
        self.eos_id, self.append_eos = self._eos_policy()
        if self.pooling is Pooling.LAST:  # the text's own last token: nothing appended
            self.append_eos = False
        self.pad_id = self._pad_id()

    # ----------------------------------------------------------------------------- properties
    @property
    def hidden_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[1])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def train(self, mode: bool = True) -> Encoder:
        """The frozen model stays in eval mode (no dropout) whatever the parent module does."""
        super().train(mode)
        self.model.eval()
        return self

    # ----------------------------------------------------------------------------- tokenizing
    def _eos_policy(self) -> tuple[int | None, bool]:
        """Which id ends a sequence, and whether we must append it ourselves."""
        eos_id = self.tokenizer.eos_token_id
        if eos_id is None:
            # BERT-style tokenizers close with [SEP]; the last real token is then that.
            return self.tokenizer.sep_token_id, False
        probe = self.tokenizer("a b", add_special_tokens=True)["input_ids"]
        return int(eos_id), not (probe and probe[-1] == eos_id)

    def _pad_id(self) -> int:
        for candidate in (self.tokenizer.pad_token_id, self.eos_id, 0):
            if candidate is not None:
                return int(candidate)
        return 0

    def tokenize(self, texts: list[str], *, max_length: int | None = None) -> Tokenized:
        """Tokenize without padding, truncated to ``max_length`` (default: the model's
        ``max_length``) including the EOS token and the ``model.prompt`` template's tokens
        (the text is cut, never the template)."""
        max_length = max_length or self.cfg.max_length
        limit = max_length - 1 if self.append_eos else max_length
        if self.cfg.prompt is None:
            encoded = self.tokenizer(
                list(texts), add_special_tokens=True, truncation=True, max_length=limit
            )["input_ids"]
        else:
            encoded = self._templated(list(texts), limit)
        if self.append_eos:
            assert self.eos_id is not None
            encoded = [[*ids, self.eos_id] for ids in encoded]
        # an empty text is one pad token: a crash would tell the server the record was sampled
        return Tokenized(input_ids=[list(ids) if ids else [self.pad_id] for ids in encoded])

    def _templated(self, texts: list[str], limit: int) -> list[list[int]]:
        """``model.prompt`` around each text: the special tokens the tokenizer adds to a
        sequence, the template's tokens before and after the text, the text cut to fit."""
        assert self.cfg.prompt is not None
        before, after = self.cfg.prompt.split("{text}")
        marker = self.tokenizer("", add_special_tokens=True)["input_ids"]
        plain = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        head = self.tokenizer(before, add_special_tokens=False)["input_ids"] if before else []
        tail = self.tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
        # BERT-style tokenizers wrap a sequence ([CLS] ... [SEP]); Llama-style ones prefix BOS.
        closing = [marker[-1]] if len(marker) > 1 else []
        opening = marker[: len(marker) - len(closing)]
        room = limit - len(opening) - len(head) - len(tail) - len(closing)
        if room < 1:
            raise ValueError(
                f"model.prompt takes {limit - room} of model.max_length={limit} tokens, leaving "
                "no room for the text; raise model.max_length or shorten the template"
            )
        return [[*opening, *head, *ids[:room], *tail, *closing] for ids in plain]

    def pad(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad a batch of id lists to its own longest length: ``(batch, seq)`` ids and mask."""
        width = max(len(ids) for ids in batch)
        left = self.padding_side == "left"
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            span = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[row, span] = torch.tensor(seq, dtype=torch.long)
            mask[row, span] = 1
        return ids.to(self.device), mask.to(self.device)

    @property
    def padding_side(self) -> str:
        if self.cfg.padding_side != "auto":
            return self.cfg.padding_side
        return str(getattr(self.tokenizer, "padding_side", "right") or "right")

    # -------------------------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """TKN: token ids ``(batch, seq)`` → embeddings ``(batch, seq, hidden)``."""
        embeddings: torch.Tensor = self.model.get_input_embeddings()(input_ids)
        return embeddings

    def transform(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """TRF: embeddings ``(batch, seq, hidden)`` → final hidden states, same shape; position
        ids come from the mask, so either padding side gives the same positions."""
        if self.blocks is not None:
            states: torch.Tensor = self.blocks(inputs_embeds, attention_mask)
            if self._norm is not None:
                states = get_module(self.model, self._norm)(states)
            return states
        kwargs: dict[str, Any] = {"inputs_embeds": inputs_embeds, "attention_mask": attention_mask}
        if self._takes_position_ids:
            kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        if self._takes_use_cache:
            kwargs["use_cache"] = False
        if self.cfg.layer != -1:
            kwargs["output_hidden_states"] = True
        out = self.model(**kwargs)
        if self.cfg.layer != -1:
            states = out.hidden_states
            if not -len(states) <= self.cfg.layer < len(states):
                raise ValueError(
                    f"model.layer={self.cfg.layer} is out of range: {self.cfg.name_or_path} has "
                    f"{len(states) - 1} blocks, so choose from {-len(states)} to "
                    f"{len(states) - 1} (-1: the final layer)"
                )
            layer: torch.Tensor = states[self.cfg.layer]
            return layer
        hidden: torch.Tensor = (
            out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        )
        return hidden

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``(batch, seq, hidden)`` → one float32 vector per sequence (a
        bf16 or fp16 model's states are pooled in float32: features feed float32 heads),
        scaled as ``model.normalize`` says."""
        pooled = pool(hidden, attention_mask, self.pooling).float()
        if self.cfg.normalize is FeatureNorm.L2:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """``eos`` and ``last``: the hidden state of the last real token; ``mean``: masked mean over
    real tokens, in float32. Either padding side; padded positions are never read."""
    mask = attention_mask.bool()
    if pooling in (Pooling.EOS, Pooling.LAST):
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)
        if bool((last < 0).any()):
            raise ValueError("a sequence in the batch has no real token (all-zero attention mask)")
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    kept = torch.where(mask.unsqueeze(-1), hidden, torch.zeros_like(hidden))
    counts = mask.sum(dim=1, keepdim=True).clamp(min=1).to(torch.float32)
    return kept.sum(dim=1, dtype=torch.float32) / counts


def shared_encoder(cfg: ModelConfig, *, device: str = "auto") -> Encoder:
    """The encoder of ``cfg`` on ``device``, loaded once per process and shared by every node
    the process serves: frozen public weights, which hold nothing of any node's data."""
    key = (*astuple(cfg), device)
    if key not in _SHARED:
        _SHARED[key] = load_encoder(cfg, device=device)
    return _SHARED[key]


def placement(cfg: ModelConfig, device: str) -> tuple[str, torch.device, torch.dtype, str]:
    """Where ``cfg``'s model comes from (a GGUF resolved to its folder), the device it runs on,
    its dtype and why that dtype; :class:`EncoderLoadError` for a GGUF that cannot be read."""
    from car_fl.model.gguf import GgufError, resolve

    try:
        name = resolve(cfg.name_or_path)
    except GgufError as err:
        raise EncoderLoadError(str(err)) from err
    target = pick_device(device)
    dtype, why = dtype_choice(cfg.dtype, target)
    return name, target, dtype, why


def load_weights(cfg: ModelConfig, name: str, *, dtype: torch.dtype, device: torch.device) -> Any:
    """``AutoModel`` of ``name`` in ``dtype``, its attention chosen for ``device`` but left on
    the CPU (placing it is the caller's: the blocks service strips it first); a failure names
    what to fix."""
    from transformers import AutoModel

    try:
        model = load_pretrained(
            AutoModel,
            name,
            dtype=dtype,
            device=device,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
        )
    except Exception as err:
        raise load_error(name, "weights", err, cfg.revision) from err
    return model


def load_encoder(cfg: ModelConfig, *, device: str = "auto") -> Encoder:
    """Load, place and freeze the model named by ``cfg``: a hub id, a local folder, or a GGUF
    file or preset (:mod:`car_fl.model.gguf`)."""
    global LOAD_COUNT
    from transformers import AutoTokenizer

    from car_fl.common.progress import quiet_hub_bars

    quiet_hub_bars()
    name, target, dtype, why = placement(cfg, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except Exception as err:
        raise load_error(name, "tokenizer", err, cfg.revision) from err
    if cfg.blocks == "remote":
        model, blocks = connect(cfg, name, dtype=dtype, device=target)
        encoder = Encoder(model, tokenizer, cfg, blocks=blocks)
    else:
        model = load_weights(cfg, name, dtype=dtype, device=target).to(target)
        encoder = Encoder(model, tokenizer, cfg)
    LOAD_COUNT += 1
    frozen = sum(p.numel() for p in model.parameters())
    log.info(
        "encoder %s loaded on %s in %s (%s), %s attention: hidden size %d, %s frozen parameters "
        "on this node%s, pooling %s",
        cfg.name_or_path,
        target,
        str(dtype).removeprefix("torch."),
        why,
        model.config._attn_implementation,
        encoder.hidden_size,
        f"{frozen:,}",
        "" if encoder.blocks is None else f" (the blocks on {cfg.blocks_service})",
        cfg.pooling,
    )
    return encoder
