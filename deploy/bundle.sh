#!/usr/bin/env bash
# Builds the release binaries and makes a relocatable bundle that runs on a
# GPU host with only a driver, the CUDA runtime libraries (cudart, cuBLAS,
# NCCL: in /usr/local/cuda/lib64, on LD_LIBRARY_PATH, or from the nvidia-*
# Python wheels PyTorch brings) and Python (torch, grpcio, protobuf, numpy):
#   <out>/bin/<tool>          wrappers that set LD_LIBRARY_PATH and exec
#   <out>/libexec/<tool>      the real binaries (servers, muonctl, GPU tests,
#                             benchmarks)
#   <out>/lib/                the non-system shared libraries they need, and
#                             libkernel_profile.so (bench/README.md)
#   <out>/client/python/muond the Python client with its generated stubs
#   <out>/examples/char_gpt   the demo trainer, <out>/data/fortunes its corpus
#   <out>/deploy/local/launch.py  the demo launcher (finds <out>/bin itself)
#   <out>/tests/gpu, <out>/bench/gpu  GPU checks and benchmarks in Python
#   <out>/tests/system/kill_mid_step.py (and its parts, mid_step_kill/)
#                             a daemon killed mid-step of the torchrun job
#                             (--device cuda: one GPU per rank)
#   <out>/run-gpu-tests.sh    runs every bundled test binary tagged `gpu`
# The tree mirrors the repository, so every script runs unchanged from it.
# Usage: deploy/bundle.sh [OUT_DIR]   (default dist/muond-bundle; also writes
# OUT_DIR.tar.xz). MUOND_BAZEL_OUTPUT_BASE: a Bazel output base of your own.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist/muond-bundle}
deploy/setup.sh >/dev/null

bazel=(bazel ${MUOND_BAZEL_OUTPUT_BASE:+--output_base=$MUOND_BAZEL_OUTPUT_BASE})
# --dynamic_mode=off: test binaries link the project statically (no _solib).
opts=(-c opt --dynamic_mode=off --symlink_prefix=/)  # no bazel-* links
# system_trainer: the trainer processes of the bundled system_cuda_test.
targets=(//server/daemon:muond-daemon //server/coordinator:muond-coordinator
         //tools/muonctl:muonctl //tests/server/daemon:system_trainer)
mapfile -t gpu_tests < <("${bazel[@]}" query 'kind(cc_test, attr(tags, "gpu", tests(//tests/...)))' 2>/dev/null)
mapfile -t bench_bins < <("${bazel[@]}" query 'kind(cc_binary, //bench/...)' 2>/dev/null)
log=$(mktemp)
if ! "${bazel[@]}" build "${opts[@]}" "${targets[@]}" "${gpu_tests[@]}" "${bench_bins[@]}" >"$log" 2>&1; then
  grep -E '^(ERROR|FAILED)|error:' "$log" | head -40 >&2 || tail -40 "$log" >&2
  echo "bundle: bazel build failed (log $log)" >&2
  exit 1
fi
bin_dir=$("${bazel[@]}" info "${opts[@]}" bazel-bin 2>/dev/null)

rm -rf "$out" && mkdir -p "$out"/{bin,libexec,lib,client/python,examples,data,deploy/local,tests,bench}
built() {  # label -> its file under bazel-bin
  echo "$bin_dir/$(echo "${1#//}" | tr ':' '/')"
}
copy_bin() {  # label -> libexec/<name>, plus a wrapper in bin/
  local path name
  path=$(built "$1")
  name=$(basename "$path")
  cp -L "$path" "$out/libexec/$name"
  chmod u+w "$out/libexec/$name"
  cat > "$out/bin/$name" <<WRAP
#!/usr/bin/env bash
# Runs libexec/$name with the bundle's libraries, then the host's CUDA ones.
here=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")/.." && pwd)
. "\$here/lib/cuda-paths.sh"
exec "\$here/libexec/$name" "\$@"
WRAP
  chmod +x "$out/bin/$name"
}
for t in "${targets[@]}" "${gpu_tests[@]}" "${bench_bins[@]}"; do
  case $t in
    *.so) cp -L "$(built "$t")" "$out/lib/" ;;  # a library, no wrapper
    *) copy_bin "$t" ;;
  esac
done

# Non-system libraries: everything ldd resolves except glibc, the C++ runtime
# (the GPU host's are as new or newer, hence compatible) and the CUDA driver /
# toolkit libraries, which must come from the GPU host itself.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libgcc_s|libstdc\+\+|libcuda\.|libcudart|libcublas|libcupti|libnccl|libnvidia)'
for bin in "$out"/libexec/*; do
  ldd "$bin" | awk '/=> \//{print $1" "$3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $skip ]] && continue
  cp -L "$path" "$out/lib/$name"
done

# LD_LIBRARY_PATH for the wrappers: bundle libs, then the host's CUDA
# libraries; a library the host lacks in /usr/local/cuda/lib64 is looked up
# in python3's nvidia-* wheels (PyTorch ships cuBLAS, cudart and NCCL so).
cat > "$out/lib/cuda-paths.sh" <<'PATHS'
# Sourced by bin/* (needs $here). MUOND_CUDA_LIB_DIRS: extra dirs, ':'-separated.
dirs="$here/lib${MUOND_CUDA_LIB_DIRS:+:$MUOND_CUDA_LIB_DIRS}:/usr/local/cuda/lib64"
for file in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  found=
  for d in ${dirs//:/ } ${LD_LIBRARY_PATH//:/ }; do
    [[ -e $d/$file ]] && found=1 && break
  done
  if [[ -z $found ]]; then
    d=$(python3 -c "import glob, os, nvidia; print(':'.join(sorted({os.path.dirname(f) for p in nvidia.__path__ for f in glob.glob(os.path.join(p, '*', 'lib', '$file'))})))" 2>/dev/null || true)
    [[ -n $d ]] && dirs="$dirs:$d"
  fi
done
export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
PATHS

cp -r client/python/muond "$out/client/python/"
# The bundle's stubs come from Debian's protoc 3.21 and grpc_python_plugin 1.51
# (as Bazel's): that gencode imports with any protobuf >= 3.20 and grpcio on the
# GPU host, whereas the pip package's (grpcio-tools 1.85) needs protobuf >= 7.35.
rm -f "$out"/client/python/muond/v1/*_pb2.py "$out"/client/python/muond/v1/*_pb2_grpc.py
mapfile -t protos < <(cd proto && find muond -name '*.proto' | sort)
protoc --proto_path=proto --python_out="$out/client/python" --grpc_python_out="$out/client/python" \
  --plugin=protoc-gen-grpc_python="$(command -v grpc_python_plugin)" "${protos[@]}"
cp -r examples/char_gpt "$out/examples/"
cp -r /usr/share/games/fortunes "$out/data/"
cp deploy/local/launch.py "$out/deploy/local/"
cp -r tests/gpu "$out/tests/"
mkdir -p "$out/tests/client/python" && cp tests/client/python/torch_ns_fp32.py "$out/tests/client/python/"
mkdir -p "$out/tests/system" && cp -r tests/system/kill_mid_step.py tests/system/mid_step_kill "$out/tests/system/"
find bench -maxdepth 1 -name "gpu*" -exec cp -r {} "$out/bench/" \;
cp -r bench/manifests "$out/bench/"
find "$out" -name __pycache__ -prune -exec rm -rf {} +
cat > "$out/env.sh" <<'ENV'
# `. env.sh`: the bundle's Python client and demo corpus for this shell.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHONPATH="$here/client/python${PYTHONPATH:+:$PYTHONPATH}"
export MUOND_FORTUNES_DIR="$here/data/fortunes" MUOND_BIN="$here/bin"
# Tests that start the real binaries (system_cuda_test) find them here.
export MUOND_BIN_DIR="$here/bin"
ENV
cat > "$out/run-gpu-tests.sh" <<'RUN'
#!/usr/bin/env bash
# Runs every bundled GoogleTest binary tagged `gpu`; prints one line per test
# binary and a summary; exit code non-zero if any failed.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fail=0 n=0
for t in "$here"/bin/*_test; do
  n=$((n + 1))
  if "$t" "$@"; then echo "PASS $(basename "$t")"; else echo "FAIL $(basename "$t")"; fail=$((fail + 1)); fi
done
echo "gpu test binaries: $((n - fail)) passed, $fail failed"
[[ $fail == 0 ]]
RUN
chmod +x "$out/run-gpu-tests.sh"
tar -C "$(dirname "$out")" -cJf "$out.tar.xz" "$(basename "$out")"
echo "bundle: $out ($(du -sh "$out" | cut -f1)), $out.tar.xz ($(du -sh "$out.tar.xz" | cut -f1))"
