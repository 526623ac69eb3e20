#!/usr/bin/env bash
# The GPU check (issue 15): one idempotent script for a machine with a CUDA GPU and no network.
#   scripts/gpu_check.sh
# Prepare it on a machine with network first: `scripts/gpu_wheels.sh` (wheels the GPU machine lacks, into
# gpu-wheels/) and `make protos` (the generated gRPC code); copy both to the GPU machine with the checkout. Then:
#   1. describes the machine (GPU model, driver, CUDA) and installs the carried wheels into .venv-gpu
#      (a venv over the machine's own Python and its torch);
#   2. builds the tiny models (models/);
#   3. serves every example whose engines are installed there, on the CPU and with every stage on the GPU,
#      and checks one request each (scripts/gpu_compare.py: same tokens, audio and images within tolerance);
#   4. the real-size check: the hollow Qwen3-Omni-30B-A3B layout (published configs and headers, no data)
#      mapped tensor for tensor onto each stage's modules on the meta device, and the memory plan of
#      examples/qwen3-omni-30b-a3b.yaml against this GPU's memory (`models check --plan --gpu-memory`);
#   5. bench/stage_batching.py --quick, bench/transport.py --quick (CUDA memory over UCX, beside
#      ucx_perftest -m cuda) and bench/e2e_vs_monolith.py --quick, each with --device cuda.
# Writes bench/results/gpu/*.json (each names the machine) and prints a summary table. Each part runs
# under its own time bound; a part that fails is reported and the others still run. Exit status: 0 when
# every part passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error \
       UCX_WARN_UNUSED_ENV_VARS=n PYTHONPATH="$PWD:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
declare -A status seconds

step() {  # step NAME BOUND_S COMMAND...: run, record pass/fail and time, keep going
  local name=$1 bound=$2; shift 2
  local t0=$SECONDS
  echo; echo "== $name (bound ${bound}s)"
  if [ "$(type -t "$1")" = function ]; then BOUND=$bound "$@"; else timeout --kill-after=10 "$bound" "$@"; fi
  local rc=$?
  status[$name]=$([ $rc -eq 0 ] && echo pass || ([ $rc -ge 124 ] && echo "timeout" || echo "fail ($rc)"))
  seconds[$name]=$((SECONDS - t0))
  order+=("$name")
}
order=()

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: not found"
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())'

# A venv over the machine's own Python (its torch and transformers); where that cannot be made or does not
# see them (python3 itself a venv, no ensurepip), the wheels go into a folder on PYTHONPATH instead.
PY=.venv-gpu/bin/python; target=()
[ -x $PY ] || python3 -m venv --system-site-packages .venv-gpu > /dev/null 2>&1
if ! $PY -c 'import torch, transformers' 2> /dev/null; then
  echo "no usable venv over python3: installing the carried wheels into .gpu-site/"
  PY=python3; export PYTHONPATH="$PWD/.gpu-site:$PYTHONPATH"
  target=(--target .gpu-site --upgrade)
fi
if compgen -G "gpu-wheels/*.whl" > /dev/null; then
  # --no-deps: the machine's own packages (torch, transformers, numpy, ...) stay as they are
  $PY -m pip install -q --no-index --no-deps "${target[@]}" gpu-wheels/*.whl 2>&1 | grep -v "^\s*$" | tail -3
else
  echo "no gpu-wheels/: run scripts/gpu_wheels.sh where there is network, and carry it"
fi
$PY -c 'import torch, transformers' || { echo "python cannot import torch and transformers here"; exit 2; }
if ! compgen -G "omnistage/v1/*_pb2.py" > /dev/null; then
  echo "no generated gRPC code in omnistage/v1: run \`make protos\` where there is network, and carry it"; exit 2
fi
for m in diffusers ucxx vllm grpc_health starlette cryptography soundfile; do  # imported, not only found
  printf '  %-14s %s\n' "$m" "$($PY -c "import $m" > /dev/null 2>&1 && echo yes || echo no)"
done

build_models() {  # every tiny model at once, one process each (the machine has cores to spare)
  local names pids=() rc=0
  names=$($PY -c 'from omnistage.tiny_models import MODELS; print(" ".join(MODELS))')
  for n in $names; do
    timeout --kill-after=10 "$BOUND" $PY -m omnistage.local.cli models build models --only "$n" > "/tmp/gpu-check-model-$n.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ $rc -eq 0 ] || tail -n 5 /tmp/gpu-check-model-*.log
  return $rc
}

real_size() {  # the 30B's layout mapped on the meta device, and its plan against this GPU's memory
  local root=/tmp/gpu-check-hollow mib
  rm -rf "$root"
  $PY -m omnistage.local.cli models hollow qwen3_omni "$root/Qwen3-Omni-30B-A3B-Instruct" || return 1
  $PY - "$root/Qwen3-Omni-30B-A3B-Instruct" <<'PY' || return 1
import sys
from stage_service.engines.mapping import map_stage
bad = 0
for component in ("thinker", "talker", "code2wav"):
    for m in map_stage("qwen3_omni", component, sys.argv[1]):
        print(f"  {component:<9s} {m.prefix:<28s} {m.tensors:>6d} tensors, {len(m.unmapped)} unmapped, "
              f"{len(m.missing)} missing, {len(m.mismatched)} mismatched")
        bad += not m.ok
sys.exit(bad)
PY
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | sort -n | head -1)
  $PY -m omnistage.local.cli models check --plan examples/qwen3-omni-30b-a3b.yaml --models "$root" \
    ${mib:+--gpu-memory "${mib}Mi"}
}

# Bounds: 530 s in all, so the whole check stays under 8 minutes with the set-up above.
step models 70 build_models
step examples 150 $PY scripts/gpu_compare.py
step real_size 60 real_size
step stage_batching 110 $PY bench/stage_batching.py --quick --device cuda
if $PY -c 'import ucxx' 2>/dev/null; then
  step transport 50 $PY bench/transport.py --quick --device cuda
else
  echo; echo "== transport: not run (ucxx is not installed here; scripts/gpu_wheels.sh says whether it fit)"
  status[transport]="not run (no ucxx)"; seconds[transport]=0; order+=(transport)
fi
step e2e_vs_monolith 90 $PY bench/e2e_vs_monolith.py --quick --device cuda

echo; echo "== summary ($((SECONDS - start))s in all)"
rc=0
for name in "${order[@]}"; do
  printf '  %-16s %-22s %5ss\n' "$name" "${status[$name]}" "${seconds[$name]}"
  [ "${status[$name]}" = pass ] || rc=1   # a part not run is not a pass
done
$PY - <<'PY'
import json, pathlib
for p in sorted(pathlib.Path("bench/results/gpu").glob("*.json")):
    doc = json.loads(p.read_text())
    print(f"\n{p}  ({doc['machine'].get('gpu', '')})")
    for f in doc["figures"]:
        print(f"  {f['name']:<48s} {f['value']:>12.4g} {f['unit']}")
PY
# With $OUT set (a runner that keeps only that folder), copy the results and the logs of what failed there.
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/results" "$OUT/logs"
  cp -r bench/results/gpu/. "$OUT/results/" 2> /dev/null
  cp /tmp/gpu-check-model-*.log "$OUT/logs/" 2> /dev/null
  for d in /tmp/omnistage-*; do [ -d "$d" ] && cp -r "$d" "$OUT/logs/" 2> /dev/null; done
fi
exit $rc
