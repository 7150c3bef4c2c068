#!/usr/bin/env bash
# The README's test command: installs what is missing (deploy/setup.sh), checks
# that every test target carries exactly one level tag
# (tests/common/check_test_levels.py; the offenders are named), then runs the
# tests with Bazel. GPU tests (tag `gpu`) run too and report skipped where no
# CUDA device is present.
#   deploy/test.sh [--quick] [BAZEL_TEST_ARGS...]
# --quick runs the unit level alone (`--test_tag_filters=unit`); other
# arguments go to `bazel test`.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
args=()
for a in "$@"; do
  if [[ $a == --quick ]]; then quick=1; else args+=("$a"); fi
done
deploy/setup.sh
mkdir -p out
# A failed check must not leave an earlier run's results for .ci/run's summary.
rm -f out/test-events.json
python3 tests/common/check_test_levels.py //...
if ((quick)); then
  args=(--test_tag_filters=unit "${args[@]}")
fi
# On a CPU newer than Debian's OpenBLAS, the tests' CPU math would run its
# fallback (SSE3) kernels: they get the kernels the daemon picks for itself
# (core/backend/openblas_core.h); nothing changes where OpenBLAS chose well.
# An OPENBLAS_CORETYPE set here is the user's choice: the tests get it too
# (Bazel passes a test none of this environment), as their daemons keep it.
if [[ -n ${OPENBLAS_CORETYPE:-} ]]; then
  core=$OPENBLAS_CORETYPE
  echo "test: OPENBLAS_CORETYPE=$core (as set)"
else
  bazel build //core/backend:openblas_coretype
  # (bazel info: the bazel-bin link may be elsewhere or absent, --symlink_prefix)
  bin=$(bazel info bazel-bin) || {
    echo "test: 'bazel info bazel-bin' failed, so the OpenBLAS kernels probe" \
      "(//core/backend:openblas_coretype) cannot run; set OPENBLAS_CORETYPE" \
      "(e.g. Haswell) to skip it" >&2
    exit 1
  }
  core=$("$bin/core/backend/openblas_coretype")
  [[ -z $core ]] || echo "test: OPENBLAS_CORETYPE=$core (OpenBLAS fell back to older kernels on this CPU)"
fi
if [[ -n $core ]]; then
  args=("--test_env=OPENBLAS_CORETYPE=$core" "${args[@]}")
fi
exec bazel test //... --build_event_json_file=out/test-events.json "${args[@]}"
