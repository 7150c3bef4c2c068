#!/usr/bin/env bash
# Wheels of the peer that bench/gpu_step_bench.py races (gram-newton-schulz 0.1.6's Muon and
# its kernels), for a GPU host without network (bench/README.md).
#
#   bench/peer_wheels.sh DIR        e.g. bench/peer_wheels.sh .whl   (/.whl/ is gitignored)
#
# Writes three folders to copy to the GPU host; p1 and p2 (the peer, what
# bench/gpu_step_bench_peer_stage.sh installs) are ~56 MiB together:
#   DIR/p1/cu13.tar.xz  nvidia-cutlass-dsl-libs-cu13 4.5.2 unpacked and `xz -9e`'d (53 MB;
#                       the wheel is 79 MB, over 64 MiB with the tree). It holds every file
#                       of nvidia-cutlass-dsl-libs-base 4.5.2 but its LICENSE and dist-info
#                       (checked below), so libs-base is not carried.
#   DIR/p2/*.whl        the peer's small wheels: gram-newton-schulz, quack-kernels,
#                       nvidia-cutlass-dsl (metadata only), apache-tvm-ffi, torch-c-dlpack-ext.
#   DIR/p3/*.whl        megatron-core + emerging-optimizers (bench/gpu_megatron_run.sh).
# The GPU host is expected to have torch 2.11, numpy, einops, typing-extensions and cuda-bindings
# already; everything here is installed --no-deps.
# Wheels already in $PEER_WHEEL_CACHE (default /tmp/whl) are reused, and so is its
# cu13.tar.xz (compressing takes ~3.5 min on 2 cores).
# On the GPU host: bench/gpu_step_bench_peer_stage.sh (stage 1, p1 and p2) then
# bench/gpu_step_bench_vs_peer.sh (stage 2).
set -euo pipefail
dir=${1:?usage: bench/peer_wheels.sh DIR}
cache=${PEER_WHEEL_CACHE:-/tmp/whl}
py=${PYTHON:-python3}
mkdir -p "$dir/p1" "$dir/p2" "$dir/p3" "$cache"

# pip's own matching for the device: CPython 3.12, manylinux x86_64.
plat=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
fetch() {  # fetch NAME==VERSION FILE-GLOB: the wheel into $cache unless there
  local spec=$1 glob=$2
  compgen -G "$cache/$glob" >/dev/null || "$py" -m pip download -q "${plat[@]}" -d "$cache" "$spec"
  compgen -G "$cache/$glob" >/dev/null || { echo "peer_wheels: no $glob after pip download $spec" >&2; exit 1; }
}

# apache-tvm-ffi: quack-kernels 0.5.0 needs >=0.1.6,<0.2; pinned for a reproducible run.
small=("gram-newton-schulz==0.1.6 gram_newton_schulz-0.1.6-*.whl"
       "quack-kernels==0.5.0 quack_kernels-0.5.0-*.whl"
       "nvidia-cutlass-dsl==4.5.2 nvidia_cutlass_dsl-4.5.2-*.whl"
       "apache-tvm-ffi==0.1.15.post2 apache_tvm_ffi-0.1.15.post2-*.whl"
       "torch-c-dlpack-ext==0.1.5 torch_c_dlpack_ext-0.1.5-*.whl")
megatron=("megatron-core==0.19.2 megatron_core-0.19.2-*.whl"
          "emerging-optimizers==0.3.0 emerging_optimizers-0.3.0-*.whl")
copy_wheels() {  # copy_wheels FOLDER "NAME==VERSION FILE-GLOB"...: fetched, copied there
  local to=$1 s spec glob
  shift
  rm -f "$to/"*.whl
  for s in "$@"; do
    read -r spec glob <<<"$s"
    fetch "$spec" "$glob"
    cp "$cache"/$glob "$to/"
  done
}
copy_wheels "$dir/p2" "${small[@]}"
copy_wheels "$dir/p3" "${megatron[@]}"

if [[ ! -s "$cache/cu13.tar.xz" ]]; then
  fetch nvidia-cutlass-dsl-libs-cu13==4.5.2 'nvidia_cutlass_dsl_libs_cu13-4.5.2-*.whl'
  fetch nvidia-cutlass-dsl-libs-base==4.5.2 'nvidia_cutlass_dsl_libs_base-4.5.2-*.whl'
  # libs-cu13 must overwrite every file of libs-base that matters (all but its LICENSE and
  # dist-info), or libs-base would have to travel too.
  missing=$(comm -23 <(unzip -Z1 "$cache"/nvidia_cutlass_dsl_libs_base-4.5.2-*.whl | sort) \
                     <(unzip -Z1 "$cache"/nvidia_cutlass_dsl_libs_cu13-4.5.2-*.whl | sort) |
            grep -v -e '^nvidia_cutlass_dsl/LICENSE$' -e '^nvidia_cutlass_dsl_libs_base-4.5.2.dist-info/' || true)
  [[ -z "$missing" ]] || { echo "peer_wheels: libs-base files not in libs-cu13: $missing" >&2; exit 1; }
  tmp=$(mktemp -d)
  unzip -q "$cache"/nvidia_cutlass_dsl_libs_cu13-4.5.2-*.whl -d "$tmp"
  tar -C "$tmp" -cf - . | xz -9e -T0 > "$cache/cu13.tar.xz.part"
  mv "$cache/cu13.tar.xz.part" "$cache/cu13.tar.xz"
  rm -rf "$tmp"
fi
cp "$cache/cu13.tar.xz" "$dir/p1/cu13.tar.xz"
du -sh "$dir/p1" "$dir/p2" "$dir/p3"
