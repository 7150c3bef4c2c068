# Sourced by bench/gpu_*_run.sh from the repository root on the GPU machine:
# `enter_bundle TARBALL NAME` sets R (the repository root) and out ($OUT, or
# /tmp/NAME-out), unpacks the bundle (deploy/bundle.sh) into /tmp/NAME-bundle
# and enters it with its environment (env.sh); exits if it cannot unpack.
enter_bundle() {
  local tarball=$1 name=$2 work=/tmp/$2-bundle
  out=${OUT:-/tmp/$name-out}; mkdir -p "$out"
  R=$(pwd)
  rm -rf "$work"; mkdir -p "$work"
  tar -xJf "$tarball" -C "$work" || exit 1
  cd "$work"/muond-bundle && . env.sh
}
