#!/usr/bin/env bash
# The test suite, as `make test` runs it (after setup and the model build).
#   scripts/run_tests.sh [PYTEST_ARGS]          everything: unit, integration, local, then the Kubernetes
#                                               e2e suite (node agent), then its real-container scenarios
#                                               (e2e/real: kubelet, containerd, runc, the project image, in a
#                                               private network namespace). Fetches helm, builds Kubernetes
#                                               and the image first when they are not cached (~/.cache/omnistage).
#   scripts/run_tests.sh --fast [PYTEST_ARGS]   `make test-fast`: unit and integration tests not marked
#                                               slow or vllm; no local serve, no e2e, nothing fetched
#   scripts/run_tests.sh --e2e [PYTEST_ARGS]    the e2e suite alone, both parts (it builds what it misses itself)
#   e2e/cluster/in-netns.sh scripts/run_tests.sh --real [PYTEST_ARGS]   the real-container scenarios alone
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 UCX_TLS=tcp UCX_WARN_UNUSED_ENV_VARS=n TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
       TRANSFORMERS_VERBOSITY=error
mode=all
case "${1:-}" in --fast|--e2e|--real) mode=${1#--}; shift ;; esac

# A bound on the whole run: a process that cannot exit must fail CI, not stall it. Measured on 2 cores with
# nothing cached (a fresh ~/.cache/omnistage): tests/ 21.5 min with the Kubernetes and image builds (about 9 min
# each) beside it, e2e 6 min, e2e/real 2.5 min (the image's first import included); the whole .ci/run 32 min.
# On a slower 2-core VM (AMD EPYC at 2.0 GHz), with more tests: tests/ 40 min (2406 s, 3907 tests) one at a time,
# the image build beside it; in two processes (below), 30.5 min (1834 s, 4046 tests), the image build beside it.
# The whole .ci/run there, Kubernetes and the image cached: 50 min (3008 s), of which e2e 11.5 min (690 s).
# This bound (75 min) leaves room for such a machine with nothing cached under CI's 90 minutes, setup included.
BUDGET=${OMNISTAGE_TEST_BUDGET:-4500}
# tests/ runs in parallel test processes (pytest-xdist), a test file's tests all in one of them (their module
# fixtures are started once): the suite's tests wait on stage processes, sockets and timers much of the time,
# so two processes use two cores where one left the second mostly idle. One per core, at most 4 (each holds its
# tests' tiny models); OMNISTAGE_TEST_WORKERS=0 runs them in this process, one after another.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)   # nproc honours OMP_NUM_THREADS (1 here)
WORKERS=${OMNISTAGE_TEST_WORKERS:-$((cores < 4 ? cores : 4))}
parallel() { if [ "$WORKERS" -gt 0 ]; then echo "-n $WORKERS --dist loadfile"; fi; }
end=$((SECONDS + BUDGET))
left() { local s=$((end - SECONDS)); echo $((s > 1 ? s : 1)); }   # `timeout 0` would mean no bound

# Each run ends with its slowest tests (--durations): where the next cut of the run's time is.
run_pytest() {
  set +e
  timeout --kill-after=60 "$(left)" .venv/bin/python -m pytest --durations=25 "$@"
  local rc=$?
  set -e
  # pytest exit code 5 means no tests were collected: that is a failure here, never a pass.
  if [ $rc -eq 5 ]; then echo "no tests were collected: failing" >&2; return 1; fi
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "the run went past its bound (${BUDGET}s): failing" >&2; fi
  return $rc
}

# The distribution's Prometheus and promtool: tests/local/test_serve_prometheus.py runs the chart's rules and
# dashboard (charts/omnistage/files/) against a real one, which it starts itself.
prometheus_tools() {
  command -v prometheus >/dev/null && command -v promtool >/dev/null && return 0
  if [ "$(id -u)" != 0 ]; then echo "the tests need prometheus and promtool: sudo apt-get install prometheus" >&2; return 0; fi
  echo "[setup] installing prometheus from the distribution"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
}

# What the e2e suite needs, built in the background while tests/ runs (helm is fetched at once: the chart tests
# use it). Kubernetes (mostly compiling) and the image (mostly downloads and unpacking) take about ten minutes
# each on a fresh machine and overlap with each other and with tests/; cached, both return at once.
cluster_tools_start() {
  local cache=${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}
  # Named here, helm is required: the chart tests fail rather than skip without it.
  OMNISTAGE_HELM=$(PYTHON=.venv/bin/python e2e/cluster/get-helm.sh "$cache/helm")
  export OMNISTAGE_HELM
  mkdir -p e2e/.run
  echo "[cluster] Kubernetes and the image build in the background (logs: e2e/.run/{k8s-build,image}.log)"
  timeout "$(left)" e2e/cluster/build.sh "${OMNISTAGE_K8S_BIN:-$cache/k8s-1.20.2/bin}" > e2e/.run/k8s-build.log 2>&1 &
  k8s_build=$!
  timeout "$(left)" scripts/build_image.sh > e2e/.run/image.log 2>&1 &
  image_build=$!
  # an interrupted run stops them too (each `timeout` leads a process group of its own)
  trap 'kill -- -$k8s_build -$image_build 2>/dev/null || true' EXIT
}

cluster_tools_wait() {
  local rc=0
  wait $k8s_build || { rc=$?; echo "the Kubernetes build failed; the end of e2e/.run/k8s-build.log:" >&2
                       tail -30 e2e/.run/k8s-build.log >&2; }
  wait $image_build || { rc=$?; echo "make image failed; the end of e2e/.run/image.log:" >&2
                         tail -30 e2e/.run/image.log >&2; }
  tail -n1 e2e/.run/k8s-build.log; tail -n1 e2e/.run/image.log
  return $rc
}

e2e_real() {  # the real-container scenarios, in a private network namespace of their own
  OMNISTAGE_TEST_BUDGET=$(left) e2e/cluster/in-netns.sh scripts/run_tests.sh --real "$@"
}

case $mode in
  fast) run_pytest -q -ra --timeout=900 $(parallel) -m "not slow and not vllm" tests/unit tests/integration "$@" ;;
  real) run_pytest -q -ra --timeout=1800 e2e/real "$@" ;;
  e2e)  status=0
        run_pytest -q -ra --timeout=1800 e2e "$@" || status=$?
        e2e_real "$@" || { rc=$?; [ $status -ne 0 ] || status=$rc; }
        exit $status ;;
  all)
    prometheus_tools
    cluster_tools_start
    status=0
    run_pytest -q -ra --timeout=900 $(parallel) tests "$@" || status=$?
    cluster_tools_wait || exit 1
    run_pytest -q -ra --timeout=1800 e2e "$@" || { rc=$?; [ $status -ne 0 ] || status=$rc; }
    e2e_real "$@" || { rc=$?; [ $status -ne 0 ] || status=$rc; }
    exit $status ;;
esac
