#!/usr/bin/env bash
# Installs everything muond needs on a Debian 12 machine (the CUDA toolkit, if
# any, is expected at /usr/local/cuda) and the project's Python environment.
# Idempotent and quick when everything is already there. Called by both
# commands of README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

APT_PACKAGES=(
  bazel-bootstrap g++ clang libclang-rt-14-dev lld
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev libgoogle-glog-dev libgflags-dev libgloo-dev libopenblas-dev
  nlohmann-json3-dev libmicrohttpd-dev libgtest-dev libgmock-dev libbenchmark-dev
  python3-venv fortunes fortunes-min procps openssl shellcheck iproute2
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The virtual environment, rebuilt only when requirements.txt changes.
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: creating .venv from requirements.txt"
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null
  # torch and its CUDA wheels are ~2.5 GB (4.8 GB installed: keep that much
  # disk free): retry and resume interrupted downloads.
  .venv/bin/pip install -q --retries 10 --resume-retries 20 -r requirements.txt
  .venv/bin/pip install -q --no-deps --ignore-requires-python emerging-optimizers==0.3.0
  .venv/bin/pip install -q --no-deps --ignore-requires-python --no-binary megatron-core \
    megatron-core==0.19.2
  echo "$want" > "$stamp"
fi

# CUTLASS/CuTe headers for the sm_90a symmetric GEMM (header-only): the pinned
# wheel in .venv, where the @cutlass repository (tools/build_defs/cutlass.bzl)
# finds them.
cutlass_want=$(grep -v '^#' requirements-cutlass.txt | grep nvidia-cutlass | cut -d= -f3)
if [ "$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("nvidia-cutlass"))' 2>/dev/null)" != "$cutlass_want" ]; then
  echo "setup: installing nvidia-cutlass $cutlass_want into .venv"
  .venv/bin/pip install -q --no-deps -r requirements-cutlass.txt
fi

# Machine-specific Bazel settings: Python tests run with the venv's python3.
# Build actions need no venv (protoc and its plugins are Debian's, nvcc is
# CUDA's), and their PATH is part of every action's cache key: a clone-specific
# path there would make every fresh clone (CI) miss the shared disk cache.
cat > .bazelrc.user <<RC
build --action_env=PATH=/usr/local/cuda/bin:/usr/bin:/bin
test --test_env=PATH=$root/.venv/bin:/usr/local/cuda/bin:/usr/bin:/bin
test --test_env=HOME=$HOME
RC

# The Python client package (client/python: `muond`, its gRPC stubs generated
# from proto/ at build time, the `muond` command) installed into .venv, so
# examples, tools and .venv/bin/muond use it. Re-installed only when its
# sources or the protos change. --no-deps --no-build-isolation: offline and
# fast (grpcio-tools, setuptools and the dependencies come from requirements.txt).
pkg_stamp=.venv/.muond-client.sha256
pkg_want=$(find client/python/pyproject.toml client/python/setup.py client/python/README.md \
             client/python/muond proto/muond -type f \( -name '*.py' -o -name '*.proto' \
             -o -name '*.toml' -o -name '*.md' \) ! -name '*_pb2.py' ! -name '*_pb2_grpc.py' \
             ! -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
# Stubs that setup.sh used to write into the source tree would shadow nothing
# once installed, but would let a stray sys.path entry import stale ones.
rm -f client/python/muond/v1/*_pb2.py client/python/muond/v1/*_pb2_grpc.py
if [ ! -x .venv/bin/muond ] || [ "$(cat "$pkg_stamp" 2>/dev/null)" != "$pkg_want" ]; then
  echo "setup: installing the muond client package into .venv"
  .venv/bin/pip install -q --no-deps --no-build-isolation --force-reinstall ./client/python
  echo "$pkg_want" > "$pkg_stamp"
fi
echo "setup: ok"
