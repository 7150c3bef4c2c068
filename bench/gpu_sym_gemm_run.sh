#!/usr/bin/env bash
# The symmetric GEMM's three consumer schedules (cooperative, ping-pong, wide)
# on one GPU, side by side: unpack the bundle, then
#   check: bin/sym_gemm_sm90_check (every correctness case with each schedule
#          against cuBLAS, then the timing table: the schedules, cuBLAS's full
#          product and full + mirror per shape), $OUT/sym_gemm_check.md;
#          and bin/sym_gemm_cuda_test (each schedule through the backend);
#   steps: the in-process step engine (bench/gpu_step_bench.py, columns
#          in-process std and Gram) with each schedule on Llama-3-8B 4 layers,
#          Qwen3-1.7B 28 layers and the Qwen3-30B-A3B MoE layer,
#          $OUT/steps_<schedule>.md;
#   all:   check, then steps (the parts' caps add up to more than one
#          10-minute device call: run check and steps as two calls there;
#          ROUNDS=1 halves the steps).
# Usage (repository root on the GPU machine):
#   bench/gpu_sym_gemm_run.sh BUNDLE.tar.xz [check|steps|all]
set -uo pipefail
tarball=$1; mode=${2:-all}
. bench/gpu_bundle_enter.sh && enter_bundle "$tarball" symgemm
B=$(pwd)
S=$out/summary.txt; : > "$S"
if [ "$mode" = check ] || [ "$mode" = all ]; then
  part sym_gemm_check 240 "$out/sym_gemm_check.md" bin/sym_gemm_sm90_check
  part sym_gemm_cuda_test 240 "$out/sym_gemm_cuda_test.log" bin/sym_gemm_cuda_test
  grep -E "^correctness|^\| [0-9]" "$out/sym_gemm_check.md" | tail -40
  grep -E "PASSED|FAILED" "$out/sym_gemm_cuda_test.log" | tail -5
fi
if [ "$mode" = steps ] || [ "$mode" = all ]; then
  for schedule in cooperative pingpong wide; do
    part "steps_$schedule" 240 "$out/steps_$schedule.log" env MUOND_BIN="$B/bin" \
      python3 "$R/bench/gpu_step_bench.py" --sym-gemm-schedule "$schedule" \
      --columns inproc_std,inproc_gram --no-rpc --rounds "${ROUNDS:-2}" --reps 10 --warmup 2 \
      --set llama3_8b:4:4 --set qwen3_1_7b:28:28 --set qwen3_30b_a3b:1:256 \
      --out "$out/steps_$schedule.md"
    grep -E "^\| " "$out/steps_$schedule.md" | head -12
  done
fi
cat "$S"
[ "$failed" -eq 0 ]
