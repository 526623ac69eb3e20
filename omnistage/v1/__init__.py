"""Generated protobuf and gRPC code for protos/omnistage/v1 (written by `make protos`, not committed)."""
