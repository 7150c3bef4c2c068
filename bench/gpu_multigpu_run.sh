#!/usr/bin/env bash
# Multi-GPU correctness and scaling on one host with several GPUs: unpack the bundle (deploy/bundle.sh), then
#   1. the multi-GPU correctness tests, one process per GPU over NCCL:
#      layer_sharded_step_cuda_test (1xN, Nx1, 2x(N/2) domains, uneven homes,
#      late plans, duplicated path, dead peer; bitwise vs the single-GPU
#      reference), nccl_multigpu_test, and system_cuda_test (the full system:
#      coordinator + one muond-daemon and one C++-client trainer per GPU, CUDA IPC,
#      bitwise vs the single-GPU reference; needs 4 GPUs);
#   2. bench/scaling (scaling_bench): the matrix set of MANIFEST's first
#      LAYERS layers on 1, 2, 4, 8 GPUs (as many as there are): layer-sharded
#      step engine vs the duplicated path vs a raw NCCL all_to_allv of the
#      same bytes, per-phase medians, slowest rank / mean, NS speedup.
# Logs and the markdown table under $OUT. Usage (repository root on the GPU
# host; NCCL's NVLink multicast stays off: NCCL_NVLS_ENABLE=0):
#   bench/gpu_multigpu_run.sh BUNDLE.tar.xz [MANIFEST=llama3_8b] [LAYERS=4] [PRECISION=medium]
set -uo pipefail
tarball=$1; manifest=${2:-llama3_8b}; layers=${3:-4}; precision=${4:-medium}
. bench/gpu_bundle_enter.sh && enter_bundle "$tarball" multigpu
gpus=$(nvidia-smi -L | wc -l)
echo "== $gpus GPUs" | tee "$out/summary.txt"
nvidia-smi topo -m > "$out/topo.txt" 2>&1
for t in layer_sharded_step_cuda_test nccl_multigpu_test system_cuda_test; do
  timeout 300 bin/$t > "$out/$t.log" 2>&1
  echo "$t exit $?: $(grep -cE '^\[       OK \]' "$out/$t.log") ok," \
       "$(grep -cE '^\[  SKIPPED \]' "$out/$t.log") skipped," \
       "$(grep -cE '^\[  FAILED  \]' "$out/$t.log") failed lines" | tee -a "$out/summary.txt"
done
ranks=1; for n in 2 4 8; do [ "$n" -le "$gpus" ] && ranks="$ranks,$n"; done
shapes=$(python3 - "$R/bench/manifests/$manifest.json" "$layers" <<'PY'
import sys
sys.path.insert(0, "bench")
from gpu_step_bench import shape_set
print(",".join(f"{r}x{c}" for r, c in shape_set(sys.argv[1], int(sys.argv[2]))))
PY
)
{
  echo "# scaling_bench: $manifest, $layers layers, $precision, ranks $ranks"
  echo
  echo '```'
  echo "NCCL_NVLS_ENABLE=0 bin/scaling_bench --device=cuda --precision=$precision --ranks=$ranks --steps=10 --warmup=3 --shapes=<$manifest first $layers layers>"
  echo '```'
  echo
  timeout 500 bin/scaling_bench --device=cuda --precision="$precision" \
    --ranks="$ranks" --steps=10 --warmup=3 --shapes="$shapes" 2>&1
  echo "exit $?"
} > "$out/scaling_$manifest.md"
cat "$out/scaling_$manifest.md" | tee -a "$out/summary.txt"
