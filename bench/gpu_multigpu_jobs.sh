#!/usr/bin/env bash
# Whole jobs on one host with N GPUs (N = what nvidia-smi lists; every part scales to it).
# Usage, from the repository root (results under $OUT; rc and seconds per part in
# $OUT/summary.log, each part's log beside it):
#   bench/gpu_multigpu_jobs.sh [tests] [main] [llama] [kill]     (no part: all four)
# with deploy/bundle.sh's bundle, tarred, at dist/muond-bundle.tar.xz (BUNDLE=... for another
# path) and, for the muonium columns, its wheel in dist (`pip download --no-deps
# muonium==0.2.0 -d dist`: pure Python, 33 kB). The llama bench and the kill script run from
# the checkout, not the bundle.
# Parts:
#   tests   the multi-GPU correctness binaries, one process per GPU over NCCL:
#           layer_sharded_step_cuda_test (domains 1xN, Nx1, 2x(N/2), bitwise vs the single-GPU
#           reference), nccl_multigpu_test, system_cuda_test (needs 4 GPUs)          ~1-2 min
#   main    the README's main job (examples/char_gpt/train_dist.py through `muond launch`,
#           deploy/local/launch.py) on N GPUs in each layout: loss curves vs the in-process
#           reference and each rank's NS load, in main-<layout>/report.md     ~1-1.5 min each
#   llama   bench/llama_train_bench.py: the ~1B Llama (random tokens) in each layout, whole
#           training step with muond vs torch.optim.Muon in every process vs muonium 0.2.0,
#           tokens/s and optimizer share as ratios (llama/*.md, llama.md merged)
#           ~4.5 min each (268 s for fsdp at N=1 with the three optimizers)
#   kill    tests/system/kill_mid_step.py: one daemon SIGKILLed mid-step in the torchrun job, at
#           the commit vote and inside a collective; survivors fail naming it, nothing
#           half-applied, nothing left behind (KILL_LAYOUTS, default fsdp fsdp+tp) ~0.5 min each
# Layouts (LAYOUTS overrides): ddp fsdp tp, plus fsdp+tp (TP 2 inside) and hsdp (replicate 2 x
# shard N/2) from N = 4 on; at N = 2 those two would be tp and fsdp again.
# Environment: LAYOUTS, STEPS (main job, default 200), LLAMA_LAYERS (default 16 = the whole
# 1B model), LLAMA_STEPS (timed, default 10), LLAMA_OPTIMIZERS (default muond,torch,muonium;
# muonium 0.2.0 fails under TP layouts on torch 2.11, recorded in the JSON: bench/README.md).
set -u
OUT=${OUT:-/tmp/muond-multigpu-jobs}
mkdir -p "$OUT"
S=$OUT/summary.log
R=$(pwd)
# shellcheck source=bench/gpu_bundle_enter.sh
. bench/gpu_bundle_enter.sh
# A part's SIGKILL 30 s after its cap: muond launch needs its stop grace (10 s) and the
# servers' drain after a TERM.
KILL_AFTER=30
N=$(nvidia-smi -L 2>/dev/null | wc -l)
{ echo "== $N GPUs, parts: ${*:-all}"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } >> "$S" 2>&1
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
use_bundle "${BUNDLE:-dist/muond-bundle.tar.xz}" /tmp/muond-bundle
export PYTHONPATH=$R/client/python MUOND_BIN_DIR=$B/bin
muonium_dir=/tmp/muonium
llama_optimizers=${LLAMA_OPTIMIZERS:-muond,torch,muonium}
if compgen -G "dist/muonium-*.whl" > /dev/null; then
  python3 -m zipfile -e dist/muonium-*.whl "$muonium_dir"
elif [[ $llama_optimizers == *muonium* ]]; then
  llama_optimizers=${llama_optimizers//,muonium/}
  echo "llama: no dist/muonium-*.whl carried, so muonium is left out ($llama_optimizers)" \
    | tee -a "$S"
fi
launch=(python3 -m muond.cli launch --device cuda --nproc-per-node "$N" --bin-dir "$B/bin")
torchrun=(python3 -m torch.distributed.run --standalone --nproc-per-node "$N")
default_layouts="ddp fsdp tp"
[ "$N" -ge 4 ] && default_layouts="$default_layouts fsdp+tp hsdp"
layouts=${LAYOUTS:-$default_layouts}
inner() {  # the inner mesh size of a 2-D layout: TP 2 for fsdp+tp, shard N/2 for hsdp
  case $1 in
    fsdp+tp) echo 2 ;;
    hsdp) echo $((N / 2 > 0 ? N / 2 : 1)) ;;
    *) echo 1 ;;
  esac
}

run_tests() {
  local t
  for t in layer_sharded_step_cuda_test nccl_multigpu_test system_cuda_test; do
    part "$t" 300 "$OUT/$t.log" "$B/bin/$t"
    echo "  $t: $(grep -cE '^\[       OK \]' "$OUT/$t.log") ok," \
      "$(grep -cE '^\[  SKIPPED \]' "$OUT/$t.log") skipped," \
      "$(grep -cE '^\[  FAILED  \]' "$OUT/$t.log") failed lines" | tee -a "$S"
  done
}

run_main() {
  local l
  for l in $layouts; do
    part "main-$l" 300 "$OUT/main-$l.log" python3 deploy/local/launch.py --device cuda \
      --nproc "$N" --parallel "$l" --inner "$(inner "$l")" --steps "${STEPS:-200}" \
      --bin "$B/bin" --out "/tmp/main-$l"
    mkdir -p "$OUT/main-$l"
    cp /tmp/main-"$l"/report.md /tmp/main-"$l"/curves.json "$OUT/main-$l/" 2>/dev/null
  done
}

run_llama() {
  local l max_diff=()
  # muond vs torch.optim.Muon, both bf16 NS: 6.6e-2 measured on the whole 1b after 13 steps
  # (bench/README.md); the bench marks a run above this MISMATCH and exits 1.
  if [[ $llama_optimizers == *muond* && $llama_optimizers == *torch* ]]; then
    max_diff=(--max-param-diff "${LLAMA_MAX_PARAM_DIFF:-0.2}")
  fi
  for l in $layouts; do
    part "llama-$l" 400 "$OUT/llama-$l.log" "${launch[@]}" --log-dir "$OUT/llama-logs-$l" \
      -- "${torchrun[@]}" bench/llama_train_bench.py --device cuda --model 1b \
      --layers "${LLAMA_LAYERS:-16}" --parallel "$l" --inner "$(inner "$l")" \
      --steps "${LLAMA_STEPS:-10}" \
      --optimizers "$llama_optimizers" --muonium-path "$muonium_dir" "${max_diff[@]}" \
      --out "$OUT/llama"
    # Merged after each layout: a call cut at its cap keeps the layouts that finished.
    python3 bench/llama_train_report.py "$OUT/llama" > "$OUT/llama.md" 2>&1
  done
}

run_kill() {
  # commit: the victim's daemon has voted, survivors fail in the commit vote (Gloo);
  # collective: survivors wait in a collective of the step (NCCL's dead-peer behaviour).
  local l at
  if [ "$N" -lt 2 ]; then echo "kill: skipped, needs 2 GPUs (have $N)" | tee -a "$S"; return; fi
  for l in ${KILL_LAYOUTS:-fsdp fsdp+tp}; do
    for at in commit collective; do
      part "kill-$l-$at" 120 "$OUT/kill-$l-$at.log" python3 tests/system/kill_mid_step.py \
        --device cuda --nproc "$N" --parallel "$l" --inner "$(inner "$l")" --kill-at "$at" \
        --bin-dir "$B/bin" --timeout 100 --out "$OUT/kill-$l-$at.json"
    done
  done
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests main llama kill)
for p in "${parts[@]}"; do
  case $p in
    tests | main | llama | kill) "run_$p" ;;
    *) echo "unknown part '$p' (tests, main, llama, kill)" | tee -a "$S"; exit 2 ;;
  esac
done
echo "left: $(pgrep -fc 'muond-(daemon|coordinator)' || true) server processes," \
  "$(find /dev/shm -name '*muond*' | wc -l) muond shm objects; $failed part(s) failed" \
  | tee -a "$S"
[ "$failed" -eq 0 ]
