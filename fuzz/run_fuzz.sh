#!/bin/bash
# Builds the libFuzzer targets with clang (-fsanitize=fuzzer,address,undefined)
# against the project sources they need and runs each for a bounded time on
# its checked-in seed corpus. Exit 0 when no run finds anything.
#   fuzz/run_fuzz.sh [SECONDS] [FUZZER...]
#     SECONDS  per fuzzer (default 20)
#     FUZZER   registration_plan | coordinator_rpc | safetensors_reader
#              (default: all three)
# From the repository root, or as the Bazel sh_test //fuzz:fuzz_test. A
# longer run, e.g. 10 minutes of the coordinator fuzzer:
#   fuzz/run_fuzz.sh 600 coordinator_rpc
# Environment: FUZZ_FLAGS, more libFuzzer flags (e.g. "-fork=2
# -ignore_crashes=1" to go on past a finding); FUZZ_ARTIFACTS, a folder that
# keeps the crash inputs (they are also printed in base64).
# Targets and their seeds:
#   registration_plan   fuzz/corpus/*.textproto (RegisterParamsRequest,
#                       encoded with protoc)
#   coordinator_rpc     fuzz/corpus_coordinator/* (raw FuzzedDataProvider
#                       bytes; any file is a program of calls)
#   safetensors_reader  fuzz/corpus_safetensors/* (state files)
set -euo pipefail
SECONDS_TO_RUN="${1:-20}"
shift || true
FUZZERS=("$@")
(( ${#FUZZERS[@]} )) || FUZZERS=(registration_plan coordinator_rpc safetensors_reader)
# The source tree: under Bazel the script is a runfiles symlink into it.
ROOT="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"
cd "$ROOT"
WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/muond-fuzz-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/gen" "$WORK/obj"

protoc -I proto --cpp_out="$WORK/gen" proto/muond/v1/muond.proto

CXX="${CXX_FUZZ:-clang++}"
FLAGS=(-std=c++20 -O1 -g -fsanitize=fuzzer-no-link,address,undefined
       -fno-sanitize-recover=undefined -I. -I"$WORK/gen" -w)
# The project sources each fuzzer needs (archived: each links what it uses).
PLAN_SRCS=(server/common/proto_convert.cc server/common/job_id.cc server/common/ns_load.cc
           server/common/metrics.cc
           # The coordinator's job logic: every file but the gRPC layer.
           server/coordinator/coordinator_core.cc server/coordinator/coordinator_metrics.cc
           server/coordinator/coordinator_options.cc server/coordinator/job_planner.cc
           server/coordinator/job_table.cc server/coordinator/kv_store.cc
           server/coordinator/manifest_checks.cc server/coordinator/plan_delivery.cc
           server/coordinator/rebalancer.cc server/coordinator/registration_rounds.cc
           core/plan/*.cc core/common/*.cc  # whole packages: a new file links without an edit here
           "$WORK/gen/muond/v1/muond.pb.cc")
# Registration's own files; view_overlap.cc (aliasing checks) where present.
REG_SRCS="server/daemon/registration.cc server/daemon/region_table.cc server/daemon/memory_mapper.cc
          server/common/open_files.cc core/step/group_count.cc"
[[ -e server/daemon/view_overlap.cc ]] && REG_SRCS+=" server/daemon/view_overlap.cc"
declare -A NEEDS=(
  [registration_plan]="$REG_SRCS ${PLAN_SRCS[*]}"
  [coordinator_rpc]="${PLAN_SRCS[*]}"
  [safetensors_reader]="server/common/safetensors.cc"
)
LIB_SRCS=()
for f in "${FUZZERS[@]}"; do
  [[ -n "${NEEDS[$f]:-}" ]] || { echo "unknown fuzzer '$f'" >&2; exit 2; }
  for src in ${NEEDS[$f]}; do
    [[ " ${LIB_SRCS[*]} " == *" $src "* ]] || LIB_SRCS+=("$src")
  done
done
SRCS=("${LIB_SRCS[@]}")
for f in "${FUZZERS[@]}"; do SRCS+=("fuzz/${f}_fuzzer.cc"); done
# Compile two at a time (CI has 2 cores).
pids=()
for src in "${SRCS[@]}"; do
  "$CXX" "${FLAGS[@]}" -c "$src" -o "$WORK/obj/$(basename "$src").o" &
  pids+=($!)
  if (( ${#pids[@]} >= 2 )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done
LIB_OBJS=()
for src in "${LIB_SRCS[@]}"; do LIB_OBJS+=("$WORK/obj/$(basename "$src").o"); done
ar rcs "$WORK/libmuond_fuzz.a" "${LIB_OBJS[@]}"
ABSL=$(sed -n '/^ABSL_LIBS = \[/,/^\]/p' third_party/BUILD | grep -o '"-l[^"]*"' | tr -d '"' | tr '\n' ' ')

# Seeds of one fuzzer into $WORK/corpus-<name>.
seed_corpus() {
  local name="$1" out="$WORK/corpus-$1"
  mkdir -p "$out"
  case "$name" in
    registration_plan)
      for seed in fuzz/corpus/*.textproto; do
        protoc -I proto --encode=muond.v1.RegisterParamsRequest \
          proto/muond/v1/muond.proto < "$seed" > "$out/$(basename "$seed" .textproto)"
      done ;;
    coordinator_rpc) cp fuzz/corpus_coordinator/* "$out/" ;;
    safetensors_reader) cp fuzz/corpus_safetensors/* "$out/" ;;
  esac
}

status=0
for name in "${FUZZERS[@]}"; do
  echo "=== ${name}_fuzzer: ${SECONDS_TO_RUN} s"
  "$CXX" -fsanitize=fuzzer,address,undefined "$WORK/obj/${name}_fuzzer.cc.o" \
    "$WORK/libmuond_fuzz.a" -o "$WORK/$name" \
    -lprotobuf $ABSL -lglog -lgflags -lrt -latomic -lpthread
  seed_corpus "$name"
  mkdir -p "$WORK/art-$name"
  set +e
  ASAN_OPTIONS=detect_leaks=1 "$WORK/$name" -max_total_time="$SECONDS_TO_RUN" \
    -max_len=65536 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$WORK/art-$name/" ${FUZZ_FLAGS:-} "$WORK/corpus-$name" 2>&1 | tail -25
  rc=${PIPESTATUS[0]}
  set -e
  if [[ -n "${FUZZ_ARTIFACTS:-}" ]]; then
    mkdir -p "$FUZZ_ARTIFACTS" && cp -r "$WORK/art-$name" "$FUZZ_ARTIFACTS/" || true
  fi
  if (( rc != 0 )); then
    status=$rc
    echo "${name}_fuzzer found a problem; the input is in the log above" >&2
    for f in "$WORK/art-$name"/*; do
      [[ -e "$f" ]] && { echo "== $f (base64):"; base64 "$f"; }
    done
  fi
done
exit "$status"
