"""Load time of the default model, cold and warm (docs/performance.md, "Memory").

    .venv/bin/python tools/probes/load_time_probe.py

Into a new, empty DFLASH_HOME (the C++ kernels' build copied in from the user cache, so that their
compilation is not counted): `generate.load(None, quantize="auto")` (target and drafter) in a fresh
process three times, the first cold (the GGUF conversion, the drafter's blocks and nothing cached), then
warm; and `dflash generate --prompt hi --max-tokens 8` likewise, its wall time and peak RSS
(`/usr/bin/time`), with the cache emptied again before its cold run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LOAD = """
import importlib, time
t0 = time.perf_counter()
generate = importlib.import_module("dflash_torch.generate")
t1 = time.perf_counter()
generate.load(None, quiet=True, quantize="auto")
print(f"import {t1 - t0:.2f} s, generate.load {time.perf_counter() - t1:.2f} s")
"""


def main() -> int:
    from dflash_torch import kernels
    from dflash_torch.loading import cache_home

    kernels.ensure()
    built = cache_home() / "kernels"
    with tempfile.TemporaryDirectory(prefix="load-time-") as tmp:
        home = Path(tmp)
        if built.is_dir():
            shutil.copytree(built, home / "kernels")
        env = dict(os.environ, DFLASH_HOME=str(home))
        for run in ("cold", "warm", "warm"):
            out = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, check=True)
            print(f"{run}: {out.stdout.strip()}", flush=True)
        dflash = Path(sys.executable).with_name("dflash")
        for run in ("cold", "warm", "warm"):
            if run == "cold":
                for sub in ("models", "drafters", "calibration"):
                    shutil.rmtree(home / sub, ignore_errors=True)
            out = subprocess.run(["/usr/bin/time", "-f", "%e s wall, %M kB peak RSS", str(dflash), "generate",
                                  "--prompt", "hi", "--max-tokens", "8"], env=env, capture_output=True, text=True)
            print(f"{run} dflash generate: {out.stderr.strip().splitlines()[-1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
