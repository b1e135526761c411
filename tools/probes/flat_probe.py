"""The flat pass against the module path: bit equality and time per pass (docs/performance.md).

Loads the embedded default model, runs greedy decode steps and verify passes through the layer
modules (`Model.flat = False`), through `llama.FlatLayers` in Python (`Model.script = False`) and
through the same layers compiled by TorchScript (the default), checks that logits and cache are
bit-identical, then times passes of each width after a 128-token context, taking the three paths in
turn pass by pass so that all see the same machine load. Last, it times what a decode step cannot do
without: its linear layers' kernels and its attention calls alone, back to back, nothing around them.
Then the same three paths for the shipped drafter's draft passes (`drafter.FlatDraft`).

    python tools/probes/flat_probe.py --quantize int4
    python tools/probes/flat_probe.py --quantize none    # float32: decode steps only take the flat path
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from dflash_torch.generate import load
from dflash_torch.models.quantize import Int4Linear, Int8Linear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", default="int4", choices=["int8", "int4", "none"])
    p.add_argument("--sizes", default="1,4,16", help="tokens per pass (1 = a decode step)")
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load(None, "auto", "cpu", "float32", quantize=None if args.quantize == "none" else args.quantize,
                quiet=True)
    target = pipe.target
    ids = torch.randint(0, 49152, (1, 128), generator=torch.Generator().manual_seed(0))
    paths = {"module path": (False, False), "flat": (True, False), "flat, scripted": (True, True)}
    with torch.inference_mode():
        runs = []
        for flat, script in paths.values():
            target.flat, target.script = flat, script
            cache = target.new_cache(256)
            out = [target(ids, cache).logits]
            token = out[0][:, -1].argmax(-1, keepdim=True)
            for _ in range(16):
                out.append(target(token, cache).logits)
                token = out[-1][:, -1].argmax(-1, keepdim=True)
            out.append(target(ids[:, :16], cache, logits="all").logits)
            runs.append((out, cache))
        (a, ca), *others = runs
        same = all(all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(ca.k, cb.k) and torch.equal(ca.v, cb.v)
                   for b, cb in others)
        print(f"{args.quantize}: flat, flat scripted == module path (prefill, 16 decode steps, a 16-token verify): "
              f"{same}")
        for width in [int(s) for s in args.sizes.split(",")]:
            times = {name: [] for name in paths}
            for i in range(len(paths) * (args.repeats + 5)):
                name = list(paths)[i % len(paths)]
                target.flat, target.script = paths[name]
                cache.crop(128)
                t0 = time.perf_counter()
                target(ids[:, :width], cache, logits="all")
                times[name].append(time.perf_counter() - t0)
            m = {k: statistics.median(v[5:]) * 1e3 for k, v in times.items()}
            base = m["module path"]
            print(f"tokens {width:2d}: " + ", ".join(
                f"{k} {v:6.2f} ms" + ("" if k == "module path" else f" ({base / v - 1:+.1%})") for k, v in m.items()))
        target.flat, target.script = True, True  # the default
        kernels_only(target, cache, args.repeats)
        draft_passes(pipe, args.repeats)


def kernels_only(target, cache, repeats: int) -> None:
    """A decode step's linear kernels (every linear layer once, one row) and attention calls (one query
    over 129 keys per layer), back to back, against a whole decode step."""
    calls = []
    for m in target.modules():
        if isinstance(m, Int4Linear):
            calls.append((lambda x, m=m: torch.ops.aten._weight_int4pack_mm_for_cpu(  # what FlatLayers calls
                x.to(torch.bfloat16), m.weight_int4, m.group_size, m.scales_and_zeros), torch.randn(1, m.in_features)))
        elif isinstance(m, Int8Linear):
            calls.append((m.forward, torch.randn(1, m.in_features)))
        elif isinstance(m, torch.nn.Linear):
            calls.append((lambda x, w=m.weight, b=m.bias: F.linear(x, w, b), torch.randn(1, m.in_features)))
    c = target.config
    q = torch.randn(1, c.num_attention_heads, 1, c.head_dim)
    keys, values = cache.k[:, :, :, :129], cache.v[:, :, :, :129]  # [L, 1, Hkv, 129, D]

    def kernels():
        for fn, x in calls:
            fn(x)
        for k, v in zip(keys, values):
            F.scaled_dot_product_attention(q, k, v, scale=c.head_dim**-0.5, enable_gqa=True)

    def step():
        cache.crop(128)
        target(torch.tensor([[1]]), cache)

    times = {kernels: [], step: []}
    with torch.inference_mode():
        for i in range(2 * (repeats + 5)):
            fn = kernels if i % 2 else step
            t0 = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t0)
    k, s = (statistics.median(times[f][5:]) * 1e3 for f in (kernels, step))
    print(f"{len(calls)} linear kernels + {len(keys)} attention calls alone: {k:.2f} ms; whole decode step "
          f"(flat, scripted): {s:.2f} ms")


def draft_passes(pipe, repeats: int) -> None:
    """Draft passes of the shipped drafter (one new context token after 127, as in a decode loop) through
    its modules, drafter.FlatDraft in Python, and FlatDraft compiled by TorchScript: equal, and timed."""
    target, drafter = pipe.target, pipe.drafter
    paths = {"module path": (False, False), "flat": (True, False), "flat, scripted": (True, True)}
    ids = torch.randint(0, 49152, (1, 128), generator=torch.Generator().manual_seed(1))
    cache, dcache = target.new_cache(256), drafter.new_cache(256)
    feats = target(ids, cache, taps=drafter.target_layer_ids).hidden  # [1, 128, F]
    drafter.propose(target, ids[:, :2], feats[:, :127], dcache)
    for width in (2, 4, 16):
        block = torch.tensor([[5] + [drafter.mask_token_id] * (width - 1)])
        times, outs = {name: [] for name in paths}, {}
        for i in range(len(paths) * (repeats + 5)):
            name = list(paths)[i % len(paths)]
            drafter.flat, drafter.script = paths[name]
            dcache.crop(127)
            t0 = time.perf_counter()
            outs[name] = drafter.propose(target, block, feats[:, 127:], dcache)
            times[name].append(time.perf_counter() - t0)
        same = all(torch.equal(outs["module path"], o) for o in outs.values())
        m = {k: statistics.median(v[5:]) * 1e3 for k, v in times.items()}
        base = m["module path"]
        print(f"draft pass, block {width:2d}: equal {same}; " + ", ".join(
            f"{k} {v:6.2f} ms" + ("" if k == "module path" else f" ({base / v - 1:+.1%})") for k, v in m.items()))


if __name__ == "__main__":
    main()
