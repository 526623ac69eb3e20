"""Published checkpoints: which families omnistage serves, reading one component's tensors, and the
pre-flight check of a pipeline's models (`omnistage models check`)."""
