"""Does torch.compile (CPU inductor) speed up a decode step of the default model? (docs/performance.md)

Times greedy decode steps of the embedded default model, eager against compiled, after a prefill of
`--contexts` random tokens, and checks that both emit the same tokens. Two ways of compiling:

  --whole   the whole `Model.forward` with dynamic shapes (the KV cache length is a Python int);
  --static  the whole `Model.forward` in its static-shape mode (`positions=`, attention over the whole
            cache through a mask, as for CUDA graphs): one graph for every step; add `--cpp-wrapper`
            to run it from generated C++ instead of Python (inductor's `cpp_wrapper`, with
            `emulate_precision_casts`);
  default   per decoder layer, only the pieces whose shapes are fixed for one token: norm + q/k/v
            projections + rotary before the cache write, o_proj + norm + MLP after attention. The
            cache write and attention (their length grows every step) stay eager.

    OMP_NUM_THREADS=1 python tools/probes/compile_probe.py --quantize int4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch.generate import load
from dflash_torch.models import llama
from dflash_torch.models.layers import attend
from dflash_torch.models.rope import apply_rotary


def before_cache(layer: llama.DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x [B, 1, H] -> q [B, Hq, 1, D], k and v [B, Hkv, 1, D] (what Attention.forward does first)."""
    a = layer.self_attn
    b, t, _ = x.shape
    h = layer.input_layernorm(x)
    if a.qkv_proj is not None:  # quantized targets have q/k/v fused (quantize.fuse_projections)
        q, k, v = a.qkv_proj(h).split([a.n_heads * a.head_dim, a.n_kv * a.head_dim, a.n_kv * a.head_dim], -1)
    else:
        q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
    q, k, v = q.view(b, t, a.n_heads, a.head_dim), k.view(b, t, a.n_kv, a.head_dim), v.view(b, t, a.n_kv, a.head_dim)
    if a.qk_norm:
        q, k = a.q_norm(q), a.k_norm(k)
    return apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin), v.transpose(1, 2)


def after_attention(layer: llama.DecoderLayer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The rest of the layer: residual + o_proj, then residual + MLP."""
    x = x + layer.self_attn.o_proj(o)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", default=None, choices=["int8", "int4"])
    p.add_argument("--whole", action="store_true", help="compile the whole forward (dynamic shapes)")
    p.add_argument("--static", action="store_true", help="compile the whole forward in static-shape mode")
    p.add_argument("--cpp-wrapper", action="store_true", help="with --static: inductor's C++ wrapper")
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load(None, None, "cpu", "float32", quiet=True, quantize=args.quantize).target
    eager_forward = target.forward
    compiled = {"on": False}
    contexts = [int(c) for c in args.contexts.split(",")]
    capacity = max(contexts) + args.steps + 1  # --static: one cache shape for every context
    if args.cpp_wrapper:
        import torch._inductor.config as inductor_config

        inductor_config.cpp_wrapper = True
        inductor_config.emulate_precision_casts = True
    if args.static:
        static = torch.compile(eager_forward, dynamic=False)

        def static_forward(ids, cache, logits="last"):
            if not compiled["on"] or ids.shape[1] != 1:
                return eager_forward(ids, cache, logits=logits)
            out = static(ids, cache, logits=logits, positions=torch.tensor([cache.length]))
            cache.length += 1
            return out

        target.forward = static_forward
    elif args.whole:
        whole = torch.compile(eager_forward, dynamic=True)
        target.forward = lambda *a, **k: (whole if compiled["on"] else eager_forward)(*a, **k)
    else:
        pre = torch.compile(before_cache, dynamic=False)
        post = torch.compile(after_attention, dynamic=False)
        eager_layer = llama.DecoderLayer.forward

        def layer_forward(self, x, cos, sin, cache, start, mask):
            if not compiled["on"] or x.shape[1] != 1:
                return eager_layer(self, x, cos, sin, cache, start, mask)
            q, k, v = pre(self, x, cos, sin)
            k, v = cache.write(self.self_attn.layer, start, k, v)
            return post(self, x, attend(q, k, v, mask, self.self_attn.scale))

        llama.DecoderLayer.forward = layer_forward

    @torch.inference_mode()
    def decode(context: int, steps: int) -> tuple[list[int], list[float]]:
        cache = target.new_cache(capacity if args.static else context + steps + 1)
        prompt = torch.randint(0, 1000, (1, context), generator=torch.Generator().manual_seed(0))
        eager_forward(prompt, cache)
        token, out, times, logits = torch.tensor([[5]]), [], [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            lg = target(token, cache, logits="last").logits
            token = lg.argmax(-1)
            times.append(time.perf_counter() - t0)
            out.append(int(token))
            logits.append(lg)
        return out, times, torch.cat(logits)

    compiled["on"] = True
    t0 = time.perf_counter()
    decode(128, 2)
    print(f"compile (first two steps): {time.perf_counter() - t0:.1f} s", flush=True)
    for context in contexts:
        compiled["on"] = False
        ref, eager_t, ref_logits = decode(context, args.steps)
        compiled["on"] = True
        out, comp_t, logits = decode(context, args.steps)
        e, c = (statistics.median(t[2:]) * 1e3 for t in (eager_t, comp_t))
        print(f"context {context}: eager {e:.2f} ms/token, compiled {c:.2f} ms/token, same tokens: {out == ref}, "
              f"max logit difference {(logits - ref_logits).abs().max().item():.2e}",
              flush=True)


if __name__ == "__main__":
    main()
