// Causal attention over a KV cache whose result for a query does not depend on the other queries of the
// call: query i of T at position start + i attends to keys 0 .. start + i, computed by a fixed sequence
// of operations that depends only on that query, its keys and values. A prefill of T tokens, a verify
// pass of a drafted block and a decode step therefore give each position the same bits, which the fused
// CPU kernels do not (they tile queries and keys by the call's shape).
//
// Per query q and head (GQA: query head h reads kv head h / (H / Hkv)):
//   s_j = dot(q, k_j) * scale                     dot: 8 lanes, lane l sums d = l, l + 8, ... by fma in d
//                                                 order, then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
//   m = max_j s_j;  p_j = exp(s_j - m)            exp: exp_scalar below (attention.h: its constants)
//   z = sum_j p_j                                 8 lanes by j mod 8, then the tree above
//   o[d] = (sum_j p_j v_j[d], by fma in j order) / z
// The AVX2 path, the AVX-512 paths (attention_avx512.cpp) and the scalar twin compute exactly this
// (tests/test_kernels.py compares them bit for bit); the vector paths take the queries that share a kv head
// in tiles (tile_avx2), or split a decode step by keys and by dimensions, which changes only the loop order.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cstdlib>
#include <type_traits>
#include <vector>

#include "attention.h"

namespace {

using namespace dflash_attention;

// a cached key or value element as float32 (float16 widens exactly)
inline float widen(float x) { return x; }
inline float widen(at::Half x) { return static_cast<float>(x); }

template <typename KV>
float dot_scalar(const float* q, const KV* k, int64_t d) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < d; i++) lane[i % 8] = std::fma(q[i], widen(k[i]), lane[i % 8]);
  return tree8(lane);
}

// one (query, head): scores over n keys into buf [n], output [d]
template <typename KV>
void query_scalar(const float* q, const KV* k, int64_t ks, const KV* v, int64_t vs, int64_t n, int64_t d,
                  float scale, float* buf, float* out) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; j++) {
    buf[j] = dot_scalar(q, k + j * ks, d) * scale;
    m = std::fmax(m, buf[j]);
  }
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t j = 0; j < n; j++) {
    buf[j] = exp_scalar(buf[j] - m);
    lane[j % 8] = lane[j % 8] + buf[j];
  }
  const float z = tree8(lane);
  for (int64_t i = 0; i < d; i++) out[i] = 0.f;
  for (int64_t j = 0; j < n; j++)
    for (int64_t i = 0; i < d; i++) out[i] = std::fma(buf[j], widen(v[j * vs + i]), out[i]);
  for (int64_t i = 0; i < d; i++) out[i] = out[i] / z;
}

#ifdef DFLASH_X86
// The AVX2 path takes several queries that read the same keys and values (the heads of one GQA group, at
// consecutive positions) at once; per query it performs the operations listed at the top, so only the loop
// order depends on the tile. Keys and values are walked in blocks of KB that stay in L1 while every query
// of the tile uses them, so a long prefill reads its cache from L2/L3 once per tile instead of once per
// query. Each query's scores, its max, exps and sum, and its output sums (fma in key order, kept in memory
// between blocks) are therefore the numbers it gets alone (tests/test_kernels.py compares them with the
// scalar twin).

// one query's output sums a [8 dv] over keys j .. lim - 1 of its softmax weights p, in key order (fma)
template <int dv, typename KV>
DFLASH_AVX2 inline void values_avx2(const float* p, const KV* v, int64_t vs, int64_t j, int64_t lim, float* a) {
  __m256 ov[dv];
  for (int64_t c = 0; c < dv; c++) ov[c] = _mm256_loadu_ps(a + 8 * c);
  for (; j < lim; j++) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const KV* vj = v + j * vs;
    for (int64_t c = 0; c < dv; c++) ov[c] = _mm256_fmadd_ps(pj, load8(vj + 8 * c), ov[c]);
  }
  for (int64_t c = 0; c < dv; c++) _mm256_storeu_ps(a + 8 * c, ov[c]);
}

// count queries q[u] (n[u] keys each) against one kv head; buf [count, stride] scratch, acc [count, 8 dv + 1]
template <int dv, typename KV>
DFLASH_AVX2 void tile_avx2(const float* const* q, const int64_t* n, int count, const KV* k, int64_t ks,
                           const KV* v, int64_t vs, float scale, float* buf, int64_t stride, float* acc,
                           float* const* out) {
  int64_t nmax = 0;
  for (int u = 0; u < count; u++) nmax = std::max(nmax, n[u]);
  alignas(32) float wide[KB * 8 * dv];  // a float16 cache's block, widened (unused for a float cache)
  int64_t bs;
  for (int64_t jb = 0; jb < nmax; jb += KB) {  // scores, a block of keys for every query
    const float* kb = block_f32<dv>(k, ks, jb, std::min(jb + KB, nmax), wide, bs);
    for (int u = 0; u < count; u++) {
      if (jb >= n[u]) continue;
      __m256 qv[dv];
      for (int64_t c = 0; c < dv; c++) qv[c] = _mm256_loadu_ps(q[u] + 8 * c);
      scores_avx2<dv>(qv, kb, bs, 0, std::min(jb + KB, n[u]) - jb, scale, buf + u * stride + jb);
    }
  }
  float* z = acc + count * 8 * dv;  // acc has count more floats for the sums
  for (int u = 0; u < count; u++) {
    z[u] = softmax_avx2(buf + u * stride, n[u]);
    for (int64_t c = 0; c < dv; c++) _mm256_storeu_ps(acc + u * 8 * dv + 8 * c, _mm256_setzero_ps());
  }
  for (int64_t jb = 0; jb < nmax; jb += KB) {  // output sums, a block of values for every query
    const float* vb = block_f32<dv>(v, vs, jb, std::min(jb + KB, nmax), wide, bs);
    for (int u = 0; u < count; u++)
      if (jb < n[u])
        values_avx2<dv>(buf + u * stride + jb, vb, bs, 0, std::min(jb + KB, n[u]) - jb, acc + u * 8 * dv);
  }
  finish_avx2<dv>(count, acc, z, out);
}

#endif

int64_t attention_isa() {  // 0 scalar, 1 AVX2 (+FMA), 2 AVX-512; ATEN_CPU_CAPABILITY caps it as PyTorch's
#ifdef DFLASH_X86
  static const int64_t isa = [] {
    const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
    if (cap && std::strcmp(cap, "default") == 0) return (int64_t)0;
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
      return (int64_t)0;
    if (cap && std::strcmp(cap, "avx2") == 0) return (int64_t)1;
    return (int64_t)(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") ? 2 : 1);
  }();
  return isa;
#else
  return 0;
#endif
}

// Positions per tile for t queries (at most `most`), with `per` tiles (kv heads x head chunks) at each
// position range: the fewest tiles whose positions split t evenly and whose count the threads share
// evenly, where there are such. A thread's time is its largest share: a 16-row verify pass of the
// default model (3 kv heads) in tiles of 10 and 6 positions left one thread 90 queries and the other 54.
// Only the loop order changes (every query's operations are its own), so the bits do not.
int64_t tile_positions(int64_t t, int64_t most, int64_t per, int64_t threads) {
  for (int64_t nt = (t + most - 1) / most; nt <= t; nt++)
    if (t % nt == 0 && (nt * per) % threads == 0) return t / nt;
  return std::min(t, most);
}

// the tile for hc query heads at pos positions (of t) after start keys, head size d, on path isa (lowered to
// the AVX2 path where that is the one taken); null: the scalar loop
template <typename KV>
Tile<KV> pick_tile(int64_t& isa, int64_t hc, int64_t pos, int64_t t, int64_t start, int64_t d) {
  Tile<KV> tile = nullptr;
#ifdef DFLASH_X86
  // A tile of fewer than 4 queries (a decode step's GQA group) does not repay the AVX-512 path's transposed
  // keys. On a float16 cache two keys per vector pay from about 512 keys (tools/probes/attention_paths_probe.py,
  // Intel Xeon model 207 with AVX-512 VNNI, 2 threads, one query, three runs: 0.93-0.97x the AVX2 tile at 512
  // keys, 0.85-0.96x at 1k, 0.82-0.89x at 4k, 0.90-1.10x at 256, 1.16x at 128; on a float32 cache, which the
  // AVX2 tile reads without widening, 1.09-1.10x up to 1k keys); else the AVX2 tile. The same bits either way.
  const bool small = hc * std::min(pos, t) < 4;
  if (isa == 2) {
    if (!small) tile = tile_avx512_for<KV>(d);
    if constexpr (std::is_same_v<KV, at::Half>)
      if (small && start + t >= 512) tile = tile_pairs_half(d);
    if (tile == nullptr && small) isa = 1;
  }
  if (isa == 1)
    tile = d == 64 ? tile_avx2<8, KV> : d == 128 ? tile_avx2<16, KV> : d == 32 ? tile_avx2<4, KV>
         : d == 16 ? tile_avx2<2, KV> : d == 256 ? tile_avx2<32, KV> : d == 96 ? tile_avx2<12, KV> : nullptr;
#else
  (void)isa, (void)hc, (void)pos, (void)t, (void)start, (void)d;
#endif
  return tile;
}

// attend's tiles for t positions: up to 32 query heads of one kv head's group (hc of them) at pos consecutive
// positions each; nt position ranges x per (kv heads x head chunks) tasks
template <typename KV>
struct TilePlan {
  Tile<KV> tile;
  int64_t t, h, d, group, hc, chunks, pos, nt, per, stride;  // stride: a query's scores (whole vectors of 16)
};

// tasks [i0, i1) of a TilePlan: q [t, H, D] of positions start.., out [t, H * D]; causal false: every query
// attends to all start + t keys (full_attention)
template <typename KV>
void tile_tasks(const TilePlan<KV>& p, int64_t i0, int64_t i1, const float* qp, const KV* kp, int64_t ks, int64_t khs,
                const KV* vp, int64_t vs, int64_t vhs, int64_t start, float scale, float* op, bool causal = true) {
  const int64_t h = p.h, d = p.d, hc = p.hc, pos = p.pos;
  // each thread's scratch, kept between calls (zeroed as new vectors would be, without the allocations)
  thread_local std::vector<float> buf, acc;
  thread_local std::vector<const float*> qs;
  thread_local std::vector<float*> os;
  thread_local std::vector<int64_t> ns;
  buf.assign(hc * pos * p.stride, 0.f), acc.assign(hc * pos * (d + 1), 0.f);
  qs.assign(hc * pos, nullptr), os.assign(hc * pos, nullptr), ns.assign(hc * pos, 0);
  for (int64_t i = i0; i < i1; i++) {
    // tiles in the order 0, last, 1, last - 1, ...: a thread's contiguous share of them is then as much
    // work as another's although later positions attend to more keys
    const int64_t r = i / p.per, tt = r % 2 == 0 ? r / 2 : p.nt - 1 - r / 2;
    const int64_t g = (i % p.per) / p.chunks, h0 = g * p.group + (i % p.chunks) * hc;
    const int64_t h1 = std::min(h0 + hc, (g + 1) * p.group);
    int count = 0;
    for (int64_t qi = tt * pos; qi < std::min(p.t, (tt + 1) * pos); qi++)
      for (int64_t hi = h0; hi < h1; hi++, count++) {
        qs[count] = qp + (qi * h + hi) * d;
        os[count] = op + qi * h * d + hi * d;
        ns[count] = causal ? start + qi + 1 : start + p.t;
      }
    p.tile(qs.data(), ns.data(), count, kp + g * khs, ks, vp + g * vhs, vs, scale, buf.data(), p.stride, acc.data(),
           os.data());
  }
}

// On the AVX2 path (attention_split_avx2.cpp) the split takes decode steps and passes of up to this many rows:
// verify_ab.py DFLASH_SPLIT 0,1 with split_switch.patch, the tiles against the split alternating in one process
// (docs/bench/cpu-avx2-zen3/split_ab.txt, AMD EPYC Zen 3, 2 threads): after 128 / 300 / 700 keys a decode step
// 0.980 / 0.938 / 0.956 of the time, 2 rows 0.974 / 0.962 / 0.930, 3 rows 1.020 / 0.947 / 0.985, 4 rows
// 0.987 / 1.004 / 0.955; 8 and 16 rows, whose tiles hold 4-8 positions and widen each value once for them, took
// 1.013-1.053 and stay tiles.
constexpr int64_t SPLIT_ROWS_AVX2 = 4;

// query heads t * h of q [T, H, D] against a cache k, v [Hkv, S, D] of KV (float or float16) into out; query i
// attends to keys 0 .. start + i (causal), or every query to keys 0 .. start + t - 1 (start may be negative then)
template <typename KV>
void attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start, double scale,
            int64_t isa, torch::Tensor& out, bool causal = true) {
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), hkv = k.size(0);
  // a tile: up to 32 query heads of one kv head's group (hc of them) at pos consecutive positions
  const int64_t group = h / hkv, hc = std::min<int64_t>(group, 32), chunks = (group + hc - 1) / hc;
  const int64_t pos = tile_positions(t, std::max<int64_t>(1, 32 / hc), hkv * chunks, at::get_num_threads());
  Tile<KV> tile = pick_tile<KV>(isa, hc, pos, t, start, d);
  const float* qp = q.data_ptr<float>();
  const KV* kp = k.data_ptr<KV>();
  const KV* vp = v.data_ptr<KV>();
  float* op = out.data_ptr<float>();
  const int64_t ks = k.stride(1), vs = v.stride(1), khs = k.stride(0), vhs = v.stride(0);
#ifdef DFLASH_X86
  if constexpr (std::is_same_v<KV, at::Half>) {
    // A decode step or a verify pass of up to 8 rows from 512 keys on: split by keys and by dimensions
    // instead of by kv heads and positions, so that every thread has as much to do and each block of keys
    // and values is read and widened once for all positions (the same bits: decode_split_half).
    // tools/probes/attention_ab.py against the tiles (AMD EPYC Zen 4, 2 threads, 30 caches cycled, 512-4k
    // keys): 2 rows 0.79-0.97x, 4 rows 0.63-0.81x, 8 rows 0.72-0.91x; 16 rows gained nothing and stay tiles.
    // The AVX2 path (attention_split_avx2.cpp) splits the same way up to SPLIT_ROWS_AVX2 rows.
    if (causal && tile != nullptr && start + t >= 512 && t <= (isa == 2 ? 8 : SPLIT_ROWS_AVX2) &&
        (isa == 2 ? decode_split_half(qp, kp, ks, khs, vp, vs, vhs, start + 1, t, h, hkv, d, (float)scale, op)
                  : decode_split_avx2(qp, kp, ks, khs, vp, vs, vhs, start + 1, t, h, hkv, d, (float)scale, op)))
      return;
  }
  if (tile) {
    const TilePlan<KV> p{tile, t, h, d, group, hc, chunks, pos, (t + pos - 1) / pos, hkv * chunks, start + t + 16};
    // about 64k multiply-adds per task before a second thread pays for waking
    const int64_t work = hc * std::min(pos, t) * (start + t) * d * 2;
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(work, 1));
    at::parallel_for(0, p.nt * p.per, grain, [&](int64_t i0, int64_t i1) {
      tile_tasks(p, i0, i1, qp, kp, ks, khs, vp, vs, vhs, start, (float)scale, op, causal);
    });
    return;
  }
#endif
  // about 64k multiply-adds per task before a second thread pays for waking
  const int64_t work = (start + t) * d * 2;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(work, 1));
  at::parallel_for(0, t * h, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(start + t + 8);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t qi = i / h, hi = i % h, g = hi / group, n = causal ? start + qi + 1 : start + t;
      const float* qv = qp + (qi * h + hi) * d;
      float* o = op + qi * h * d + hi * d;
      query_scalar(qv, kp + g * khs, ks, vp + g * vhs, vs, n, d, (float)scale, buf.data(), o);
    }
  });
}

// causal_attention and full_attention: the checks, then attend (start + t: the keys the last query sees)
torch::Tensor attention_call(const char* name, const torch::Tensor& q_in, const torch::Tensor& k, const torch::Tensor& v,
                             int64_t start, double scale, int64_t isa, bool causal) {
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 3 && v.dim() == 3, name, " takes q [T, H, D], k/v [Hkv, S, D]");
  const bool half = k.scalar_type() == torch::kHalf;
  TORCH_CHECK((k.scalar_type() == torch::kFloat32 || half) && v.scalar_type() == k.scalar_type(),
              "float32 or float16 keys and values (both alike)");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "keys and values need a contiguous last dimension");
  const int64_t t = q_in.size(0), h = q_in.size(1), d = q_in.size(2), hkv = k.size(0);
  TORCH_CHECK(h % hkv == 0 && k.size(2) == d && v.size(2) == d && v.size(0) == hkv, "head shapes do not match");
  TORCH_CHECK(start + t <= k.size(1) && start + t <= v.size(1), "queries past the cache: ", start + t, " > ",
              k.size(1));
  const int64_t best = attention_isa();
  if (isa < 0) isa = best;
  TORCH_CHECK(isa <= best, "this CPU lacks attention path ", isa, " (best: ", best, ")");
  torch::Tensor q = q_in.to(torch::kFloat32).contiguous();
  auto out = torch::empty({t, h * d}, torch::kFloat32);
  if (half) attend<at::Half>(q, k, v, start, scale, isa, out, causal);
  else attend<float>(q, k, v, start, scale, isa, out, causal);
  return out;
}

// q [T, H, D]; k, v [Hkv, S, D] (any strides with a contiguous last dim), keys 0 .. start + T - 1 written.
// The cache may hold float16 (a block-format target's): each element is widened exactly to float32 as it
// is read, so the result is the float32 kernel's on the widened cache, bit for bit (tests/test_kernels.py).
torch::Tensor causal_attention(const torch::Tensor& q_in, const torch::Tensor& k, const torch::Tensor& v, int64_t start,
                               double scale, int64_t isa) {
  return attention_call("causal_attention", q_in, k, v, start, scale, isa, true);
}

// q [T, H, D]; k, v [Hkv, S, D] as causal_attention takes them: every query attends to keys 0 .. n - 1 (a draft
// block's positions see each other and the whole context). The tiles and the scalar loop of causal_attention
// with each query's key count n, so a query's result does not depend on the others in the call either.
torch::Tensor full_attention(const torch::Tensor& q_in, const torch::Tensor& k, const torch::Tensor& v, int64_t n,
                             double scale, int64_t isa) {
  TORCH_CHECK(n >= 1 && n <= k.size(1), "full_attention needs 1 <= n <= the cache's ", k.size(1), " positions, got ",
              n);
  return attention_call("full_attention", q_in, k, v, n - q_in.size(0), scale, isa, false);
}

// a rotated key or value row into the cache (float16: rounded to nearest even, as Tensor.copy_ rounds)
// f16c: the CPU converts 8 at a time (vcvtps2ph, round to nearest even: the same halves as at::Half for every
// number, NaN payloads aside); the scalar loop is the reference and the path without F16C
#ifdef DFLASH_X86
DFLASH_AVX2 void store_half_f16c(at::Half* dst, const float* src, int64_t d) {
  int64_t e = 0;
  for (; e + 8 <= d; e += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; e < d; e++) dst[e] = at::Half(src[e]);
}
#endif
inline void store_row(float* dst, const float* src, int64_t d, bool) { std::memcpy(dst, src, sizeof(float) * d); }
inline void store_row(at::Half* dst, const float* src, int64_t d, bool f16c) {
#ifdef DFLASH_X86
  if (f16c) return store_half_f16c(dst, src, d);
#endif
  (void)f16c;
  for (int64_t e = 0; e < d; e++) dst[e] = at::Half(src[e]);
}

// rope_attention's rotation and cache writes for positions i0 .. i1 (see below)
template <typename KV>
void rotate_rows(const float* xp, const float* cp, const float* sp, float* qp, KV* kp, KV* vp, int64_t i0, int64_t i1,
                 int64_t start, int64_t h, int64_t hkv, int64_t d, int64_t ks0, int64_t ks1, int64_t vs0,
                 int64_t vs1, bool f16c) {
  const int64_t half = d / 2, row = (h + 2 * hkv) * d;
  thread_local std::vector<float> tmp;  // kept between calls: no allocation per call
  tmp.resize(d);
  for (int64_t i = i0; i < i1; i++) {
    const float *c = cp + i * d, *sg = sp + i * d;
    for (int64_t j = 0; j < h + hkv; j++) {
      const float* x = xp + i * row + j * d;
      float* out = j < h ? qp + (i * h + j) * d : tmp.data();
      for (int64_t e = 0; e < half; e++) out[e] = x[e] * c[e] + x[e + half] * sg[e];  // two halves: vectorizable
      for (int64_t e = half; e < d; e++) out[e] = x[e] * c[e] + x[e - half] * sg[e];
      if (j >= h) store_row(kp + (j - h) * ks0 + (start + i) * ks1, out, d, f16c);
    }
    for (int64_t g = 0; g < hkv; g++)
      store_row(vp + g * vs0 + (start + i) * vs1, xp + i * row + (h + hkv + g) * d, d, f16c);
  }
}

// A decode step's attention block from the fused q/k/v projection, in one call: rotate q and k (full
// rotary: out = x * cos + roll(x, D/2) * signed_sin, the same three rounded operations as flat.rotate),
// write k and v into the cache at positions start .., attend. qkv [T, (H + 2 Hkv) * D]; cos and
// signed_sin [T, D] (any shape with T * D contiguous elements); k, v the cache [Hkv, S, D], float32 or
// float16.
torch::Tensor rope_attention(const torch::Tensor& qkv_in, const torch::Tensor& cos_in, const torch::Tensor& ssin_in,
                             const torch::Tensor& k, const torch::Tensor& v, int64_t start, int64_t h, int64_t hkv,
                             double scale) {
  TORCH_CHECK(qkv_in.dim() == 2 && qkv_in.scalar_type() == torch::kFloat32, "rope_attention takes float32 qkv [T, F]");
  const int64_t t = qkv_in.size(0), d = k.size(2);
  TORCH_CHECK(qkv_in.size(1) == (h + 2 * hkv) * d && d % 2 == 0, "qkv is not [T, (H + 2 Hkv) * D]");
  TORCH_CHECK(cos_in.numel() == t * d && ssin_in.numel() == t * d, "rotary tables are not [T, D]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.size(0) == hkv && start + t <= k.size(1), "bad cache");
  const bool half = k.scalar_type() == torch::kHalf;
  TORCH_CHECK((k.scalar_type() == torch::kFloat32 || half) && v.scalar_type() == k.scalar_type(),
              "a float32 or float16 cache (keys and values alike)");
  torch::Tensor qkv = qkv_in.contiguous(), cs = cos_in.contiguous().to(torch::kFloat32),
                sn = ssin_in.contiguous().to(torch::kFloat32);
  auto q = torch::empty({t, h, d}, torch::kFloat32);
  const float *xp = qkv.data_ptr<float>(), *cp = cs.data_ptr<float>(), *sp = sn.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const bool f16c = attention_isa() >= 1;  // AVX2 implies F16C here (attention_isa checks both)
  // positions are independent (each writes its own q row and cache slots): from 4 the threads share them
  at::parallel_for(0, t, t >= 4 ? 1 : t, [&](int64_t i0, int64_t i1) {
    if (half)
      rotate_rows(xp, cp, sp, qp, k.data_ptr<at::Half>(), v.data_ptr<at::Half>(), i0, i1, start, h, hkv, d, ks0, ks1,
                  vs0, vs1, f16c);
    else
      rotate_rows(xp, cp, sp, qp, k.data_ptr<float>(), v.data_ptr<float>(), i0, i1, start, h, hkv, d, ks0, ks1, vs0,
                  vs1, f16c);
  });
  return causal_attention(q, k, v, start, scale, -1);
}

template <typename KV>
void decode_attend_t(const float* qp, const DecodeCache& c, int64_t start, int64_t h, float scale, int64_t i0,
                     int64_t i1, float* op) {
  const int64_t d = c.d, group = h / c.hkv, hc = std::min<int64_t>(group, 32);
  const int64_t chunks = (group + hc - 1) / hc, n = start + 1;
  const KV* kp = static_cast<const KV*>(c.k);
  const KV* vp = static_cast<const KV*>(c.v);
  int64_t isa = attention_isa();
  // attend's tile for one position (tile_positions gives 1 for t = 1), or its scalar loop
  const Tile<KV> tile = pick_tile<KV>(isa, hc, 1, 1, start, d);
  const int64_t stride = n + 16;
  thread_local std::vector<float> buf, acc;
  thread_local std::vector<const float*> qs;
  thread_local std::vector<float*> os;
  thread_local std::vector<int64_t> ns;
  if (tile) buf.assign(hc * stride, 0.f), acc.assign(hc * (d + 1), 0.f);
  else buf.assign(n + 8, 0.f);
  qs.assign(hc, nullptr), os.assign(hc, nullptr), ns.assign(hc, n);
  for (int64_t i = i0; i < i1; i++) {
    const int64_t g = i / chunks, h0 = g * group + (i % chunks) * hc, h1 = std::min(h0 + hc, (g + 1) * group);
    if (tile) {
      int count = 0;
      for (int64_t hi = h0; hi < h1; hi++, count++) qs[count] = qp + hi * d, os[count] = op + hi * d;
      tile(qs.data(), ns.data(), count, kp + g * c.khs, c.ks, vp + g * c.vhs, c.vs, scale, buf.data(), stride,
           acc.data(), os.data());
    } else {
      for (int64_t hi = h0; hi < h1; hi++)
        query_scalar(qp + hi * d, kp + g * c.khs, c.ks, vp + g * c.vhs, c.vs, n, d, scale, buf.data(), op + hi * d);
    }
  }
}

}  // namespace

namespace dflash_attention {

void decode_rotate(const float* qkv, const float* cos, const float* ssin, float* q, const DecodeCache& c,
                   int64_t start, int64_t h) {
  const bool f16c = attention_isa() >= 1;
  if (c.half)
    rotate_rows(qkv, cos, ssin, q, static_cast<at::Half*>(c.k), static_cast<at::Half*>(c.v), 0, 1, start, h, c.hkv,
                c.d, c.khs, c.ks, c.vhs, c.vs, f16c);
  else
    rotate_rows(qkv, cos, ssin, q, static_cast<float*>(c.k), static_cast<float*>(c.v), 0, 1, start, h, c.hkv, c.d,
                c.khs, c.ks, c.vhs, c.vs, f16c);
}

int64_t decode_tasks(int64_t h, int64_t hkv) {
  const int64_t group = h / hkv, hc = std::min<int64_t>(group, 32);
  return hkv * ((group + hc - 1) / hc);
}

void decode_attend(const float* q, const DecodeCache& c, int64_t start, int64_t h, double scale, int64_t i0,
                   int64_t i1, float* out) {
  if (c.half) decode_attend_t<at::Half>(q, c, start, h, (float)scale, i0, i1, out);
  else decode_attend_t<float>(q, c, start, h, (float)scale, i0, i1, out);
}

// From this many keys a decode step whose kv heads the threads cannot share evenly takes the split by keys
// (otherwise, and in causal_attention's decode steps, from 512). Below 512 the tiles give each thread whole kv
// heads: with the default model's 3 kv heads on 2 threads one thread runs 2 of them while the other waits
// (decode_timers.patch: 0.24 ms of a 4.8 ms step after 300 keys). The same bits either way. A decode step of the
// default model, 128 against 512 alternating in one process (docs/bench/cpu-epyc-zen4-headroom/decode_split.*,
// AMD EPYC Zen 4, 2 threads): 0.964-0.981x after 130-500 keys, and 0.971-0.987x in a second run. Where the heads
// share evenly (or one thread runs the step) nothing waits, and the split's three steps were not measured there.
constexpr int64_t DECODE_SPLIT_KEYS = 128;

DecodePlan decode_plan(const DecodeCache& c, int64_t start, int64_t h, int64_t threads) {
  DecodePlan p{1, {decode_tasks(h, c.hkv), 0, 0}, 0, nullptr, nullptr};
#ifdef DFLASH_X86
  // split by keys as causal_attention does (a float16 cache; the AVX2 path's in attention_split_avx2.cpp): from
  // DECODE_SPLIT_KEYS where the tiles leave a thread waiting, else from 512
  const int64_t from = p.tasks[0] % std::max<int64_t>(1, threads) != 0 ? DECODE_SPLIT_KEYS : 512;
  // the calling thread's, kept between calls and only grown: every score and sum a step reads, the layer's earlier
  // steps wrote (as the verify region's scratch), so nothing is zeroed (it was 40 KB a layer after 1,000 keys)
  thread_local std::vector<float> scores, z;
  if (c.half && attention_isa() >= 1 && start + 1 >= from && split_tasks(c.d, start + 1, 1, h, c.hkv, p.tasks, p.stride)) {
    if ((int64_t)scores.size() < h * p.stride) scores.resize(h * p.stride);
    if ((int64_t)z.size() < h) z.resize(h);
    p.steps = 3, p.scores = scores.data(), p.z = z.data();
  }
#endif
  return p;
}

void rows_rotate(const float* qkv, const float* cos, const float* ssin, float* q, const DecodeCache& c,
                 int64_t start, int64_t h, int64_t i0, int64_t i1) {
  const bool f16c = attention_isa() >= 1;
  if (c.half)
    rotate_rows(qkv, cos, ssin, q, static_cast<at::Half*>(c.k), static_cast<at::Half*>(c.v), i0, i1, start, h, c.hkv,
                c.d, c.khs, c.ks, c.vhs, c.vs, f16c);
  else
    rotate_rows(qkv, cos, ssin, q, static_cast<float*>(c.k), static_cast<float*>(c.v), i0, i1, start, h, c.hkv, c.d,
                c.khs, c.ks, c.vhs, c.vs, f16c);
}

// From this many keys a verify pass of 2-16 rows in layers.cpp's region takes the split by keys (causal_attention:
// 2-8 rows from 512). tools/probes/decode_region_probe.py, the region's stack against the per-call stack, the region with its
// tiles (old) and with the split (new) in alternating processes (AMD EPYC Zen 4, 2 threads): after 130 / 300 / 450
// keys 4 rows 0.894 / 0.910 / 0.912 -> 0.811 / 0.792 / 0.755, 8 rows 0.929 / 0.944 -> 0.898 / 0.843, 2 rows level;
// after 40 keys 4 rows 0.841 -> 0.872 and 8 rows 0.909 -> 0.920, slower; 12 rows 0.946 / 0.941 -> 0.914 / 0.882 and
// 16 rows 0.951 / 0.959 / 0.954 -> 0.924 / 0.900 / 0.913 after 130 / 200 / 400 keys. The same bits either way.
constexpr int64_t ROWS_SPLIT_KEYS = 128;

RowsPlan rows_plan(const DecodeCache& c, int64_t start, int64_t t, int64_t h, int64_t threads) {
  RowsPlan r{};
  const int64_t d = c.d, hkv = c.hkv, group = h / hkv, hc = std::min<int64_t>(group, 32);
  const int64_t chunks = (group + hc - 1) / hc;
  const int64_t pos = tile_positions(t, std::max<int64_t>(1, 32 / hc), hkv * chunks, threads);
  const int64_t best = attention_isa();
  int64_t isa = best;  // pick_tile lowers it to the AVX2 tiles for small ones on the AVX-512 path
  void* tile = c.half ? (void*)pick_tile<at::Half>(isa, hc, pos, t, start, d) : (void*)pick_tile<float>(isa, hc, pos, t, start, d);
  if (tile == nullptr) return r;  // causal_attention's scalar loop: not here
  r.t = t, r.h = h;
#ifdef DFLASH_X86
  // causal_attention's split by keys on a float16 cache (there 2-8 positions from 512 keys; here up to 16 from
  // ROWS_SPLIT_KEYS, up to SPLIT_ROWS_AVX2 on the AVX2 path), its three steps: the region's threads are running
  // already, and the split reads each block of keys once for all positions
  if (c.half && (isa == 2 || (best == 1 && t <= SPLIT_ROWS_AVX2)) && start + t >= ROWS_SPLIT_KEYS && t <= 16 &&
      split_tasks(d, start + 1, t, h, hkv, r.split, r.sstride)) {
    r.ok = true, r.steps = 3;
    return r;
  }
#endif
  r.ok = true, r.steps = 1;
  r.tile = tile;
  r.group = group, r.hc = hc, r.chunks = chunks, r.pos = pos;
  r.nt = (t + pos - 1) / pos, r.per = hkv * chunks, r.stride = start + t + 16, r.tasks = r.nt * r.per;
  return r;
}

void rows_split_step(const RowsPlan& r, int step, int64_t i0, int64_t i1, const float* q, const DecodeCache& c,
                     int64_t start, double scale, float* scores, float* z, float* out) {
#ifdef DFLASH_X86
  (attention_isa() == 2 ? split_step_half : split_step_avx2)(step, i0, i1, q, static_cast<const at::Half*>(c.k), c.ks,
                                                             c.khs, static_cast<const at::Half*>(c.v), c.vs, c.vhs,
                                                             start + 1, r.t, r.h, c.hkv, c.d, (float)scale, scores,
                                                             r.sstride, z, out);
#else
  (void)r, (void)step, (void)i0, (void)i1, (void)q, (void)c, (void)start, (void)scale, (void)scores, (void)z, (void)out;
#endif
}

void rows_attend(const RowsPlan& r, int64_t i0, int64_t i1, const float* q, const DecodeCache& c, int64_t start,
                 double scale, float* out) {
  if (c.half) {
    const TilePlan<at::Half> p{(Tile<at::Half>)r.tile, r.t, r.h, c.d, r.group, r.hc, r.chunks, r.pos, r.nt, r.per,
                               r.stride};
    tile_tasks(p, i0, i1, q, static_cast<const at::Half*>(c.k), c.ks, c.khs, static_cast<const at::Half*>(c.v), c.vs,
               c.vhs, start, (float)scale, out);
  } else {
    const TilePlan<float> p{(Tile<float>)r.tile, r.t, r.h, c.d, r.group, r.hc, r.chunks, r.pos, r.nt, r.per, r.stride};
    tile_tasks(p, i0, i1, q, static_cast<const float*>(c.k), c.ks, c.khs, static_cast<const float*>(c.v), c.vs, c.vhs,
               start, (float)scale, out);
  }
}

void decode_step(const DecodePlan& p, int step, int64_t i0, int64_t i1, const float* q, const DecodeCache& c,
                 int64_t start, int64_t h, double scale, float* out) {
  if (p.steps == 1) return decode_attend(q, c, start, h, scale, i0, i1, out);
#ifdef DFLASH_X86
  (attention_isa() == 2 ? split_step_half : split_step_avx2)(step, i0, i1, q, static_cast<const at::Half*>(c.k), c.ks,
                                                             c.khs, static_cast<const at::Half*>(c.v), c.vs, c.vhs,
                                                             start + 1, 1, h, c.hkv, c.d, (float)scale, p.scores,
                                                             p.stride, p.z, out);
#endif
}

}  // namespace dflash_attention

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, int start, float scale, int isa=-1) -> Tensor");
  m.impl("causal_attention", torch::kCPU, &causal_attention);
  m.def("full_attention(Tensor q, Tensor k, Tensor v, int n, float scale, int isa=-1) -> Tensor");
  m.impl("full_attention", torch::kCPU, &full_attention);
  m.def("rope_attention(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) k, Tensor(b!) v, int start, int h, "
        "int hkv, float scale) -> Tensor");
  m.impl("rope_attention", torch::kCPU, &rope_attention);
}
