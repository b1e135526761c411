"""How a matmul's time grows with the number of rows M, per layer shape of the default model: the block
kernels (q4_0, q4_1) beside PyTorch's int4 kernel, and llama.cpp's own batch scaling on the same GGUF
(one forward pass of M tokens over one of 1 token, through llama-cpp-python).

    python tools/kernel_table.py [--threads 2] [--rows 1,2,4,8,16] [--isa vnni,amx] [--json FILE]

--isa: the block kernels' instruction sets to time, side by side (default: the one each call picks on
this CPU: on an AMX CPU, VNNI below 8 rows and AMX from there on; see kernels/blocks.cpp).

Times are the best of several rounds (microseconds per call; llama.cpp: milliseconds per pass), each
call on another copy of the weights so that they come from memory as in a decode step, not from cache.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

# (name, out_features, in_features) of SmolLM2-135M's matmuls: fused q/k/v, o, fused gate/up, down, LM head
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]


def best(fn, reps: int, rounds: int = 7) -> float:
    fn()
    out = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out = min(out, (time.perf_counter() - t0) / reps)
    return out


def rotating(fn, weights: list):
    """fn(next weight) on each call, cycling through `weights`."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(weights)
        return fn(weights[state["i"]])

    return call


def kernel_rows(rows: list[int], isas: list[str] | None = None) -> list[dict]:
    from dflash_torch import kernels
    from dflash_torch.kernels import pack
    from dflash_torch.models.quantize import Int4Linear

    kernels.ensure()
    # (column, format, instruction-set code): -1 lets each call pick, as the engine's calls do
    columns = [(f if isa is None else f"{f}@{isa}", f, -1 if isa is None else kernels.ISAS.index(isa))
               for f in ("q4_0", "q4_1") for isa in (isas or [None])]
    out = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        copies = max(1, 48 * 1536 * 576 // (n * k))  # ~ 24 MB of weights per format: past the caches
        w = torch.randn(n, k, generator=gen)
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = w
        i4 = Int4Linear(lin)
        packed = {f: pack.pack(pack.quantize(w, f), f) for f in ("q4_0", "q4_1")}
        formats = {f: [p.clone() for _ in range(copies)] for f, p in packed.items()}
        int4 = [(i4.weight_int4.clone(), i4.scales_and_zeros.clone()) for _ in range(copies)]
        reps = max(5, int(4e4 / (n * k / 1e4)))
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            row = {"layer": name, "shape": f"{n}x{k}", "M": m}
            xb = x.bfloat16()
            for col, f, isa in columns:
                code = pack.FORMATS.index(f)
                row[col] = best(rotating(lambda w, x=x, code=code, n=n, isa=isa: torch.ops.dflash.block_mm(
                    x, w, code, n, isa), formats[f]), reps) * 1e6
            row["int4"] = best(rotating(lambda w, xb=xb: torch.ops.aten._weight_int4pack_mm_for_cpu(
                xb, w[0], 32, w[1]), int4), reps) * 1e6
            out.append(row)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return out


def llamacpp_rows(rows: list[int], threads: int) -> list[dict]:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp column")
        return []
    from dflash_torch import loading

    llm = Llama(model_path=str(loading.default_gguf()), n_ctx=512, n_batch=64, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    prompt = list(range(1000, 1128))  # 128 tokens of context, as `dflash profile`
    out = []
    for m in rows:
        block = list(range(2000, 2000 + m))

        def run(block=block):
            llm.reset()
            llm.n_tokens = 0
            llm.eval(prompt)
            t0 = time.perf_counter()
            llm.eval(block)
            return time.perf_counter() - t0

        run()
        out.append({"M": m, "llamacpp_ms": min(run() for _ in range(7)) * 1e3})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp's batch scaling")
    ap.add_argument("--isa", default=None, help="block-kernel instruction sets to compare, e.g. vnni,amx")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    kern = kernel_rows(rows, args.isa.split(",") if args.isa else None)
    lc = [] if args.no_llamacpp else llamacpp_rows(rows, args.threads)
    print(f"\nthreads {args.threads}; us per call (x = over M=1 of the same kernel)")
    cols = [c for c in kern[0] if c not in ("layer", "shape", "M")]
    print(f"{'layer':>8} {'shape':>10} {'M':>3} " + " ".join(f"{'torch int4' if c == 'int4' else c:>14}" for c in cols))
    base = {}
    for r in kern:
        if r["M"] == rows[0]:
            base = r
        cells = [f"{r[c]:7.0f} {r[c] / base[c]:5.2f}x" for c in cols]
        print(f"{r['layer']:>8} {r['shape']:>10} {r['M']:>3} " + " ".join(cells))
    if lc:
        print("\nllama.cpp, one pass of M tokens after 128 of context (the whole model), ms")
        for r in lc:
            print(f"M {r['M']:>3}: {r['llamacpp_ms']:7.2f} ms  {r['llamacpp_ms'] / lc[0]['llamacpp_ms']:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "kernels": kern, "llamacpp": lc}, f, indent=1)


if __name__ == "__main__":
    main()
