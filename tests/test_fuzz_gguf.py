"""The GGUF fuzzer in CI (tools/fuzz_gguf.py): a few hundred seeded malformed copies of the tiny model through
`cli.py logits` in this process, every one a clean error or finite logits; and the script itself, forking a child
per case."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tools.fuzz_gguf import GOOD, bases, case, run_inprocess

ROOT = Path(__file__).parent.parent
CASES = 500


def test_fuzzed_files_keep_the_promise(tmp_path):
    """Exit 2 with one `error:` line, or exit 0 with finite logits: never an exception out of cli.main (a
    traceback), never NaN written."""
    bs = bases(Path(os.environ["STRATA_CACHE"]) / "fuzz")
    counts, kinds, broken = Counter(), set(), []
    path, out = tmp_path / "case.gguf", tmp_path / "case.npy"
    for i in range(CASES):
        mix, kind, what, blob = case(bs, 0, i)
        path.write_bytes(blob)
        out.unlink(missing_ok=True)
        outcome, stderr = run_inprocess(path, out)
        counts[outcome] += 1
        kinds.add(kind)
        if outcome not in GOOD:
            broken.append(f"case {i} [{mix}] {kind}: {what}: {outcome}: {stderr[-600:]}")
    assert not broken, "\n".join(broken)
    assert counts["error"] > CASES // 2 and counts["ok"] > 0, counts
    assert len(kinds) >= 18, kinds                 # every mutation ran


def test_fuzz_script(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz_gguf.py"), "--cases", "40", "--seed", "7",
                        "--jobs", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("40 cases (seed 7)") and "traceback         0" in r.stdout, r.stdout
