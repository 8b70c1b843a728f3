"""The prefill benchmark the device sessions run (bench/bench_prefill_gpu.py, the batched step's breakdown by stage
and by launch), run here on a tiny model through the emulated driver (tests/emu_driver.py): a change that would
break it on the GPU machine breaks it here first, before any device time is spent. Its timings here are the
emulator's and mean nothing; what is checked is that every pass runs and prints its table. (gpu_check.py's bench
phase runs too, ~70 s here: its decode paths are the backend tests'.)
"""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

from kernel_emu import why_not

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata.model.synth import make_model
    path = tmp_path_factory.mktemp("bench_emu") / "tiny.gguf"
    make_model("tiny", path)
    return path


@pytest.fixture
def emulated(monkeypatch, request, tmp_path_factory):
    if why_not() is not None:
        pytest.skip(f"the kernel emulator: {why_not()}")
    import emu_driver
    cache = getattr(request.config, "cache", None)
    emu_driver.install(monkeypatch, cache.mkdir("kernel_emu") if cache else tmp_path_factory.mktemp("kernel_emu"))


def run_script(monkeypatch, script: str, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", [script, *args])
    runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")


def test_bench_prefill_gpu(emulated, tiny, monkeypatch, capsys):
    run_script(monkeypatch, "bench_prefill_gpu.py", "--model", str(tiny), "--chunks", "16", "--tokens", "48",
               "--launches", "3")
    out = capsys.readouterr().out
    for mode in ("whole", "stages", "launches"):
        assert re.search(rf"^chunk +16 {mode} *:", out, re.M), out[-2000:]
    sums = [float(x) for x in re.findall(r"^    sum +([\d.]+) ms", out, re.M)]
    parts = re.findall(r"^    \S+ +([\d.]+) ms +[\d.]+%$", out, re.M)
    assert len(sums) == 2 and parts
    assert "the other" in out                                   # --launches 3: the rest folded into one line



def test_gpu_check_moe(emulated, monkeypatch, capsys):
    """gpu_check.py's moe phase (the grouped expert launches timed one by one) at the small preset's geometry."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_check
    gpu_check.phase_moe(rows=40, preset="small")
    out = capsys.readouterr().out
    assert re.search(r"moe 40 rows top-8 of 64, .*tiles of 16 pairs", out), out
    names = re.findall(r"(\w+) [\d.]+ ms", out.splitlines()[-1])
    assert names == ["moe_group", "gate_up_split", "gate_up", "down_split", "down", "all", "gate_up", "down"], out


def test_gpu_check_ple(emulated, monkeypatch, capsys):
    """gpu_check.py's ple phase (the PLE block's three launches timed one by one, at a chunk and at one row) at
    the small preset's geometry."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_check
    gpu_check.phase_ple(rows=24, preset="small")
    out = capsys.readouterr().out
    names = re.findall(r"(\w+ \d+) [\d.]+ ms", out.splitlines()[-1])
    assert names == ["gate 24", "conv 24", "hist 24", "all 24", "gate 1", "conv 1", "hist 1", "all 1"], out


def test_gpu_check_overlap(emulated, tiny, monkeypatch, capsys):
    """gpu_check.py's overlap phase (pinned-memory readers alone and beside the whole-token graph) on the tiny
    model: every pair runs, and the readers' staging equals the blobs they read (the phase checks it)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_check
    monkeypatch.setattr(gpu_check, "FLASH", tiny)
    gpu_check.phase_overlap(misses=2, reps=1)
    out = capsys.readouterr().out
    assert len(re.findall(r"reader +\d+ CTAs.*alone [\d.]+ ms .*both [\d.]+ ms", out)) == 4, out
    assert "the last reader's staging equals its blobs" in out, out
