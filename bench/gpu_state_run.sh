#!/usr/bin/env bash
# The optimizer-state runs on one GPU (state_dtype, state_location): unpack the
# bundle, run the state GPU tests, then the step benchmark of the state modes
# and the in-process engine's momentum/update phases; logs and tables under
# $OUT. Usage (repository root on the GPU machine):
#   bench/gpu_state_run.sh BUNDLE.tar.xz [tests|bench|engine|memory|defaults|all]
# tests:  state_location_test, cuda_fp8_state_test, e4m3_vs_cuda_test and
#         tests/gpu/test_state_modes_cuda.py;
# bench:  bench/gpu_state_bench.py on Llama-3-8B's first 4 layers (fp32 params,
#         every mode; then bf16 params, auto / fp8), $OUT/state_llama*.md;
# engine: bench/gpu:step_bench --engine per mode and ns_batch_size 1 / 4 (the
#         engine alone: no RPC), $OUT/engine_modes.log;
# memory: the ~1B Llama training step (bench/llama_train_bench.py, FSDP, world 1)
#         with muond's state fp8 on the host beside torch.optim.Muon: trainer +
#         daemon peak memory and tokens/s, $OUT/llama/ (about 4 minutes);
# defaults: the same ~1B step with muond at its defaults (state on the device,
#         NS algorithm auto) beside torch.optim.Muon, 20 steps: tokens/s and
#         peak memory, $OUT/llama_defaults/ (about 4 minutes);
# all:    tests, engine and bench (about 6 minutes; memory apart: one device call
#         holds at most 10 minutes).
set -uo pipefail
tarball=$1; mode=${2:-all}
. bench/gpu_bundle_enter.sh && enter_bundle "$tarball" state
B=$(pwd)  # the bundle: bin/, libexec/
if [ "$mode" = tests ] || [ "$mode" = all ]; then
  # state_location_test's CPU cases (minutes on one core) run in CI; here the GPU ones.
  echo "== state_location_test (GPU cases)"
  timeout 120 bin/state_location_test --gtest_filter='*Cuda*:*DeviceMemory*' 2>&1 | tail -12
  for t in cuda_fp8_state_test e4m3_vs_cuda_test; do
    echo "== $t"; timeout 120 "bin/$t" 2>&1 | tail -4
  done
  echo "== test_state_modes_cuda"
  (cd "$R" && MUOND_BIN="$B/bin" timeout 300 python3 tests/gpu/test_state_modes_cuda.py) 2>&1 | tail -8
fi
if [ "$mode" = engine ] || [ "$mode" = all ]; then
  L="4096x4096,1024x4096,1024x4096,4096x4096,14336x4096,14336x4096,4096x14336"
  for b in 1 4; do for dt in fp32 bf16 fp8_e4m3; do for loc in device host; do
    echo "== engine $loc $dt ns_batch_size $b"
    timeout 120 bin/step_bench --engine --shapes="$L,$L,$L,$L" --precision=medium --reps=10 \
      --warmup=3 --ns_batch_size=$b --state_location=$loc --state_dtype=$dt 2>&1 | tail -1
  done; done; done | tee "$out/engine_modes.log"
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  cd "$R" || exit 1
  MUOND_BIN="$B/bin" timeout 400 python3 bench/gpu_state_bench.py --set llama3_8b:4 \
    --out "$out/state_llama.md" 2>&1 | tail -20
  MUOND_BIN="$B/bin" timeout 200 python3 bench/gpu_state_bench.py --set llama3_8b:4 \
    --param-dtype bf16 --modes auto:device,fp8_e4m3:device,fp8_e4m3:host --no-peers --rounds 1 \
    --out "$out/state_llama_bf16.md" 2>&1 | tail -10
fi
if [ "$mode" = memory ]; then
  cd "$R" || exit 1
  timeout 280 python3 -m muond.cli launch --device cuda --nproc-per-node 1 --bin-dir "$B/bin" \
    -- python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    bench/llama_train_bench.py --device cuda --model 1b --parallel fsdp --steps 10 \
    --optimizers muond,torch --muond-state-location host --muond-state-dtype fp8_e4m3 \
    --out "$out/llama" 2>&1 | tail -30
fi
if [ "$mode" = defaults ]; then
  cd "$R" || exit 1
  timeout 280 python3 -m muond.cli launch --device cuda --nproc-per-node 1 --bin-dir "$B/bin" \
    -- python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    bench/llama_train_bench.py --device cuda --model 1b --parallel fsdp --steps 20 \
    --optimizers muond,torch --out "$out/llama_defaults" 2>&1 | tail -30
fi
