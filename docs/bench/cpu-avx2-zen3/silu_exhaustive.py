"""Every float32 bit pattern through torch.ops.dflash.act_mul(x, 1, silu) against F.silu(x) * 1, 2^24 at a time as
one row (python docs/bench/cpu-avx2-zen3/silu_exhaustive.py; about two minutes on two cores)."""
import time, torch, torch.nn.functional as F
from dflash_torch import kernels
assert kernels.ensure() == "compiled"
torch.set_num_threads(2)
chunk = 1 << 24
ones = torch.ones(1, chunk)
bad, t0 = 0, time.time()
for c in range(1 << 8):
    start = (c << 24) - (1 << 31)
    bits = torch.arange(start, start + chunk, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).view(1, chunk)
    a = torch.ops.dflash.act_mul(x, ones, 0)
    b = F.silu(x) * ones
    diff = a.view(torch.int32) != b.view(torch.int32)
    nan_both = torch.isnan(a) & torch.isnan(b)
    n = int((diff & ~nan_both).sum())
    bad += n
print(f"{1 << 32} inputs, capability {torch.backends.cpu.get_cpu_capability()}: {bad} differ (NaN payloads aside), {time.time() - t0:.0f} s")
