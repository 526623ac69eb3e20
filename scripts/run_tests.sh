#!/usr/bin/env bash
# The test suite, as `make test` runs it (after setup and the model build).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 OMNISTAGE_MODEL_DIR="$PWD/models" UCX_TLS=tcp UCX_WARN_UNUSED_ENV_VARS=n \
       TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
args=(-q -ra --timeout=900 tests)
if [ "${1:-}" = "--e2e" ]; then shift; args=(-q -ra --timeout=1800 e2e); fi
set +e
# A bound on the whole run: a process that cannot exit must fail CI, not stall it.
timeout --kill-after=60 3000 .venv/bin/python -m pytest "${args[@]}" "$@"
rc=$?
set -e
# pytest exit code 5 means no tests were collected: that is a failure here, never a pass.
if [ $rc -eq 5 ]; then echo "no tests were collected: failing" >&2; exit 1; fi
exit $rc
