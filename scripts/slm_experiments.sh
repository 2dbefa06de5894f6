#!/usr/bin/env bash
# The paper's table on real generative small LMs (GGUF presets, docs/models.md), SMS Spam with
# duplicate-free splits, subsampled for a 2-core CPU: 1,200 messages (864 train, 96 validation,
# 240 test after duplicates are removed), batch 16, lr 1e-3. Classifier-mode rows train 3
# passes over the data; rows that backpropagate through the LM (adapter) train 1 pass (an
# adapter epoch of SmolLM2 took 7 to 35 minutes on this machine, depending on its load).
#   bash scripts/slm_experiments.sh MODEL [path/to/SMSSpamCollection.tsv] [steps]
#   MODEL: smollm2 | gemma3; steps: which of 1-5 to run (default: all)
# Sweep folders: sweeps/slm_sms_<step>_MODEL; a report in each folder's report/.
set -euo pipefail
model="${1:?usage: bash scripts/slm_experiments.sh smollm2|gemma3 [data.tsv] [steps]}"
data="${2:-../shared/data/sms_spam/SMSSpamCollection.tsv}"
steps="${3:-1 2 3 4 5}"
# model.pooling=eos model.dtype=float32: how this table was measured (before 2026-11-26 the
# presets pooled the appended EOS token's state, and the CPU ran float32); docs/conventions.md
pinned=(model.pooling=eos model.dtype=float32)
common=("model=$model" "${pinned[@]}" "dataset.path=$data" dataset.max_examples=1200 train.batch_size=16)
for step in $steps; do
  case "$step" in
    # 1. Centralised, on cached features: MIPS, CaR, kNN; 3 epochs.
    1) python -m car_fl.sweep -m experiment=sms_mips "${common[@]}" approach=mips,car,knn \
         sweep.centralized_epochs=3 hydra.sweep.dir="sweeps/slm_sms_central_$model" ;;
    # 2. Federated CaR, 2 clients, 3 rounds x 1 local epoch, without DP and with the paper's
    #    local DP (adaptive clipping, the private rule of conf/dp/adaptive.yaml).
    2) python -m car_fl.sweep -m experiment=sms_scenarios "${common[@]}" approach=car clients=2 \
         dp=none,adaptive fl.rounds=3 fl.local_epochs=1 hydra.sweep.dir="sweeps/slm_sms_fl_$model" ;;
    # 3. Federated CaR, 2 clients, record-level DP-SGD at epsilon = 3 (delta 1e-5): the settings
    #    of experiment=sms_privacy_record (5 rounds x 5 local epochs, Adam lr 0.02, q 0.1, clip 1).
    3) python -m car_fl.sweep -m experiment=sms_privacy_record "model=$model" "${pinned[@]}" "dataset.path=$data" \
         dataset.max_examples=1200 clients=2 dp.target_epsilon=3 \
         hydra.sweep.dir="sweeps/slm_sms_record_$model" ;;
    # 4. Centralised through the LM: adapter + MIPS, adapter + CaR; 1 epoch.
    4) python -m car_fl.sweep -m experiment=sms_mips "${common[@]}" approach=adapter_mips,adapter_car \
         sweep.centralized_epochs=1 hydra.sweep.dir="sweeps/slm_sms_adapter_$model" ;;
    # 5. Federated adapter + CaR, 2 clients, 1 round x 1 local epoch, without DP and with local DP.
    5) python -m car_fl.sweep -m experiment=sms_scenarios "${common[@]}" approach=adapter_car \
         clients=2 dp=none,adaptive fl.rounds=1 fl.local_epochs=1 \
         hydra.sweep.dir="sweeps/slm_sms_fl_adapter_$model" ;;
    *) echo "unknown step $step (1-5)" >&2; exit 2 ;;
  esac
done
