"""The embedded default model: the `tiny` preset, made deterministically on first use (no download)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0


def cache_dir() -> Path:
    root = os.environ.get("STRATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
    return Path(root)


def default_model_path(log=lambda s: print(s, file=sys.stderr)) -> Path:
    """Path of the tiny default model, made (in about a second) if it is not in the cache yet."""
    from strata.model.synth import make_model
    path = cache_dir() / f"{DEFAULT_PRESET}-seed{DEFAULT_SEED}-v2.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"making the default model ({DEFAULT_PRESET} preset, random weights) at {path}")
        make_model(DEFAULT_PRESET, path, seed=DEFAULT_SEED, log=lambda s: None)
    return path
