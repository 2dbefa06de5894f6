"""Loading a frozen model's weights: the kernels its dtype takes, and errors that say what to do.
The one place the encoder, the blocks service and the RAG generator load a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class EncoderLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says which, why and what to do."""


def attention_choice(dtype: torch.dtype, device: torch.device) -> str:
    """The frozen model's attention kernels: ``eager`` for bf16 on a CPU (faster there than
    SDPA's backward, docs/performance.md), ``sdpa`` elsewhere; both are exact."""
    return "eager" if device.type == "cpu" and dtype == torch.bfloat16 else "sdpa"


def load_pretrained(
    auto_class: Any, name: str, *, dtype: torch.dtype, device: torch.device, **kwargs: Any
) -> Any:
    """``auto_class.from_pretrained`` in ``dtype`` with :func:`attention_choice`'s kernels, so
    the encoder and the generator run the same ones; placing it on ``device`` is the caller's."""
    attention = attention_choice(dtype, device)
    try:
        return auto_class.from_pretrained(
            name, dtype=dtype, attn_implementation=attention, **kwargs
        )
    except (ValueError, ImportError) as err:
        if attention != "sdpa" or "sdpa" not in str(err).lower():
            raise
        return auto_class.from_pretrained(name, dtype=dtype, **kwargs)


def load_error(
    name: str, what: str, err: Exception, revision: str | None = None
) -> EncoderLoadError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = str(err).lower()
    if Path(name).exists() or name.startswith(("/", ".", "~")):
        hint = "check that the folder holds config.json, the weights and the tokenizer files"
    elif "gated" in text or "401" in text or "403" in text or "access" in text:
        hint = (
            "the model is gated: accept its licence on huggingface.co and run "
            "`huggingface-cli login`, or download it and set model.name_or_path=/local/folder"
        )
    else:
        from car_fl.model.sources import MODEL_FIX

        hint = f"check the hub id and your network; offline, use {MODEL_FIX}"
        if revision is not None:
            hint = (
                f"revision {revision} must be in the Hub cache offline (huggingface-cli "
                f"download {name} --revision {revision}); or {hint}"
            )
    return EncoderLoadError(f"could not load the {what} of model {name!r}: {reason}. Fix: {hint}")
