"""Opening a GGUF file: gguf's own reader, with its small reads made cheaper.

`gguf.GGUFReader` reads every metadata value, and every string of the vocabulary and merges arrays, as a
slice of a numpy memmap (about 250,000 slices for a 49k-token vocabulary). Slicing a memmap goes through its
Python-level `__array_finalize__`, and each read also builds an empty array to learn the item size: opening
SmolLM2-135M's file made 247,312 reads and took 4.3-5.0 s on an AMD EPYC Zen 3, of which the tensors are a small
part. `open_gguf` runs the same reads on a plain ndarray view of the same mapping: 1.1-1.6 s
(`python tools/probes/gguf_open_probe.py`), with the same fields and the same tensor bytes
(tests/test_gguf.py compares them). A gguf whose reader no longer reads through `_get(offset, dtype, count,
override_order)` gets its own reader unchanged.
"""

from __future__ import annotations

import inspect
from pathlib import Path


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` of `path` (fields, tensors: as gguf gives them; tensor data as plain ndarray views
    of the file's mapping rather than memmap objects)."""
    import gguf

    cls = _fast_reader(gguf.GGUFReader)
    return cls(str(path))


_CACHE: dict[type, type] = {}


def _fast_reader(base: type) -> type:
    if base in _CACHE:
        return _CACHE[base]
    import numpy as np

    params = list(inspect.signature(base._get).parameters) if hasattr(base, "_get") else []
    if params != ["self", "offset", "dtype", "count", "override_order"]:
        _CACHE[base] = base  # another gguf version: its reader as it is
        return base
    sizes: dict = {}

    class FastReader(base):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:  # the same bytes, without memmap's per-slice Python hooks
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            size = sizes.get(dtype)
            if size is None:
                size = sizes[dtype] = np.dtype(dtype).itemsize
            arr = plain[offset : offset + size * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    _CACHE[base] = FastReader
    return FastReader
