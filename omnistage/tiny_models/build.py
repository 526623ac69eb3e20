"""`omnistage models build DIR`: build every tiny model the examples and tests use."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

from omnistage.tiny_models import (
    diffusion,
    flux,
    lm,
    qwen2_5_omni,
    qwen3_asr,
    qwen3_omni,
    qwen3_tts,
    qwen_image,
    sd3,
    wan,
)

# Bump when a builder changes, so stale models get rebuilt.
BUILD_VERSION = 7
MODELS: dict[str, Callable[[Path, int], None]] = {
    "qwen3-omni-tiny": qwen3_omni.build,
    "qwen2.5-omni-tiny": qwen2_5_omni.build,
    "qwen2-tiny": lm.build,
    "sd-tiny": diffusion.build,
    "sd3-tiny": sd3.build,
    "wan-t2v-tiny": wan.build,
    "wan-i2v-tiny": wan.build_i2v,
    "qwen3-asr-tiny": qwen3_asr.build,
    "flux-tiny": flux.build,
    "qwen-image-tiny": qwen_image.build,
    "qwen3-tts-tiny": qwen3_tts.build,
    "qwen3-tts-base-tiny": qwen3_tts.build_base,
    "flux-kontext-tiny": flux.build_kontext,
}


STAMP = ".omnistage-build.json"


def is_current(out: Path) -> bool:
    """`out` holds a model built by this version of its builder."""
    stamp = Path(out) / STAMP
    return stamp.exists() and json.loads(stamp.read_text()).get("version") == BUILD_VERSION


def build_models(root: str | Path, names: list[str] | None = None, *, force: bool = False,
                 progress: Callable[[str], None] = print) -> list[Path]:
    """Build the named models (all by default) under `root`; up-to-date ones are kept."""
    root = Path(root)
    built = []
    for name in names or list(MODELS):
        if name not in MODELS:
            raise KeyError(f'unknown model "{name}" (known: {", ".join(MODELS)})')
        out = root / name
        if not force and is_current(out):
            progress(f"  {name}: up to date ({out})")
            built.append(out)
            continue
        t0 = time.monotonic()
        progress(f"  {name}: building ...")
        shutil.rmtree(out, ignore_errors=True)  # no file of an older layout may survive a rebuild
        MODELS[name](out, 0)
        (out / STAMP).write_text(json.dumps({"version": BUILD_VERSION, "seed": 0}))
        _readable_by_all(out)  # stage pods run as non-root users
        progress(f"  {name}: built in {time.monotonic() - t0:.1f}s ({out})")
        built.append(out)
    return built


def _readable_by_all(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod(path.stat().st_mode | (0o755 if path.is_dir() else 0o644))
