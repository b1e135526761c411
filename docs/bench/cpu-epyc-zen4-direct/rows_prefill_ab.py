"""A cold prefill of N random tokens of the default model (`auto`), by columns and by rows in turn in one process
(DFLASH_ROWS_BY_THREAD, read on every pass): python rows_prefill_ab.py 0,9 N ROUNDS."""
import os, sys, time, statistics, torch
from dflash_torch.generate import load
vals = sys.argv[1].split(","); n = int(sys.argv[2]); rounds = int(sys.argv[3])
target = load(None, None, "auto", "auto", quantize="auto").target
prompt = torch.randint(0, target.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
times = {v: [] for v in vals}; outs = {}
with torch.inference_mode():
    for _ in range(rounds):
        for v in vals:
            os.environ["DFLASH_ROWS_BY_THREAD"] = v
            cache = target.new_cache(n + 1)
            t0 = time.perf_counter(); out = target(prompt, cache, logits="last"); times[v].append(time.perf_counter() - t0)
            outs[v] = out.logits.clone()
med = {v: statistics.median(times[v]) for v in vals}
print(f"prefill {n} tokens: " + ", ".join(f"DFLASH_ROWS_BY_THREAD={v} {med[v]*1e3:.1f} ms ({n/med[v]:.0f} tok/s)" for v in vals) + f", ratio {med[vals[1]]/med[vals[0]]:.3f}, same logits {torch.equal(outs[vals[0]], outs[vals[1]])}", flush=True)
