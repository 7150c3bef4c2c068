#!/usr/bin/env bash
# Megatron-LM's own unit tests for layer-sharded Muon against muond.megatron's
# LayerShardedMuon, on CPU under gloo: 4 trainer ranks under `muond launch` (host-mode
# daemons), Megatron-LM's test files from a checkout that has them.
#
#   tests/megatron/megatron_lm/run_megatron_lm_tests.sh CHECKOUT [TEST_FILES] [-- PYTEST_ARGS]
#
# TEST_FILES: paths under tests/unit_tests/optimizer/ of the copy (default
# test_layer_sharded_muon.py); PYTEST_ARGS after --, e.g. -- -k unequal.
# Needs the project's venv (deploy/setup.sh: megatron-core, emerging-optimizers), pytest
# on PYTHONPATH (it is not in the venv: pip install --target DIR pytest), and the servers (bazel build //server/daemon:muond-daemon
# //server/coordinator:muond-coordinator, or MUOND_BIN_DIR). Nothing of the checkout is
# changed: its tests are copied to a temporary directory next to this plugin.
set -euo pipefail
usage="usage: run_megatron_lm_tests.sh CHECKOUT [TEST_FILES] [-- PYTEST_ARGS]"
checkout=${1:?$usage}
shift
files=() pytest_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = -- ]; then shift; pytest_args=("$@"); break; fi
  files+=("tests/unit_tests/optimizer/$(basename "$1")"); shift
done
[ ${#files[@]} -gt 0 ] || files=(tests/unit_tests/optimizer/test_layer_sharded_muon.py)
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
work=$(mktemp -d /tmp/megatron-lm-tests.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tests/unit_tests/optimizer"
touch "$work/tests/__init__.py" "$work/tests/unit_tests/__init__.py" \
  "$work/tests/unit_tests/optimizer/__init__.py"
cp "$checkout/tests/unit_tests/test_utilities.py" "$work/tests/unit_tests/"
cp "$checkout"/tests/unit_tests/optimizer/test_layer_sharded_*.py \
  "$work/tests/unit_tests/optimizer/"
cp "$here/conftest.py" "$here/megatron_lm_muon.py" "$work/"
bin=${MUOND_BIN_DIR:-$repo/bazel-bin}
py=$repo/.venv/bin/python
"$py" -c "import pytest" 2>/dev/null || {
  echo "run_megatron_lm_tests: pytest is not importable; put it on PYTHONPATH" \
    "(pip install --target DIR pytest)" >&2; exit 2; }
cd "$work"
export PYTHONPATH=$work:${PYTHONPATH:-}
"$py" -m muond.cli launch --nproc-per-node 4 --device cpu --bin-dir "$bin" -- \
  "$py" -m torch.distributed.run --standalone --nproc-per-node 4 \
  -m pytest -p no:cacheprovider -W ignore -rA -q "${files[@]}" ${pytest_args[@]+"${pytest_args[@]}"}
