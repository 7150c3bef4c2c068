#!/usr/bin/env bash
# `muond launch` with CUDA daemons on one GPU (bench/README.md). Usage, from the repository
# root on a GPU host (results under $OUT):
#   bench/gpu_launch_cuda.sh
# with deploy/bundle.sh's bundle, tarred, at dist/muond-bundle.tar.xz (BUNDLE=... for another
# path). Parts (rc and seconds in summary.log):
#   launch_cuda   `muond launch --device cuda --nproc-per-node 1 --metrics-port P
#                 --log-format json -- python3 bench/gpu_launch_trainer.py`: the trainer
#                 (muond.torch.Muon on CUDA tensors, CUDA IPC) checks its daemon's
#                 grpc.health.v1 SERVING mid-run, scrapes /metrics of the daemon and the
#                 coordinator (steps applied, phase counts, NS load), and compares its
#                 params with torch.optim.Muon run in the same process (launch.log,
#                 launch.json)
#   demo          deploy/local/launch.py --device cuda --nproc 1 (the README's main job,
#                 through muond launch; out/demo/report.md -> demo/)
set -u
OUT=${OUT:-/tmp/muond-launch-cuda}
mkdir -p "$OUT"
S=$OUT/summary.log
# shellcheck source=bench/gpu_bundle_enter.sh
. bench/gpu_bundle_enter.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$S" 2>&1
use_bundle "${BUNDLE:-dist/muond-bundle.tar.xz}" /tmp/b
export PYTHONPATH=$PWD/client/python
muond=(python3 -m muond.cli)
"${muond[@]}" --version >> "$S" 2>&1

part launch_cuda 150 "$OUT/launch.log" "${muond[@]}" launch --device cuda --nproc-per-node 1 \
  --bin-dir "$B/bin" --log-dir "$OUT/launch-logs" --metrics-port 9460 --log-format json \
  -- python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/gpu_launch_trainer.py --metrics-port 9460 --out "$OUT/launch.json"
part demo 240 "$OUT/demo.log" python3 deploy/local/launch.py --device cuda --nproc 1 \
  --steps 60 --bin "$B/bin" --out /tmp/demo21
mkdir -p "$OUT/demo" && cp /tmp/demo21/report.md "$OUT/demo/" 2>/dev/null
ls /tmp/demo21/logs >> "$OUT/demo.log" 2>&1
echo "left after both: $(pgrep -fc 'muond-(daemon|coordinator)' || true) server processes," \
  "$(find /dev/shm -name '*muond*' | wc -l) muond shm objects" >> "$S"
