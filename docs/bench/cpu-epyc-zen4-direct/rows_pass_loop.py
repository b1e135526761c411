"""A pass of R rows of the default model (q4_0) after 128 cached positions, N times after 20 warm-ups, for a
sampling profiler: python rows_pass_loop.py R N. Prints the median and shortest pass."""
import sys, time, torch
torch.set_grad_enabled(False)
from dflash_torch.generate import load
b = int(sys.argv[1]); n = int(sys.argv[2])
pipe = load(None, None, "cpu", "float32", quantize="q4_0")
target = pipe.target
ctx = 128
prompt = torch.randint(0, target.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(0))
cache = target.new_cache(ctx + 32)
target(prompt, cache, logits="last")
def step():
    cache.crop(ctx)
    target(prompt[:, :b], cache, logits="all" if b > 1 else "last")
for _ in range(20): step()
ts = []
for _ in range(n):
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
ts.sort(); print("b", b, "median ms %.3f min %.3f" % (ts[len(ts)//2]*1e3, ts[0]*1e3))
