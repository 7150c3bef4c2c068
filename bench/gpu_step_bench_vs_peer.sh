#!/usr/bin/env bash
# Stage 2 of 2 of the step bench against its peer (bench/README.md): the whole GPU comparison
# on one GPU, after bench/gpu_step_bench_peer_stage.sh on the same machine. Usage, from the
# repository root (results under $OUT):
#   bench/gpu_step_bench_vs_peer.sh
# with deploy/bundle.sh's bundle, tarred, at dist/muond-bundle.tar.xz (BUNDLE=... for another
# path). The peer is in /tmp/site from stage 1, compiled.
# Each part has a wall-clock cap (T_* below: 90 + 20 + 60 + 290 + 30 + 40 = 530 s) and logs
# its exit code and wall time to $OUT/summary.log; results under $OUT:
#   summary.log  GPU, installs, each part's rc and seconds
#   tests.log    GPU test binaries (incl. the Gram spectra GPU test), sym GEMM bench,
#                exactness vs torch.optim.Muon
#   step.log, step.md    gpu_step_bench.py on the three sets, 2 rounds (the target table)
#   sweep.md     the aspect-ratio sweep (muond standard vs Gram NS), its log in step.log
#   profile.txt  per-kernel profile of one muond step (step engine, Gram NS) on the Llama set
#                (llama3_8b:4:4 as step.md's muond columns): nsys's cuda_gpu_kern_sum where
#                nsys is installed, else step_bench's per-chunk NS times (--ns_only)
set -u
OUT=${OUT:-/tmp/muond-step-bench}
mkdir -p "$OUT"
S=$OUT/summary.log
T_TESTS=${T_TESTS:-90} T_SYMGEMM=${T_SYMGEMM:-20} T_EXACT=${T_EXACT:-60}
T_STEP=${T_STEP:-290} T_SWEEP=${T_SWEEP:-30} T_PROFILE=${T_PROFILE:-40}
# SYMGEMM_ARGS: sym_gemm_bench's flags
# shellcheck source=bench/gpu_bundle_enter.sh
. bench/gpu_bundle_enter.sh  # part NAME LIMIT LOG CMD...: one capped part, rc and time to $S
t_all=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$S" 2>&1

# The peer: installed into /tmp/site and compiled by stage 1; .whl/p2, if present, installs
# the small wheels again where stage 1 did not get that far.
peer_path=
if [[ -d /tmp/site/nvidia_cutlass_dsl/python_packages ]]; then
  if [[ ! -d /tmp/site/gram_newton_schulz ]] && compgen -G ".whl/p2/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site .whl/p2/*.whl >> "$S" 2>&1
  fi
  if [[ -d /tmp/site/gram_newton_schulz ]]; then
    peer_path=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages
    echo "peer: /tmp/site; caches: $(du -sh /tmp/*/quack_cache /tmp/torchinductor_* \
      2>/dev/null | tr '\n' ' ')" >> "$S"
  else
    echo "peer: gram_newton_schulz not installed; peer columns will be n/a" >> "$S"
  fi
else
  echo "peer not staged (/tmp/site missing: run bench/gpu_step_bench_peer_stage.sh first, on the" \
       "same machine); peer columns will be n/a" >> "$S"
fi

# The bundle (as bench/gpu_main_job.sh): binaries from it, Python scripts from this tree.
BUNDLE=${BUNDLE:-dist/muond-bundle.tar.xz}
t0=$SECONDS
use_bundle "$BUNDLE" /tmp/b
export PYTHONPATH=$PWD/client/python${peer_path:+:$peer_path}
export MUOND_BIN=$B/bin
echo "bundle unpacked in $((SECONDS - t0)) s" >> "$S"

part gpu_tests "$T_TESTS" "$OUT/tests.log" "$B/run-gpu-tests.sh"
if [[ -x $B/bin/sym_gemm_bench ]]; then
  part sym_gemm_bench "$T_SYMGEMM" "$OUT/tests.log" "$B/bin/sym_gemm_bench" ${SYMGEMM_ARGS:-}
else
  echo "sym_gemm_bench: not in the bundle" >> "$S"
fi
part exactness "$T_EXACT" "$OUT/tests.log" python3 tests/gpu/test_exactness_vs_torch.py
part step_bench "$T_STEP" "$OUT/step.log" python3 bench/gpu_step_bench.py \
  --set llama3_8b:4:4 --set qwen3_1_7b:28:28 --set qwen3_30b_a3b:1:256 \
  --rounds 2 --reps 10 --warmup 2 --out "$OUT/step.md"
part aspect_sweep "$T_SWEEP" "$OUT/step.log" python3 bench/gpu_step_bench.py --sweep-aspect \
  --reps 10 --warmup 2 --out "$OUT/sweep.md"
# The profile: step_bench --engine with the flags gpu_step_bench.py gives muond's in-process
# Gram column on llama3_8b:4:4 (medium, ns_batch_size 4, fp16 Gram, default restarts and
# aspect threshold), a few reps so the trace stays small.
profile_step() {
  local shapes nsys flags
  shapes=$(python3 -c 'import sys; sys.path.insert(0, "bench"); import gpu_step_bench as g
_, path, layers, _ = g.parse_set("llama3_8b:4:4")
print(",".join(f"{r}x{c}" for r, c in g.shape_set(path, layers)))') || return 1
  flags=(--shapes="$shapes" --precision=medium --ns_batch_size=4 --ns_algorithm=gram
         --gram_dtype=fp16)
  nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys \
    2>/dev/null | head -1)
  if [[ -n $nsys ]]; then
    echo "# nsys: $nsys; step_bench --engine --reps=3 --warmup=1 ${flags[*]:1}"
    # The report stays in /tmp (never under $OUT) and is deleted after the stats.
    "$nsys" profile --stats=false --force-overwrite=true -o /tmp/muond-step-profile \
      "$B/bin/step_bench" --engine --reps=3 --warmup=1 "${flags[@]}" &&
      { "$nsys" stats --report cuda_gpu_kern_sum --format column /tmp/muond-step-profile.nsys-rep ||
        "$nsys" stats --report gpukernsum --format column /tmp/muond-step-profile.nsys-rep; }  # nsys < 2023
    local rc=$?
    rm -f /tmp/muond-step-profile.nsys-rep /tmp/muond-step-profile.sqlite
    [[ $rc == 0 ]] && return 0
    echo "# nsys failed (rc $rc): falling back to step_bench's own numbers"
  fi
  echo "# no nsys profile (ncu is too slow for this cap): step_bench's own numbers; the step, then"
  echo "# each chunk's batched NS alone (--ns_only)"
  "$B/bin/step_bench" --engine --reps=5 --warmup=2 "${flags[@]}" &&
    "$B/bin/step_bench" --ns_only --reps=5 --warmup=2 "${flags[@]}"
}
export -f profile_step
export B
part profile "$T_PROFILE" "$OUT/profile.txt" bash -c profile_step
grep -E "^(PASS|FAIL) |gpu test binaries:|^worst .*: (PASS|FAIL)|SKIP" "$OUT/tests.log" >> "$S"
grep -E "gram pays|never pays" "$OUT/sweep.md" >> "$S" 2>/dev/null
echo "profile (head):" >> "$S"; head -n 16 "$OUT/profile.txt" >> "$S" 2>/dev/null
echo "all parts: $((SECONDS - t_all)) s" >> "$S"
cat "$S"
