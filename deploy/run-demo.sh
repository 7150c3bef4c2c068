#!/usr/bin/env bash
# The README's first command: the main job. Installs what is missing
# (deploy/setup.sh), builds the servers, then deploy/local/launch.py runs
# `muond launch` (a coordinator and one muond per trainer rank) around a torchrun
# job of examples/char_gpt/train_dist.py: on a machine without a GPU 4 gloo
# processes laid out as FSDP2 2 x TP 2 with host-mode daemons; on a GPU host one
# process per GPU (NCCL), each daemon on its rank's GPU. They train a small GPT on
# Debian's fortunes; rank 0 then trains the in-process reference for the report.
#   deploy/run-demo.sh [--steps N] [--parallel ddp|fsdp|tp|fsdp+tp|hsdp] [--nproc N]
#                      [--device auto|cpu|cuda] [--out DIR]
#                      [-- <examples/char_gpt/train_dist.py options>]
# `deploy/local/launch.py --help` lists every option.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
# Bad arguments fail here, before the build.
.venv/bin/python deploy/local/launch.py --check-args "$@"
# MUOND_BAZEL_OUTPUT_BASE: a Bazel output base of your own (as deploy/bundle.sh).
bazel ${MUOND_BAZEL_OUTPUT_BASE:+--output_base=$MUOND_BAZEL_OUTPUT_BASE} build -c opt //server/daemon:muond-daemon //server/coordinator:muond-coordinator \
  //tools/muonctl 2>&1 | grep -vE '^(INFO|Loading|Analyzing)' || true
test -x bazel-bin/server/daemon/muond-daemon && test -x bazel-bin/server/coordinator/muond-coordinator
exec .venv/bin/python deploy/local/launch.py "$@"
