"""Float32 matmuls of a few rows: F.linear against (W @ x^T)^T (`layers.linear`, docs/performance.md).

Part 1 times the two forms alone on weights shaped like the default model's (30 layers' q/k/v, o,
gate/up and down projections, and the LM head), each read cold from memory as in a real pass, for
1-16 rows. Part 2 loads the embedded default model twice in float32, once with the skinny form
(`layers.SKINNY_ROWS`, the default) and once with F.linear everywhere (`layers.set_skinny_rows(model, 0)`),
times decode steps and verify passes of each width on both, taking them in turn pass by pass, and
compares their greedy tokens.

    python tools/probes/skinny_probe.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from dflash_torch.data import encode_chat
from dflash_torch.generate import load
from dflash_torch.models import layers


def _median_ms(f, repeats: int) -> float:
    for _ in range(2):
        f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def kernels(rows: list[int], repeats: int) -> None:
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused q/k/v, o, gate/up, down
    weights = [[torch.randn(n, k) for n, k in shapes] for _ in range(30)]
    head = torch.randn(49152, 576)
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}

        def run(skinny: int, xs: dict = xs) -> None:
            for layer in weights:
                for w in layer:
                    layers.linear(xs[w.shape[1]], w, None, skinny)

        x = xs[576]
        cells = [f"30 layers: F.linear {_median_ms(lambda: run(0), repeats):6.2f} ms, "
                 f"skinny {_median_ms(lambda: run(64), repeats):6.2f} ms",
                 f"LM head: F.linear {_median_ms(lambda x=x: F.linear(x, head), repeats):6.2f} ms, "
                 f"skinny {_median_ms(lambda x=x: layers.linear(x, head, None, 64), repeats):6.2f} ms"]
        print(f"rows {m:2d}: " + "; ".join(cells), flush=True)


@torch.inference_mode()
def model(widths: list[int], repeats: int, tokens: int) -> None:
    pipes = {"skinny": load(None, None, "cpu", "float32", quantize=None, quiet=True),
             "F.linear": load(None, None, "cpu", "float32", quantize=None, quiet=True)}
    layers.set_skinny_rows(pipes["F.linear"].target, 0)
    ids = torch.randint(0, 49152, (1, 128), generator=torch.Generator().manual_seed(0))
    caches = {}
    for name, pipe in pipes.items():
        caches[name] = pipe.target.new_cache(256)
        pipe.target(ids, caches[name])
    for width in widths:
        times = {name: [] for name in pipes}
        for i in range(2 * (repeats + 2)):
            name = list(pipes)[i % 2]
            cache = caches[name]
            cache.crop(128)
            t0 = time.perf_counter()
            pipes[name].target(ids[:, :width], cache, logits="last" if width == 1 else "all")
            if i >= 4:
                times[name].append(time.perf_counter() - t0)
        what = "decode step" if width == 1 else f"verify {width:2d}"
        print(f"{what}: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.2f} ms" for k, v in times.items()),
              flush=True)
    # greedy tokens of both: equal unless a near-tie rounds the other way
    tok = pipes["skinny"].tokenizer
    prompts = ["Write a short poem about the sea.", "What is 17 times 23?", "List three uses of Python.",
               "Explain what a hash map is."]
    same = 0
    for text in prompts:
        prompt = encode_chat(tok, [{"role": "user", "content": text}])
        outs = []
        for pipe in pipes.values():
            cache, t = pipe.target.new_cache(len(prompt) + tokens + 1), torch.tensor([prompt])
            out, seq = pipe.target(t, cache, logits="last"), []
            for _ in range(tokens):
                seq.append(int(out.logits[0, -1].argmax()))
                out = pipe.target(torch.tensor([[seq[-1]]]), cache, logits="last")
            outs.append(seq)
        same += outs[0] == outs[1]
    print(f"greedy tokens equal over {tokens} tokens: {same} of {len(prompts)} prompts")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,3,4,5,6,8,16")
    p.add_argument("--widths", default="1,2,4,8,16", help="tokens per pass for part 2 (1 = a decode step)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt for the comparison")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels([int(r) for r in args.rows.split(",")], args.repeats)
    model([int(w) for w in args.widths.split(",")], args.repeats, args.tokens)


if __name__ == "__main__":
    main()
