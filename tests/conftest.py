import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))          # tests import the oracle helpers
sys.path.insert(0, str(Path(__file__).parent.parent))   # and cli.py


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """The `tiny` preset (the default model's geometry), made once per session."""
    from strata.model.synth import make_model
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    make_model("tiny", path, seed=0, log=lambda s: None)
    return path


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # the default model is made into a per-session cache, never the user's
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    yield
