#!/usr/bin/env bash
# Stage 1 of 2 of the step bench against its peer (bench/README.md): installs the peer
# (gram-newton-schulz 0.1.6 and its kernels) outside the working tree and compiles it once,
# so that stage 2 (bench/gpu_step_bench_vs_peer.sh), on the same machine, finds the peer's
# compiled kernels in the machine's caches. For a GPU host without network:
#   bench/peer_wheels.sh .whl          (where there is a network), then on the GPU host
#   bench/gpu_step_bench_peer_stage.sh
# .whl/p1/cu13.tar.xz (nvidia-cutlass-dsl-libs-cu13 4.5.2 unpacked, xz'd) and .whl/p2/*.whl:
# bench/peer_wheels.sh's output. With a network, a plain `pip install` of the versions
# peer_wheels.sh pins does the same (bench/README.md).
# Why precompile: the peer's first step compiles its CuTe DSL kernels (quack's disk
# cache, /tmp/<user>/quack_cache) and torch.compile graphs (/tmp/torchinductor_<user>):
# 139 s cold on the MoE set alone (measured 2026-12-02). T_PRECOMPILE (default 280 s) caps
# it; whatever it compiled stays cached for stage 2. PEER_COLUMNS (default peer_a,peer_b):
# the peer columns compiled, e.g. peer_a alone for a run that races only that one.
set -uo pipefail
# shellcheck source=bench/gpu_bundle_enter.sh
. bench/gpu_bundle_enter.sh
OUT=${OUT:-/tmp/muond-step-bench}
mkdir -p "$OUT" /tmp/peer /tmp/site
L=$OUT/stage.log
t0=$SECONDS
cp .whl/p1/cu13.tar.xz /tmp/peer/ && tar -xJf /tmp/peer/cu13.tar.xz -C /tmp/site || {
  echo "stage: unpacking .whl/p1/cu13.tar.xz failed" | tee -a "$L"; exit 1; }
rm -f /tmp/site/nvidia_cutlass_dsl.pth  # --target installs run no .pth: PYTHONPATH says it
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/p2/*.whl >> "$L" 2>&1 || { echo "stage: pip install failed" | tee -a "$L"; exit 1; }
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages
echo "staged and installed /tmp/site in $((SECONDS - t0)) s: $(du -sh /tmp/site | cut -f1)" \
  | tee -a "$L"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$L" 2>&1
t0=$SECONDS
timeout -k 5 "${T_PRECOMPILE:-280}" python3 bench/gpu_step_bench.py --columns "${PEER_COLUMNS:-peer_a,peer_b}" \
  --set qwen3_30b_a3b:1 --set llama3_8b:4 --set qwen3_1_7b:28 --rounds 1 --reps 1 --warmup 0 \
  --no-rpc --out "$OUT/precompile.md" >> "$L" 2>&1
echo "peer precompile: rc $?, $((SECONDS - t0)) s; caches: $(du -sh /tmp/*/quack_cache \
  /tmp/torchinductor_* 2>/dev/null | tr '\n' ' ')" | tee -a "$L"
grep "warm-up step 1:" "$L"
