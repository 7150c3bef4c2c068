#!/usr/bin/env bash
# Builds dist/sym_gemm_sm90_check (bench/gpu/sym_gemm_sm90_check.cu) with nvcc
# alone: cudart static, cuBLAS dynamic, so that it runs on a GPU machine that
# has the CUDA toolkit's libraries but no Bazel. CUTLASS headers come from the
# nvidia-cutlass wheel in .venv (deploy/setup.sh), as for Bazel's @cutlass.
set -euo pipefail
cd "$(dirname "$0")/../.."
cutlass=$(.venv/bin/python -c 'import importlib.util as u; print(u.find_spec("cutlass_library").submodule_search_locations[0])')/source
# A fresh object folder: the link takes dist/obj/*.o, so a stale object (say of
# a kernel file since split or removed) must not linger there.
rm -rf dist/obj
mkdir -p dist/obj
flags=(-std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I.
       -I"$cutlass/include" --expt-relaxed-constexpr -DNDEBUG)
# The kernel's files in parallel (each a long CUTLASS build); any failure
# fails the script.
pids=()
for k in sym_gemm_sm90 sym_gemm_sm90_cooperative sym_gemm_sm90_pingpong sym_gemm_sm90_wide; do
  /usr/local/cuda/bin/nvcc "${flags[@]}" -c core/backend/$k.cu -o dist/obj/$k.o &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
# The sources of //core/backend:cuda_kernels (the launchers of cuda_kernels.h).
for k in cuda_copy_kernels cuda_multi_tensor_kernels cuda_norm_kernels cuda_state_kernels cuda_step_kernels cuda_variant_kernels; do
  /usr/local/cuda/bin/nvcc "${flags[@]}" -c core/backend/$k.cu -o dist/obj/$k.o
done
/usr/local/cuda/bin/nvcc "${flags[@]}" -c bench/gpu/sym_gemm_sm90_check.cu -o dist/obj/check.o
/usr/local/cuda/bin/nvcc -cudart static dist/obj/*.o -o dist/sym_gemm_sm90_check -lcublas -ldl
echo "built dist/sym_gemm_sm90_check"
