// A Llama-family decoder stack whose linear layers are all block-format matmuls, in one call: for each
// layer, RMSNorm -> fused q/k/v -> rotary + cache write + attention -> output projection + residual ->
// RMSNorm -> fused gate/up -> activation * up -> down projection + residual. It calls the operators
// `llama.FlatLayers` calls on that path (the dflash kernels through the dispatcher, the activation and
// product through ATen), in the same order, except that each RMSNorm runs inside the matmul that reads
// it (block_mm_norm: the norm's own row function on each row before its quantization, the same bits),
// so its results are FlatLayers' bit for bit (tests/test_fast_flat.py). What it saves is everything between them: a decode step of a small model is a
// few hundred small operators, and from Python or TorchScript each one costs microseconds of dispatch,
// boxing and bookkeeping that a compiled loop does not pay. A decode step (one row) goes further: the whole
// stack in one parallel region (decode_region), the kernels' own steps called directly.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <optional>
#include <vector>

#include "activation.h"
#include "attention.h"
#include "blocks.h"
#include "layers.h"

namespace dflash_layers {

const Ops& ops() {
  static const Ops o = [] {
    auto& d = c10::Dispatcher::singleton();
    return Ops{
        d.findSchemaOrThrow("dflash::block_mm", "").typed<Tensor(const Tensor&, const Tensor&, int64_t, int64_t,
                                                                 int64_t)>(),
        d.findSchemaOrThrow("dflash::block_mm_add", "")
            .typed<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&, int64_t)>(),
        d.findSchemaOrThrow("dflash::rms_norm", "").typed<Tensor(const Tensor&, const Tensor&, double, int64_t)>(),
        d.findSchemaOrThrow("dflash::block_mm_norm", "")
            .typed<Tensor(const Tensor&, const Tensor&, double, const Tensor&, int64_t, int64_t, int64_t)>(),
        d.findSchemaOrThrow("dflash::rope_attention", "")
            .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                          int64_t, double)>(),
        d.findSchemaOrThrow("dflash::full_attention", "")
            .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, double, int64_t)>(),
    };
  }();
  return o;
}

Tensor linear(const Ops& o, const Tensor& x, const Tensor& packed, int64_t code, const std::optional<Tensor>& bias) {
  Tensor y = o.mm.call(x, packed, code % 8, code / 8, -1);
  return bias.has_value() ? y + *bias : y;
}

Tensor norm_linear(const Ops& o, const Tensor& x, const Tensor& w, double eps, const Tensor& packed, int64_t code,
                   const std::optional<Tensor>& bias) {
  Tensor y = o.mm_norm.call(x, w, eps, packed, code % 8, code / 8, -1);
  return bias.has_value() ? y + *bias : y;
}

Tensor add_linear(const Ops& o, const Tensor& r, const Tensor& x, const Tensor& packed, int64_t code,
                  const std::optional<Tensor>& bias) {
  if (!bias.has_value()) return o.mm_add.call(x, packed, code % 8, code / 8, r, -1);
  return r + linear(o, x, packed, code, bias);
}

}  // namespace dflash_layers

namespace {

using at::Tensor;
using dflash_activation::act_mul;
using dflash_activation::act_rows;
using namespace dflash_layers;

// f() on a thread of a parallel region unless some thread has failed already; the first exception is kept for the
// calling thread to rethrow after the region (every thread still reaches every barrier)
template <class F>
void run_guarded(std::exception_ptr& error, F&& f) {
  if (error) return;
  try {
    f();
  } catch (...) {
#pragma omp critical
    error = std::current_exception();
  }
}

// A decode step (one row) through every layer in one parallel region, its steps apart by barriers. Every thread
// normalizes and quantizes each matmul's row into its own scratch (mm_quantize: block_mm's own code; the same
// bits on every thread) and takes its chunks of the output columns at once (mm_columns), so a matmul costs one
// barrier, after its columns; thread 0 deals the next matmul's chunks meanwhile (two ColumnShares, used in turn).
// Thread 0 rotates q and k and writes the cache (decode_rotate); every thread takes its share of the attention's
// tasks (decode_step: by kv heads, or by keys and dimensions, as causal_attention splits it) and runs the
// activation on the whole row into its own buffer (act_rows). With thread 0 alone quantizing each row (the others
// waiting for it at a barrier before every matmul) decode steps took 1.5-6% longer on an AMD EPYC Zen 3
// (docs/performance.md, "AVX2 only: AMD EPYC (Zen 3)"). The same functions as the per-call path, so the same bits (tests/test_exact.py,
// tests/test_fast_flat.py). What it saves is a decode step's ~180 forks and joins of the threads, and the tensors,
// views and dispatch around them. Returns false (nothing done) where it does not apply: biases, a row that
// is not float32 [1, H], layers shaped differently.
// Whether t rows (x [t, H] float32) can run through the stack in one parallel region (decode_region, rows_region):
// no biases, float32 norms, every layer shaped alike with blocks the size of its matrix (else the per-call path
// says what is wrong), a float32 or float16 cache [L, 1, Hkv, S, D] with room, rotary tables [t, D].
bool region_fits(const Tensor& x_in, const Tensor& cos, const Tensor& signed_sin, int64_t pos, const Tensor& keys,
                 const Tensor& values, at::TensorList norms, at::TensorList packed, at::IntArrayRef codes,
                 const c10::List<std::optional<Tensor>>& biases, int64_t h, int64_t hkv) {
  using namespace dflash_blocks;
  const int64_t layers = keys.size(0), t = x_in.size(0), hid = x_in.size(1), d = keys.size(-1);
  if (!x_in.is_contiguous() || keys.dim() != 5 || keys.size(1) != 1 || h * d != hid || hid % QK ||
      pos + t > keys.size(3))
    return false;
  const bool half = keys.scalar_type() == at::kHalf;
  if ((!half && keys.scalar_type() != at::kFloat) || values.scalar_type() != keys.scalar_type() ||
      keys.stride(4) != 1 || values.stride(4) != 1 || values.sizes() != keys.sizes())
    return false;
  if (cos.scalar_type() != at::kFloat || signed_sin.scalar_type() != at::kFloat || !cos.is_contiguous() ||
      !signed_sin.is_contiguous() || cos.numel() != t * d || signed_sin.numel() != t * d)
    return false;
  for (int64_t i = 0; i < (int64_t)biases.size(); i++)
    if (biases.get(i).has_value()) return false;
  for (const Tensor& n : norms)
    if (n.scalar_type() != at::kFloat || !n.is_contiguous() || n.numel() != hid) return false;
  for (const Tensor& w : packed)
    if (w.scalar_type() != at::kByte || !w.is_contiguous()) return false;
  const int64_t fqkv = codes[0] / 8, fgu = codes[2] / 8;
  if (fqkv != (h + 2 * hkv) * d || fgu % (2 * QK)) return false;
  auto fits = [](const Tensor& w, int64_t code, int64_t k) {
    return code % 8 <= Q8_0 && w.numel() == packed_bytes(code % 8, code / 8, k);
  };
  for (int64_t i = 0; i < layers; i++)
    if (codes[4 * i] / 8 != fqkv || codes[4 * i + 2] / 8 != fgu || codes[4 * i + 1] / 8 != hid ||
        codes[4 * i + 3] / 8 != hid || !fits(packed[4 * i], codes[4 * i], hid) ||
        !fits(packed[4 * i + 1], codes[4 * i + 1], hid) || !fits(packed[4 * i + 2], codes[4 * i + 2], hid) ||
        !fits(packed[4 * i + 3], codes[4 * i + 3], fgu / 2))
      return false;
  return true;
}

bool decode_region(Tensor& x_out, std::vector<Tensor>& tapped, const Tensor& x_in, const Tensor& cos,
                   const Tensor& signed_sin, int64_t pos, Tensor& keys, Tensor& values, at::IntArrayRef taps,
                   at::TensorList norms, at::TensorList packed, at::IntArrayRef codes,
                   const c10::List<std::optional<Tensor>>& biases, double eps, int64_t h, int64_t hkv, double scale,
                   int64_t act) {
  using namespace dflash_blocks;
  if (x_in.size(0) != 1 ||
      !region_fits(x_in, cos, signed_sin, pos, keys, values, norms, packed, codes, biases, h, hkv))
    return false;
  const int64_t layers = keys.size(0), hid = x_in.size(1), d = keys.size(-1);
  const bool half = keys.scalar_type() == at::kHalf;
  const int64_t fqkv = codes[0] / 8, fgu = codes[2] / 8, inter = fgu / 2;
  const int64_t isa = resolve_isa(-1);
  Tensor x = x_in.clone();  // the residual stream [1, H], updated in place by the o and down projections
  float* xp = x.data_ptr<float>();
  Tensor yqkv = at::empty({1, fqkv}, x.options()), ygu = at::empty({1, fgu}, x.options());
  const Tensor gate = ygu.narrow(1, 0, inter), up = ygu.narrow(1, inter, inter);
  // the rotated query [H, D] and the attention's output [H * D]: the calling thread's, kept between calls, and
  // named by pointer in the region (there, a thread_local name is each thread's own)
  thread_local std::vector<float> qbuf, abuf;
  qbuf.resize(hid), abuf.resize(hid);
  float *qv = qbuf.data(), *av = abuf.data();
  std::vector<int64_t> tap_layers;  // each tapped layer once, in layer order
  for (int64_t i = 0; i < layers; i++)
    for (int64_t t : taps)
      if (t == i) {
        tap_layers.push_back(i);
        tapped.push_back(at::empty({1, hid}, x.options()));
        break;
      }
  const int64_t esize = half ? 2 : 4;
  char* kbase = static_cast<char*>(keys.data_ptr());
  char* vbase = static_cast<char*>(values.data_ptr());
  const float *cp = cos.data_ptr<float>(), *sp = signed_sin.data_ptr<float>();
  dflash_attention::DecodePlan plan{};  // each layer's attention steps: set by thread 0, read past a barrier
  // matmul s of the step (4 a layer: q/k/v, o, gate/up, down): its shape, and its column units (its call's shape,
  // by mm_setup without a scratch), so that thread 0 can deal matmul s + 1's chunks while s runs
  auto shape = [&](int64_t s) -> std::pair<int64_t, int64_t> {  // (outputs, inputs)
    const int64_t j = s % 4;
    return {j == 0 ? fqkv : j == 2 ? fgu : hid, j == 3 ? inter : hid};
  };
  std::vector<int64_t> units(4 * layers);
  {
    MmScratch none;
    for (int64_t s = 0; s < 4 * layers; s++) {
      MmCall c;
      mm_setup(c, none, codes[s] % 8, isa, false, packed[s].data_ptr<uint8_t>(), shape(s).first, shape(s).second,
               1, nullptr, nullptr, 0.f, nullptr, nullptr, false);
      units[s] = c.units;
    }
  }
  // every thread of the region takes part in every matmul: as many threads as the fewest column units
  const int threads = (int)std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), *std::min_element(units.begin(), units.begin() + 4)));
  ColumnShare shares[2];  // matmul s's chunks in shares[s % 2]
  shares[0].reset(units[0], threads);
  std::vector<Tensor> a_own;  // each thread's activation row [1, I]
  for (int th = 0; th < threads; th++) a_own.push_back(at::empty({1, inter}, x.options()));
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the other threads are told
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    c10::InferenceMode mode(inference);  // (act_rows' torch operators, on every thread)
    auto guarded = [&](auto&& f) { run_guarded(error, f); };
    thread_local MmScratch scratch;  // this thread's quants of the row (in the region, each thread its own)
    MmCall c;                         // and its copy of the current matmul's call
    auto matmul = [&](int64_t s, const float* in, const float* norm_w, float* y, const float* res) {
      guarded([&] {
        mm_setup(c, scratch, codes[s] % 8, isa, false, packed[s].data_ptr<uint8_t>(), shape(s).first,
                 shape(s).second, 1, in, norm_w, (float)eps, y, res);
        mm_quantize(c, 0, 1);
        // shares[(s + 1) % 2] last served matmul s - 1, which every thread left at its barrier; no thread takes
        // from it before the barrier below
        if (tid == 0 && s + 1 < 4 * layers) shares[(s + 1) % 2].reset(units[s + 1], nth);
        shares[s % 2].run(c, tid);
      });
#pragma omp barrier
    };
    size_t next_tap = 0;
    for (int64_t i = 0; i < layers; i++) {
      const dflash_attention::DecodeCache cache{kbase + i * keys.stride(0) * esize, vbase + i * values.stride(0) * esize,
                                                half, hkv, d, keys.stride(2), keys.stride(3), values.stride(2),
                                                values.stride(3)};
      matmul(4 * i, xp, norms[2 * i].data_ptr<float>(), yqkv.data_ptr<float>(), nullptr);
      if (tid == 0)
        guarded([&] {
          dflash_attention::decode_rotate(yqkv.data_ptr<float>(), cp, sp, qv, cache, pos, h);
          plan = dflash_attention::decode_plan(cache, pos, h, nth);
        });
#pragma omp barrier
      for (int st = 0; st < plan.steps; st++) {  // (plan.steps: the same for every thread past the barrier)
        const auto [t0, t1] = even_share(plan.tasks[st], tid, nth);
        guarded([&] { dflash_attention::decode_step(plan, st, t0, t1, qv, cache, pos, h, scale, av); });
#pragma omp barrier
      }
      matmul(4 * i + 1, av, nullptr, xp, xp);  // x += o(attn), each thread its own columns
      matmul(4 * i + 2, xp, norms[2 * i + 1].data_ptr<float>(), ygu.data_ptr<float>(), nullptr);
      guarded([&] { act_rows(a_own[tid], gate, up, act, 0, 1); });  // each thread the whole row, into its own
      matmul(4 * i + 3, a_own[tid].data_ptr<float>(), nullptr, xp, xp);  // x += down(a)
      if (next_tap < tap_layers.size() && tap_layers[next_tap] == i) {
        if (tid == 0) std::memcpy(tapped[next_tap].data_ptr<float>(), xp, sizeof(float) * hid);
        next_tap++;  // (every thread counts, so that all take the same branches)
      }
    }
  }
  if (error) std::rethrow_exception(error);
  x_out = x;
  return true;
}

// A tree pass (docs/performance.md, "Tree verification"): row r is the child of row parents[r] (row 0 the
// root, a parent before its child). Rows 0 .. chain - 1 are a chain (each the child of the row before it): they
// attend as a verify pass's rows do, at positions pos .. pos + chain - 1. Every other row r, at depth d, attends
// as the decode step at position pos + d of its own path does: the keys and values of its ancestors lent into
// the slots pos + 1 .. pos + d - 1 (the chain's kept aside and put back after, `Lend`), its own rotated and
// written at pos + d (decode_rotate), then that position's attention (decode_plan/decode_step): the functions
// of a decode step, so its bits. Its keys and values stay in slot pos + r.
struct TreeRows {
  std::vector<int64_t> depth;
  int64_t chain = 1;
  TreeRows(at::IntArrayRef parents, int64_t t) : depth(t, 0) {
    TORCH_CHECK((int64_t)parents.size() == t && parents[0] < 0, "parents: one per row, the first row the root");
    for (int64_t r = 1; r < t; r++) {
      TORCH_CHECK(parents[r] >= 0 && parents[r] < r, "a row's parent must come before it");
      depth[r] = depth[parents[r]] + 1;
      if (chain == r && parents[r] == r - 1) chain++;
    }
  }
};

// The slots a side row borrows in one layer's cache, and giving them back
struct Lend {
  const dflash_attention::DecodeCache& c;
  int64_t es, bytes;  // element size, one row of one head
  std::vector<char> kept;
  std::vector<int64_t> path;
  explicit Lend(const dflash_attention::DecodeCache& cache) : c(cache), es(cache.half ? 2 : 4), bytes(cache.d * es) {}
  char* k(int64_t g, int64_t s) const { return static_cast<char*>(c.k) + (g * c.khs + s * c.ks) * es; }
  char* v(int64_t g, int64_t s) const { return static_cast<char*>(c.v) + (g * c.vhs + s * c.vs) * es; }
  // slots pos + 1 .. pos + d kept aside, r's ancestors' keys and values in pos + 1 .. pos + d - 1
  void out(at::IntArrayRef parents, int64_t r, int64_t d, int64_t pos) {
    kept.resize(2 * c.hkv * d * bytes);
    for (int64_t s = 1; s <= d; s++)
      for (int64_t g = 0; g < c.hkv; g++) {
        char* o = kept.data() + ((s - 1) * c.hkv + g) * 2 * bytes;
        std::memcpy(o, k(g, pos + s), bytes);
        std::memcpy(o + bytes, v(g, pos + s), bytes);
      }
    path.assign(d + 1, 0);  // path[s]: the row at depth s on r's path
    for (int64_t a = r, s = d; s >= 0; a = parents[a], s--) path[s] = a;
    for (int64_t s = 1; s < d; s++)  // (path[s] >= s: a slot is read before any copy writes it)
      if (path[s] != s)
        for (int64_t g = 0; g < c.hkv; g++) {
          std::memcpy(k(g, pos + s), k(g, pos + path[s]), bytes);
          std::memcpy(v(g, pos + s), v(g, pos + path[s]), bytes);
        }
  }
  void back(int64_t d, int64_t pos) {  // the slots kept aside by `out`, put back
    for (int64_t s = 1; s <= d; s++)
      for (int64_t g = 0; g < c.hkv; g++) {
        const char* in = kept.data() + ((s - 1) * c.hkv + g) * 2 * bytes;
        std::memcpy(k(g, pos + s), in, bytes);
        std::memcpy(v(g, pos + s), in + bytes, bytes);
      }
  }
};

// A verify pass (2 .. ROWS_MAX rows) through every layer in one parallel region, as decode_region does for one
// row: thread 0 sets up each matmul (mm_setup), the threads quantize their shares of its rows and compute their
// shares of its columns (mm_columns); each thread rotates its share of the rows and writes their keys and values
// (rows_rotate), takes its share of the attention's tasks on rows_plan's path (rows_attend: tiles by kv heads and
// positions, as causal_attention runs them; or, for up to 16 positions from 128 keys, rows_split_step: scores by
// blocks of keys, softmax, output sums by dimensions, a barrier after each) and of the activation's rows
// (act_rows). The functions of the per-call path, so its bits (tests/test_exact.py, tests/test_fast_flat.py); what it
// saves is a pass's ~200 forks and joins and the dispatch and tensors around them. From rows_by_thread() rows
// (blocks.cpp: 9 on AMD Zen 4, for two threads; as many per thread on more) a chain's pass goes by rows instead:
// each thread takes its own rows through every layer (its own quantization, all of each matmul's columns, its rows'
// attention on a plan of their own), and the threads meet once a layer, after the keys and values are written.
// Returns false (nothing done) where it does not apply (region_fits; an attention that causal_attention would run
// on its scalar loop).
constexpr int64_t ROWS_MAX = 64;

bool rows_region(Tensor& x_out, std::vector<Tensor>& tapped, const Tensor& x_in, const Tensor& cos,
                 const Tensor& signed_sin, int64_t pos, Tensor& keys, Tensor& values, at::IntArrayRef taps,
                 at::TensorList norms, at::TensorList packed, at::IntArrayRef codes,
                 const c10::List<std::optional<Tensor>>& biases, double eps, int64_t h, int64_t hkv, double scale,
                 int64_t act, at::IntArrayRef parents) {
  using namespace dflash_blocks;
  const int64_t t = x_in.size(0);
  if (t < 2 || t > ROWS_MAX || !region_fits(x_in, cos, signed_sin, pos, keys, values, norms, packed, codes, biases,
                                            h, hkv))
    return false;
  const int64_t layers = keys.size(0), hid = x_in.size(1), d = keys.size(-1);
  const bool half = keys.scalar_type() == at::kHalf;
  const int64_t fqkv = codes[0] / 8, fgu = codes[2] / 8, inter = fgu / 2;
  const int64_t esize = half ? 2 : 4;
  char* kbase = static_cast<char*>(keys.data_ptr());
  char* vbase = static_cast<char*>(values.data_ptr());
  auto layer_cache = [&](int64_t i) {
    return dflash_attention::DecodeCache{kbase + i * keys.stride(0) * esize, vbase + i * values.stride(0) * esize,
                                         half, hkv, d, keys.stride(2), keys.stride(3), values.stride(2),
                                         values.stride(3)};
  };
  const int64_t isa = resolve_isa(-1);
  int64_t units = 0;  // every thread of the region takes part in every matmul: as many as the fewest column units
  for (int64_t f : {fqkv, hid, fgu}) {
    const int64_t groups = (f + GROUP - 1) / GROUP, u = isa >= VNNI ? (groups + 1) / 2 : groups;
    units = units == 0 ? u : std::min(units, u);
  }
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  // a tree: the chain rows attend as a pass of theirs, each other row as a decode step of its path (TreeRows)
  const std::optional<TreeRows> tree = parents.empty() ? std::nullopt : std::optional<TreeRows>(TreeRows(parents, t));
  const int64_t chain = tree ? tree->chain : t;
  const dflash_attention::RowsPlan plan = dflash_attention::rows_plan(layer_cache(0), pos, chain, h, threads);
  if (!plan.ok) return false;
  // the split's scores and softmax sums, shared by the threads (every score a step reads, that layer's step 0
  // wrote: no zeroing between layers or passes)
  thread_local std::vector<float> split_buf;
  if (plan.steps == 3 && (int64_t)split_buf.size() < chain * h * (plan.sstride + 1))
    split_buf.resize(chain * h * (plan.sstride + 1));
  float* split_scores = split_buf.data();
  float* split_z = split_scores + chain * h * plan.sstride;
  Tensor x = x_in.clone();  // the residual stream [T, H], updated in place by the o and down projections
  float* xp = x.data_ptr<float>();
  Tensor yqkv = at::empty({t, fqkv}, x.options()), ygu = at::empty({t, fgu}, x.options());
  Tensor q = at::empty({t, h, d}, x.options()), attn = at::empty({t, hid}, x.options());
  Tensor a = at::empty({t, inter}, x.options());  // the activation's output
  const Tensor gate = ygu.narrow(1, 0, inter), up = ygu.narrow(1, inter, inter);
  std::vector<int64_t> tap_layers;  // each tapped layer once, in layer order
  for (int64_t i = 0; i < layers; i++)
    for (int64_t tp : taps)
      if (tp == i) {
        tap_layers.push_back(i);
        tapped.push_back(at::empty({t, hid}, x.options()));
        break;
      }
  const float *cp = cos.data_ptr<float>(), *sp = signed_sin.data_ptr<float>();
  // the activations' quants, sized here for every matmul of the pass, so that inside the region each thread sets up
  // its own copy of a matmul's call (the same pointers) with no barrier after it; thread 0 alone clears AMX's
  // padding rows (mm_setup's prepare). (thread_local: the calling thread's, reached inside through the pointer)
  thread_local MmScratch scratch_tl;
  MmScratch* scratch = &scratch_tl;
  for (int64_t i = 0; i < layers; i++) {
    MmCall sized;
    const int64_t nk[4][2] = {{fqkv, hid}, {hid, hid}, {fgu, hid}, {hid, inter}};
    for (int64_t j = 0; j < 4; j++)
      mm_setup(sized, *scratch, codes[4 * i + j] % 8, isa, false, packed[4 * i + j].data_ptr<uint8_t>(), nk[j][0],
               nk[j][1], t, nullptr, nullptr, 0.f, nullptr, nullptr);
  }
  ColumnShare share;  // the current matmul's columns' chunks, reset by thread 0
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the other threads are told
  // the threads share each matmul's rows to quantize (and normalize) as block_mm's do: thread 0 alone took 0.2-0.3
  // ms of a 2- or 4-row pass while the other waited (barrier timers, docs/performance.md)
  const bool split_quantize = t >= threads;
  // a side row's rotated query and decode plan (set by thread 0, read by all past a barrier), and the slots it
  // borrows in the current layer's cache
  thread_local std::vector<float> qbuf;
  qbuf.resize(h * d);
  float* qside = qbuf.data();
  // by rows (from rows_by_thread() rows, chains only): each thread takes its own rows through every layer, all of
  // every matmul's columns for them, and the threads meet once a layer, after the keys and values are written
  // (rows_by_thread counts rows for two threads: more threads need as many rows each, since each reads every weight)
  const int64_t by_from = dflash_blocks::rows_by_thread();
  bool by_rows = !tree && threads > 1 && by_from > 0 && 2 * t >= by_from * threads;
  std::vector<dflash_attention::RowsPlan> own_plans;  // each thread's rows' attention, on that thread alone
  for (int64_t th = 0; by_rows && th < threads; th++) {
    const auto [a0, a1] = even_share(t, th, threads);
    if (a1 <= a0) {  // more threads than shares of rows: by columns
      by_rows = false;
      break;
    }
    own_plans.push_back(dflash_attention::rows_plan(layer_cache(0), pos + a0, a1 - a0, h, 1));
    by_rows = own_plans.back().ok;
  }
  dflash_attention::DecodePlan side{};
  dflash_attention::DecodeCache lent = layer_cache(0);  // (every layer's alike but for its pointers)
  Lend lend(lent);
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    c10::InferenceMode mode(inference);
    auto guarded = [&](auto&& f) { run_guarded(error, f); };
    MmCall c;  // this thread's copy of the current matmul's call
    // one matmul: every thread sets up its copy and quantizes its share of the rows (thread 0 all of them, with
    // fewer rows than threads), a barrier, then everyone's chunks of the columns. Thread 0 resets the chunks: the
    // last matmul's are all taken (past its barrier) and no thread takes this one's before the next barrier.
    auto matmul = [&](int64_t slot, int64_t n, int64_t k, const float* in, const float* norm_w, float* y,
                      const float* res) {
      guarded([&] {
        mm_setup(c, *scratch, codes[slot] % 8, isa, false, packed[slot].data_ptr<uint8_t>(), n, k, t, in, norm_w,
                 (float)eps, y, res, tid == 0);
        if (tid == 0) share.reset(c.units, nth);
        const QuantShare q = split_quantize ? quantize_share(c, tid, nth) : QuantShare{0, tid == 0 ? t : 0, 0, -1};
        if (q.r0 < q.r1) mm_quantize(c, q.r0, q.r1, q.b0, q.b1);
      });
#pragma omp barrier
      guarded([&] { share.run(c, tid); });
#pragma omp barrier
    };
    size_t next_tap = 0;
    const auto [r0, r1] = even_share(t, tid, nth);  // this thread's rows (rotation, activation)
    const bool rows_mode = by_rows && nth == threads;  // (the plans are the shares of `threads` threads)
    if (rows_mode) {
      thread_local MmScratch own;  // this thread's quants of its rows
      thread_local std::vector<float> own_split;
      const dflash_attention::RowsPlan& op = own_plans[tid];
      const int64_t m = r1 - r0;
      if (op.steps == 3) own_split.resize(m * h * (op.sstride + 1));
      auto matmul_own = [&](int64_t slot, int64_t n, int64_t k, const float* in, const float* norm_w, float* y,
                            const float* res) {
        guarded([&] {
          mm_setup(c, own, codes[slot] % 8, isa, false, packed[slot].data_ptr<uint8_t>(), n, k, m, in + r0 * k,
                   norm_w, (float)eps, y + r0 * n, res != nullptr ? res + r0 * n : nullptr);
          mm_quantize(c, 0, m);
          mm_columns(c, 0, c.units);
        });
      };
      float *qo = q.data_ptr<float>() + r0 * h * d, *ao = attn.data_ptr<float>() + r0 * hid;
      for (int64_t i = 0; i < layers; i++) {
        const dflash_attention::DecodeCache cache = layer_cache(i);
        matmul_own(4 * i, fqkv, hid, xp, norms[2 * i].data_ptr<float>(), yqkv.data_ptr<float>(), nullptr);
        guarded([&] {
          dflash_attention::rows_rotate(yqkv.data_ptr<float>(), cp, sp, q.data_ptr<float>(), cache, pos, h, r0, r1);
        });
#pragma omp barrier
        guarded([&] {
          if (op.steps == 1) {
            dflash_attention::rows_attend(op, 0, op.tasks, qo, cache, pos + r0, scale, ao);
          } else {
            float *sc = own_split.data(), *z = sc + m * h * op.sstride;
            for (int st = 0; st < op.steps; st++)
              dflash_attention::rows_split_step(op, st, 0, op.split[st], qo, cache, pos + r0, scale, sc, z, ao);
          }
        });
        matmul_own(4 * i + 1, hid, hid, attn.data_ptr<float>(), nullptr, xp, xp);  // x += o(attn)
        matmul_own(4 * i + 2, fgu, hid, xp, norms[2 * i + 1].data_ptr<float>(), ygu.data_ptr<float>(), nullptr);
        guarded([&] { act_rows(a, gate, up, act, r0, r1); });
        matmul_own(4 * i + 3, hid, inter, a.data_ptr<float>(), nullptr, xp, xp);  // x += down(a)
        if (next_tap < tap_layers.size() && tap_layers[next_tap] == i) {
          std::memcpy(tapped[next_tap].data_ptr<float>() + r0 * hid, xp + r0 * hid, sizeof(float) * m * hid);
          next_tap++;
        }
      }
    }
    for (int64_t i = 0; i < layers && !rows_mode; i++) {
      const dflash_attention::DecodeCache cache = layer_cache(i);
      if (tid == 0) lent = cache;  // (`lend` reads it; thread 0 alone uses `lend`)
      matmul(4 * i, fqkv, hid, xp, norms[2 * i].data_ptr<float>(), yqkv.data_ptr<float>(), nullptr);
      guarded([&] {
        dflash_attention::rows_rotate(yqkv.data_ptr<float>(), cp, sp, q.data_ptr<float>(), cache, pos, h, r0, r1);
      });
#pragma omp barrier
      if (plan.steps == 1) {
        const auto [a0, a1] = even_share(plan.tasks, tid, nth);
        guarded([&] {
          dflash_attention::rows_attend(plan, a0, a1, q.data_ptr<float>(), cache, pos, scale, attn.data_ptr<float>());
        });
#pragma omp barrier
      } else {
        for (int st = 0; st < plan.steps; st++) {  // the split by keys: scores, softmax, output sums
          const auto [a0, a1] = even_share(plan.split[st], tid, nth);
          guarded([&] {
            dflash_attention::rows_split_step(plan, st, a0, a1, q.data_ptr<float>(), cache, pos, scale, split_scores,
                                              split_z, attn.data_ptr<float>());
          });
#pragma omp barrier
        }
      }
      for (int64_t r = chain; r < t; r++) {  // a tree's side rows, one after the other, the threads sharing each
        const int64_t dr = tree->depth[r];
        if (tid == 0)
          guarded([&] {
            if (r > chain) lend.back(tree->depth[r - 1], pos);
            lend.out(parents, r, dr, pos);
            dflash_attention::decode_rotate(yqkv.data_ptr<float>() + r * fqkv, cp + r * d, sp + r * d, qside, cache,
                                            pos + dr, h);
            side = dflash_attention::decode_plan(cache, pos + dr, h, nth);
          });
#pragma omp barrier
        for (int st = 0; st < side.steps; st++) {  // (side.steps: the same for every thread past the barrier)
          const auto [s0, s1] = even_share(side.tasks[st], tid, nth);
          guarded([&] {
            dflash_attention::decode_step(side, st, s0, s1, qside, cache, pos + dr, h, scale,
                                          attn.data_ptr<float>() + r * hid);
          });
#pragma omp barrier
        }
      }
      if (chain < t) {
        if (tid == 0) guarded([&] { lend.back(tree->depth[t - 1], pos); });
#pragma omp barrier
      }
      matmul(4 * i + 1, hid, hid, attn.data_ptr<float>(), nullptr, xp, xp);  // x += o(attn)
      matmul(4 * i + 2, fgu, hid, xp, norms[2 * i + 1].data_ptr<float>(), ygu.data_ptr<float>(), nullptr);
      guarded([&] {
        if (r0 < r1) act_rows(a, gate, up, act, r0, r1);
      });
#pragma omp barrier
      matmul(4 * i + 3, hid, inter, a.data_ptr<float>(), nullptr, xp, xp);  // x += down(a)
      if (next_tap < tap_layers.size() && tap_layers[next_tap] == i) {
        if (tid == 0) std::memcpy(tapped[next_tap].data_ptr<float>(), xp, sizeof(float) * t * hid);
        next_tap++;  // (every thread counts, so that all take the same branches)
      }
    }
  }
  if (error) std::rethrow_exception(error);
  x_out = x;
  return true;
}


// A tree pass's attention on the per-call path (where rows_region does not apply): rope_attention on the chain
// rows, then each side row as a decode step of its own path (TreeRows). Returns the output [T, H * D].
constexpr int64_t SPLIT_KEYS = 1024;

Tensor tree_attention(const Ops& o, const Tensor& qkv, const Tensor& cos, const Tensor& signed_sin, int64_t pos,
                      Tensor& k, Tensor& v, at::IntArrayRef parents, int64_t h, int64_t hkv, double scale) {
  const int64_t t = qkv.size(0), d = k.size(2), hid = h * d;
  TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  signed_sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  signed_sin.scalar_type() == at::kFloat && cos.numel() == t * d && signed_sin.numel() == t * d,
              "a tree pass takes float32 rows and rotary tables [T, D]");
  const TreeRows tree(parents, t);
  const int64_t chain = tree.chain;
  Tensor head = o.rope_attention.call(qkv.narrow(0, 0, chain), cos.narrow(0, 0, chain),
                                      signed_sin.narrow(0, 0, chain), k, v, pos, h, hkv, scale);  // [C, H * D]
  if (chain == t) return head;
  Tensor attn = at::empty({t, hid}, qkv.options());
  attn.narrow(0, 0, chain).copy_(head);
  const dflash_attention::DecodeCache cache{k.data_ptr(), v.data_ptr(), k.scalar_type() == at::kHalf, hkv, d,
                                            k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  Lend lend(cache);
  std::vector<float> q(hid);
  const float* xp = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = signed_sin.data_ptr<float>();
  for (int64_t r = chain; r < t; r++) {
    const int64_t dr = tree.depth[r];  // (< r: its slot pos + r is outside the slots it borrows)
    lend.out(parents, r, dr, pos);
    dflash_attention::decode_rotate(xp + r * qkv.size(1), cp + r * d, sp + r * d, q.data(), cache, pos + dr, h);
    for (int64_t g = 0; g < hkv; g++) {  // its own slot, where a kept path's rows are moved from
      std::memcpy(lend.k(g, pos + r), lend.k(g, pos + dr), lend.bytes);
      std::memcpy(lend.v(g, pos + r), lend.v(g, pos + dr), lend.bytes);
    }
    const dflash_attention::DecodePlan plan = dflash_attention::decode_plan(cache, pos + dr, h, 1);  // serial below 1k
    float* out = attn.data_ptr<float>() + r * hid;
    // each step's tasks over the threads, a join between steps; over fewer keys than SPLIT_KEYS the
    // calling thread takes them all (a fork and join cost more than the attention there)
    for (int s = 0; s < plan.steps; s++) {
      auto run = [&](int64_t i0, int64_t i1) {
        dflash_attention::decode_step(plan, s, i0, i1, q.data(), cache, pos + dr, h, scale, out);
      };
      if (pos + dr + 1 < SPLIT_KEYS) run(0, plan.tasks[s]);
      else at::parallel_for(0, plan.tasks[s], 1, run);
    }
    lend.back(dr, pos);
  }
  return attn;
}

// x [T, H] float32 through every layer; keys/values the cache [L, 1, Hkv, S, D]; per layer 2 norms and 4
// linear layers (qkv, o, gate_up, down: packed blocks, 8 * out_features + format, optional bias); act 0
// silu, 1 gelu (tanh), 2 gelu. Returns x and the outputs of the layers listed in taps, in layer order.
std::tuple<Tensor, std::vector<Tensor>> decoder_stack(
    const Tensor& x_in, const Tensor& cos, const Tensor& signed_sin, int64_t pos, Tensor& keys, Tensor& values,
    at::IntArrayRef taps, at::TensorList norms, at::TensorList packed, at::IntArrayRef codes,
    const c10::List<std::optional<Tensor>>& biases, double eps, int64_t h, int64_t hkv, double scale, int64_t act,
    at::IntArrayRef parents) {
  const int64_t layers = keys.size(0);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "decoder_stack takes float32 x [T, H]");
  TORCH_CHECK(parents.empty() || (int64_t)parents.size() == x_in.size(0), "parents: none, or one per row");
  TORCH_CHECK(values.size(0) == layers && (int64_t)norms.size() == 2 * layers &&
                  (int64_t)packed.size() == 4 * layers && (int64_t)codes.size() == 4 * layers &&
                  (int64_t)biases.size() == 4 * layers,
              "decoder_stack: per layer 2 norms and 4 linear layers, and a cache of as many layers");
  TORCH_CHECK(act >= 0 && act <= 2, "unknown activation code ", act);
  std::vector<Tensor> tapped;
  Tensor x = x_in;
  if (parents.empty() && decode_region(x, tapped, x_in, cos, signed_sin, pos, keys, values, taps, norms, packed, codes, biases, eps,
                    h, hkv, scale, act))
    return {x, tapped};
  if (rows_region(x, tapped, x_in, cos, signed_sin, pos, keys, values, taps, norms, packed, codes, biases, eps, h,
                  hkv, scale, act, parents))
    return {x, tapped};
  const Ops& o = ops();
  for (int64_t i = 0; i < layers; i++) {
    Tensor qkv = norm_linear(o, x, norms[2 * i], eps, packed[4 * i], codes[4 * i], biases.get(4 * i));
    Tensor k = keys.select(0, i).select(0, 0), v = values.select(0, i).select(0, 0);  // [Hkv, S, D]
    Tensor attn = parents.empty() ? o.rope_attention.call(qkv, cos, signed_sin, k, v, pos, h, hkv, scale)
                                  : tree_attention(o, qkv, cos, signed_sin, pos, k, v, parents, h, hkv, scale);
    x = add_linear(o, x, attn, packed[4 * i + 1], codes[4 * i + 1], biases.get(4 * i + 1));
    std::vector<Tensor> gu =
        norm_linear(o, x, norms[2 * i + 1], eps, packed[4 * i + 2], codes[4 * i + 2], biases.get(4 * i + 2)).chunk(2, -1);
    x = add_linear(o, x, act_mul(gu[0], gu[1], act), packed[4 * i + 3], codes[4 * i + 3], biases.get(4 * i + 3));
    for (int64_t t : taps)
      if (t == i) {  // once, however often taps lists it
        tapped.push_back(x);
        break;
      }
  }
  return {x, tapped};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("decoder_stack(Tensor x, Tensor cos, Tensor signed_sin, int pos, Tensor(a!) keys, Tensor(b!) values, "
        "int[] taps, Tensor[] norms, Tensor[] packed, int[] codes, Tensor?[] biases, float eps, int h, int hkv, "
        "float scale, int act, int[] parents=[]) -> (Tensor, Tensor[])");
  m.impl("decoder_stack", c10::DispatchKey::CPU, &decoder_stack);
}
