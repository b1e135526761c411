// The block kernels' AVX2 paths (blocks.cpp has the arithmetic they reproduce, the scalar twin and the
// dispatch). A packed record holds one block of a group's 8 columns as 8 chunk vectors (32 bytes: 4 values
// of each column); each is multiplied by 4 of a row's values broadcast to all columns, so every int32 lane
// sums one column's products: the block sums come out per column, with no horizontal adds. Then each row
// and column takes the float step of float_step8 (blocks.h), block after block, so the bits are the scalar
// twin's whatever the path.
//
// Q4: unsigned nibbles x signed bytes -> int16 pairs (maddubs); |pair| <= 2 * 15 * 127, so the 8 chunks of
// a block add up in int16 without overflow (<= 30480) before one madd to int32 (Q4_0's nibbles are
// unsigned here: its - 8 * sum(x) comes off in the float step's integer). Q8 weights are signed: |w| times x
// with w's sign (sign_epi8), each chunk to int32 at once (a pair reaches 2 * 127 * 127). Integer sums are
// exact, so their order is free.

#include "blocks.h"

#ifdef DFLASH_X86
namespace dflash_blocks {
namespace {

// The sums v as they stand, each chunk's products added before the next chunk's: left to itself the compiler
// reassociates the chains of integer adds (all chunks' products first, summed as a tree), keeps more vectors live
// than the 16 registers hold, and spills them every block.
template <int N>
__attribute__((target("avx2"), always_inline)) inline void keep_order(__m256i* v) {
  #pragma GCC unroll 16
  for (int i = 0; i < N; i++) asm("" : "+x"(v[i]));
}

// A few rows of one column group with their float sums in registers across all blocks (R <= 4: the sums,
// the rows' int16 chains and one chunk's weights fill the 16 ymm registers). The weights are unpacked one
// chunk (32 bytes) at a time, so a few rows cost little more than one while the weights stream from memory.
template <int64_t fmt, int R>
__attribute__((target("avx2,fma,f16c"))) void avx2_rows(const uint8_t* w, int64_t nb, const Rows& x, int64_t r0,
                                                        float* out) {
  const int64_t gb = group_bytes(fmt), qoff = (fmt == Q4_1 ? 4 : 2) * GROUP;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* rec = w + b * gb;
    prefetch_ahead(rec, gb);
    const uint8_t* qs = rec + qoff;
    __m256i isum[R];
    if (fmt == Q8_0) {
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
      for (int j = 0; j < 8; j++) {
        const __m256i wj = _mm256_loadu_si256((const __m256i*)(qs + 32 * j)), aw = _mm256_abs_epi8(wj);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          const int32_t* x4 = (const int32_t*)(x.q + (r0 + r) * x.k + b * QK);
          const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(x4[j]), wj);
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
        }
        if (R > 1) keep_order<R>(isum);  // one row's chain spills nothing
      }
    } else {
      __m256i s16[R];
      for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          const int32_t* x4 = (const int32_t*)(x.q + (r0 + r) * x.k + b * QK);
          const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4[j])),
                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4[j + 4])));
          s16[r] = j == 0 ? t : _mm256_add_epi16(s16[r], t);
        }
        if (R > 1) keep_order<R>(s16);
      }
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) isum[r] = _mm256_madd_epi16(s16[r], ones);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec));
    const __m256 mw = fmt == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 16))) : _mm256_setzero_ps();
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = float_step8<fmt>(acc[r], isum[r], dw, mw, x, (r0 + r) * x.nb + b);
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) _mm256_storeu_ps(out + GROUP * r, acc[r]);
}

// column groups [g0, g1) for all m rows on the register rows (a Q4 matmul of 1-2 rows, Q8_0 at every count), 4
// rows per pass over a group's weights, each pass's sums stored into y (store_rows) without a zeroed tile between
template <int64_t fmt>
void columns_rows_t(const uint8_t* wp, int64_t gstride, int64_t nb, const Rows& x, int64_t m, int64_t g0, int64_t g1,
                    float* y, int64_t n, const float* res) {
  alignas(32) float acc[4 * GROUP];
  for (int64_t t0 = 0; t0 < m; t0 += TILE_ROWS) {  // a prefill's rows a tile at a time
    const int64_t t1 = std::min<int64_t>(m, t0 + TILE_ROWS);
    for (int64_t g = g0; g < g1; g++) {
      const uint8_t* w = wp + g * gstride;
      const int64_t cols = std::min<int64_t>(GROUP, n - g * GROUP);
      for (int64_t r = t0; r < t1; r += 4) {
        const int64_t rows = std::min<int64_t>(4, t1 - r);
        switch (rows) {
          case 1: avx2_rows<fmt, 1>(w, nb, x, r, acc); break;
          case 2: avx2_rows<fmt, 2>(w, nb, x, r, acc); break;
          case 3: avx2_rows<fmt, 3>(w, nb, x, r, acc); break;
          default: avx2_rows<fmt, 4>(w, nb, x, r, acc); break;
        }
        store_rows(y, res, n, r, rows, g * GROUP, cols, acc, GROUP);
      }
    }
  }
}

// Prefetch for block b of a strip over a pair of column groups (group g's nb records from w, then group g + 1's):
// a strip reads block b of both, so where a group has at most PF blocks the records ahead are fetched as one sweep
// in memory order at the pace the strip consumes them, two records a block: records PF + 2b and PF + 2b + 1 from
// the pair's first (the second group's last blocks, then the next pair's). prefetch_pair fetches each group's own
// stream PF blocks ahead instead, and with it two-group strips read weights from memory slower than one group's
// single stream did, though faster from cache (docs/performance.md, "AVX2 only: AMD EPYC (Zen 3)"). Past PF blocks
// a sweep at that pace would fall behind the second group's stream, which prefetch_pair follows.
__attribute__((always_inline)) inline void prefetch_sweep(const uint8_t* w, int64_t b, int64_t nb, int64_t gb) {
  if (nb > PF) {
    prefetch_pair(w, b, nb, gb);
    return;
  }
  const uint8_t* ahead = w + (PF + 2 * b) * gb;
  for (int64_t off = 0; off < 2 * gb; off += 64) _mm_prefetch((const char*)(ahead + off), _MM_HINT_T0);
}

// Chunk j of a block for a strip: values 4j.. in the low nibbles, then 16 + 4j.. in the high, each unpacked
// once for the R rows. first: the first chunk's low half sets the int16 sums (no zeroing, no add).
template <int R, int C, bool first>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void strip_chunk(__m256i (&s)[R][C], const uint8_t* rec,
                                                                               int64_t gstride, int64_t qoff, int j,
                                                                               const int8_t* xb0, int64_t xk,
                                                                               __m256i low) {
  #pragma GCC unroll 2
  for (int h = 0; h < 2; h++) {  // one half at a time: C weight vectors live, not 2 C
    __m256i wh[C];
    #pragma GCC unroll 4
    for (int c = 0; c < C; c++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(rec + c * gstride + qoff + 32 * j));
      wh[c] = _mm256_and_si256(h == 0 ? v : _mm256_srli_epi16(v, 4), low);
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const __m256i xb = _mm256_set1_epi32(((const int32_t*)(xb0 + r * xk))[j + 4 * h]);
      #pragma GCC unroll 4
      for (int c = 0; c < C; c++) {
        const __m256i p = _mm256_maddubs_epi16(wh[c], xb);
        s[r][c] = first && h == 0 ? p : _mm256_add_epi16(s[r][c], p);
      }
    }
    keep_order<R * C>(&s[0][0]);  // each half's products into the sums before the next half's
  }
}

// R rows x C column groups (C <= 2) of a Q4 matmul over all blocks, past avx2_tile_rows() rows (blocks.cpp): the
// int16 block sums of the R x C pairs in registers (R = 4, C = 2: 8 sums, a chunk's weights for both groups
// and a broadcast), so each unpacked chunk of weights serves R rows and each broadcast of 4 activation bytes
// serves C groups; the float sums go to acc [R, 2 * GROUP] in L1 once per block (the first block's over zeros,
// so acc needs no clearing per strip). Per multiply-add that is fewer loads and broadcasts than a tile that
// unpacks a block once for 64 rows and runs them one after another, which is what the AVX2 path did before
// (docs/performance.md, "AVX2 only: AMD EPYC (Zen 3)").
// pf: prefetch the weights ahead (the first strip of rows reads them from memory, the others from L1).
template <int64_t fmt, int R, int C>
__attribute__((target("avx2,fma,f16c"))) void avx2_block(const uint8_t* w, int64_t gstride, int64_t nb, const Rows& xr,
                                                         int64_t r0, bool pf, float* acc) {
  const Rows x = xr;  // a local copy: the stores to acc cannot change its pointers, so they stay in registers
  const int64_t gb = group_bytes(fmt), qoff = (fmt == Q4_1 ? 4 : 2) * GROUP;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const int8_t* xq = x.q + r0 * x.k;
  const int64_t xk = x.k;
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* rec = w + b * gb;  // group c's record: rec + c * gstride
    if (pf) {
      if (C == 2) prefetch_sweep(w, b, nb, gb);
      else prefetch_ahead(rec, gb);
    }
    __m256i s[R][C];
    strip_chunk<R, C, true>(s, rec, gstride, qoff, 0, xq + b * QK, xk, low);
    #pragma GCC unroll 1  // a loop: unrolled (as -O3 does), its loads are hoisted and spilled
    for (int j = 1; j < 4; j++) strip_chunk<R, C, false>(s, rec, gstride, qoff, j, xq + b * QK, xk, low);
    __m256 dw[C], mw[C];
    #pragma GCC unroll 4
    for (int c = 0; c < C; c++) {
      dw[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + c * gstride)));
      mw[c] = fmt == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + c * gstride + 16))) : _mm256_setzero_ps();
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const RowStep8 xs = row_step8<fmt>(x, (r0 + r) * x.nb + b);  // once for the row's C groups
      #pragma GCC unroll 4
      for (int c = 0; c < C; c++) {
        const __m256i isum = _mm256_madd_epi16(s[r][c], ones);
        float* a = acc + r * 2 * GROUP + c * GROUP;
        const __m256 prev = b == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(a);  // 0 + the first block, as the twin
        _mm256_storeu_ps(a, float_step8<fmt>(prev, isum, dw[c], mw[c], xs));
      }
    }
  }
}

template <int64_t fmt, int C>
void block_rows(const uint8_t* w, int64_t gstride, int64_t nb, const Rows& x, int64_t r0, int64_t rows, bool pf,
                float* acc) {
  switch (rows) {
    case 1: avx2_block<fmt, 1, C>(w, gstride, nb, x, r0, pf, acc); break;
    case 2: avx2_block<fmt, 2, C>(w, gstride, nb, x, r0, pf, acc); break;
    case 3: avx2_block<fmt, 3, C>(w, gstride, nb, x, r0, pf, acc); break;
    default: avx2_block<fmt, 4, C>(w, gstride, nb, x, r0, pf, acc); break;
  }
}

template <int64_t fmt>
void columns_avx2_t(const uint8_t* wp, int64_t gstride, int64_t nb, const Rows& x, int64_t m, int64_t g0, int64_t g1,
                    float* y, int64_t n, const float* res) {
  alignas(32) float acc[4 * 2 * GROUP];
  std::memset(acc, 0, sizeof(acc));  // once: a strip over no blocks (k = 0) writes nothing into it
  for (int64_t t0 = 0; t0 < m; t0 += TILE_ROWS) {  // a prefill's rows a tile at a time
    const int64_t t1 = std::min<int64_t>(m, t0 + TILE_ROWS);
    for (int64_t g = g0; g < g1; g += 2) {  // two groups per strip (the last of an odd share alone)
      const int64_t pair = std::min<int64_t>(2, g1 - g);
      const uint8_t* w = wp + g * gstride;
      for (int64_t r = t0; r < t1; r += 4) {  // strips of 4 rows; the pair's weights stay in L1 across them
        const int64_t rows = std::min<int64_t>(4, t1 - r);
        if (pair == 2) block_rows<fmt, 2>(w, gstride, nb, x, r, rows, r == t0, acc);
        else block_rows<fmt, 1>(w, gstride, nb, x, r, rows, r == t0, acc);
        for (int64_t c = 0; c < pair; c++) {
          const int64_t cols = std::min<int64_t>(GROUP, n - (g + c) * GROUP);
          store_rows(y, res, n, r, rows, (g + c) * GROUP, cols, acc + c * GROUP, 2 * GROUP);
        }
      }
    }
  }
}

}  // namespace

void columns_rows_avx2(int64_t fmt, const uint8_t* wp, int64_t gstride, int64_t nb, const Rows& x, int64_t m,
                       int64_t g0, int64_t g1, float* y, int64_t n, const float* res) {
  if (fmt == Q4_0) columns_rows_t<Q4_0>(wp, gstride, nb, x, m, g0, g1, y, n, res);
  else if (fmt == Q4_1) columns_rows_t<Q4_1>(wp, gstride, nb, x, m, g0, g1, y, n, res);
  else columns_rows_t<Q8_0>(wp, gstride, nb, x, m, g0, g1, y, n, res);
}

void columns_avx2(int64_t fmt, const uint8_t* wp, int64_t gstride, int64_t nb, const Rows& x, int64_t m, int64_t g0,
                  int64_t g1, float* y, int64_t n, const float* res) {
  if (fmt == Q4_0) columns_avx2_t<Q4_0>(wp, gstride, nb, x, m, g0, g1, y, n, res);
  else columns_avx2_t<Q4_1>(wp, gstride, nb, x, m, g0, g1, y, n, res);
}

}  // namespace dflash_blocks
#endif
