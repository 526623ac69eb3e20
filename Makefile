# omnistage: two commands do all the set-up on a fresh machine.
#   make demo   install what is missing, build the tiny models, serve examples/qwen3-omni-tiny.yaml
#               locally and answer one request (prints the text, writes out/demo.wav)
#   make test   install what is missing, run `make lint`, then every suite: unit, integration, local and the
#               Kubernetes e2e suite (fetches helm and builds the control plane when they are not cached)
#   make lint   ruff (lint + import order), mypy on the contracts and subsystems, import-linter's contracts
#   make test-fast  the quick loop (about 3 min): unit and integration tests not marked slow or vllm
#   make image  the project's image without a Docker daemon (debootstrap + buildah; `docker build .` also works)
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
MODELS := models
PROTO_SRC := $(wildcard protos/omnistage/v1/*.proto)
PROTO_OUT := $(patsubst protos/%.proto,%_pb2.py,$(PROTO_SRC))
export OMP_NUM_THREADS := 1

.PHONY: setup protos crd models demo demo-image demo-llm lint test test-unit test-fast e2e bench clean image

image:
	@scripts/build_image.sh

setup:
	@scripts/setup.sh
	@$(MAKE) --no-print-directory protos

protos: $(PROTO_OUT)
$(PROTO_OUT) &: $(PROTO_SRC) scripts/gen_protos.sh
	@echo "[setup] generating protobuf code"
	@scripts/gen_protos.sh

# The OmniPipeline CRD, generated from the API model (omnistage/api/model.py), and the chart's copy.
crd: setup
	$(VENV)/bin/omnistage crd -o crds/omnipipelines.yaml -o charts/omnistage/crds/omnipipelines.yaml

models: setup
	@$(VENV)/bin/omnistage models build $(MODELS)

demo: models
	@mkdir -p out
	$(VENV)/bin/omnistage run examples/qwen3-omni-tiny.yaml --models $(MODELS) \
	  --prompt "Tell me a short story about the sea." --out out/demo.wav --return-trace

demo-image: models
	@mkdir -p out
	$(VENV)/bin/omnistage run examples/text-to-image-tiny.yaml --models $(MODELS) \
	  --prompt "a red car on a road" --out out/demo.png --return-trace

demo-llm: models
	$(VENV)/bin/omnistage run examples/llm-tiny.yaml --models $(MODELS) --prompt "Hello" --return-trace

# The map, checked: pyproject.toml holds each tool's settings ([tool.ruff], [tool.mypy], [tool.importlinter]).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint models
	@scripts/run_tests.sh

test-fast: models
	@scripts/run_tests.sh --fast

test-unit: setup
	$(PY) -m pytest -q tests/unit

e2e: models
	@scripts/run_tests.sh --e2e

bench: models
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b --quick || exit 1; done

clean:
	rm -rf out .pytest_cache .hypothesis omnistage/v1/*_pb2*.py*
