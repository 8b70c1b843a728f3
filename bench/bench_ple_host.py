"""The loop thread's share of a prompt chunk's PLE rows with the table in RAM: _PleRead.start (hashing is the
caller's; the dedup, the read and the per-token gather now run on the PLE thread for chunks of more than
ple_io.INLINE_ROWS rows) and the wait for the vectors, against doing the read and the gather on the loop as
before (the PLE layer's launch waited for them). Medians over repeats, warm-up excluded; this machine's CPU.

    python3 bench/bench_ple_host.py --model models/medium.gguf [--tokens 4096] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from strata.host.ple_io import PleReader
    from strata.host.scheduler import _PleRead
    from strata.model.loader import load_model
    from strata.reference.ple import NgramWindow, ple_rows
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/medium.gguf")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    model = load_model(a.model)
    cfg = model.cfg
    reader = PleReader(model.file.path, model.file.tensor("per_layer_token_embd.weight"),
                       ThreadPoolExecutor(1), direct=False)
    reader.load_table()
    rng = np.random.default_rng(0)
    before, loop, total = [], [], []
    for i in range(a.reps + 1):
        toks = rng.integers(300, cfg.n_vocab - 300, a.tokens).tolist()
        rows = ple_rows(cfg, toks, NgramWindow.start(cfg))
        t0 = time.perf_counter()                          # before: the read and the gather on the loop
        uniq, inv = np.unique(rows, return_inverse=True)
        got = reader.read_rows(uniq)
        e_old = got.e[inv.reshape(rows.shape)].reshape(len(toks), -1)
        t1 = time.perf_counter()
        read = _PleRead.start(reader, rows)               # now: the loop starts it ...
        t2 = time.perf_counter()
        e_new = read.fut.result().vec[:len(toks)]          # ... and takes the vectors when the layer needs them
        t3 = time.perf_counter()
        assert np.array_equal(e_old, e_new)
        if i:
            before.append(t1 - t0)
            loop.append(t2 - t1)
            total.append(t3 - t1)
    ms = lambda v: 1e3 * statistics.median(v)
    print(f"{a.tokens} tokens, {cfg.ple_heads} heads x {cfg.ple_row} values (ple_dim {cfg.ple_dim}), table in RAM: "
          f"before {ms(before):.2f} ms on the loop; now {ms(loop):.2f} ms on the loop to start it, "
          f"{ms(total):.2f} ms until the vectors are ready (on the PLE thread, beside layer 0's compute)")
    reader.close()


if __name__ == "__main__":
    main()
