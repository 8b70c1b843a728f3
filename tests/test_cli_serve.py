"""The command line's front ends: `serve` as a process, `chat` on stdin, defaults in --help, progress lines, the
context option, a missing CUDA install."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from cli import main
from strata.chat import ChatFormat
from strata.engine import Engine
from strata.sampling import SamplingParams

ROOT = Path(__file__).parent.parent


def cli(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "cli.py"), *map(str, args)], text=True, **kw)


def test_serve_process(tiny_gguf):
    p = cli("serve", "--model", tiny_gguf, "--port", 0, "--name", "t", stderr=subprocess.PIPE)
    try:
        line = p.stderr.readline()
        m = re.match(r"serving t \(context 4096 tokens\) at (http://127\.0\.0\.1:(\d+)/v1)$", line.strip())
        assert m, line
        c = openai.OpenAI(base_url=m[1], api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="t", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                      temperature=0)
        assert r.usage.completion_tokens == 4
        p.send_signal(signal.SIGTERM)                            # a clean stop
        assert p.wait(30) == 0
    finally:
        p.kill()
        p.wait()


def test_chat_keeps_history(tiny_gguf):
    turns = ["Hello there", "And then?"]
    with Engine.open_sync(tiny_gguf) as e:
        fmt, history, want = ChatFormat.of(e), [], []
        for t in turns:
            history.append({"role": "user", "content": t})
            reply = e.generate_text(fmt.prompt_ids(history), SamplingParams(max_tokens=7,
                                                                            stop_token_ids=fmt.end_of_turn))
            history.append({"role": "assistant", "content": reply})
            want.append(reply)
    p = cli("chat", "--model", tiny_gguf, "-n", 7, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
    out, err = p.communicate("\n".join(turns) + "\n/exit\nnever read\n", timeout=120)
    assert p.returncode == 0, err
    assert out == "".join(r + "\n" for r in want)
    p = cli("chat", "--model", tiny_gguf, "-n", 7, "--ctx", 12, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
    out, err = p.communicate("Hello there\n", timeout=120)          # past the context; end of input ends
    assert p.returncode == 0 and out == "" and "error: the context length is 12 tokens" in err


def test_help_shows_defaults(capsys):
    want = {"generate": ["(default: 64)", "(default: 0.0)", "(default: cpu)", "(default: auto)", "(default: 24.0)",
                         "(default: Once upon a time)", "(default: a random one)"],
            "chat": ["(default: the rest of the context)", "(default: 1.0)", "(default: none)"],
            "serve": ["(default: 127.0.0.1)", "(default: 8000)", "(default: $STRATA_API_KEY; unset: no key)",
                      "(default: the model's context_length"],
            "make-model": ["(default: tiny)", "(default: 0)", "(default: one per core)"],
            "convert": ["(default: f32)"]}
    for cmd, texts in want.items():
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())             # argparse wraps lines
        for t in texts:
            assert t in out, (cmd, t)
        assert "(default: None)" not in out and "(default: False)" not in out


def test_progress_is_one_line_per_update_off_a_terminal(tiny_gguf):
    p = cli("generate", "one two three four five six seven eight nine ten", "--model", tiny_gguf, "-n", 2,
            "--step-tokens", 4, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("prompt ")]
    n = int(lines[0].split("/")[1])
    assert lines == [f"prompt {d}/{n}" for d in range(4, n, 4)] + [f"prompt {n}/{n}"]


def test_progress_is_a_live_line_on_a_terminal(tiny_gguf):
    master, slave = pty.openpty()
    p = cli("generate", "one two three four five six seven eight nine ten", "--model", tiny_gguf, "-n", 2,
            "--step-tokens", 4, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    out, t = b"", time.monotonic()
    while time.monotonic() - t < 120:
        if select.select([master], [], [], 1)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:                                          # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    os.close(master)
    assert p.wait(30) == 0
    text = out.decode()
    assert "\rprompt 4/" in text and "\rprompt 8/" in text and re.search(r"\rprompt (\d+)/\1\r?\n", text)


def test_ctx_option_and_cuda_install_errors(tiny_gguf):
    p = cli("generate", "--model", tiny_gguf, "-n", 8, "--ctx", 5, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and err.startswith("error: the context length is 5 tokens")
    from strata.cuda.driver import available
    why = available()
    if why is None or not why.startswith("cuda-bindings"):
        pytest.skip(f"cuda-bindings is installed here ({why or 'a GPU is usable'})")
    for cmd in ("generate", "serve", "chat"):
        p = cli(cmd, "--model", tiny_gguf, "--backend", "cuda", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and err.count("\n") == 1 and err.startswith("error: "), (cmd, err)
        assert "pip install -e '.[cuda]'" in err
