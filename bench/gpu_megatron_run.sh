#!/usr/bin/env bash
# On the GPU host: a Megatron-Core GPT trained with Megatron's own Muon and with
# muond.megatron side by side (bench/megatron_train_bench.py), bf16 params, one rank
# per GPU (TP 2 when there are two GPUs or more, else TP 1), under `muond launch`.
#
#   bench/gpu_megatron_run.sh BUNDLE WHEELS [STEPS] [LR] [MEGATRON_LM_CHECKOUT]
#
# BUNDLE: deploy/bundle.sh's dist/muond-bundle.tar.xz. WHEELS: bench/peer_wheels.sh's p3
# folder (megatron-core 0.19.2 and emerging-optimizers 0.3.0 wheels for CPython 3.12).
# MEGATRON_LM_CHECKOUT: a Megatron-LM checkout with layer-sharded Muon (only its
# megatron/core/optimizer/layer_sharded_*.py are read): Megatron-LM's own
# LayerShardedMuon runs too.
# Writes $OUT/megatron/curves.json and the table (stdout).
set -euo pipefail
bundle=${1:?usage: bench/gpu_megatron_run.sh BUNDLE WHEELS [STEPS] [LR]}
wheels=${2:?usage: bench/gpu_megatron_run.sh BUNDLE WHEELS [STEPS] [LR]}
steps=${3:-200}
lr=${4:-0.005}  # at 0.02 this model diverges under Megatron's own Muon too
checkout=${5:-}
out=${OUT:-/tmp/out}
repo=$(pwd)
tar xf "$bundle" -C /tmp
# shellcheck disable=SC1091
. /tmp/muond-bundle/env.sh
export NCCL_NVLS_ENABLE=0
site=/tmp/megatron-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/megatron_core-0.19.2-*.whl \
  "$wheels"/emerging_optimizers-0.3.0-*.whl
export PYTHONPATH=$site:${PYTHONPATH:-}
gpus=$(nvidia-smi -L | wc -l)
tp=1; [ "$gpus" -ge 2 ] && tp=2
python3 -m muond.cli launch --nproc-per-node "$gpus" --device cuda --bin-dir /tmp/muond-bundle/bin -- \
  python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" \
  "$repo/bench/megatron_train_bench.py" --device cuda --bf16 --tp "$tp" --steps "$steps" --lr "$lr" \
  --layers 8 --hidden 2048 --heads 16 --seq 1024 --global-batch 8 \
  --fp32-matmul-prec medium --out "$out/megatron" ${checkout:+--megatron-lm "$(cd "$checkout" && pwd)"}
