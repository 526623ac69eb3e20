"""Shared test fixtures. Kept free of tool checks so unit tests run anywhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny models (`make models` builds them); tests that need models fail loudly without them."""
    d = Path(os.environ.get("OMNISTAGE_MODEL_DIR", REPO / "models"))
    if not (d / "qwen3-omni-tiny" / "thinker" / "config.json").exists():
        pytest.fail(f"tiny models missing in {d}: run `make models` (or `.venv/bin/omnistage models build {d}`)")
    return d
