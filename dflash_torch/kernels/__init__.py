"""CPU kernels whose result for a row does not depend on the other rows of the call: GGUF Q4_0 / Q4_1 /
Q8_0 weights times 8-bit activations (blocks.cpp), causal attention over a KV cache (attention.cpp),
RMSNorm (norm.cpp), the row-wise argmax and top candidates of logits (argmax.cpp), and a Llama-family decoder stack of
block-format layers in one call (layers.cpp), a drafter's (draft.cpp), and a DFlash2 selector's chances
for a tree draft (selector.cpp).

`ensure()` builds the C++ extension once with `torch.utils.cpp_extension` (ninja) into the user cache
and registers its ops as `torch.ops.dflash.*`; later processes load the cached build. Where no compiler
is at hand (or DFLASH_NO_EXTENSION=1), it says so once and registers the PyTorch reference
(reference.py) under the same op names instead: same results, much slower. Everything else calls the
ops through torch.ops, so TorchScript can call them too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch

from . import reference

ISAS = ("scalar", "avx2", "vnni", "amx")  # the kernel's instruction-set codes are their indices
_state: dict = {}


def _build_dir() -> Path:
    from ..loading import cache_home

    tag = f"torch{torch.__version__.split('+')[0]}-py{sys.version_info.major}{sys.version_info.minor}"
    path = cache_home() / "kernels" / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


SOURCES = ("blocks.cpp", "blocks_avx2.cpp", "blocks_avx512.cpp", "attention.cpp", "attention_avx512.cpp",
           "attention_split_avx2.cpp", "norm.cpp",
           "argmax.cpp", "activation.cpp", "layers.cpp", "draft.cpp",
           "selector.cpp")
HEADERS = ("blocks.h", "attention.h", "activation.h", "layers.h")
# -ffp-contract=off: no multiply-add fused behind our back, so every path rounds each step as written;
# -fopenmp: at::parallel_for then runs on PyTorch's own OpenMP threads (without it, on a slower path)
CFLAGS, LDFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"], ["-fopenmp"]


def fingerprint() -> str:
    """What the build depends on: the sources, the flags, this torch and this Python."""
    import hashlib

    h = hashlib.sha256(f"{torch.__version__} {torch.__file__} {sys.version} {CFLAGS} {LDFLAGS}".encode())
    for name in (*SOURCES, *HEADERS):
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()


@contextlib.contextmanager
def _build_lock(build: Path):
    """One process at a time builds into `build`: an flock on a file there, which the system releases when its
    holder exits however it ends. Yields whether this process holds it (False without flock: Windows).
    torch.utils.cpp_extension's own lock is a file whose existence is the lock: a build interrupted by Ctrl-C
    or a kill leaves it behind, and every later process waited for it forever."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(build / "build.flock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"dflash: waiting for another process that is building the C++ kernels in {build}", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile() -> None:
    build = _build_dir()
    library, stamp = build / "dflash_blocks.so", build / "sources.sha256"
    built_from = fingerprint()

    def built() -> bool:  # built from these very sources
        return library.is_file() and stamp.is_file() and stamp.read_text().strip() == built_from

    if not built():
        with _build_lock(build) as exclusive:
            if not built():  # (else another process built it while this one waited)
                _build(build, stamp, built_from, exclusive)
                return  # (cpp_extension.load has loaded it)
    # load it without torch.utils.cpp_extension (and the setuptools it imports: ~4 MB resident for every run)
    torch.ops.load_library(str(library))


def _build(build: Path, stamp: Path, built_from: str, exclusive: bool) -> None:
    from torch.utils import cpp_extension

    baton = build / "lock"  # cpp_extension's lock: with ours held, one that exists was left by a build that died
    if exclusive and baton.exists():
        baton.unlink()
    print(f"dflash: building the C++ kernels into {build} (once per torch and source version; a minute or two)",
          file=sys.stderr)
    sources = [str(Path(__file__).parent / name) for name in SOURCES]
    cpp_extension.load(name="dflash_blocks", sources=sources, build_directory=str(build), extra_cflags=CFLAGS,
                       extra_ldflags=LDFLAGS, is_python_module=False, verbose=False)
    stamp.write_text(built_from + "\n")


def _register_reference() -> None:
    lib = torch.library.Library("dflash", "DEF")
    lib.define("block_mm(Tensor x, Tensor packed, int fmt, int n, int isa=-1) -> Tensor")
    lib.define("quantize_act(Tensor x, int isa=-1) -> (Tensor, Tensor, Tensor)")
    lib.define("best_isa() -> int")
    lib.impl("block_mm", reference.block_mm, "CPU")
    lib.define("block_mm_add(Tensor x, Tensor packed, int fmt, int n, Tensor residual, int isa=-1) -> Tensor")
    lib.impl("block_mm_add", lambda x, p, fmt, n, r, isa=-1: r + reference.block_mm(x, p, fmt, n), "CPU")
    lib.impl("quantize_act", lambda x, isa=-1: reference.quantize_act(x), "CPU")
    lib.define("block_mm_norm(Tensor x, Tensor norm_w, float eps, Tensor packed, int fmt, int n, int isa=-1) -> Tensor")
    lib.impl("block_mm_norm", lambda x, w, eps, p, fmt, n, isa=-1: reference.block_mm(
        reference.rms_norm(x, w, eps), p, fmt, n), "CPU")
    lib.impl("best_isa", lambda: -1, "CompositeExplicitAutograd")
    lib.define("narrow_rows() -> int")
    lib.impl("narrow_rows", lambda: 0, "CompositeExplicitAutograd")
    lib.define("causal_attention(Tensor q, Tensor k, Tensor v, int start, float scale, int isa=-1) -> Tensor")
    lib.impl("causal_attention", reference.causal_attention, "CPU")
    lib.define("full_attention(Tensor q, Tensor k, Tensor v, int n, float scale, int isa=-1) -> Tensor")
    lib.impl("full_attention", reference.full_attention, "CPU")
    lib.define("rope_attention(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) k, Tensor(b!) v, int start, "
               "int h, int hkv, float scale) -> Tensor")
    lib.impl("rope_attention", reference.rope_attention, "CPU")
    lib.define("rms_norm(Tensor x, Tensor w, float eps, int isa=-1) -> Tensor")
    lib.impl("rms_norm", reference.rms_norm, "CPU")
    lib.define("argmax_rows(Tensor x, int isa=-1) -> Tensor")
    lib.impl("argmax_rows", lambda x, isa=-1: x.argmax(-1), "CPU")
    lib.define("top_probs(Tensor x, int k, int isa=-1) -> (Tensor, Tensor)")
    lib.impl("top_probs", reference.top_probs, "CPU")
    lib.define("selector_chances(Tensor probs, Tensor cand, Tensor proj, Tensor pred, Tensor succ, int anchor) "
               "-> Tensor")
    lib.impl("selector_chances", reference.selector_chances, "CPU")
    _state["library"] = lib  # the registration lives as long as this object


def ensure() -> str:
    """Make `torch.ops.dflash.block_mm` available (building the extension on first use); returns what
    serves it: "compiled" or "reference"."""
    if "backend" in _state:
        return _state["backend"]
    backend = "reference"
    if os.environ.get("DFLASH_NO_EXTENSION") == "1":
        why = "DFLASH_NO_EXTENSION=1"
    else:
        try:
            _compile()
            backend, why = "compiled", ""
        except Exception as e:  # no compiler, no ninja, no headers: the reference serves
            lines = str(e).strip().splitlines() or [""]
            # the compiler's own "error:" line where there is one (not the command line that failed)
            first = next((x for x in lines if "error:" in x), None) or next(
                (x for x in lines if "error" in x.lower()), lines[-1])
            why = f"{type(e).__name__}: {first.strip()}"
    if backend == "reference":
        warnings.warn(f"dflash: the C++ block kernels are not available ({why}); using the PyTorch reference, "
                      "which computes the same results far more slowly (install a C++ compiler and ninja)",
                      stacklevel=2)
        _register_reference()
    _state["backend"] = backend
    return backend


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the same indices; CPU float32 rows run on argmax.cpp once the extension is loaded
    (PyTorch's CPU argmax reads a vocabulary-wide row at ~0.5 GB/s). Never builds the extension itself."""
    if (_state.get("backend") == "compiled" and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and logits.shape[-1] > 0):
        return torch.ops.dflash.argmax_rows(logits, -1)
    return logits.argmax(-1)


def top_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(logits) at each row's k largest logits [T, k], their indices [T, k]), best first: argmax.cpp's
    top_probs for CPU float32 rows once the extension is loaded (one call where a top-k, a logsumexp and the
    operators between them ran: docs/performance.md), else the same through PyTorch."""
    if (_state.get("backend") == "compiled" and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2):
        return torch.ops.dflash.top_probs(logits, k, -1)
    return reference.top_probs(logits, k)


def selector_chances(probs: torch.Tensor, cand: torch.Tensor, proj: torch.Tensor, pred: torch.Tensor,
                     succ: torch.Tensor, anchor: int) -> torch.Tensor:
    """A DFlash2 selector's chances [K, k (prev), k] for a tree draft (`reference.selector_chances` says what):
    selector.cpp for CPU float32 tensors once the extension is loaded, else the same through PyTorch."""
    if (_state.get("backend") == "compiled" and all(t.device.type == "cpu" and t.dtype == torch.float32
                                                     for t in (probs, proj, pred, succ))):
        return torch.ops.dflash.selector_chances(probs, cand, proj, pred, succ, int(anchor))
    return reference.selector_chances(probs, cand, proj, pred, succ, anchor)


def best_isa() -> str:
    """The instruction set the compiled kernels use on this CPU ("reference" without them)."""
    ensure()
    code = int(torch.ops.dflash.best_isa())
    return ISAS[code] if code >= 0 else "reference"


def narrow_rows() -> int:
    """Matmuls of fewer rows than this run on 256-bit VNNI instead of the 512-bit path (AMD Zen 4, where it is
    faster for a few rows; blocks.cpp, `vnni_min_rows`); 0 where no matmul does."""
    ensure()
    return int(torch.ops.dflash.narrow_rows())


def block_mm(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, isa: int = -1) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] @ W^T (see blocks.cpp); isa: -1 the best this CPU has, else ISAS's code."""
    ensure()
    return torch.ops.dflash.block_mm(x, packed, fmt, n, isa)
