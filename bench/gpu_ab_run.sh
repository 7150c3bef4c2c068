#!/usr/bin/env bash
# Compares two bundles (deploy/bundle.sh) side by side on the
# same GPU: e.g. the commit before a behaviour-preserving refactor (A) and
# after it (B). Runs B's GPU tests and the exactness check, then each step
# benchmark (bench/gpu_step_bench.py) for A, B, B, A (so drift over the call
# weighs on both alike). Logs and tables under $OUT; a summary of every run's
# table rows in $OUT/ab.txt. `gram` instead: the in-process Gram step of the
# three step sets in one process per run, A B B A, and the B ÷ A table
# (bench/ab_steps_report.py) in $OUT/ab_gram.md; AB_STEP_ARGS adds
# gpu_step_bench.py arguments (e.g. --sym-gemm-schedule pingpong).
# Usage (repository root on the GPU machine):
#   bench/gpu_ab_run.sh A.tar.xz B.tar.xz [tests|steps|all|gram]
set -uo pipefail
# shellcheck source=bench/gpu_bundle_enter.sh
. bench/gpu_bundle_enter.sh
a=$(realpath "$1"); b=$(realpath "$2"); mode=${3:-all}
R=$(pwd); out=${OUT:-/tmp/ab-out}; mkdir -p "$out"
unpack() {  # TARBALL NAME -> /tmp/NAME-bundle/muond-bundle (whatever the tarball's top folder)
  rm -rf "/tmp/$2-bundle" "/tmp/$2-x" && mkdir -p "/tmp/$2-x" &&
    tar -xJf "$1" -C "/tmp/$2-x" || exit 1
  mkdir -p "/tmp/$2-bundle" && mv "$(dirname "$(find "/tmp/$2-x" -maxdepth 2 -name env.sh)")" "/tmp/$2-bundle/muond-bundle"
}
unpack "$a" A; unpack "$b" B
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
if [ "$mode" = tests ] || [ "$mode" = all ]; then
  ( cd /tmp/B-bundle/muond-bundle && . env.sh &&
    ./run-gpu-tests.sh > "$out/B-gpu-tests.log" 2>&1
    grep -E "^(PASS|FAIL) |gpu test binaries" "$out/B-gpu-tests.log" | sort | uniq -c
    echo "== exactness"; timeout 300 python3 tests/gpu/test_exactness_vs_torch.py 2>&1 | tail -8
  ) > "$out/tests.log" 2>&1
  cat "$out/tests.log"
fi
[ "$mode" = tests ] && exit 0
if [ "$mode" = gram ]; then
  i=0; runs=()
  for who in A B B A; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # AB_STEP_ARGS: words on purpose
    ( cd "/tmp/$who-bundle/muond-bundle" && . env.sh &&
      timeout 150 python3 "$R/bench/gpu_step_bench.py" --columns inproc_gram --no-rpc \
        --rounds 1 --reps 10 --warmup 2 --set llama3_8b:4:4 --set qwen3_1_7b:28:28 \
        --set qwen3_30b_a3b:1:256 ${AB_STEP_ARGS:-} --out "$out/$who-gram-$i.md" \
        > "$out/$who-gram-$i.log" 2>&1 ) || echo "run $i ($who) failed: $out/$who-gram-$i.log"
    runs+=("$out/$who-gram-$i.md")
  done
  python3 "$R/bench/ab_steps_report.py" "${runs[@]}" | tee "$out/ab_gram.md"
  exit 0
fi
# MANIFEST LAYERS REPS ROUNDS NS_BATCH SYRK NAME, as bench/gpu_perf_run.sh.
step_run() {  # BUNDLE(A|B) MANIFEST LAYERS REPS ROUNDS NS_BATCH SYRK NAME
  local who=$1 flag=""; shift; [ "$6" = 1 ] && flag=--syrk
  ( cd "/tmp/$who-bundle/muond-bundle" && . env.sh &&
    timeout 200 python3 bench/gpu_step_bench.py $flag --manifest "$R/bench/manifests/$1.json" \
      --layers $2 --reps $3 --rounds $4 --ns-batch-size $5 --out "$out/$who-$7.md" \
      > "$out/$who-$7.log" 2>&1 )
  { echo "== $who $*"; grep -E '^\| [0-9]' "$out/$who-$7.log"; } | tee -a "$out/ab.txt"
}
for run in "llama3_8b 4 10 1 4 0 llama" "llama3_8b 4 10 1 4 1 llama_syrk" \
           "qwen3_1_7b 28 10 1 8 0 qwen17" "qwen3_30b_a3b 1 5 1 256 0 moe"; do
  # AB_ONLY="llama moe": only the runs of those names (a call has 10 minutes).
  name=${run##* }
  [ -n "${AB_ONLY:-}" ] && [[ " $AB_ONLY " != *" $name "* ]] && continue
  for who in A B B A; do step_run $who $run; done
done
