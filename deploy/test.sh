#!/usr/bin/env bash
# The README's test command: installs what is missing (deploy/setup.sh), then
# runs every test with Bazel. GPU tests (tag `gpu`) run too and report
# skipped where no CUDA device is present. Extra arguments go to `bazel test`.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
mkdir -p out
exec bazel test //... --build_event_json_file=out/test-events.json "$@"
