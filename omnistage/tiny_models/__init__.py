"""Seeded, random-weight tiny models built from configs and saved locally.

No weights are downloaded: tests and the local demo build these and serve
them with the real engines. Outputs are noise; shapes, flow and timing are real.
"""

from omnistage.tiny_models.build import MODELS, build_models

__all__ = ["MODELS", "build_models"]
