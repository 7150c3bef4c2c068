#!/bin/bash
# Builds fuzz/registration_plan_fuzzer.cc with clang (-fsanitize=fuzzer,
# address,undefined) against the project sources it needs and runs it for a
# bounded time on the checked-in seed corpus (fuzz/corpus/*.textproto,
# encoded with protoc). Exit 0 when the run finds nothing.
#   fuzz/run_fuzz.sh [SECONDS]     (default 20; from the repository root or
#                                    as the Bazel sh_test //fuzz:fuzz_test)
set -euo pipefail
SECONDS_TO_RUN="${1:-20}"
# The source tree: under Bazel the script is a runfiles symlink into it.
ROOT="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"
cd "$ROOT"
WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/muond-fuzz-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/gen" "$WORK/obj" "$WORK/corpus"

protoc -I proto --cpp_out="$WORK/gen" proto/muond/v1/muond.proto
for seed in fuzz/corpus/*.textproto; do
  protoc -I proto --encode=muond.v1.RegisterParamsRequest \
    proto/muond/v1/muond.proto < "$seed" > "$WORK/corpus/$(basename "$seed" .textproto)"
done

CXX="${CXX_FUZZ:-clang++}"
FLAGS=(-std=c++20 -O1 -g -fsanitize=fuzzer-no-link,address,undefined
       -fno-sanitize-recover=undefined -I. -I"$WORK/gen" -w)
SRCS=(fuzz/registration_plan_fuzzer.cc server/daemon/registration.cc
      server/daemon/region_table.cc
      server/daemon/memory_mapper.cc server/common/proto_convert.cc
      server/coordinator/coordinator_core.cc
      core/plan/*.cc core/common/*.cc  # whole packages: a new file links without an edit here
      "$WORK/gen/muond/v1/muond.pb.cc")
# Compile two at a time (CI has 2 cores).
pids=()
for src in "${SRCS[@]}"; do
  "$CXX" "${FLAGS[@]}" -c "$src" -o "$WORK/obj/$(basename "$src").o" &
  pids+=($!)
  if (( ${#pids[@]} >= 2 )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done
ABSL=$(sed -n '/^ABSL_LIBS = \[/,/^\]/p' third_party/BUILD | grep -o '"-l[^"]*"' | tr -d '"' | tr '\n' ' ')
"$CXX" -fsanitize=fuzzer,address,undefined "$WORK"/obj/*.o -o "$WORK/fuzzer" \
  -lprotobuf $ABSL -lglog -lgflags -lrt -latomic -lpthread

ASAN_OPTIONS=detect_leaks=1 "$WORK/fuzzer" -max_total_time="$SECONDS_TO_RUN" \
  -max_len=65536 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
  -artifact_prefix="$WORK/" "$WORK/corpus" 2>&1 | tail -25
status=${PIPESTATUS[0]}
if (( status != 0 )); then
  echo "fuzzer found a problem; the input is in the log above" >&2
  for f in "$WORK"/crash-* "$WORK"/leak-* "$WORK"/timeout-*; do
    [[ -e "$f" ]] && { echo "== $f (base64):"; base64 "$f"; }
  done
fi
exit "$status"
