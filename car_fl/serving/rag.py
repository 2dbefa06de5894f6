"""Retrieval-augmented generation: the top-K documents, a prompt, a causal LM's answer.

:func:`build_prompt` fits the retrieved documents (best first) and the question into one prompt
(the chat template when there is one); :meth:`Generator.answer` answers with its sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from car_fl.heads.scorer import Hit

if TYPE_CHECKING:
    from car_fl.model.encoder import Encoder
    from car_fl.settings.schema import ModelConfig

#: What the generator is told before the documents.
INSTRUCTION = (
    "Answer the question using only the documents below. "
    "If they do not hold the answer, say that you do not know."
)
#: A simpler instruction for very small generators (``car-fl ask --instruction``).
PLAIN_INSTRUCTION = "Answer the question using the documents below."
#: A context length to assume when neither the model nor its tokenizer states one.
FALLBACK_CONTEXT = 2048


class GeneratorLoadError(OSError):
    """The generator (a causal LM and its tokenizer) could not be loaded."""


@dataclass(frozen=True)
class Answer:
    """A generated answer, the ids of the documents it was given (best first) and the prompt."""

    text: str
    sources: tuple[str, ...]
    prompt: str


def document_block(hits: Sequence[Hit]) -> str:
    """The documents as numbered paragraphs, best first: ``[1] (id) text``."""
    return "\n\n".join(f"[{rank}] ({hit.id}) {hit.text}" for rank, hit in enumerate(hits, 1))


def build_prompt(
    question: str,
    hits: Sequence[Hit],
    tokenizer: Any | None = None,
    *,
    instruction: str = INSTRUCTION,
) -> str:
    """The prompt for ``question`` given ``hits``: chat template if ``tokenizer`` has one."""
    user = f"{instruction}\n\nDocuments:\n{document_block(hits)}\n\nQuestion: {question}"
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text: str = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        return text
    return f"{user}\nAnswer:"


def cut_to_tokens(text: str, tokenizer: Any, budget: int) -> str:
    """``text``'s first ``budget`` tokens (all of it when it fits), decoded back to text."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= budget:
        return text
    return str(tokenizer.decode(ids[: max(budget, 0)], skip_special_tokens=True)).strip()


def fit_documents(
    question: str,
    hits: Sequence[Hit],
    tokenizer: Any,
    *,
    context: int,
    max_new_tokens: int,
    instruction: str = INSTRUCTION,
) -> list[Hit]:
    """``hits`` cut to equal shares of the tokens the prompt and ``max_new_tokens`` leave free
    in ``context`` (``ValueError`` when the question alone leaves no room)."""
    bare = build_prompt(
        question, [Hit(h.id, "", h.score) for h in hits], tokenizer, instruction=instruction
    )
    used = len(tokenizer(bare, add_special_tokens=True)["input_ids"])
    free = context - max_new_tokens - used
    if hits and free < len(hits):
        raise ValueError(
            f"the question and {len(hits)} document headers take {used} of the generator's "
            f"{context} tokens, leaving no room for the documents and {max_new_tokens} new "
            "tokens; ask a shorter question, lower -k or --max-new-tokens"
        )
    share = free // max(len(hits), 1)
    return [Hit(h.id, cut_to_tokens(h.text, tokenizer, share), h.score) for h in hits]


def context_length(model: Any, tokenizer: Any) -> int:
    """The tokens the generator attends to: its config's, else its tokenizer's, else 2048."""
    found = getattr(model.config, "max_position_embeddings", None)
    if isinstance(found, int) and found > 0:
        return found
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**7:  # transformers' "no limit" is huge
        return limit
    return FALLBACK_CONTEXT


class Generator:
    """A causal LM and its tokenizer that answer questions from retrieved documents."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.context = context_length(model, tokenizer)

    def as_encoder(self, cfg: ModelConfig) -> Encoder:
        """The same weights as the frozen encoder (the paper's on-device case: one copy in
        memory): the causal LM's transformer without its LM head, and the same tokenizer."""
        from car_fl.model.encoder import Encoder

        return Encoder(self.model.get_decoder(), self.tokenizer, cfg)

    def prompt(
        self,
        question: str,
        hits: Sequence[Hit],
        *,
        max_new_tokens: int,
        instruction: str = INSTRUCTION,
    ) -> str:
        """The prompt :meth:`answer` sends: documents cut to fit the context."""
        fitted = fit_documents(
            question,
            hits,
            self.tokenizer,
            context=self.context,
            max_new_tokens=max_new_tokens,
            instruction=instruction,
        )
        return build_prompt(question, fitted, self.tokenizer, instruction=instruction)

    def answer(
        self,
        question: str,
        hits: Sequence[Hit],
        *,
        max_new_tokens: int = 128,
        instruction: str = INSTRUCTION,
    ) -> Answer:
        """Greedy generation of at most ``max_new_tokens`` tokens after the prompt, which opens
        with ``instruction`` (small models may need a simpler one than :data:`INSTRUCTION`)."""
        import torch

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt = self.prompt(question, hits, max_new_tokens=max_new_tokens, instruction=instruction)
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        # a chat template already holds the special tokens it needs
        inputs = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=not templated)
        inputs = {k: v.to(self.model.device) for k, v in inputs.items()}
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        with torch.inference_mode():
            out = self.model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
            )
        new = out[0, inputs["input_ids"].shape[1] :]
        text = str(self.tokenizer.decode(new, skip_special_tokens=True)).strip()
        return Answer(text=text, sources=tuple(h.id for h in hits), prompt=prompt)


def load_generator(
    name_or_path: str,
    *,
    device: str = "auto",
    trust_remote_code: bool = False,
    dtype: str = "auto",
) -> Generator:
    """A Hugging Face causal LM and its tokenizer (hub id, folder, or a GGUF file or preset
    such as ``gguf:smollm2``: :mod:`car_fl.model.gguf`), in eval mode, in ``dtype``
    (``auto``: as :func:`~car_fl.model.encoder.pick_dtype` chooses for the device)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from car_fl.model.encoder import pick_device, pick_dtype
    from car_fl.model.gguf import GgufError, resolve
    from car_fl.model.loading import load_pretrained

    target = pick_device(device)
    torch_dtype = pick_dtype(dtype, target)
    try:
        folder = resolve(name_or_path)
    except GgufError as err:
        raise GeneratorLoadError(str(err)) from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        model = load_pretrained(
            AutoModelForCausalLM,
            folder,
            dtype=torch_dtype,
            device=target,
            trust_remote_code=trust_remote_code,
        )
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GeneratorLoadError(
            f"could not load the generator {name_or_path!r} ({first}); give a causal LM's hub "
            "id (online, or in the local Hugging Face cache) or a folder holding its "
            "config.json, weights and tokenizer files"
        ) from err
    model = model.to(target).eval()
    return Generator(model, tokenizer)
