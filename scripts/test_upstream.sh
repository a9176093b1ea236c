#!/usr/bin/env bash
# MMEngine's own runner and hook tests with DeepSpeedRunner in place of Runner.
#   bash scripts/test_upstream.sh MMENGINE_CHECKOUT [STAGE ...]
# MMENGINE_CHECKOUT: a checkout of open-mmlab/mmengine at v0.10.7 (PyPI's
# distribution has no tests). STAGE: ZeRO stages to run (default: 0 2 3).
# Extra pytest arguments go in PYTEST_ARGS. See tests/upstream/mmds_upstream.py.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
UPSTREAM=$(cd "$1" && pwd)
shift
STAGES=${*:-0 2 3}
. .venv/bin/activate
# MMEngine's tests import parameterized; its profiler-hook test imports pkg_resources,
# gone from the setuptools this environment has (that file is left out).
python -m pip install -q -c requirements/constraints.txt parameterized
status=0
# test_runner and test_hooks register toy classes of the same names: one process each.
for stage in $STAGES; do
    for suite in tests/test_runner tests/test_hooks; do
        echo "== MMEngine's $suite at ZeRO-$stage"
        (cd "$UPSTREAM" && MMDS_UPSTREAM_STAGE=$stage PYTHONPATH="$ROOT/tests/upstream:$ROOT" \
            python -m pytest -q -p mmds_upstream -p no:cacheprovider \
            --rootdir="$UPSTREAM" -o addopts= ${PYTEST_ARGS:-} \
            --ignore=tests/test_hooks/test_profiler_hook.py "$suite") || status=1
    done
done
exit $status
