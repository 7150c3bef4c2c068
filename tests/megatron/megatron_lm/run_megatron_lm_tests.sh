#!/usr/bin/env bash
# Megatron-LM's own unit tests for layer-sharded Muon against muond.megatron's
# LayerShardedMuon, on CPU under gloo: 4 trainer ranks under `muond launch` (host-mode
# daemons), Megatron-LM's test files from a checkout that has them.
#
#   tests/megatron/megatron_lm/run_megatron_lm_tests.sh MEGATRON_LM_CHECKOUT [pytest args]
#
# Needs the project's venv (deploy/setup.sh: megatron-core, emerging-optimizers), pytest
# on PYTHONPATH, and the servers (bazel build //server/daemon:muond-daemon
# //server/coordinator:muond-coordinator, or MUOND_BIN_DIR). Nothing of the checkout is
# changed: its tests are copied to a temporary directory next to this plugin.
set -euo pipefail
checkout=${1:?usage: run_megatron_lm_tests.sh MEGATRON_LM_CHECKOUT [pytest args]}
shift
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
work=$(mktemp -d /tmp/megatron-lm-tests.XXXXXX)
mkdir -p "$work/tests/unit_tests/optimizer"
touch "$work/tests/__init__.py" "$work/tests/unit_tests/__init__.py" \
  "$work/tests/unit_tests/optimizer/__init__.py"
cp "$checkout/tests/unit_tests/test_utilities.py" "$work/tests/unit_tests/"
cp "$checkout"/tests/unit_tests/optimizer/test_layer_sharded_*.py \
  "$work/tests/unit_tests/optimizer/"
cp "$here/conftest.py" "$work/"
bin=${MUOND_BIN_DIR:-$repo/bazel-bin}
py=$repo/.venv/bin/python
cd "$work"
export PYTHONPATH=$work:${PYTHONPATH:-}
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/unit_tests/optimizer/test_layer_sharded_muon.py)
"$py" -m muond.cli launch --nproc-per-node 4 --device cpu --bin-dir "$bin" -- \
  "$py" -m torch.distributed.run --standalone --nproc-per-node 4 \
  -m pytest -p no:cacheprovider -W ignore -rA -q "${files[@]}"
