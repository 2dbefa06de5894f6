#!/usr/bin/env bash
# The paper's table on real generative small LMs (GGUF presets, docs/models.md), SMS Spam with
# duplicate-free splits, subsampled for a 2-core CPU: 1,200 messages (864 train, 96 validation,
# 240 test after duplicates are removed), batch 16, lr 1e-3.
#   bash scripts/slm_experiments.sh MODEL [path/to/SMSSpamCollection.tsv]   # MODEL: smollm2 | gemma3
# Sweep folders: sweeps/slm_sms_*_MODEL; reports in each folder's report/.
set -euo pipefail
model="${1:?usage: bash scripts/slm_experiments.sh smollm2|gemma3 [data.tsv]}"
data="${2:-../shared/data/sms_spam/SMSSpamCollection.tsv}"
common=("model=$model" "dataset.path=$data" dataset.max_examples=1200 train.batch_size=16)

# 1. Centralised: MIPS, adapter + MIPS, CaR, adapter + CaR, kNN; 3 epochs.
python -m car_fl.sweep -m experiment=sms_mips "${common[@]}" sweep.centralized_epochs=3 \
  hydra.sweep.dir="sweeps/slm_sms_mips_$model"
# 2. Federated, 2 clients, 3 rounds x 1 local epoch (the same 3 passes over the data): CaR and
#    adapter + CaR, without DP and with the paper's local DP (adaptive clipping, private rule).
python -m car_fl.sweep -m experiment=sms_scenarios "${common[@]}" clients=2 dp=none,adaptive \
  approach=car,adapter_car fl.rounds=3 fl.local_epochs=1 hydra.sweep.dir="sweeps/slm_sms_fl_$model"
# 3. Federated, 2 clients, record-level DP-SGD at epsilon = 3 (delta 1e-5), classifier only:
#    the settings of experiment=sms_privacy_record (5 rounds x 5 local epochs, Adam lr 0.02,
#    sampling rate 0.1, clip 1).
python -m car_fl.sweep -m experiment=sms_privacy_record "model=$model" "dataset.path=$data" \
  dataset.max_examples=1200 clients=2 dp.target_epsilon=3 \
  hydra.sweep.dir="sweeps/slm_sms_record_$model"
