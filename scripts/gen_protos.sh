#!/usr/bin/env bash
# Generate Python code for protos/omnistage/v1 into the omnistage package (omnistage/v1/).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/omnistage/v1/*.proto
