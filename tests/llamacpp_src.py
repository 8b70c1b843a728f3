"""llama.cpp's own converter, from the llama-cpp-python 0.3.36 sdist (it vendors llama.cpp with qwen4exp).

Fetched once with pip into strata's cache; only convert_hf_to_gguf.py, conversion/ and gguf-py/ are kept.
No llama.cpp code is committed to this repository.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
KEEP = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/", "vendor/llama.cpp/gguf-py/")


def converter_dir(cache: Path) -> Path | None:
    """The vendored llama.cpp folder holding convert_hf_to_gguf.py, or None when it cannot be fetched."""
    dest = cache / f"llama-cpp-python-{VERSION}"
    root = dest / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").exists():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={VERSION}", "-d", tmp], capture_output=True, text=True)
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if r.returncode != 0 or not archives:
            return None
        with tarfile.open(archives[0]) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name.split("/", 1)[1] if "/" in m.name else ""
                if rel.startswith(KEEP) and (m.isfile() or m.isdir()):
                    m.name = rel
                    members.append(m)
            dest.mkdir(parents=True, exist_ok=True)
            tar.extractall(dest, members=members, filter="data")
    return root if (root / "convert_hf_to_gguf.py").exists() else None


RUN = """
import sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
# the tiny test tokenizer has no registered pre-tokenizer hash; the weights are what is compared
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import convert_hf_to_gguf as c
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "f32"]
c.main()
"""


def convert_with_llamacpp(root: Path, hf_dir: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN, str(root), str(hf_dir), str(out)], capture_output=True,
                          text=True)
