"""The README's Python blocks run as written: each in a fresh interpreter, on the embedded default model (made in
the test's own cache folder), with a server started for the blocks that talk to one."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ, STRATA_CACHE=str(tmp_path_factory.mktemp("cache")), PYTHONPATH=str(ROOT))
    return e


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i, env, tmp_path):
    code = BLOCKS[i]
    server = None
    if "127.0.0.1:8000" in code:            # a client block: the README's own `serve` on a free port
        pytest.importorskip("openai")
        port = _free_port()
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        server = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "serve", "--port", str(port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() - t0 > 120:
                    server.kill()
                    pytest.fail(f"the server did not start: {server.stderr.read()[-2000:]}")
                time.sleep(0.2)
    try:
        script = tmp_path / f"block{i}.py"
        script.write_text(code)
        r = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"README block {i} failed:\n{code}\n--- stderr ---\n{r.stderr[-3000:]}"
        assert "Task was destroyed" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert r.stdout.strip(), "the block printed nothing"
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
