#!/usr/bin/env bash
# ns_batch_size sweep of the in-process step engine (step_bench --engine) on
# one GPU: for each shape set, the batch sizes given, alternated over two
# rounds so the GPU's warm-up and power state fall on all of them alike.
# Run from an unpacked bundle after `. env.sh`; $1 = repository root.
#   bench/batch_sweep.sh $R "llama3_8b 4 1 4 8" "qwen3_1_7b 28 8 28 56" ...
# Prints "set layers batch round step_ms_median".
set -uo pipefail
R=$1; shift
for spec in "$@"; do
  set -- $spec; manifest=$1; layers=$2; shift 2
  # The shape set exactly as bench/gpu_step_bench.py takes it (shape_set).
  shapes=$(cd "$R/bench" && python3 -c "import sys
from gpu_step_bench import shape_set
print(','.join(f'{r}x{c}' for r, c in shape_set(sys.argv[1], int(sys.argv[2]))))" \
    "$R/bench/manifests/$manifest.json" "$layers")
  for round in 1 2; do
    for b in "$@"; do
      ms=$(timeout 120 bin/step_bench --shapes="$shapes" --precision=medium --reps=10 \
             --warmup=3 --ns_batch_size=$b --engine | sed -n 's/^step_ms_median \([^ ]*\).*/\1/p')
      echo "$manifest $layers batch $b round $round step_ms_median $ms"
    done
  done
done
