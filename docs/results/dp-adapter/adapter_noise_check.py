"""One-off check (issue 40): does the noise DP-SGD put on the adapter hurt a trained CaR head?

Loads the head of the CaR DP-SGD run (runs/dp-adapter/sms-smollm2-car-dpsgd), perturbs the identity
adapter by the per-entry noise a 3-epoch run leaves at adapter lr 0.001 and 0.01, and scores
validation. From the repository root, after that run:
python docs/results/dp-adapter/adapter_noise_check.py
"""

import json

import torch
from safetensors.torch import load_file

from car_fl.data.splits import load_splits
from car_fl.model.retriever import build_retriever
from car_fl.model.features import extract_features
from car_fl.settings.compose import load_settings

torch.set_num_threads(1)
s = load_settings(
    [
        "model=smollm2",
        "mode=adapter",
        "dataset.path=../shared/data/sms_spam/SMSSpamCollection.tsv",
        "device=cpu",
        "model.normalize=l2",
    ]
)
sp = load_splits(s.dataset, seed=s.seed)
m = build_retriever(s, 2)
m.eval()
w = load_file("runs/dp-adapter/sms-smollm2-car-dpsgd/checkpoints/best/weights.safetensors")
print(list(w))
with torch.no_grad():
    for k, v in w.items():
        dict(m.named_parameters())[k].copy_(v)
texts = sp.validation["text"]
y = torch.tensor(sp.validation["label"])
ids = m.encoder.tokenize(texts).input_ids
g = torch.Generator().manual_seed(0)
base = None
for per_entry in (0.0, 1.42e-4, 1.42e-3):
    with torch.no_grad():
        m.adapter.weight.copy_(torch.eye(576) + per_entry * torch.randn(576, 576, generator=g))
        f = extract_features(m.encode, m.encoder.pad, ids, batch_size=32, progress=False)
        acc = float((m.score(f).argmax(-1) == y).float().mean())
    if base is None:
        base = f
    cos = float(torch.nn.functional.cosine_similarity(f, base).mean())
    print(
        json.dumps(
            {
                "noise_per_entry": per_entry,
                "drift": per_entry * 576 / 24,
                "val_top1": acc,
                "mean_cos_to_identity": cos,
            }
        )
    )
