"""A/B timing of the attention kernel: a git revision's attention files against the working tree's, built side
by side in one process and called in alternation (the machine's drift falls on both alike), on the default
model's shapes (9 query heads over 3 kv heads, head dim 64) with a float16 cache, T query positions after
`start` cached ones. `--layers` copies of the keys and values are cycled through, as a pass over the model's
layers does, so that with 30 of them a long context does not stay in the caches. Both builds must give the
same bits (checked per cell). (docs/performance.md, "AMD EPYC Zen 4")

    python tools/probes/attention_ab.py REV [--starts 512,1008,2032,4064] [--rows 1,2,4,8,16] [--layers 30]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
FILES = ("attention.cpp", "attention_avx512.cpp", "attention_split_avx2.cpp", "attention.h")
OPTIONAL = ("attention_split_avx2.cpp",)  # not in revisions before it


def build_old(rev: str):
    """The revision's causal_attention as torch.ops.<name>.causal_attention (op library and C++ namespace
    renamed so that both builds live in one process), compiled once per source into the user cache."""
    from torch.utils import cpp_extension

    from dflash_torch.kernels import CFLAGS, LDFLAGS
    from dflash_torch.loading import cache_home

    srcs = {}
    for f in FILES:
        try:
            srcs[f] = subprocess.check_output(["git", "show", f"{rev}:dflash_torch/kernels/{f}"], cwd=ROOT,
                                              stderr=subprocess.DEVNULL).decode()
        except subprocess.CalledProcessError:
            if f in OPTIONAL:
                continue
            raise SystemExit(f"{rev} has no dflash_torch/kernels/{f}") from None
    tag = hashlib.sha1("".join(srcs[k] for k in FILES if k in srcs).encode()).hexdigest()[:10]
    name = f"dflash_attn_ab_{tag}"
    build = cache_home() / "kernels" / "ab" / name
    build.mkdir(parents=True, exist_ok=True)
    for f, src in srcs.items():
        src = src.replace("TORCH_LIBRARY_FRAGMENT(dflash,", f"TORCH_LIBRARY({name},")
        (build / f).write_text(src.replace("dflash_attention", name))
    cpp_extension.load(name=name, sources=[str(build / f) for f in FILES if f.endswith(".cpp") and f in srcs],
                       build_directory=str(build), extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                       is_python_module=False, verbose=False)
    return getattr(torch.ops, name).causal_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="git revision of the old attention kernels")
    ap.add_argument("--starts", default="512,1008,2032,4064", help="cached positions before the queries")
    ap.add_argument("--rows", default="1,2,4,8,16", help="query positions T per call")
    ap.add_argument("--layers", type=int, default=30, help="copies of the keys and values cycled through")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    from dflash_torch import kernels

    old = build_old(args.rev)
    kernels.ensure()
    new = torch.ops.dflash.causal_attention
    h, hkv, d = 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, {args.layers} copies of the cache; us per call, old -> new (ratio), "
          f"median of {args.rounds} alternating rounds")
    for start in (int(s) for s in args.starts.split(",")):
        ks = [torch.randn(hkv, start + 32, d, generator=gen).half() for _ in range(args.layers)]
        vs = [torch.randn(hkv, start + 32, d, generator=gen).half() for _ in range(args.layers)]
        for t in (int(r) for r in args.rows.split(",")):
            q = torch.randn(t, h, d, generator=gen)
            assert torch.equal(old(q, ks[0], vs[0], start, d**-0.5, -1), new(q, ks[0], vs[0], start, d**-0.5, -1))
            times: dict[str, list[float]] = {"old": [], "new": []}
            for r in range(args.rounds):
                for label, fn in ((("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))):
                    t0 = time.perf_counter()
                    for i in range(2 * args.layers):
                        fn(q, ks[i % args.layers], vs[i % args.layers], start, d**-0.5, -1)
                    times[label].append((time.perf_counter() - t0) / (2 * args.layers) * 1e6)
            a, b = statistics.median(times["old"]), statistics.median(times["new"])
            print(f"start {start:5d} T {t:2d}: {a:8.1f} -> {b:8.1f} us ({b / a:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
