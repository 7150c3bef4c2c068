# shellcheck shell=bash
# The one GPU setup of the bench/gpu_*.sh scripts, sourced from the repository
# root on the GPU host: the environment every GPU run uses, the bundle
# (deploy/bundle.sh) unpacked and entered, and capped, timed parts.
#
# NVLink multicast (NVLS) off, as every committed result was measured: not every
# GPU host supports it. Unbuffered Python so that a part's log holds every line
# up to a kill at its cap.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
#
# `enter_bundle TARBALL NAME` sets R (the repository root) and out ($OUT, or
# /tmp/NAME-out), unpacks the bundle (deploy/bundle.sh) into /tmp/NAME-bundle
# and enters it with its environment (env.sh); exits if it cannot unpack.
enter_bundle() {
  local tarball=$1 name=$2 work=/tmp/$2-bundle
  out=${OUT:-/tmp/$name-out}; mkdir -p "$out"
  # shellcheck disable=SC2034  # R and out are the caller's
  R=$(pwd)
  rm -rf "$work"; mkdir -p "$work"
  tar -xJf "$tarball" -C "$work" || exit 1
  cd "$work"/muond-bundle && . env.sh
}

# `use_bundle TARBALL DIR` unpacks the bundle into DIR and, staying in the
# checkout, sets B (the bundle's root), takes its generated stubs into the
# checkout's client and sources its env.sh; exits 1, noted in $S, if it cannot.
use_bundle() {
  local tarball=$1 dir=$2
  rm -rf "$dir"; mkdir -p "$dir"
  if ! tar -xJf "$tarball" -C "$dir"; then echo "bundle $tarball: missing or broken" >> "$S"; exit 1; fi
  B=$(find "$dir" -mindepth 1 -maxdepth 1 -type d | head -1)
  cp "$B"/client/python/muond/v1/*_pb2*.py client/python/muond/v1/
  # shellcheck source=/dev/null
  . "$B/env.sh"
}

# `part NAME LIMIT LOG CMD...` runs one capped part of a device script: CMD
# under `timeout LIMIT` (SIGKILL $KILL_AFTER s later, default 5), its output
# appended to LOG, "NAME: rc R, T s (cap LIMIT s)" to $S; counts the parts
# that failed in $failed.
failed=0
part() {
  local name=$1 lim=$2 log=$3 t0=$SECONDS rc
  shift 3
  echo "=== $name: $*" >> "$log"
  timeout -k "${KILL_AFTER:-5}" "$lim" "$@" >> "$log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  echo "$name: rc $rc, $((SECONDS - t0)) s (cap $lim s)" | tee -a "$S"
}
