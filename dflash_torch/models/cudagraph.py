"""CUDA graphs for the target's decode and verify passes (Llama-family targets).

On a GPU a decode step of a small or mid-size model is mostly kernel launches: a few hundred small
kernels whose launch costs add up to more than their work. A CUDA graph records one forward pass and
replays it with one launch. A graph fixes every shape and address, so the graphed forward runs in the
target's static-shape mode (`llama.Model.forward(positions=...)`): the positions are a device tensor,
keys/values are written at them (`KVCache.write_at`), and attention reads the whole cache through a
mask, so nothing in the pass depends on a Python int. One graph per (width, logits, taps): decode (1)
and each verify width the loop uses, captured on first use; prefills and other widths run the same
static forward without a graph, so a graph changes no result (tests/test_fast_static_shapes.py compares replay and
eager bit for bit on a GPU).

The graphs are bound to one cache, owned here: `new_cache` hands it out again (rewound) to each
request, and grows it (dropping the graphs, which are captured again) when a request needs more room.
Capacity is rounded up to a power of two, because every step attends over all of it.
"""

from __future__ import annotations

import torch

from .cache import KVCache
from .llama import Model, Output

MAX_GRAPHED_WIDTH = 16  # decode and verify widths (a DFlash block is 16); wider passes run without a graph


class GraphedTarget:
    """A Llama-family target whose decode/verify passes replay CUDA graphs (`use_graphs=False`: the same
    static-shape passes, eager; this is what runs on a CPU, and what the graphs are checked against).
    Everything else (embed_tokens, lm_head, config, ...) is the wrapped model's."""

    single_cache = True  # new_cache hands out the same cache again (a prefix cache must not keep it meanwhile)

    def __init__(self, target: Model, use_graphs: bool = True) -> None:
        if not isinstance(target, Model) or not target.graphable:
            raise ValueError(
                f"--cuda-graphs supports Llama-family targets (llama, mistral, qwen2, qwen3) so far, not "
                f"{type(target).__module__.rsplit('.', 1)[-1]}"
            )
        self.target = target
        self.device = target.embed_tokens.weight.device
        if use_graphs and self.device.type != "cuda":
            raise ValueError(f"--cuda-graphs needs a CUDA device (the target is on {self.device})")
        self.use_graphs = use_graphs
        self.cache: KVCache | None = None
        self.graphs: dict[tuple, tuple] = {}  # (T, logits, taps) -> (graph, ids, positions, Output)
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.replays = 0  # passes served by a graph (for tests and metrics)
        self.handed_out = 0  # new_cache calls: each one rewinds the cache whatever held it (prefix_cache.py)

    def __getattr__(self, name: str):
        return getattr(self.target, name)

    def flat_serves(self) -> bool:
        """Never: the loops must call this wrapper (its graphs), not the wrapped model's flat path."""
        return False

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """The one cache the graphs read and write, rewound; reallocated (graphs dropped) if too small."""
        if batch != 1:
            raise ValueError("--cuda-graphs runs one sequence at a time")
        if self.cache is None or self.cache.max_len < max_len:
            capacity = 1 << max(8, (max_len - 1).bit_length())  # at least 256 positions
            self.graphs.clear()
            self.cache = None  # free the old buffers before allocating the new ones
            self.cache = self.target.new_cache(capacity)
        self.cache.crop(0)
        self.handed_out += 1
        return self.cache

    def __call__(
        self, input_ids: torch.Tensor, cache: KVCache, logits: str | None = "last",
        taps: tuple[int, ...] | list[int] = (),
    ) -> Output:
        if cache is not self.cache:
            raise ValueError("a GraphedTarget runs only on the cache from its own new_cache()")
        t, start = input_ids.shape[1], cache.length
        if start + t > cache.max_len:
            raise ValueError(f"KV cache overflow: position {start + t} > capacity {cache.max_len}")
        positions = torch.arange(start, start + t, device=self.device)
        if not self.use_graphs or t > MAX_GRAPHED_WIDTH:
            out = self.target(input_ids, cache, logits=logits, taps=taps, positions=positions)
        else:
            key = (t, logits, tuple(taps))
            if key not in self.graphs:
                self.graphs[key] = self._capture(input_ids, positions, logits, tuple(taps))
            graph, ids, pos, static = self.graphs[key]
            ids.copy_(input_ids)
            pos.copy_(positions)
            graph.replay()
            self.replays += 1
            # the graph's outputs are overwritten by its next replay: hand out copies
            out = Output(None if static.logits is None else static.logits.clone(),
                         None if static.hidden is None else static.hidden.clone())
        cache.length = start + t
        return out

    def _capture(self, input_ids, positions, logits, taps) -> tuple:
        ids, pos = input_ids.clone(), positions.clone()
        run = lambda: self.target(ids, self.cache, logits=logits, taps=taps, positions=pos)  # noqa: E731
        # Warm up on a side stream (library handles, workspaces) before recording. The warm-up passes
        # compute this very step (same ids, same positions), so what they write to the cache is what the
        # replay writes again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static = run()
        return graph, ids, pos, static
