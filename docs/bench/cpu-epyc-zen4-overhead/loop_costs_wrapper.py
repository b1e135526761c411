# wraps loop_phases_probe.py: prints each generation's cycles, free-draft cycles and the shared verify-cost table (ms)
import sys

sys.argv = ["x"]
sys.path.insert(0, "tools/probes")
import loop_phases_probe as L  # noqa: E402

from dflash_torch.decoding import speculative as S  # noqa: E402

orig = S.generate_tokens


def gen(*a, **k):
    st = k.get("stats")
    yield from orig(*a, **k)
    c = k.get("lookup_costs")
    if c is not None:
        print(
            "   gen: cycles",
            st.cycles,
            "lookup",
            st.lookup_cycles,
            "datastore",
            st.datastore_cycles,
            "costs ms",
            {w: round(v * 1e3, 2) for w, v in sorted(c.items())},
            flush=True,
        )


L.generate_tokens = gen
L.main()
