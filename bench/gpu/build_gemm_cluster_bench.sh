#!/usr/bin/env bash
# Builds dist/gemm_cluster_bench (bench/gpu/gemm_cluster_bench.cu) with nvcc
# alone, as build_sym_gemm_check.sh builds the symmetric GEMM's checker: for a
# GPU machine that has the CUDA toolkit's libraries but no Bazel. CUTLASS
# headers come from the nvidia-cutlass wheel in .venv (deploy/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
cutlass=$(.venv/bin/python -c 'import importlib.util as u; print(u.find_spec("cutlass_library").submodule_search_locations[0])')/source
mkdir -p dist
/usr/local/cuda/bin/nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a \
  -I. -I"$cutlass/include" --expt-relaxed-constexpr -DNDEBUG \
  bench/gpu/gemm_cluster_bench.cu -o dist/gemm_cluster_bench \
  -cudart static -lcublas -ldl
echo "built dist/gemm_cluster_bench"
