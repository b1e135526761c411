"""How long opening the default model's GGUF file takes: gguf's own reader against `gguf_reader.open_gguf`
(best of three opens each), and the reads the reader makes; then the conversion (`loading.resolve_model(None)`
into an empty DFLASH_HOME) with each, each in a fresh process (imports included), alternating, twice.

    python tools/probes/gguf_open_probe.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import gguf

from dflash_torch import gguf_convert, loading
from dflash_torch.gguf_reader import open_gguf


def best(fn, n=3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    path = loading.default_gguf()
    stock = best(lambda: gguf.GGUFReader(str(path)))
    fast = best(lambda: open_gguf(path))
    reads = [0]
    get = gguf.GGUFReader._get

    def counted(self, *a, **k):
        reads[0] += 1
        return get(self, *a, **k)

    gguf.GGUFReader._get = counted
    gguf.GGUFReader(str(path))
    gguf.GGUFReader._get = get
    print(f"open: gguf.GGUFReader {stock:.2f} s, open_gguf {fast:.2f} s ({reads[0]} reads)")
    for _ in range(2):
        for name in ("open_gguf", "gguf.GGUFReader"):
            with tempfile.TemporaryDirectory() as home:
                env = dict(os.environ, DFLASH_HOME=home)
                out = subprocess.run([sys.executable, __file__, "--convert", name], env=env, capture_output=True,
                                     text=True, check=True).stdout
            print(f"conversion with {name}: {out.strip()} s")


def convert(name: str) -> None:
    if name == "gguf.GGUFReader":
        gguf_convert.open_gguf = lambda p: gguf.GGUFReader(str(p))
    t = time.perf_counter()
    loading.resolve_model(None)
    print(f"{time.perf_counter() - t:.1f}")

if __name__ == "__main__":
    convert(sys.argv[2]) if sys.argv[1:2] == ["--convert"] else main()
