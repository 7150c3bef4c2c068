#!/usr/bin/env bash
# Builds the release binaries and makes a relocatable bundle that runs on a
# GPU host with only a driver, the CUDA runtime libraries (cudart, cuBLAS,
# NCCL in /usr/local/cuda/lib64 or on LD_LIBRARY_PATH) and Python:
#   <out>/bin/<tool>        wrappers that set LD_LIBRARY_PATH and exec
#   <out>/libexec/<tool>    the real binaries (servers, muonctl, GPU tests)
#   <out>/lib/              the non-system shared libraries they need
#   <out>/python/           the Python client `muond` with generated stubs
#   <out>/examples/         the demo trainer
#   <out>/run-gpu-tests.sh  runs every test binary tagged `gpu`
# Usage: deploy/bundle.sh [OUT_DIR]   (default dist/muond-bundle; also writes
# OUT_DIR.tar.xz, small enough to copy to a node).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist/muond-bundle}
deploy/setup.sh >/dev/null

targets=(//server/daemon:muond //server/coordinator:muond-coordinator //tools/muonctl:muonctl)
gpu_tests=$(bazel query 'attr(tags, "gpu", tests(//tests/...))' 2>/dev/null | grep -v '_py' || true)
bench_bins=$(bazel query 'kind(cc_binary, //bench/...)' 2>/dev/null || true)
bazel build -c opt "${targets[@]}" $gpu_tests $bench_bins 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1

rm -rf "$out" && mkdir -p "$out"/{bin,libexec,lib,python,examples}
copy_bin() {  # label -> libexec/<name>, plus a wrapper in bin/
  local label=$1 path name
  path=bazel-bin/$(echo "${label#//}" | tr ':' '/')
  name=$(basename "$path")
  cp -L "$path" "$out/libexec/$name"
  cat > "$out/bin/$name" <<WRAP
#!/usr/bin/env bash
here=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")/.." && pwd)
export LD_LIBRARY_PATH="\$here/lib:/usr/local/cuda/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "\$here/libexec/$name" "\$@"
WRAP
  chmod +x "$out/bin/$name"
}
for t in "${targets[@]}" $gpu_tests $bench_bins; do copy_bin "$t"; done

# Non-system libraries: everything ldd resolves except glibc, the C++ runtime
# (the GPU host's are newer, hence compatible) and the CUDA driver/toolkit
# libraries, which must come from the GPU host itself.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libgcc_s|libstdc\+\+|libcuda\.|libcudart|libcublas|libnccl|libnvidia)'
for bin in "$out"/libexec/*; do
  ldd "$bin" | awk '/=> \//{print $1" "$3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $skip ]] && continue
  cp -Ln "$path" "$out/lib/$name" 2>/dev/null || true
done

cp -r client/python/muond "$out/python/"
find "$out/python" -name __pycache__ -prune -exec rm -rf {} +
cp -r examples/char_gpt "$out/examples/"
cp deploy/local/launch.py "$out/launch.py"
cat > "$out/run-gpu-tests.sh" <<'RUN'
#!/usr/bin/env bash
# Runs every bundled GoogleTest binary tagged `gpu`; prints one line per test
# binary and a summary; exit code non-zero if any failed.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fail=0
for t in $here/bin/*_test; do
  if "$t" "$@"; then echo "PASS $(basename "$t")"; else echo "FAIL $(basename "$t")"; fail=1; fi
done
exit $fail
RUN
chmod +x "$out/run-gpu-tests.sh"
tar -C "$(dirname "$out")" -cJf "$out.tar.xz" "$(basename "$out")"
echo "bundle: $out ($(du -sh "$out" | cut -f1)), $out.tar.xz ($(du -sh "$out.tar.xz" | cut -f1))"
