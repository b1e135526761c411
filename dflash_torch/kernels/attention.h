// What the attention kernels' files share (attention.cpp: the reference order, the scalar twin, the AVX2
// path and the dispatch; attention_avx512.cpp: the AVX-512 tiles): the exp's constants, the 8-lane helpers
// that every vector path reduces with, and the tiles' interface.
#pragma once

// c10's Half only (not ATen/ATen.h): the SIMD files build in seconds without torch's full headers.
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DFLASH_X86 1
#endif

namespace dflash_attention {

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * P(r), r = x - n ln2, Cephes' polynomial;
// 0 below -87 (where 2^n would leave the normal range). Error ~2 ulp; the point is that every path
// performs these same operations.
constexpr float EXP_LO = -87.f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float C0 = 1.9875691500e-4f, C1 = 1.3981999507e-3f, C2 = 8.3334519073e-3f, C3 = 4.1665795894e-2f,
                C4 = 1.6666665459e-1f, C5 = 5.0000001201e-1f;

// exp(x) for x <= 0, one float at a time: the operations of the comment above, in their order (exp_avx2's, lane
// for lane)
inline float exp_scalar(float x) {
  if (x < EXP_LO) return 0.f;
  const float n = std::nearbyint(x * LOG2E);
  float r = std::fma(n, -LN2_HI, x);
  r = std::fma(n, -LN2_LO, r);
  float p = std::fma(C0, r, C1);
  p = std::fma(p, r, C2);
  p = std::fma(p, r, C3);
  p = std::fma(p, r, C4);
  p = std::fma(p, r, C5);
  const float y = std::fma(p, r * r, r) + 1.f;
  int32_t bits;
  std::memcpy(&bits, &y, 4);
  bits += (int32_t)n << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline float tree8(const float* a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

// keys and values are walked in blocks of KB that stay in L1 while every query of a tile uses them
constexpr int64_t KB = 64;
constexpr int64_t VALUES_AHEAD = 16;  // value rows fetched ahead of the split's output sums

#ifdef DFLASH_X86
// the cache lines of one cached row (bytes long) fetched ahead: a pass's weights have just evicted the cache, and
// the kernels' reads of it otherwise wait on memory block by block
__attribute__((always_inline)) inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(row) + off, _MM_HINT_T0);
}
#endif

#ifdef DFLASH_X86
#define DFLASH_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DFLASH_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512dq")))

// 8 cached floats (a float16 cache: 8 halves widened, exactly)
DFLASH_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
DFLASH_AVX2 inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

DFLASH_AVX2 inline float tree8_avx2(__m256 a) {
  const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // l0+l4 .. l3+l7
  const __m128 t = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

DFLASH_AVX2 inline __m256 exp_avx2(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(C0), r, _mm256_set1_ps(C1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C5));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(y), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ);
  return _mm256_and_ps(_mm256_castsi256_ps(bits), keep);
}

// the tile's outputs: each query's sums over its z
template <int dv>
DFLASH_AVX2 inline void finish_avx2(int count, const float* acc, const float* z, float* const* out) {
  for (int u = 0; u < count; u++) {
    const __m256 zb = _mm256_set1_ps(z[u]);
    for (int64_t c = 0; c < dv; c++)
      _mm256_storeu_ps(out[u] + 8 * c, _mm256_div_ps(_mm256_loadu_ps(acc + u * 8 * dv + 8 * c), zb));
  }
}

// 8 keys' 8-lane dot sums a[0..8) -> their scores into dst[0..8): tree8's sums for all 8 at once
DFLASH_AVX2 inline void reduce8_avx2(const __m256* a, __m256 sc, float* dst) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // lanes hold keys 0 2 4 6 1 3 5 7
  __m256 b[4];  // keys 2i, 2i+1: [l0+l4 .. l3+l7 | l0+l4 .. l3+l7]
  for (int i = 0; i < 4; i++)
    b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  // [(l0+l4)+(l2+l6), (l1+l5)+(l3+l7)] per key, keys (0, 2 | 1, 3) and (4, 6 | 5, 7)
  const __m256 c0 = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x44), _mm256_shuffle_ps(b[0], b[1], 0xee));
  const __m256 c1 = _mm256_add_ps(_mm256_shuffle_ps(b[2], b[3], 0x44), _mm256_shuffle_ps(b[2], b[3], 0xee));
  const __m256 dots = _mm256_hadd_ps(c0, c1);  // keys 0 2 4 6 | 1 3 5 7
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_permutevar8x32_ps(dots, order), sc));
}

template <int dv, typename KV>  // head dim / 8, known at compile time so that the vectors stay in registers
DFLASH_AVX2 inline void scores_avx2(const __m256* qv, const KV* k, int64_t ks, int64_t j, int64_t lim, float scale,
                             float* buf) {  // buf[j .. lim) = scores of keys j .. lim - 1
  const __m256 sc = _mm256_set1_ps(scale);
  for (; j + 8 <= lim; j += 8) {  // 8 keys at once, their 8-lane sums reduced together by the same tree
    __m256 a[8];
    for (int u = 0; u < 8; u++) {
      const KV* kj = k + (j + u) * ks;
      a[u] = _mm256_setzero_ps();
      for (int64_t c = 0; c < dv; c++) a[u] = _mm256_fmadd_ps(qv[c], load8(kj + 8 * c), a[u]);
    }
    reduce8_avx2(a, sc, buf + j);
  }
  for (; j < lim; j++) {
    const KV* kj = k + j * ks;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < dv; c++) acc = _mm256_fmadd_ps(qv[c], load8(kj + 8 * c), acc);
    buf[j] = tree8_avx2(acc) * scale;
  }
}

// softmax weights in place over buf[0 .. n): the max, exps and 8-lane sums; returns z
DFLASH_AVX2 inline float softmax_avx2(float* buf, int64_t n) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  float m = -INFINITY;
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(buf + j));
  {
    float tmp[8];
    _mm256_storeu_ps(tmp, mv);
    for (int i = 0; i < 8; i++) m = std::fmax(m, tmp[i]);  // max is exact: any order
    for (; j < n; j++) m = std::fmax(m, buf[j]);
  }
  const __m256 mb = _mm256_set1_ps(m);
  __m256 zv = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 p = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(buf + j), mb));
    _mm256_storeu_ps(buf + j, p);
    zv = _mm256_add_ps(zv, p);
  }
  if (j < n) {  // the tail: lanes past n add nothing (exact: + 0)
    float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = j; i < n; i++) tmp[i - j] = buf[i] - m;
    __m256 p = exp_avx2(_mm256_loadu_ps(tmp));
    _mm256_storeu_ps(tmp, p);
    for (int64_t i = j; i < n; i++) buf[i] = tmp[i - j];
    const __m256 valid = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)(n - j)), _CMP_LT_OQ);
    zv = _mm256_add_ps(zv, _mm256_and_ps(p, valid));
  }
  return tree8_avx2(zv);
}

// keys or values j0 .. j1 of a cache as float32 rows of 8 dv: a float cache as it is, a float16 one widened
// (exactly) into dst once, so that every query of a tile reads floats instead of converting each element
// again (the conversion cost as much as the multiply-adds on an AVX2-only CPU, AMD Zen 1)
template <int dv>
DFLASH_AVX2 inline const float* block_f32(const float* src, int64_t stride, int64_t j0, int64_t, float*, int64_t& out_stride) {
  out_stride = stride;
  return src + j0 * stride;
}
template <int dv>
DFLASH_AVX2 inline const float* block_f32(const at::Half* src, int64_t stride, int64_t j0, int64_t j1, float* dst,
                                          int64_t& out_stride) {
  for (int64_t j = j0; j < j1; j++)
    for (int64_t c = 0; c < dv; c++) _mm256_storeu_ps(dst + (j - j0) * 8 * dv + 8 * c, load8(src + j * stride + 8 * c));
  out_stride = 8 * dv;
  return dst;
}

// A tile: count queries q[u] (n[u] keys each) against one kv head's keys k and values v (rows ks, vs
// apart); buf [count, stride] scratch for scores, acc [count, d + 1] for output sums; outputs to out[u].
template <typename KV>
using Tile = void (*)(const float* const*, const int64_t*, int, const KV*, int64_t, const KV*, int64_t, float, float*,
                      int64_t, float*, float* const*);

// the AVX-512 tiles for head size d (null where there is none): keys transposed, for tiles of 4 or more
// queries; two keys per vector, for fewer (a decode step's GQA group) on a float16 cache
template <typename KV>
Tile<KV> tile_avx512_for(int64_t d);
Tile<at::Half> tile_pairs_half(int64_t d);
// decode_split_half's three steps for t positions (scores by kv head and block of keys, the softmax by query
// head and position, the output sums by kv head and dimensions), for a caller that splits each step's tasks over
// its own threads with a barrier between steps: split_tasks gives the counts and the scores' row stride (false
// where d has no such path); scores [t h, stride] and z [t h] are the caller's. Position p attends to n + p keys.
bool split_tasks(int64_t d, int64_t n, int64_t t, int64_t h, int64_t hkv, int64_t* tasks, int64_t& stride);
void split_step_half(int step, int64_t i0, int64_t i1, const float* q, const at::Half* k, int64_t ks, int64_t khs,
                     const at::Half* v, int64_t vs, int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv,
                     int64_t d, float scale, float* scores, int64_t stride, float* z, float* out);
// attention_split_avx2.cpp: split_step_half's and decode_split_half's AVX2 twins (the same tasks, the same bits)
void split_step_avx2(int step, int64_t i0, int64_t i1, const float* q, const at::Half* k, int64_t ks, int64_t khs,
                     const at::Half* v, int64_t vs, int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv,
                     int64_t d, float scale, float* scores, int64_t stride, float* z, float* out);
bool decode_split_avx2(const float* q, const at::Half* k, int64_t ks, int64_t khs, const at::Half* v, int64_t vs,
                       int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv, int64_t d, float scale, float* out);
// the attention of t query positions (q [t, H, D]; position p attends to n + p keys) over a float16 cache,
// split evenly over the threads (scores by keys, output sums by dimensions); false where d has no such path
bool decode_split_half(const float* q, const at::Half* k, int64_t ks, int64_t khs, const at::Half* v, int64_t vs,
                       int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv, int64_t d, float scale, float* out);
#endif

// A decode step's attention in parts, for a caller that runs them on its own threads (layers.cpp):
// decode_rotate (one thread: q [H, D] rotated out of qkv [(H + 2 Hkv) D], k and v rotated and written at
// position start of one layer's cache), then decode_attend on [i0, i1) of decode_tasks(h, hkv) tasks (each
// thread its share) into out [H * D]: rope_attention's bits for one position.
struct DecodeCache {  // one layer's cache [Hkv, S, D]: float16 or float32, strides in elements
  void *k, *v;
  bool half;
  int64_t hkv, d, khs, ks, vhs, vs;
};
void decode_rotate(const float* qkv, const float* cos, const float* ssin, float* q, const DecodeCache& c,
                   int64_t start, int64_t h);
int64_t decode_tasks(int64_t h, int64_t hkv);
void decode_attend(const float* q, const DecodeCache& c, int64_t start, int64_t h, double scale, int64_t i0,
                   int64_t i1, float* out);
// the attention as causal_attention runs it: by kv heads (one step of decode_tasks tasks), or from 512 keys
// on a float16 cache by keys and dimensions (three steps, a barrier after each), from 128
// where the kv heads do not share evenly over the `threads` that run its tasks; made by one thread, which owns
// the scratch it points to
struct DecodePlan {
  int steps;
  int64_t tasks[3];
  int64_t stride;
  float *scores, *z;
};
DecodePlan decode_plan(const DecodeCache& c, int64_t start, int64_t h, int64_t threads);
void decode_step(const DecodePlan& p, int step, int64_t i0, int64_t i1, const float* q, const DecodeCache& c,
                 int64_t start, int64_t h, double scale, float* out);

// A verify pass's attention in parts (layers.cpp's region for several rows): rows_rotate (rows [i0, i1) of qkv
// [T, (H + 2 Hkv) D] rotated: q [T, H, D] out, keys and values written at positions start + i), then the
// attention in steps (a barrier after each): steps 1, rows_attend on each thread's share of the tiles (by kv
// heads and positions, causal_attention's); steps 3, rows_split_step on each thread's share of split[step] tasks
// (the split by keys of a float16 cache, up to 16 positions from 128 keys (4 on the AVX2 path), where
// causal_attention splits 2-8 from 512 (2-4): scores [t h, sstride] and z [t h] the caller's). Either way rope_attention's bits. ok is false where
// causal_attention would run its scalar loop; threads: as causal_attention counts them (only the split of the
// work depends on it).
struct RowsPlan {
  bool ok;
  int steps;
  void* tile;  // the Tile<KV> of the cache's type
  int64_t t, h, group, hc, chunks, pos, nt, per, stride, tasks;
  int64_t split[3], sstride;
};
void rows_rotate(const float* qkv, const float* cos, const float* ssin, float* q, const DecodeCache& c,
                 int64_t start, int64_t h, int64_t i0, int64_t i1);
RowsPlan rows_plan(const DecodeCache& c, int64_t start, int64_t t, int64_t h, int64_t threads);
void rows_attend(const RowsPlan& p, int64_t i0, int64_t i1, const float* q, const DecodeCache& c, int64_t start,
                 double scale, float* out);
void rows_split_step(const RowsPlan& p, int step, int64_t i0, int64_t i1, const float* q, const DecodeCache& c,
                     int64_t start, double scale, float* scores, float* z, float* out);

}  // namespace dflash_attention
