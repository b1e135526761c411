// The attention's AVX-512 tiles (attention.cpp has the order of operations they reproduce, the scalar
// twin, the AVX2 path and the dispatch): every query's operations are the AVX2 path's, so the bits are.

#include "attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#ifdef DFLASH_X86
namespace dflash_attention {
namespace {

// AVX-512: keys transposed, 16 keys per vector. Per block of KB keys, the tile first lays the keys out as
// kt[i][j] = k_j[i] (float32; a float16 cache widened exactly on the way), once for all of its queries. A
// query's scores then come 16 keys at a time without any reduction across lanes: accumulator l holds
// dot lane l (d = l, l + 8, ...) for 16 keys, each by fma in d order as on the AVX2 path, and tree8's
// adds become 7 vector adds; so every score is the same bits. Exps run 16 wide (elementwise: the same
// operations), z's 8 lanes take the two halves in key order. The output sums run 16 dimensions wide,
// two queries at once so that each value vector loaded serves both (fma in key order, per dimension).

// 8 rows r[i] = [key i | key i + 8] (8 dimensions each) -> out[l] = dimension l of the 16 keys, in order
DFLASH_AVX512 inline void transpose16x8(const __m512* r, __m512* out) {
  __m512 t[8], s[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);      // per 128 bits: a0 b0 a1 b1
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);  // a2 b2 a3 b3
  }
  for (int i = 0; i < 2; i++) {  // keys 4i .. 4i + 3 (and + 8): s[4i + e] = dimension e (and e + 4)
    s[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    s[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    s[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    s[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  // s[e]'s 128-bit quarters: dim e of keys 0-3, dim e + 4 of keys 0-3, the same of keys 8-11; s[4 + e]: keys
  // 4-7 and 12-15
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int e = 0; e < 4; e++) {
    out[e] = _mm512_permutex2var_ps(s[e], lo, s[4 + e]);
    out[e + 4] = _mm512_permutex2var_ps(s[e], hi, s[4 + e]);
  }
}

// keys j0 .. j0 + m - 1 (m <= KB) into kt [8 dv][KB], zeros up to the next multiple of 16
template <int dv, typename KV>
DFLASH_AVX512 void transpose_keys(const KV* k, int64_t ks, int64_t j0, int64_t m, float* kt) {
  for (int64_t jj = 0; jj < m; jj += 16)
    for (int64_t c = 0; c < dv; c++) {
      __m512 r[8], o[8];
      for (int i = 0; i < 8; i++) {
        const __m256 a = jj + i < m ? load8(k + (j0 + jj + i) * ks + 8 * c) : _mm256_setzero_ps();
        const __m256 b = jj + i + 8 < m ? load8(k + (j0 + jj + i + 8) * ks + 8 * c) : _mm256_setzero_ps();
        r[i] = _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
      }
      transpose16x8(r, o);
      for (int l = 0; l < 8; l++) _mm512_store_ps(kt + (8 * c + l) * KB + jj, o[l]);
    }
}

// tree8 over the 8 lanes' accumulators of 16 keys, then the scale: their 16 scores into dst
DFLASH_AVX512 inline void scores16_avx512(const __m512* a, __m512 sc, float* dst) {
  const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                                 _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
  _mm512_storeu_ps(dst, _mm512_mul_ps(s, sc));
}

// the scores of keys jb + j, j < lim (lim <= KB, a multiple of 16 past the last key is zeros in kt) into dst
template <int dv>
DFLASH_AVX512 void scores_avx512(const float* q, const float* kt, int64_t lim, float scale, float* dst) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 16 < lim; j += 32) {  // 32 keys: each broadcast of q serves two vectors of keys
    __m512 a[8], b[8];
    for (int l = 0; l < 8; l++) a[l] = b[l] = _mm512_setzero_ps();
    for (int64_t c = 0; c < dv; c++)
      for (int l = 0; l < 8; l++) {
        const __m512 x = _mm512_set1_ps(q[8 * c + l]);
        const float* row = kt + (8 * c + l) * KB + j;
        a[l] = _mm512_fmadd_ps(x, _mm512_load_ps(row), a[l]);
        b[l] = _mm512_fmadd_ps(x, _mm512_load_ps(row + 16), b[l]);
      }
    scores16_avx512(a, sc, dst + j);
    scores16_avx512(b, sc, dst + j + 16);
  }
  if (j < lim) {
    __m512 a[8];
    for (int l = 0; l < 8; l++) a[l] = _mm512_setzero_ps();
    for (int64_t c = 0; c < dv; c++)
      for (int l = 0; l < 8; l++)
        a[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[8 * c + l]), _mm512_load_ps(kt + (8 * c + l) * KB + j), a[l]);
    scores16_avx512(a, sc, dst + j);
  }
}

DFLASH_AVX512 inline __m512 exp_avx512(__m512 x) {  // exp_avx2's operations, 16 wide
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(C0), r, _mm512_set1_ps(C1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C5));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(y), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(keep, _mm512_castsi512_ps(bits));
}

// softmax_avx2's result: the max (exact in any order), exps 16 at a time, z's 8 lanes by j mod 8 in key
// order (each 16's low half, then its high half); the rest as softmax_avx2 does it
DFLASH_AVX512 float softmax_avx512(float* buf, int64_t n) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(buf + j));
  float m = _mm512_reduce_max_ps(mv);
  for (; j < n; j++) m = std::fmax(m, buf[j]);
  const __m512 mb = _mm512_set1_ps(m);
  __m256 zv = _mm256_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    const __m512 p = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(buf + j), mb));
    _mm512_storeu_ps(buf + j, p);
    zv = _mm256_add_ps(_mm256_add_ps(zv, _mm512_castps512_ps256(p)), _mm512_extractf32x8_ps(p, 1));
  }
  if (j < n) {  // the tail: lanes past n add nothing (exact: + 0)
    alignas(64) float tmp[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = j; i < n; i++) tmp[i - j] = buf[i] - m;
    const __m512 p = exp_avx512(_mm512_load_ps(tmp));
    _mm512_store_ps(tmp, p);
    for (int64_t i = j; i < n; i++) buf[i] = tmp[i - j];
    const __m512 valid = _mm512_maskz_mov_ps((__mmask16)((1u << (n - j)) - 1), p);
    zv = _mm256_add_ps(zv, _mm512_castps512_ps256(valid));
    if (n - j > 8) zv = _mm256_add_ps(zv, _mm512_extractf32x8_ps(valid, 1));
  }
  return tree8_avx2(zv);
}

// two queries' output sums a [8 dv] (in memory between blocks) over values j0 .. lim - 1 of their softmax
// weights p (indexed by key); vb holds the values from key jb on, rows of bs floats. 16 dimensions wide,
// each value vector loaded once for both queries; per dimension fma in key order.
template <int dv>
DFLASH_AVX512 inline void values2_avx512(const float* pa, const float* pb, const float* vb, int64_t bs, int64_t jb,
                                         int64_t j0, int64_t lim, float* aa, float* ab) {
  constexpr int w = dv / 2;  // 16-float vectors per row (d a multiple of 16)
  __m512 oa[w], ob[w];
  for (int c = 0; c < w; c++) oa[c] = _mm512_loadu_ps(aa + 16 * c), ob[c] = _mm512_loadu_ps(ab + 16 * c);
  for (int64_t j = j0; j < lim; j++) {
    const __m512 x = _mm512_set1_ps(pa[j]), y = _mm512_set1_ps(pb[j]);
    const float* vj = vb + (j - jb) * bs;
    for (int c = 0; c < w; c++) {
      const __m512 vv = _mm512_loadu_ps(vj + 16 * c);
      oa[c] = _mm512_fmadd_ps(x, vv, oa[c]);
      ob[c] = _mm512_fmadd_ps(y, vv, ob[c]);
    }
  }
  for (int c = 0; c < w; c++) _mm512_storeu_ps(aa + 16 * c, oa[c]), _mm512_storeu_ps(ab + 16 * c, ob[c]);
}

// values2_avx512 for one query
template <int dv>
DFLASH_AVX512 inline void values1_avx512(const float* p, const float* vb, int64_t bs, int64_t jb, int64_t j0,
                                         int64_t lim, float* a) {
  constexpr int w = dv / 2;
  __m512 o[w];
  for (int c = 0; c < w; c++) o[c] = _mm512_loadu_ps(a + 16 * c);
  for (int64_t j = j0; j < lim; j++) {
    const __m512 x = _mm512_set1_ps(p[j]);
    const float* vj = vb + (j - jb) * bs;
    for (int c = 0; c < w; c++) o[c] = _mm512_fmadd_ps(x, _mm512_loadu_ps(vj + 16 * c), o[c]);
  }
  for (int c = 0; c < w; c++) _mm512_storeu_ps(a + 16 * c, o[c]);
}

// A tile's softmax and output sums once its scores are in buf (both AVX-512 tiles): each query's exps and
// z, then its sums over a block of values at a time (widened once into vbuf for all of the tile's queries)
template <int dv, typename KV>
DFLASH_AVX512 void softmax_values_avx512(const int64_t* n, int count, int64_t nmax, const KV* v, int64_t vs,
                                         float* buf, int64_t stride, float* acc, float* vbuf, float* const* out) {
  float* z = acc + count * 8 * dv;
  for (int u = 0; u < count; u++) {
    z[u] = softmax_avx512(buf + u * stride, n[u]);
    for (int64_t c = 0; c < dv; c++) _mm256_storeu_ps(acc + u * 8 * dv + 8 * c, _mm256_setzero_ps());
  }
  for (int64_t jb = 0; jb < nmax; jb += KB) {  // output sums, a block of values for every query
    int64_t bs;
    const float* vb = block_f32<dv>(v, vs, jb, std::min(jb + KB, nmax), vbuf, bs);
    int u = 0;
    for (; u + 2 <= count; u += 2) {
      const int64_t la = std::min(jb + KB, n[u]), lb = std::min(jb + KB, n[u + 1]), both = std::min(la, lb);
      const float *pa = buf + u * stride, *pb = buf + (u + 1) * stride;
      float *aa = acc + u * 8 * dv, *ab = acc + (u + 1) * 8 * dv;
      if (jb < both) values2_avx512<dv>(pa, pb, vb, bs, jb, jb, both, aa, ab);
      // the longer query's values past the shorter one's, in key order
      const int64_t from = std::max(jb, both);
      if (from < la) values1_avx512<dv>(pa, vb, bs, jb, from, la, aa);
      if (from < lb) values1_avx512<dv>(pb, vb, bs, jb, from, lb, ab);
    }
    if (u < count && jb < n[u])
      values1_avx512<dv>(buf + u * stride, vb, bs, jb, jb, std::min(jb + KB, n[u]), acc + u * 8 * dv);
  }
  finish_avx2<dv>(count, acc, z, out);
}

// tile_avx2's interface and results (head dim 8 dv, a multiple of 16); buf's rows need 15 floats of room
// past n (whole vectors of 16 scores are stored)
template <int dv, typename KV>
DFLASH_AVX512 void tile_avx512(const float* const* q, const int64_t* n, int count, const KV* k, int64_t ks,
                               const KV* v, int64_t vs, float scale, float* buf, int64_t stride, float* acc,
                               float* const* out) {
  const int64_t nmax = *std::max_element(n, n + count);
  alignas(64) float kt[8 * dv * KB];  // a block of keys, transposed; then a block of values, as float32
  for (int64_t jb = 0; jb < nmax; jb += KB) {  // scores, a block of keys for every query
    const int64_t m = std::min(KB, nmax - jb);
    transpose_keys<dv>(k, ks, jb, m, kt);
    for (int u = 0; u < count; u++)
      if (jb < n[u]) scores_avx512<dv>(q[u], kt, std::min(KB, n[u] - jb), scale, buf + u * stride + jb);
  }
  softmax_values_avx512<dv>(n, count, nmax, v, vs, buf, stride, acc, kt, out);
}

// ---- Two keys per vector: tiles of fewer than 4 queries (a decode step's GQA group) ----
// Transposing the keys does not pay for so few queries. Here a vector holds chunk c (8 dimensions) of keys
// j and j + 1 side by side and the query's chunk c twice, so each half is the AVX2 path's accumulator for
// its key, fma for fma, at half the instructions; 8 keys' halves then take tree8's adds in its grouping
// (shuffles only move lanes) and the scale, as reduce8_avx2 does. Keys are laid out in pairs (widened from
// float16 on the way) once per block for all of the tile's queries.

// keys j0 .. j0 + m - 1 (m <= KB) into kp [KB / 2][dv][16]: pair i's chunk c holds chunk c of keys j0 + 2i
// and j0 + 2i + 1; zeros past m, up to the next multiple of 8 keys
template <int dv, typename KV>
DFLASH_AVX512 void pair_keys(const KV* k, int64_t ks, int64_t j0, int64_t m, float* kp, bool ahead = false) {
  const int64_t m8 = (m + 7) / 8 * 8;
  for (int64_t j = 0; j < m8; j++) {
    if (ahead) prefetch_row(k + (j0 + j + KB) * ks, 8 * dv * (int64_t)sizeof(KV));  // the next block's key j
    float* dst = kp + (j / 2) * dv * 16 + (j % 2) * 8;
    for (int64_t c = 0; c < dv; c++)
      _mm256_store_ps(dst + 16 * c, j < m ? load8(k + (j0 + j) * ks + 8 * c) : _mm256_setzero_ps());
  }
}

// 4 pairs' accumulators ([k0 | k1], [k2 | k3], [k4 | k5], [k6 | k7], 8 lanes each) -> the 8 keys' scores
// into dst: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), times the scale
DFLASH_AVX512 inline void reduce8_pairs(const __m512* a, __m512 sc, float* dst) {
  // 128-bit quarter i: key i's lanes 0-3 plus its lanes 4-7 (d01), key 4 + i's (d23)
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x88), _mm512_shuffle_f32x4(a[0], a[1], 0xdd));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x88), _mm512_shuffle_f32x4(a[2], a[3], 0xdd));
  // quarter i: (l0+l4)+(l2+l6), (l1+l5)+(l3+l7) of key i, then the same of key 4 + i
  const __m512 g = _mm512_add_ps(_mm512_shuffle_ps(d01, d23, 0x44), _mm512_shuffle_ps(d01, d23, 0xee));
  const __m512 s = _mm512_mul_ps(_mm512_add_ps(g, _mm512_permute_ps(g, 0xb1)), sc);  // lanes 4i: key i, 4i+2: 4+i
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm256_storeu_ps(dst, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, s)));
}

// one query's scores of keys 0 .. lim - 1 of a block in pairs (pair_keys) into dst, 8 keys at a time (those
// past lim, up to the next multiple of 8, land in dst's room)
template <int dv>
DFLASH_AVX512 inline void pair_scores(const float* q, const float* kp, int64_t lim, __m512 sc, float* dst) {
  __m512 qq[dv];  // the query's chunks, each twice
  for (int c = 0; c < dv; c++) qq[c] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + 8 * c));
  for (int64_t j = 0; j < lim; j += 8) {
    __m512 a[4];
    for (int i = 0; i < 4; i++) {
      const float* pr = kp + (j / 2 + i) * dv * 16;
      a[i] = _mm512_setzero_ps();
      for (int c = 0; c < dv; c++) a[i] = _mm512_fmadd_ps(qq[c], _mm512_load_ps(pr + 16 * c), a[i]);
    }
    reduce8_pairs(a, sc, dst + j);
  }
}

// tile_avx2's interface and results (head dim 8 dv, a multiple of 16); buf's rows need 15 floats of room
// past n
template <int dv, typename KV>
DFLASH_AVX512 void tile_pairs(const float* const* q, const int64_t* n, int count, const KV* k, int64_t ks,
                              const KV* v, int64_t vs, float scale, float* buf, int64_t stride, float* acc,
                              float* const* out) {
  const int64_t nmax = *std::max_element(n, n + count);
  alignas(64) float kp[8 * dv * KB];  // a block of keys in pairs; then a block of values, as float32
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t jb = 0; jb < nmax; jb += KB) {  // scores, a block of keys for every query
    pair_keys<dv>(k, ks, jb, std::min(KB, nmax - jb), kp);
    for (int u = 0; u < count; u++) {
      if (jb >= n[u]) continue;
      const int64_t lim = std::min(KB, n[u] - jb);
      pair_scores<dv>(q[u], kp, lim, sc, buf + u * stride + jb);
    }
  }
  softmax_values_avx512<dv>(n, count, nmax, v, vs, buf, stride, acc, kp, out);
}

// ---- Few query positions over a long float16 cache, split evenly over the threads ----
// Tiles of a kv head's queries leave threads idle where the kv heads do not divide among them (3 over 2:
// one thread waits a third of the time), and tiles of one position each read the kv head's keys and values
// again for every position. The same numbers, split otherwise: the scores by blocks of keys (each score is
// its own sum; every position's queries use a block of keys converted once), then the softmax per query,
// then the output sums by 16 dimensions at a time (each dimension's chain over the keys, in key order, is
// its own; up to 12 queries share each value vector converted). Every operation is tile_pairs's. Query
// position p (of t) attends to its n + p keys.
// tasks i0 .. i1 of the scores (task i: kv head i / blocks, keys of block i % blocks)
template <int dv>
DFLASH_AVX512 void split_scores(int64_t i0, int64_t i1, const float* q, const at::Half* k, int64_t ks, int64_t khs,
                                int64_t n, int64_t t, int64_t h, int64_t group, float scale, float* scores,
                                int64_t stride) {
  constexpr int64_t d = 8 * dv;
  const int64_t nmax = n + t - 1, blocks = (nmax + KB - 1) / KB;
  alignas(64) float kp[8 * dv * KB];
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t i = i0; i < i1; i++) {
    const int64_t g = i / blocks, jb = (i % blocks) * KB;
    pair_keys<dv>(k + g * khs, ks, jb, std::min(KB, nmax - jb), kp, true);
    for (int64_t p = 0; p < t; p++) {
      if (jb >= n + p) continue;
      const int64_t lim = std::min(KB, n + p - jb);
      for (int64_t hi = g * group; hi < (g + 1) * group; hi++)
        pair_scores<dv>(q + (p * h + hi) * d, kp, lim, sc, scores + (p * h + hi) * stride + jb);
    }
  }
}

// C queries' sums over their n[u] values (16 NV dimensions from vg, rows vs apart: a 64-byte line of a float16
// row for NV = 2) of their softmax weights p[u], fma in key order per dimension, each over its z[u], into out[u]
template <int C, int NV>
DFLASH_AVX512 inline void values16(const at::Half* vg, int64_t vs, const int64_t* n, const float* const* p,
                                   const float* z, float* const* out) {
  __m512 o[C][NV];
  for (int u = 0; u < C; u++)
    for (int e = 0; e < NV; e++) o[u][e] = _mm512_setzero_ps();
  const int64_t lo = *std::min_element(n, n + C), hi = *std::max_element(n, n + C);
  int64_t j = 0;
  for (; j < lo; j++) {  // keys every query attends to
    prefetch_row(vg + (j + VALUES_AHEAD) * vs, 32 * NV);
    __m512 vv[NV];
    for (int e = 0; e < NV; e++)
      vv[e] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vg + j * vs + 16 * e)));
    for (int u = 0; u < C; u++) {
      const __m512 pu = _mm512_set1_ps(p[u][j]);
      for (int e = 0; e < NV; e++) o[u][e] = _mm512_fmadd_ps(pu, vv[e], o[u][e]);
    }
  }
  for (; j < hi; j++) {  // the later positions' last few
    __m512 vv[NV];
    for (int e = 0; e < NV; e++)
      vv[e] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vg + j * vs + 16 * e)));
    for (int u = 0; u < C; u++) {
      if (j >= n[u]) continue;
      const __m512 pu = _mm512_set1_ps(p[u][j]);
      for (int e = 0; e < NV; e++) o[u][e] = _mm512_fmadd_ps(pu, vv[e], o[u][e]);
    }
  }
  for (int u = 0; u < C; u++) {
    const __m512 zu = _mm512_set1_ps(z[u]);
    for (int e = 0; e < NV; e++) _mm512_storeu_ps(out[u] + 16 * e, _mm512_div_ps(o[u][e], zu));
  }
}

// values16 for count (1 .. SPLIT_BATCH) queries
constexpr int SPLIT_BATCH = 12;  // 12 queries' sums (24 vectors for NV = 2), the values and a weight in registers
template <int NV>
DFLASH_AVX512 void values_batch(const at::Half* vg, int64_t vs, int count, const int64_t* n, const float* const* p,
                                const float* z, float* const* out) {
  switch (count) {
#define DFLASH_VALUES_CASE(C) \
  case C: values16<C, NV>(vg, vs, n, p, z, out); break;
    DFLASH_VALUES_CASE(1) DFLASH_VALUES_CASE(2) DFLASH_VALUES_CASE(3) DFLASH_VALUES_CASE(4)
    DFLASH_VALUES_CASE(5) DFLASH_VALUES_CASE(6) DFLASH_VALUES_CASE(7) DFLASH_VALUES_CASE(8)
    DFLASH_VALUES_CASE(9) DFLASH_VALUES_CASE(10) DFLASH_VALUES_CASE(11) DFLASH_VALUES_CASE(12)
#undef DFLASH_VALUES_CASE
  }
}

// tasks i0 .. i1 of the output sums (task i: kv head i / w, dimensions 16 NV (i % w) ..), each query's over z;
// a kv head's queries (t positions x its group) go in batches that share each value vector converted. 32
// dimensions per task where the head size allows: each 64-byte line of values is then read by one task only.
template <int dv>
DFLASH_AVX512 void split_values(int64_t i0, int64_t i1, const at::Half* v, int64_t vs, int64_t vhs, int64_t n,
                                int64_t t, int64_t h, int64_t group, const float* scores, int64_t stride,
                                const float* z, float* out) {
  constexpr int64_t d = 8 * dv;
  constexpr int NV = dv % 4 == 0 ? 2 : 1;
  constexpr int64_t w = d / (16 * NV);
  for (int64_t i = i0; i < i1; i++) {
    const int64_t g = i / w, c = (i % w) * 16 * NV;
    const at::Half* vg = v + g * vhs + c;
    int64_t ns[SPLIT_BATCH];
    const float* ps[SPLIT_BATCH];
    float zs[SPLIT_BATCH];
    float* os[SPLIT_BATCH];
    int count = 0;
    for (int64_t p = 0; p < t; p++)
      for (int64_t hi = g * group; hi < (g + 1) * group; hi++) {
        const int64_t r = p * h + hi;
        ns[count] = n + p, ps[count] = scores + r * stride, zs[count] = z[r], os[count] = out + r * d + c;
        if (++count == SPLIT_BATCH) {
          values_batch<NV>(vg, vs, count, ns, ps, zs, os);
          count = 0;
        }
      }
    if (count) values_batch<NV>(vg, vs, count, ns, ps, zs, os);
  }
}

// t query positions (q [t, H, D]; position p attends to n + p keys) over a float16 cache, split evenly over
// the threads
template <int dv>
void decode_split(const float* q, const at::Half* k, int64_t ks, int64_t khs, const at::Half* v, int64_t vs,
                  int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv, float scale, float* out) {
  const int64_t group = h / hkv, blocks = (n + t - 1 + KB - 1) / KB, stride = blocks * KB + 16;
  thread_local std::vector<float> scores, z;  // the calling thread's, kept between calls and only grown (every
  if ((int64_t)scores.size() < t * h * stride) scores.resize(t * h * stride);  // score a step reads, an earlier wrote)
  if ((int64_t)z.size() < t * h) z.resize(t * h);
  float *sp = scores.data(), *zp = z.data();
  at::parallel_for(0, hkv * blocks, 1, [&](int64_t i0, int64_t i1) {
    split_scores<dv>(i0, i1, q, k, ks, khs, n, t, h, group, scale, sp, stride);
  });
  at::parallel_for(0, t * h, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) zp[r] = softmax_avx512(sp + r * stride, n + r / h);
  });
  at::parallel_for(0, hkv * (dv % 4 == 0 ? dv / 4 : dv / 2), 1, [&](int64_t i0, int64_t i1) {
    split_values<dv>(i0, i1, v, vs, vhs, n, t, h, group, sp, stride, zp, out);
  });
}

}  // namespace

template <typename KV>
Tile<KV> tile_avx512_for(int64_t d) {
  return d == 64 ? tile_avx512<8, KV> : d == 128 ? tile_avx512<16, KV> : d == 32 ? tile_avx512<4, KV>
       : d == 16 ? tile_avx512<2, KV> : d == 256 ? tile_avx512<32, KV> : d == 96 ? tile_avx512<12, KV> : nullptr;
}
template Tile<float> tile_avx512_for<float>(int64_t);
template Tile<at::Half> tile_avx512_for<at::Half>(int64_t);

bool decode_split_half(const float* q, const at::Half* k, int64_t ks, int64_t khs, const at::Half* v, int64_t vs,
                       int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv, int64_t d, float scale, float* out) {
  auto run = [&](auto fn) { fn(q, k, ks, khs, v, vs, vhs, n, t, h, hkv, scale, out); return true; };
  return d == 64 ? run(decode_split<8>) : d == 128 ? run(decode_split<16>) : d == 32 ? run(decode_split<4>)
       : d == 16 ? run(decode_split<2>) : d == 96 ? run(decode_split<12>) : false;
}

// decode_split's three steps for a caller that runs them on its own threads: tasks [i0, i1) of step 0 (the
// scores), 1 (the softmax, into z) or 2 (the output sums) for t positions; split_tasks: each step's task count
template <int dv>
void split_step(int step, int64_t i0, int64_t i1, const float* q, const at::Half* k, int64_t ks, int64_t khs,
                const at::Half* v, int64_t vs, int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv, float scale,
                float* scores, int64_t stride, float* z, float* out) {
  const int64_t group = h / hkv;
  if (step == 0) split_scores<dv>(i0, i1, q, k, ks, khs, n, t, h, group, scale, scores, stride);
  else if (step == 1)
    for (int64_t r = i0; r < i1; r++) z[r] = softmax_avx512(scores + r * stride, n + r / h);
  else split_values<dv>(i0, i1, v, vs, vhs, n, t, h, group, scores, stride, z, out);
}

bool split_tasks(int64_t d, int64_t n, int64_t t, int64_t h, int64_t hkv, int64_t* tasks, int64_t& stride) {
  const int64_t dv = d / 8;
  if (d != 64 && d != 128 && d != 32 && d != 16 && d != 96) return false;
  const int64_t blocks = (n + t - 1 + KB - 1) / KB;  // the last position: n + t - 1 keys
  stride = blocks * KB + 16;
  tasks[0] = hkv * blocks, tasks[1] = t * h, tasks[2] = hkv * (dv % 4 == 0 ? dv / 4 : dv / 2);
  return true;
}

void split_step_half(int step, int64_t i0, int64_t i1, const float* q, const at::Half* k, int64_t ks, int64_t khs,
                     const at::Half* v, int64_t vs, int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv,
                     int64_t d, float scale, float* scores, int64_t stride, float* z, float* out) {
  auto run = [&](auto fn) { fn(step, i0, i1, q, k, ks, khs, v, vs, vhs, n, t, h, hkv, scale, scores, stride, z, out); };
  if (d == 64) run(split_step<8>);
  else if (d == 128) run(split_step<16>);
  else if (d == 32) run(split_step<4>);
  else if (d == 16) run(split_step<2>);
  else if (d == 96) run(split_step<12>);
}

Tile<at::Half> tile_pairs_half(int64_t d) {  // not 256: 32 vectors of the query's chunks would not stay in registers
  using H = at::Half;
  return d == 64 ? tile_pairs<8, H> : d == 128 ? tile_pairs<16, H> : d == 32 ? tile_pairs<4, H>
       : d == 16 ? tile_pairs<2, H> : d == 96 ? tile_pairs<12, H> : nullptr;
}

}  // namespace dflash_attention
#endif
