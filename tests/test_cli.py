"""The command line: the `logits` interface other tools call, inspect, make-model, generate on the default model."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.engine import Engine

ROOT = Path(__file__).parent.parent


def run(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *map(str, args)], capture_output=True, text=True,
                          env=env)


def test_logits_interface(tiny_gguf, tmp_path):
    out = tmp_path / "l.npy"
    r = run("logits", tiny_gguf, "--tokens", "1,2,3,500,7", "--out", out)
    assert r.returncode == 0, r.stderr
    a = np.load(out)
    assert a.dtype == np.float32 and a.shape == (5, 512)
    ref = Engine.open_sync(tiny_gguf).logits([1, 2, 3, 500, 7])
    assert np.array_equal(a, ref)


def test_logits_bad_tokens(tiny_gguf, tmp_path):
    r = run("logits", tiny_gguf, "--tokens", "1,99999", "--out", tmp_path / "x.npy")
    assert r.returncode == 2 and "token #1 = 99999" in r.stderr
    r = run("logits", tiny_gguf, "--tokens", "1,a", "--out", tmp_path / "x.npy")
    assert r.returncode == 2 and "comma-separated integers" in r.stderr


def test_inspect(tiny_gguf):
    r = run("inspect", tiny_gguf)
    assert r.returncode == 0, r.stderr
    assert "qwen4exp.block_count" in r.stdout and "bytes read per decoded token" in r.stdout


def test_make_model_is_deterministic(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    for p, seed in ((a, 3), (b, 3), (c, 4)):
        assert run("make-model", "--preset", "tiny", "--seed", seed, p).returncode == 0
    h = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (a, b, c)]
    assert h[0] == h[1] != h[2]
    d = tmp_path / "new" / "folder" / "d.gguf"            # its folders are made (models/ is not in a clone)
    assert run("make-model", "--preset", "tiny", "--seed", 3, d).returncode == 0
    assert hashlib.sha256(d.read_bytes()).hexdigest() == h[0]


def test_generate_default_model(tmp_path):
    import os
    env = dict(os.environ, STRATA_CACHE=str(tmp_path / "cache"))
    r = run("generate", "Hello", "-n", "8", env=env)
    assert r.returncode == 0, r.stderr
    assert "generation: " in r.stderr and "tok/s" in r.stderr
    r2 = run("generate", "Hello", "-n", "8", env=env)        # greedy: the same text again
    assert r2.stdout == r.stdout


def test_generate_preload(tiny_gguf, tmp_path):
    """--preload reads every expert first (progress on stderr, ending at the experts' size); the text is the same
    as without it (greedy)."""
    import os
    from strata.host.experts import ExpertLayout
    from strata.model.loader import load_model
    env = dict(os.environ, STRATA_CACHE=str(tmp_path / "cache"))
    model = load_model(tiny_gguf)
    layout = ExpertLayout.from_model(model)
    total = sum(layout.blob_bytes(il) for il in range(model.cfg.n_layer)) * model.cfg.n_expert
    r = run("generate", "-m", tiny_gguf, "Hello", "-n", "6", "--preload", "--experts", "host", env=env)
    plain = run("generate", "-m", tiny_gguf, "Hello", "-n", "6", env=env)
    assert r.returncode == 0 and plain.returncode == 0, r.stderr + plain.stderr
    lines = [x for x in r.stderr.replace("\r", "\n").splitlines() if x.startswith("preloading experts")]
    assert lines and lines[-1].endswith(f"{total / 2**30:.1f}/{total / 2**30:.1f} GiB")
    assert r.stdout == plain.stdout


def test_generate_bad_sampling(tmp_path):
    import os
    env = dict(os.environ, STRATA_CACHE=str(tmp_path / "cache"))
    r = run("generate", "Hi", "--top-p", "0", env=env)
    assert r.returncode == 2 and "top_p" in r.stderr


def test_cache_options_reach_the_host_config():
    """--cache-half-life, --promote-per-layer, --mapped-reads and --prefetch-extra become the HostConfig the engine
    opens with (prefetch by default); a half-life under one token is refused with the option's name, a prefetch
    past its limit with HostConfig's."""
    import argparse
    sys.path.insert(0, str(ROOT))
    import cli
    p = argparse.ArgumentParser()
    cli._engine_options(p)
    host = cli._host(p.parse_args(["--cache-half-life", "64", "--promote-per-layer", "3"]))
    assert (host.cache_half_life, host.promote_per_layer) == (64, 3)
    assert cli._host(p.parse_args([])).cache_half_life == 512
    host = cli._host(p.parse_args(["--mapped-reads", "fetch", "--prefetch-extra", "4"]))
    assert (host.mapped_reads, host.prefetch_extra) == ("fetch", 4)
    default = cli._host(p.parse_args([]))
    assert (default.mapped_reads, default.prefetch_extra) == ("prefetch", 0)
    r = run("generate", "Hi", "--cache-half-life", "0")
    assert r.returncode == 2 and "--cache-half-life" in r.stderr
    r = run("generate", "Hi", "--prefetch-extra", "17")
    assert r.returncode != 0 and "prefetch_extra = 17: 0 .. 16" in r.stderr
