"""The ports, port names and the API-key variable every pod of a pipeline uses. The API names them (the
orchestrator's HTTP port and its keys; validation keeps a pipeline's own ports off the reserved ones) and
the process contract serves on them (`omnistage/contract/launch.py` re-exports them), so they live with the API."""

# Ports and their names on a cluster (the pod IP keeps pods apart); locally every port is 0 (any free).
GRPC_PORT, HTTP_PORT = 50051, 8080
GRPC_PORT_NAME, HTTP_PORT_NAME = "grpc", "http"
# The orchestrator's OpenAI-compatible HTTP API (spec.deployment.orchestrator.http.port overrides the port).
API_PORT, API_PORT_NAME = 8000, "openai"
# Bearer keys of the OpenAI-compatible API, comma-separated: how a Kubernetes Secret reaches the orchestrator
# (an env var from a secretKeyRef), and how `omnistage serve` passes them without showing them in `ps`.
ENV_API_KEYS = "OMNISTAGE_API_KEYS"
