"""Tiny models, tokenizers and data built offline: for tests, benchmarks and trying things.

Real transformers classes with small configs, random weights, loaded back through car-fl's own
loader, so the code path is the one real models take.

    python -m car_fl.testing.tiny /tmp/car-fl-tiny   # writes llama/, bert/ and synthetic.tsv there
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = (
    [f"w{i}" for i in range(60)]
    + [f"k{i}" for i in range(8)]
    + [
        "free",
        "prize",
        "call",
        "now",
        "win",
        "cash",
        "hello",
        "lunch",
        "see",
        "you",
        "later",
        "ok",
        "meeting",
        "home",
        "love",
        "text",
        "stop",
        "claim",
        "urgent",
        "tomorrow",
    ]
)


def build_llama(
    folder: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    intermediate: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    dtype: str = "float32",
    causal: bool = False,
    vocab_size: int | None = None,
) -> Path:
    """A 2-layer Llama (hidden 64) and a word-level tokenizer that adds BOS but not EOS;
    ``causal``: a ``LlamaForCausalLM`` (a generator). TinyLlama's shape: ``hidden=2048,
    layers=22, intermediate=5632, heads=32, kv_heads=4, vocab_size=32000``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if vocab_size is not None and vocab_size < len(vocab):
        raise ValueError(f"vocab_size must be >= the tokenizer's {len(vocab)}, got {vocab_size}")
    config = LlamaConfig(
        vocab_size=vocab_size or len(vocab),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = (LlamaForCausalLM if causal else LlamaModel)(config).to(getattr(torch, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def build_bert(folder: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A 2-layer BERT (hidden 64) with a WordPiece vocabulary: [CLS] ... [SEP], no EOS token."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = BertTokenizer(vocab={tok: i for i, tok in enumerate(vocab)}, do_lower_case=True)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=256,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(seed)
    model = BertModel(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def synthetic_examples(
    n: int, *, num_labels: int = 4, seed: int = 0, fillers: tuple[int, int] = (2, 9)
) -> list[tuple[str, str]]:
    """A learnable task: each text holds the keyword ``k<label>`` among ``fillers[0]`` to
    ``fillers[1]`` random words; label ``topic<i>``'s document text is ``k<i>``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = i % num_labels
        words = [f"w{rng.randrange(60)}" for _ in range(rng.randint(*fillers))]
        words.insert(rng.randint(0, len(words)), f"k{label}")
        out.append((" ".join(words), f"topic{label}"))
    rng.shuffle(out)
    return out


def write_tsv(path: Path, examples: list[tuple[str, str]]) -> Path:
    """``label<TAB>text`` lines, the SMS Spam Collection's format."""
    path.write_text("".join(f"{label}\t{text}\n" for text, label in examples), encoding="utf-8")
    return path


def write_corpus(
    folder: Path, *, documents: int = 12, queries: int = 8, seed: int = 0
) -> tuple[Path, Path]:
    """A learnable retrieval corpus in ``folder``: document ``d<i>`` is ``k<i mod 8> w<i>
    w<i+20>`` (topic ``t<i mod 3>``), each of its queries ``w<i>`` or ``w<i+20>`` among fillers."""
    import json

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    docs: list[dict[str, object]] = [
        {"id": f"d{i}", "text": f"k{i % 8} w{i} w{i + 20}", "metadata": {"category": f"t{i % 3}"}}
        for i in range(documents)
    ]
    rows: list[dict[str, object]] = []
    for i in range(documents):
        for j in range(queries):
            words = [f"w{rng.randrange(40, 60)}" for _ in range(rng.randint(2, 5))]
            words.insert(rng.randint(0, len(words)), f"w{i + 20 * (j % 2)}")
            rows.append({"query": " ".join(words) + f" w{40 + j}", "document_id": f"d{i}"})
    paths = folder / "documents.jsonl", folder / "queries.jsonl"
    for path, items in ((paths[0], docs), (paths[1], rows)):
        path.write_text("".join(json.dumps(r) + "\n" for r in items), encoding="utf-8")
    return paths


def build_gguf(path: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A tiny Llama causal LM written as a GGUF file, the way llama.cpp's converter writes one
    (llama.cpp's names and rotary layout, a byte-level BPE vocabulary); loaded back, it must
    equal the model :func:`gguf_source` saves beside it."""
    import gguf
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ w", "k 0", "k 1", "k 2", "k 3", "Ġw 1"]
    tokens = [*symbols, *(m.replace(" ", "") for m in merges), "<s>", "</s>"]
    bos, eos = len(tokens) - 2, len(tokens) - 1
    heads, kv_heads = 4, 2
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    gguf_source(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(gguf_source(path))

    def permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:  # llama.cpp's rotary layout
        rows = weights.shape[0]
        return (
            weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape)
        )

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("car-fl tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)  # LlamaConfig's default rope_theta
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.CONTROL] * 2
    writer.add_token_types(types)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float()
        if name.endswith("q_proj.weight"):
            data = permute(data, heads)
        elif name.endswith("k_proj.weight"):
            data = permute(data, kv_heads)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"no GGUF name for {name}")
        writer.add_tensor(target, data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_source(path: Path) -> Path:
    """The folder where :func:`build_gguf` saved the model it wrote to ``path``."""
    return path.with_name(path.stem + "-source")


def tiny_overrides(
    model_dir: str | Path,
    data_path: str | Path,
    *,
    cache_dir: str | Path | None = None,
    device: str = "cpu",
) -> list[str]:
    """Hydra overrides that run car-fl on a tiny local model and a local data file, quietly."""
    return [
        "model=local",
        f"model.name_or_path={model_dir}",
        f"dataset.path={data_path}",
        *([f"cache_dir={cache_dir}"] if cache_dir is not None else []),
        "progress=false",
        f"device={device}",
    ]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write llama/, bert/, synthetic.tsv")
    parser.add_argument("--examples", type=int, default=400)
    args = parser.parse_args(argv)
    build_llama(args.folder / "llama")
    build_bert(args.folder / "bert")
    write_tsv(args.folder / "synthetic.tsv", synthetic_examples(args.examples))
    print(f"wrote {args.folder}/llama, {args.folder}/bert and {args.folder}/synthetic.tsv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
