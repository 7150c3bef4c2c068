#!/usr/bin/env bash
# The NS and step performance runs on one GPU: unpack
# the bundle, run the GPU tests and the exactness check, then the NS and step
# benchmarks, logs under $OUT. Usage (repository root on the GPU machine):
#   bench/gpu_perf_run.sh BUNDLE.tar.xz [quick|steps|verify|final|syrk]
#   bench/gpu_perf_run.sh BUNDLE.tar.xz runs "MANIFEST LAYERS REPS ROUNDS NS_BATCH SYRK NAME" ...
# steps: tests, exactness, the step benchmarks (Llama plain and symmetric at
# ns_batch_size 4, Qwen3-1.7B at 8, the MoE layer at 256, 2 rounds each),
# NS per shape set (plain and symmetric).
# final: verify, then steps.
# verify: tests, exactness, and the demo with --device cuda (report + plot).
# syrk: ns_cuda_test, NS per shape set for symmetric-path block-row counts,
# then the three step benchmarks with --syrk (no exactness run).
# runs: only the step benchmarks named (SYRK 1 adds --syrk), logs NAME.log/md.
set -uo pipefail
tarball=$1; mode=${2:-full}
. bench/gpu_bundle_enter.sh && enter_bundle "$tarball" perf
# One step benchmark: MANIFEST LAYERS REPS ROUNDS NS_BATCH SYRK(0|1) NAME;
# logs $out/NAME.log and .md, prints the breakdown and the table rows.
step_run() {
  local flag=""; [ "$6" = 1 ] && flag=--syrk
  timeout 200 python3 bench/gpu_step_bench.py $flag --manifest "$R/bench/manifests/$1.json" --layers $2 --reps $3 --rounds $4 --ns-batch-size $5 --out "$out/$7.md" > "$out/$7.log" 2>&1
  echo "== $*"; grep breakdown "$out/$7.log"; grep -E '^\| [0-9]' "$out/$7.log"
}
if [ "$mode" = runs ]; then
  shift 2
  for run in "$@"; do step_run $run; done
  exit 0
fi
if [ "$mode" = syrk ]; then
  libexec/ns_cuda_test 2>&1 | tail -3
  { for set in llama qwen; do
      timeout 90 bin/ns_bench --backend=cuda --shapes=$set --reps=7 --precisions=medium --syrk_block_rows=0,3,4,8
    done
    timeout 90 bin/ns_bench --backend=cuda --shapes=qwen --batch=4 --reps=7 --precisions=medium --syrk_block_rows=0,4
    timeout 90 bin/ns_bench --backend=cuda --shapes=moe --batch=128 --reps=7 --precisions=medium --syrk_block_rows=0,3,4
  } > "$out/ns_syrk.log" 2>&1
  cat "$out/ns_syrk.log"
  for run in "llama3_8b 4 10 1 1 1 step_llama_syrk" "qwen3_1_7b 28 10 1 1 1 step_qwen17_syrk" "qwen3_1_7b 28 10 1 4 1 step_qwen17_b4_syrk" "qwen3_30b_a3b 1 5 1 128 1 step_moe_syrk"; do
    step_run $run
  done
  exit 0
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
{
  echo "== gpu tests"; ./run-gpu-tests.sh > "$out/gpu-tests-full.log" 2>&1
  grep -E "^(PASS|FAIL) |gpu test binaries|SKIPPED \]|FAILED  \]" "$out/gpu-tests-full.log" | sort | uniq -c
  echo "== exactness"; timeout 300 python3 tests/gpu/test_exactness_vs_torch.py 2>&1 | tail -15
} > "$out/tests.log" 2>&1
tail -25 "$out/tests.log"
if [ "$mode" = verify ] || [ "$mode" = final ]; then
  timeout 400 python3 deploy/local/launch.py --device cuda --steps 200 --out "$out/demo" \
    > "$out/demo.log" 2>&1
  echo "demo exit $?"; tail -6 "$out/demo.log"
  cp "$out/demo/report.md" "$out/demo_report.md" 2>/dev/null
  cp "$out/demo/loss.png" "$out/demo_loss.png" 2>/dev/null
  rm -rf "$out/demo"
  [ "$mode" = verify ] && exit 0
fi
if [ "$mode" = steps ] || [ "$mode" = final ]; then
  # Step benchmarks first (the short device budget), then NS per shape.
  for run in "llama3_8b 4 10 2 4 0 step_llama" "llama3_8b 4 10 2 4 1 step_llama_syrk" "qwen3_1_7b 28 10 2 8 0 step_qwen17" "qwen3_30b_a3b 1 5 2 256 0 step_moe"; do
    step_run $run
  done
  { timeout 60 bin/ns_bench --backend=cuda --shapes=llama --reps=7 --precisions=medium --syrk_block_rows=0
    timeout 60 bin/ns_bench --backend=cuda --shapes=qwen --batch=8 --reps=7 --precisions=medium
    timeout 60 bin/ns_bench --backend=cuda --shapes=moe --batch=256 --reps=7 --precisions=medium
  } > "$out/ns_final.log" 2>&1
  cat "$out/ns_final.log"
  exit 0
fi
{
  echo "== ns_bench medium --detail (cublasLt)"
  bin/ns_bench --backend=cuda --shapes=llama --reps=7 --precisions=medium --detail
  echo "== ns_bench medium, legacy cublasGemmEx"
  MUOND_CUBLAS_GEMMEX=1 bin/ns_bench --backend=cuda --shapes=llama --reps=7 --precisions=medium
  echo "== ns_bench medium, cublasLt autotune 8"
  MUOND_LT_AUTOTUNE=8 bin/ns_bench --backend=cuda --shapes=llama --reps=7 --precisions=medium --detail
} > "$out/ns_diag.log" 2>&1
cat "$out/ns_diag.log"
[ "$mode" = quick ] && exit 0
bin/ns_bench --backend=cuda --shapes=llama --reps=5 > "$out/ns_bench.md" 2>&1
cat "$out/ns_bench.md"
for run in "llama3_8b 4 10 2 1 0 step_llama" "qwen3_30b_a3b 1 5 1 128 0 step_moe" "qwen3_1_7b 28 10 1 1 0 step_qwen17"; do
  step_run $run
done
