"""A/B timing of the block matmul: earlier block kernels (a git revision's, a blocks.cpp, or a folder of the
kernel sources) against the working tree's, built side by side in one process and called in alternation, so
that the machine's drift (tens of percent over minutes on a shared VM) falls on both alike. Per layer shape
of the default model, format and row count: the best of 9 rounds of each, old -> new microseconds and their
ratio. Both must give the same bits (checked on every cell).

    python tools/kernel_ab.py REV [--threads 2] [--formats q4_0,q4_1,q8_0] [--rows 1,4,8,16]
                              [--isa -1] [--new-isa -1] [--mb 24] [--shapes qkv,o,4096x4096] [--json FILE]

--isa picks the instruction set of the old build (-1: its own choice per call; 1 avx2, 2 vnni, 3 amx), --new-isa
that of the new one (default: the same), e.g. `--isa 2 --new-isa 3` times VNNI against AMX. REV `.` times the
working tree's build against itself: `python tools/kernel_ab.py . --isa 1 --new-isa 2` is AVX2 against VNNI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]


OLD_FILES = ("blocks.cpp", "blocks_avx2.cpp", "blocks_avx512.cpp", "blocks.h", "norm.cpp")


def _old_sources(rev: str) -> dict[str, str]:
    """The old block-kernel sources by file name: blocks.cpp, and the other files of OLD_FILES where the
    revision (or a folder of such files) has them; a .cpp file given alone stands for blocks.cpp."""
    if rev.endswith(".cpp"):
        return {"blocks.cpp": Path(rev).read_text()}
    if Path(rev).is_dir():
        return {name: (Path(rev) / name).read_text() for name in OLD_FILES if (Path(rev) / name).is_file()}
    out = {}
    for name in OLD_FILES:
        try:
            out[name] = subprocess.check_output(["git", "show", f"{rev}:dflash_torch/kernels/{name}"], cwd=ROOT,
                                                stderr=subprocess.DEVNULL).decode()
        except subprocess.CalledProcessError:
            if name == "blocks.cpp":
                raise
    return out


def build_old(rev: str) -> object:
    """The old block kernels as torch.ops.<namespace>, compiled once per source into the user cache (the op
    library and the C++ namespace renamed, so that the two builds live side by side in one process)."""
    from torch.utils import cpp_extension

    from dflash_torch.loading import cache_home

    srcs = _old_sources(rev)
    tag = hashlib.sha1("".join(srcs[k] for k in sorted(srcs)).encode()).hexdigest()[:10]
    name = f"dflash_ab_{tag}"
    build = cache_home() / "kernels" / "ab" / tag
    build.mkdir(parents=True, exist_ok=True)
    for file, src in srcs.items():
        src = (src.replace("TORCH_LIBRARY(dflash,", f"TORCH_LIBRARY({name},")
               .replace("TORCH_LIBRARY_FRAGMENT(dflash,", f"TORCH_LIBRARY_FRAGMENT({name},")
               .replace("dflash_blocks", name).replace("dflash_norm", f"{name}_norm"))
        (build / file).write_text(src)
    cpp_extension.load(name=name, sources=[str(build / f) for f in srcs if f.endswith(".cpp")],
                       build_directory=str(build), extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return getattr(torch.ops, name).block_mm


def shapes(spec: str | None) -> list[tuple[str, int, int]]:
    """The (name, out, in) matrices to time: the default model's layers named in spec, and spec's NxK entries."""
    if not spec:
        return SHAPES
    out, names = [], [s[0] for s in SHAPES]
    for item in spec.split(","):
        if item in names:
            out += [s for s in SHAPES if s[0] == item]
            continue
        try:
            n, k = (int(v) for v in item.split("x"))
        except ValueError:
            raise SystemExit(f"kernel_ab: --shapes {item!r}: a layer name ({', '.join(names)}) or NxK") from None
        if n < 1 or k < 32 or k % 32:
            raise SystemExit(f"kernel_ab: --shapes {item!r}: N >= 1 outputs and K a multiple of 32 inputs")
        out.append((item, n, k))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="git revision of the old kernels (or a blocks.cpp file, or a folder of kernel "
                                "sources; `.`: the working tree's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default="q4_0,q4_1,q8_0")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--isa", type=int, default=-1, help="old build's instruction set (-1: its choice)")
    ap.add_argument("--new-isa", type=int, default=None, help="new build's (default: --isa)")
    ap.add_argument("--mb", type=int, default=24, help="MB of weights (as q4_0) cycled per cell (default 24)")
    ap.add_argument("--shapes", default=None,
                    help="layer names to time, and/or other matrices as NxK (out x in); default: all the layers")
    ap.add_argument("--json", default=None, help="also write the cells here")
    args = ap.parse_args()
    from dflash_torch import kernels
    from dflash_torch.kernels import pack

    kernels.ensure()
    new = torch.ops.dflash.block_mm
    old = new if args.rev == "." else build_old(args.rev)
    torch.set_num_threads(args.threads)
    isa_old, isa_new = args.isa, args.isa if args.new_isa is None else args.new_isa
    gen = torch.Generator().manual_seed(0)
    cells = []
    print(f"threads {args.threads}; us per call, old -> new (ratio), best of 9 alternating rounds")
    for name, n, k in shapes(args.shapes):
        w = torch.randn(n, k, generator=gen)
        copies = max(1, args.mb * 2**24 // (9 * n * k))  # --mb MB of q4_0 blocks (18 bytes per 32 values)
        for fmt in args.formats.split(","):
            code = pack.FORMATS.index(fmt)
            packed = [pack.pack(pack.quantize(w, fmt), fmt) for _ in range(copies)]
            line = []
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen)
                if not torch.equal(new(x, packed[0], code, n, isa_new), old(x, packed[0], code, n, isa_old)):
                    raise SystemExit(f"{name} {fmt} M={m}: the two builds give different results")
                reps = max(3, int(2e4 / (n * k / 1e4)))
                times: dict = {"old": [], "new": []}
                for _ in range(9):
                    for key, op, isa in (("old", old, isa_old), ("new", new, isa_new)):
                        t0 = time.perf_counter()
                        for i in range(reps):
                            op(x, packed[i % copies], code, n, isa)
                        times[key].append((time.perf_counter() - t0) / reps)
                a, b = min(times["old"]) * 1e6, min(times["new"]) * 1e6
                cells.append({"layer": name, "shape": f"{n}x{k}", "format": fmt, "M": m, "old_us": round(a, 1),
                              "new_us": round(b, 1), "ratio": round(b / a, 3)})
                line.append(f"M{m} {a:.0f}->{b:.0f} ({b / a:.2f})")
            print(f"{name:>8} {fmt}  " + "  ".join(line), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(cells, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
