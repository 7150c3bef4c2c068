#!/usr/bin/env bash
# The README's first command: the main job. Installs what is missing
# (deploy/setup.sh), builds the servers, then deploy/local/launch.py starts a
# coordinator and one muond per rank (default: a 2x2 GTP_remat x TP domain in
# host mode on a machine without a GPU; one daemon per GPU on a GPU host) and
# trains a small GPT on Debian's fortunes through them.
#   deploy/run-demo.sh [--steps N] [--ranks GxT] [--device auto|cpu|cuda] [--out DIR]
#                      [-- <examples/char_gpt/train.py options>]
# `deploy/local/launch.py --help` lists every option.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
# Bad arguments fail here, before the build.
.venv/bin/python deploy/local/launch.py --check-args "$@"
# MUOND_BAZEL_OUTPUT_BASE: a Bazel output base of your own (as deploy/bundle.sh).
bazel ${MUOND_BAZEL_OUTPUT_BASE:+--output_base=$MUOND_BAZEL_OUTPUT_BASE} build -c opt //server/daemon:muond //server/coordinator:muond-coordinator \
  //tools/muonctl 2>&1 | grep -vE '^(INFO|Loading|Analyzing)' || true
test -x bazel-bin/server/daemon/muond && test -x bazel-bin/server/coordinator/muond-coordinator
exec .venv/bin/python deploy/local/launch.py "$@"
