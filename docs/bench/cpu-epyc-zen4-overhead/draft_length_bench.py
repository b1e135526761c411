# DraftPricing.draft_length (a running sum over the widths) against its definition (each width's expected tokens over
# its cost, width by width), warm, on a lookup with every width's cost measured; run from the repository root.
import random
import sys
import time

sys.path.insert(0, ".")
from dflash_torch.decoding.lookup import PromptLookup  # noqa: E402

lk = PromptLookup([1, 2, 3])
for w in range(1, 17):
    lk.observe_cost(w, 1.0 + 0.1 * w)
rng = random.Random(0)
for _ in range(20):
    c = rng.randint(1, 15)
    lk.observe(c, rng.randint(0, c))
for avail in (3, 8, 15):
    old = lambda: max(range(1, avail + 2), key=lambda w: lk.expected_tokens(w) / lk.cost(w)) - 1  # noqa: B023, E731
    new = lambda: lk.draft_length(avail)  # noqa: B023, E731
    assert old() == new()
    for name, f in (("width by width", old), ("running sum", new)):
        t = time.perf_counter()
        for _ in range(20000):
            f()
        print(f"{avail} matched tokens, {name}: {(time.perf_counter() - t) / 20000 * 1e6:.2f} us a call")
