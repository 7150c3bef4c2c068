#!/usr/bin/env bash
# The torchrun main job on one GPU, with the checks around it: the bundle's GPU tests, the
# main job (deploy/local/launch.py --device cuda) in the fsdp and ddp layouts, exactness vs
# torch.optim.Muon and the drop-in bench (bench/results/gpu_h200_main_job.md).
# Usage, from the repository root on a GPU host (results under $OUT):
#   bench/gpu_main_job.sh
# with deploy/bundle.sh's bundle, tarred, at dist/muond-bundle.tar.xz (BUNDLE=... for another
# path).
set -u
OUT=${OUT:-/tmp/muond-main-job}
mkdir -p "$OUT"
S=$OUT/summary.log
# shellcheck source=bench/gpu_bundle_enter.sh
. bench/gpu_bundle_enter.sh
use_bundle "${BUNDLE:-dist/muond-bundle.tar.xz}" /tmp/muond-bundle
export PYTHONPATH=$PWD/client/python
export MUOND_BIN=$B/bin
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
( time timeout 150 $B/run-gpu-tests.sh ) > $OUT/gpu_tests.log 2>&1
for L in fsdp ddp; do
  ( time timeout 170 python3 deploy/local/launch.py --bin $B/bin --device cuda --nproc 1 --parallel $L \
      --steps 300 --out $OUT/demo-$L ) > $OUT/demo-$L.log 2>&1
done
( time timeout 120 python3 tests/gpu/test_exactness_vs_torch.py ) > $OUT/exactness.log 2>&1
( time timeout 100 python3 bench/gpu_dropin_bench.py --manifest bench/manifests/llama3_8b.json --layers 4 --rounds 2 ) > $OUT/dropin_llama.log 2>&1
ls -la $OUT
