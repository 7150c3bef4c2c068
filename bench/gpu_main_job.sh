#!/usr/bin/env bash
# Issue 18's GPU checks, one device call (bench/results/gpu_h200_main_job.md). Results under
# $OUT. Expects the bundle of main (deploy/bundle.sh, tarred) at dist/muond-bundle.tar.xz.
set -u
export NCCL_NVLS_ENABLE=0
mkdir -p /tmp/b && tar -xJf dist/muond-bundle.tar.xz -C /tmp/b && B=$(ls -d /tmp/b/*/ | head -1)
B=${B%/}
cp $B/client/python/muond/v1/*_pb2*.py client/python/muond/v1/
. $B/env.sh
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
