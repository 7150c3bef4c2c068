#!/usr/bin/env bash
# Issue 20, device call 1 of 2 (bench/README.md): stages the peer's large library outside the
# working tree, so call 2, back to back on the same warm machine, carries only small files.
#   run(command="bench/gpu_issue20_stage.sh", carry=[".whl/p1"], kind="nvidia-h200")
# .whl/p1/cu13.tar.xz is nvidia-cutlass-dsl-libs-cu13 4.5.2 unpacked and xz'd by
# bench/peer_wheels.sh .whl (the wheel is over the 64 MiB carry limit with the tree).
set -euo pipefail
t0=$SECONDS
mkdir -p /tmp/peer /tmp/site
cp .whl/p1/cu13.tar.xz /tmp/peer/
tar -xJf /tmp/peer/cu13.tar.xz -C /tmp/site
rm -f /tmp/site/nvidia_cutlass_dsl.pth  # --target installs run no .pth: PYTHONPATH says it
{
  echo "staged /tmp/site in $((SECONDS - t0)) s: $(du -sh /tmp/site | cut -f1)"
  ls /tmp/site /tmp/site/nvidia_cutlass_dsl
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} 2>&1 | tee "${OUT:-/tmp}/stage.log"
