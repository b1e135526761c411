"""A decode step's decoder stack (kernels/layers.cpp) in one parallel region against the per-call path, in one
process, alternating call by call: the same `decoder_stack` call, once with its rows as given (the region) and
once as a strided view, which the region does not take (the per-call path copies it and computes the same
bits). Prints the median time of each over the rounds and checks that outputs and caches are equal. `--rows T`
times a verify pass of T rows instead (rows_region).

    python tools/probes/decode_region_probe.py --rounds 400 --context 128
    python tools/probes/decode_region_probe.py --rounds 200 --context 300 --rows 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))
from dflash_torch.generate import load  # noqa: E402
from dflash_torch.models import flat  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default="q4_0")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    t = load(None, None, "auto", "auto", quantize=args.quantize, quiet=True).target
    n, rows = args.context, args.rows
    prompt = torch.randint(0, t.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = t.new_cache(n + rows + 1)
        t(prompt, cache, logits=None)
        plan = t._plan[(True, True)]
        f = plan.layers
        row = t.model.embed_tokens(prompt[0, -rows:])  # [T, H]
        strided = torch.empty(rows, 2 * row.shape[1])[:, ::2]
        strided.copy_(row)
        cos, sin = t.rotary.span(n, n + rows, torch.float32)
        cos, signed = cos[:, None], flat.signed(sin[:, None])

        def stack(x):
            return torch.ops.dflash.decoder_stack(x, cos, signed, n, cache.k, cache.v, [3, 17], plan.norms,
                                                  plan.packed, plan.codes, plan.biases, f.eps, f.h, f.hkv, f.scale,
                                                  f.act)

        outs = {}
        for name, x in (("region", row), ("per call", strided)):
            y, taps = stack(x)
            outs[name] = (y.clone(), [a.clone() for a in taps], cache.k[..., : n + rows, :].clone())
        a, b = outs["region"], outs["per call"]
        assert torch.equal(a[0], b[0]) and all(map(torch.equal, a[1], b[1])) and torch.equal(a[2], b[2])
        times: dict[str, list[float]] = {"region": [], "per call": []}
        for r in range(args.rounds):
            for name, x in ((("region", row), ("per call", strided)) if r % 2 == 0
                            else (("per call", strided), ("region", row))):
                t0 = time.perf_counter()
                stack(x)
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = statistics.median(a / b for a, b in zip(times["region"], times["per call"]))
    print(f"threads {torch.get_num_threads()}, context {n}, rows {rows}: region {med['region']:.3f} ms, per call "
          f"{med['per call']:.3f} ms (medians over {args.rounds} rounds), median ratio {ratio:.3f}; outputs equal")


if __name__ == "__main__":
    main()
