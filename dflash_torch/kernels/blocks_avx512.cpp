// The block kernels' AVX-512 paths: VNNI on 512-bit registers and AMX tiles (blocks.cpp has the
// arithmetic they reproduce, the scalar twin, the AVX2 path and the dispatch).

#include "blocks.h"

#include <c10/util/Exception.h>  // TORCH_CHECK only (light, unlike torch/types.h)

#ifdef DFLASH_X86
namespace dflash_blocks {
namespace {

// ---- VNNI on 512-bit registers: 16 columns (two packed groups) per vector ----
// A vector holds chunk j of column groups g and g + 1 (4 values of each of 16 columns), so one dpbusd
// multiplies 16 columns by 4 of the row's values and the block sums come out per column, as on the
// 8-column AVX2 path, with half its instructions. The float step runs 16 columns wide with the operations
// of DFLASH_FLOAT_STEP_AT in the same order, lane for lane, so the bits are every other path's. Up to 8
// rows, or 16, keep their sums in registers across all blocks (16: 16 sums and a block's 8 weight vectors
// fill 24 of the 32 zmm registers, and each block is unpacked once for a 16-row verify pass); other row
// counts go 16 or 8 at a time, each unpacking the pair's blocks again from L1. dpbusd multiplies unsigned by
// signed bytes: the weights are the unsigned operand (Q4's nibbles as they are, Q8_0's as w + 128, once per
// block for all rows) and the activations the signed one, broadcast from memory inside the instruction; each
// row's sum starts at Q4_0's -8 * s or Q8_0's -128 * s, so it ends at the same exact integer as every path's.
#define DFLASH_PAIR(p0, p1, off)                                                                    \
  _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)((p0) + (off)))),     \
                     _mm256_loadu_si256((const __m256i*)((p1) + (off))), 1)

// acc + w (unsigned bytes) . broadcast(*x) (signed bytes), the broadcast folded into dpbusd's memory operand
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i dpbusd512_bcast(__m512i acc, __m512i w,
                                                                                          const int32_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

template <int64_t fmt, int R>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) void vnni_rows(
    const uint8_t* w0, const uint8_t* w1, int64_t nb, const Rows& x, int64_t r0, float* out, int64_t ostride,
    const float* res) {
  const int64_t gb = group_bytes(fmt), qoff = (fmt == Q4_1 ? 4 : 2) * GROUP;
  const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
  const bool in_order = pairs_in_address_order();
  __m512 acc[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* e0 = w0 + b * gb;
    const uint8_t* e1 = w1 + b * gb;
    if (in_order) prefetch_next_pair<false>(w0, b, nb, gb);  // (into L2: the two pairs may not fit L1)
    else prefetch_pair(w0, b, nb, gb);
#define DFLASH_HALVES(off)                                                                          \
  _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(e0 + (off)))), \
                                          _mm_loadu_si128((const __m128i*)(e1 + (off))), 1))
    const __m512 dw = DFLASH_HALVES(0);
    const __m512 mw = fmt == Q4_1 ? DFLASH_HALVES(16) : _mm512_setzero_ps();
#undef DFLASH_HALVES
    const uint8_t* q0 = e0 + qoff;
    const uint8_t* q1 = e1 + qoff;
    __m512i wv[8];
    if (fmt == Q8_0) {
      for (int j = 0; j < 8; j++) wv[j] = _mm512_xor_si512(DFLASH_PAIR(q0, q1, 32 * j), flip);  // w + 128
    } else {
      for (int j = 0; j < 4; j++) {
        const __m512i v = DFLASH_PAIR(q0, q1, 32 * j);
        wv[j] = _mm512_and_si512(v, low);
        wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const int64_t row = r0 + r, at = row * x.nb + b;
      // Two chains of exact integer sums per row (one chain of 8 dpbusd measured slower: its latency
      // shows). The first starts at the correction term (Q4_0's -8 * s, Q8_0's -128 * s), so no shift or
      // subtract follows: the same integer, two instructions fewer per row and block.
      __m512i e = fmt != Q4_1 ? _mm512_set1_epi32(x.s8[at]) : _mm512_setzero_si512(), o = _mm512_setzero_si512();
      const int32_t* x4 = (const int32_t*)(x.q + row * x.k + b * QK);
      for (int j = 0; j < 8; j += 2) {
        e = dpbusd512_bcast(e, wv[j], x4 + j);
        o = dpbusd512_bcast(o, wv[j + 1], x4 + j + 1);
      }
      const __m512i isum = _mm512_add_epi32(e, o);
      const __m512 dd = _mm512_mul_ps(_mm512_set1_ps(x.d[at]), dw);
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), dd));
      if (fmt == Q4_1) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(x.ds[at])));
    }
  }
  // row r's 16 outputs at out + r * ostride, res's (the same layout) added first where there is one: the bits of
  // store_rows, without its copy of each row through a buffer
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    const __m512 v = res != nullptr ? _mm512_add_ps(_mm512_loadu_ps(res + r * ostride), acc[r]) : acc[r];
    _mm512_storeu_ps(out + r * ostride, v);
  }
}
#undef DFLASH_PAIR

// ---- VNNI on 256-bit registers: the AVX2 path's layout, its 8 columns a vector and its float step, with
// the block sums by dpbusd instead of maddubs chains. For a few rows on a CPU that runs 512-bit
// instructions as two halves (AMD Zen 4, `vnni_min_rows` in blocks.cpp): one weight stream and the
// AVX2 path's per-block work, fewer instructions per row. dpbusd multiplies unsigned by signed bytes; the
// activations are the signed operand (broadcast from memory), so Q8_0's weights go in as w + 128 and the sum
// starts at -128 * s, as Q4_0's nibbles go in unsigned and its sum starts at -8 * s: the same exact integers
// as every other path's. From BM_MIN_ROWS rows the activations are block-major (BM; blocks.h, block_at): block b
// of the R rows from one pointer; fewer rows read them row-major, a pointer a row.

// acc + w (unsigned bytes) . broadcast(*x) (signed bytes) by 4-byte groups, the broadcast folded into the
// instruction's memory operand (GCC 12 emits a separate vpbroadcastd for the intrinsic: one instruction more per
// row, chunk and block, in a loop whose time is its instruction count)
__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"), always_inline)) inline __m256i dpbusd_bcast(
    __m256i acc, __m256i w, const int32_t* x) {
  __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// the block-major rows' dpbusd folds the broadcast (dpbusd_bcast); the row-major rows' leaves it to the compiler
// (a vpbroadcastd before the dpbusd): with 1-4 rows their loop has room for it, and Q4_1's 4-row matmuls took
// 1.00-1.12x as long with the broadcast folded (tools/kernel_ab.py, weights from memory)
template <bool BM>
__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"), always_inline)) inline __m256i dpbusd_row(
    __m256i acc, __m256i w, const int32_t* x) {
  if constexpr (BM) return dpbusd_bcast(acc, w, x);
  else return _mm256_dpbusd_epi32(acc, w, _mm256_set1_epi32(*x));
}

template <int64_t fmt, int R, bool BM>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) void vnni256_rows(
    const uint8_t* w, int64_t nb, const Rows& x, int64_t r0, float* out) {
  const int64_t gb = group_bytes(fmt), qoff = (fmt == Q4_1 ? 4 : 2) * GROUP;
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* rec = w + b * gb;
    prefetch_ahead(rec, gb);
    const uint8_t* qs = rec + qoff;
    // BM: rows r0.. are one tile of R rows (rows_vnni256_t): row r0 + r's block b at block_at(b, r0, ..) + r
    const int64_t tile = BM ? block_at(b, r0, x.m, x.nb) : 0;
    auto at = [&](int r) { return BM ? tile + r : (r0 + r) * x.nb + b; };  // row r0 + r's scales' index
    auto x4 = [&](int r) { return (const int32_t*)(x.q + (BM ? (tile + r) * QK : (r0 + r) * x.k + b * QK)); };
    // two chains of exact integer sums per row (one chain's latency shows); Q4_0's first starts at -8 * s, as
    // on the 512-bit path: the same integer, without a shift and a subtract per row and block
    __m256i e[R], o[R];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      e[r] = fmt != Q4_1 ? _mm256_set1_epi32(x.s8[at(r)]) : _mm256_setzero_si256();
      o[r] = _mm256_setzero_si256();
    }
    if (fmt == Q8_0) {
      const __m256i flip = _mm256_set1_epi8((char)0x80);
      #pragma GCC unroll 8
      for (int j = 0; j < 8; j++) {
        const __m256i wj = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(qs + 32 * j)), flip);  // w + 128
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          if (j % 2 == 0) e[r] = dpbusd_row<BM>(e[r], wj, x4(r) + j);
          else o[r] = dpbusd_row<BM>(o[r], wj, x4(r) + j);
        }
      }
    } else {
      #pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          e[r] = dpbusd_row<BM>(e[r], lo, x4(r) + j);
          o[r] = dpbusd_row<BM>(o[r], hi, x4(r) + j + 4);
        }
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec));
    const __m256 mw = fmt == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 16))) : _mm256_setzero_ps();
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)  // the AVX2 path's float step
      acc[r] = float_step8<fmt, true>(acc[r], _mm256_add_epi32(e[r], o[r]), dw, mw, x, at(r));
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) _mm256_storeu_ps(out + GROUP * r, acc[r]);
}

// 3-4 row-major rows against two column groups at once, g (w0) and g + 1 (w1, its records right after g's): each
// broadcast of an activation group feeds both groups' dpbusd, half the activation loads a multiply needs one group
// at a time (those loads, not the multiplies, held 4 rows to 2.4 ns per row and block against 1.9 for 8
// block-major rows: tools/kernel_ab.py --mb 1 --threads 1). Per group the same integers and float steps as
// vnni256_rows. Its loads read two streams, which from DRAM ran at under half the rate of one (--mb 48): the next
// pair's records are prefetched in address order, two records a block, into L1 where the pair and the next fit
// there (L1), else into L2.
template <int64_t fmt, int R, bool L1>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) void vnni256_rows_pair(
    const uint8_t* w0, int64_t nb, const Rows& x, int64_t r0, float* out) {
  const int64_t gb = group_bytes(fmt), qoff = (fmt == Q4_1 ? 4 : 2) * GROUP;
  const uint8_t* w1 = w0 + nb * gb;
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc[2][R];
  #pragma GCC unroll 4
  for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* rec0 = w0 + b * gb;
    const uint8_t* rec1 = w1 + b * gb;
    prefetch_next_pair<L1>(w0, b, nb, gb);
    const uint8_t *qs0 = rec0 + qoff, *qs1 = rec1 + qoff;
    auto x4 = [&](int r) { return (const int32_t*)(x.q + (r0 + r) * x.k + b * QK); };
    // [group][row]: two chains of exact integer sums each; Q4_0's first starts at -8 * s, Q8_0's at -128 * s
    __m256i e[2][R], o[2][R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      e[0][r] = e[1][r] = fmt != Q4_1 ? _mm256_set1_epi32(x.s8[(r0 + r) * x.nb + b]) : _mm256_setzero_si256();
      o[0][r] = o[1][r] = _mm256_setzero_si256();
    }
    if (fmt == Q8_0) {  // (chunks j: even ones into e, odd ones into o)
      const __m256i flip = _mm256_set1_epi8((char)0x80);
      #pragma GCC unroll 8
      for (int j = 0; j < 8; j++) {
        const __m256i a0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(qs0 + 32 * j)), flip);  // w + 128
        const __m256i a1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(qs1 + 32 * j)), flip);
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
          const __m256i xb = _mm256_set1_epi32(x4(r)[j]);
          __m256i* c = j % 2 == 0 ? e[0] : o[0];
          __m256i* d = j % 2 == 0 ? e[1] : o[1];
          c[r] = _mm256_dpbusd_epi32(c[r], a0, xb);
          d[r] = _mm256_dpbusd_epi32(d[r], a1, xb);
        }
      }
    } else {  // (low nibbles into e, high ones into o)
      #pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i*)(qs0 + 32 * j));
        const __m256i v1 = _mm256_loadu_si256((const __m256i*)(qs1 + 32 * j));
        const __m256i lo0 = _mm256_and_si256(v0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
        const __m256i lo1 = _mm256_and_si256(v1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
          const __m256i xl = _mm256_set1_epi32(x4(r)[j]), xh = _mm256_set1_epi32(x4(r)[j + 4]);
          e[0][r] = _mm256_dpbusd_epi32(e[0][r], lo0, xl);
          e[1][r] = _mm256_dpbusd_epi32(e[1][r], lo1, xl);
          o[0][r] = _mm256_dpbusd_epi32(o[0][r], hi0, xh);
          o[1][r] = _mm256_dpbusd_epi32(o[1][r], hi1, xh);
        }
      }
    }
    const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec0));
    const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec1));
    const __m256 mw0 = fmt == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec0 + 16))) : _mm256_setzero_ps();
    const __m256 mw1 = fmt == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec1 + 16))) : _mm256_setzero_ps();
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {  // the AVX2 path's float step, the row's part broadcast once for both groups
      const RowStep8 step = row_step8<fmt, true>(x, (r0 + r) * x.nb + b);
      acc[0][r] = float_step8<fmt, true>(acc[0][r], _mm256_add_epi32(e[0][r], o[0][r]), dw0, mw0, step);
      acc[1][r] = float_step8<fmt, true>(acc[1][r], _mm256_add_epi32(e[1][r], o[1][r]), dw1, mw1, step);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < R; r++) {
    _mm256_storeu_ps(out + 2 * GROUP * r, acc[0][r]);
    _mm256_storeu_ps(out + 2 * GROUP * r + GROUP, acc[1][r]);
  }
}

template <int64_t fmt>
void rows_vnni256_t(const uint8_t* w, int64_t nb, const Rows& x, int64_t r0, int64_t r1, float* acc) {
  // acc [r1 - r0, GROUP]; a tile of 8 rows' sums and a block's weights fit 32 ymm (r0: a multiple of the tile's
  // rows, r1: r0's tile's end or m, so each call below runs one whole tile)
  if (x.m < BM_MIN_ROWS) {  // row-major: one call of the rows (fewer than a tile)
    switch (r1 - r0) {
#define DFLASH_V256_CASE(R) \
  case R: vnni256_rows<fmt, R, false>(w, nb, x, r0, acc); break;
      DFLASH_V256_CASE(1) DFLASH_V256_CASE(2) DFLASH_V256_CASE(3) DFLASH_V256_CASE(4)
#undef DFLASH_V256_CASE
      default: break;
    }
    return;
  }
  for (int64_t r = r0; r < r1; r += 8) {
    float* out = acc + (r - r0) * GROUP;
    switch (std::min<int64_t>(8, r1 - r)) {
#define DFLASH_V256_CASE(R) \
  case R: vnni256_rows<fmt, R, true>(w, nb, x, r, out); break;
      DFLASH_V256_CASE(1) DFLASH_V256_CASE(2) DFLASH_V256_CASE(3) DFLASH_V256_CASE(4)
      DFLASH_V256_CASE(5) DFLASH_V256_CASE(6) DFLASH_V256_CASE(7) DFLASH_V256_CASE(8)
#undef DFLASH_V256_CASE
    }
  }
}

template <int64_t fmt>
void columns_vnni_t(const uint8_t* wp, int64_t gstride, int64_t groups, int64_t nb, const Rows& x, int64_t m,
                    int64_t p0, int64_t p1, float* y, int64_t n, const float* res) {
  thread_local std::vector<uint8_t> zeros;  // stands in for the missing second group of an odd group count
  if (groups % 2) zeros.assign(gstride, 0);
  alignas(64) float acc[16 * 16];
  for (int64_t p = p0; p < p1; p++) {
    const int64_t g0 = 2 * p, cols = std::min<int64_t>(2 * GROUP, n - g0 * GROUP);
    const uint8_t* w0 = wp + g0 * gstride;
    const uint8_t* w1 = g0 + 1 < groups ? w0 + gstride : zeros.data();
    // a whole tile's 16 columns go straight to y; a matrix's last, narrower tile through acc
    const bool whole = cols == 2 * GROUP;
    const int64_t os = whole ? n : 16;
    for (int64_t r0 = 0; r0 < m;) {
      const int64_t rows = m - r0 >= 16 ? 16 : std::min<int64_t>(8, m - r0);
      float* out = whole ? y + r0 * n + g0 * GROUP : acc;
      const float* rs = whole && res != nullptr ? res + r0 * n + g0 * GROUP : nullptr;
      switch (rows) {
#define DFLASH_VNNI_CASE(R) \
  case R: vnni_rows<fmt, R>(w0, w1, nb, x, r0, out, os, rs); break;
        DFLASH_VNNI_CASE(1) DFLASH_VNNI_CASE(2) DFLASH_VNNI_CASE(3) DFLASH_VNNI_CASE(4)
        DFLASH_VNNI_CASE(5) DFLASH_VNNI_CASE(6) DFLASH_VNNI_CASE(7) DFLASH_VNNI_CASE(8)
        DFLASH_VNNI_CASE(16)
#undef DFLASH_VNNI_CASE
      }
      if (!whole) store_rows(y, res, n, r0, rows, g0 * GROUP, cols, acc, 16);
      r0 += rows;
    }
  }
}

#ifdef DFLASH_AMX
// AMX (Sapphire Rapids and later): one TDPBSUD / TDPBSSD multiplies 16 rows by 16 columns over one block
// of 32 values into 16 x 16 exact int32 sums, the same integers the dpbusd lanes produce; the float step
// then runs on 16-column zmm vectors with the same operations, in the same order, as the 8-column paths,
// so every path gives the same bits (tests/test_kernels.py). A tile holds a weight block of two adjacent
// column groups: B's row j is chunk j of group g and of group g + 1, 4 values of each of 16 columns, which
// is the layout TDP* reads; Q4's nibbles are spread to bytes first. Tiles have min(M, 16) rows; past 16
// rows the activations are padded with zero rows to a multiple of 16 (block_mm_impl).
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// one block's tile product: activations of rows r0.. (A) by the column tile's unpacked block (B) into C.
// Q4_0's nibbles are unpacked as signed values nibble - 8, so TDPBSSD yields isum - 8 * sx directly (the
// same integer the other paths compute in two steps); Q4_1's stay unsigned (TDPBSUD), Q8_0 is signed.
#define DFLASH_AMX_TDP(b, ta, tb, tc)                                                             \
  _tile_loadd(ta, x.q + r0 * x.k + (b) * QK, x.k);                                                \
  _tile_loadd(tb, bt + ((b) & t.slots) * 512, 64);                                               \
  _tile_zero(tc);                                                                                 \
  if (fmt == Q4_1) _tile_dpbsud(tc, ta, tb); /* signed activations x unsigned nibbles */          \
  else _tile_dpbssd(tc, ta, tb);             /* signed activations x signed weights */

// the float step of DFLASH_FLOAT_STEP_AT for one block of a 16-column tile, 16 columns wide, for R rows
// whose sums stay in registers across the blocks (R a constant: the loop unrolls onto zmm registers)
template <int64_t fmt, int R>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"))) inline void amx_scale(
    const Rows& x, int64_t r0, int64_t b, const int32_t* c, const float* dws, const float* mws, __m512* acc) {
  const __m512 dw = _mm512_loadu_ps(dws + 16 * b);
  const __m512 mw = fmt == Q4_1 ? _mm512_loadu_ps(mws + 16 * b) : _mm512_setzero_ps();
  const float* dx = x.d + r0 * x.nb + b;
  const float* dsx = x.ds + r0 * x.nb + b;
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    const __m512 dd = _mm512_mul_ps(_mm512_set1_ps(dx[r * x.nb]), dw);
    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)), dd));
    if (fmt == Q4_1) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(dsx[r * x.nb])));
  }
}

// The weights of one 16-column tile (column groups g and g + 1), unpacked block by block into B's layout.
struct AmxTile {
  const uint8_t* w0;  // group g's records
  const uint8_t* w1;  // group g + 1's, or zeros where the matrix has no such group (its columns are unused)
  uint8_t* bt;        // [nb or slots + 1, 8, 64] bytes: B's rows for each block (block b in row b & slots)
  int64_t slots;      // all ones where later row tiles reuse every block; else 15, a ring of 16 blocks
  float* dws;         // [nb, 16] weight scales
  float* mws;         // [nb, 16] Q4_1 minimums
  int64_t nb;         // blocks per column group
};

// unpack block b: the 16 columns' scales (and minimums) to floats, Q4's nibbles spread to bytes (Q4_0:
// nibble - 8, a signed byte)
template <int64_t fmt>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"), always_inline)) inline void amx_unpack(
    const AmxTile& t, int64_t b) {
  const int64_t gb = group_bytes(fmt), qoff = (fmt == Q4_1 ? 4 : 2) * GROUP;
  const uint8_t* e0 = t.w0 + b * gb;
  const uint8_t* e1 = t.w1 + b * gb;
  prefetch_pair(t.w0, b, t.nb, gb);
  const __m128i h0 = _mm_loadu_si128((const __m128i*)e0);
  const __m128i h1 = _mm_loadu_si128((const __m128i*)e1);
  _mm512_store_ps(t.dws + 16 * b, _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1)));
  if (fmt == Q4_1) {
    const __m128i m0 = _mm_loadu_si128((const __m128i*)(e0 + 16));
    const __m128i m1 = _mm_loadu_si128((const __m128i*)(e1 + 16));
    _mm512_store_ps(t.mws + 16 * b, _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(m0), m1, 1)));
  }
  const uint8_t* q0 = e0 + qoff;
  const uint8_t* q1 = e1 + qoff;
  uint8_t* bb = t.bt + 512 * (b & t.slots);
  // B's row j: chunk j of both groups, one 64-byte store
#define DFLASH_BOTH(off)                                                                  \
  _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(q0 + (off)))), \
                     _mm256_loadu_si256((const __m256i*)(q1 + (off))), 1)
  if (fmt == Q8_0) {
    for (int j = 0; j < 8; j++) _mm512_store_si512((__m512i*)(bb + 64 * j), DFLASH_BOTH(32 * j));
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(fmt == Q4_0 ? 8 : 0);
  for (int j = 0; j < 4; j++) {
    const __m512i v = DFLASH_BOTH(32 * j);
    _mm512_store_si512((__m512i*)(bb + 64 * j), _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
    _mm512_store_si512((__m512i*)(bb + 64 * (j + 4)),
                       _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight));
  }
#undef DFLASH_BOTH
}

// one tile of R rows x 16 columns over all blocks, in block order; the sums into out [R, 16]. With
// unpack, each block is unpacked just before its product, so that the unpacking (loads from memory)
// overlaps the tile instructions' latency; later row tiles of the call reuse the unpacked blocks.
template <int64_t fmt, int R>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8"))) void amx_rows(
    const Rows& x, int64_t r0, int64_t nb, const AmxTile& t, bool unpack, float* out) {
  alignas(64) int32_t ct[2][16 * 16];
  const uint8_t* bt = t.bt;
  __m512 acc[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  constexpr int64_t ahead = 6;  // blocks unpacked ahead of their product: the stores settle before tile loads
  if (unpack)
    for (int64_t b = 0; b < std::min(ahead, nb); b++) amx_unpack<fmt>(t, b);
  DFLASH_AMX_TDP(0, 0, 1, 2)
  for (int64_t b = 0; b < nb; b += 2) {  // two tile sets: one block's product runs while the other's is scaled
    if (unpack && b + ahead < nb) amx_unpack<fmt>(t, b + ahead);
    if (unpack && b + ahead + 1 < nb) amx_unpack<fmt>(t, b + ahead + 1);
    if (b + 1 < nb) {
      DFLASH_AMX_TDP(b + 1, 3, 4, 5)
    }
    _tile_stored(2, ct[0], 64);
    if (b + 2 < nb) {
      DFLASH_AMX_TDP(b + 2, 0, 1, 2)
    }
    amx_scale<fmt, R>(x, r0, b, ct[0], t.dws, t.mws, acc);
    if (b + 1 < nb) {
      _tile_stored(5, ct[1], 64);
      amx_scale<fmt, R>(x, r0, b + 1, ct[1], t.dws, t.mws, acc);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) _mm512_store_ps(out + 16 * r, acc[r]);
}

template <int64_t fmt>
void amx_rows_n(int64_t rows, const Rows& x, int64_t r0, int64_t nb, const AmxTile& t, bool unpack, float* out) {
  switch (rows) {
#define DFLASH_AMX_ROWS_CASE(R) \
  case R: amx_rows<fmt, R>(x, r0, nb, t, unpack, out); break;
    DFLASH_AMX_ROWS_CASE(1) DFLASH_AMX_ROWS_CASE(2) DFLASH_AMX_ROWS_CASE(3) DFLASH_AMX_ROWS_CASE(4)
    DFLASH_AMX_ROWS_CASE(5) DFLASH_AMX_ROWS_CASE(6) DFLASH_AMX_ROWS_CASE(7) DFLASH_AMX_ROWS_CASE(8)
    DFLASH_AMX_ROWS_CASE(9) DFLASH_AMX_ROWS_CASE(10) DFLASH_AMX_ROWS_CASE(11) DFLASH_AMX_ROWS_CASE(12)
    DFLASH_AMX_ROWS_CASE(13) DFLASH_AMX_ROWS_CASE(14) DFLASH_AMX_ROWS_CASE(15) DFLASH_AMX_ROWS_CASE(16)
#undef DFLASH_AMX_ROWS_CASE
    default: TORCH_CHECK(false, "an AMX tile has 1 to 16 rows");
  }
}

template <int64_t fmt>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8"))) void columns_amx_t(
    const uint8_t* wp, int64_t gstride, int64_t groups, int64_t nb, const Rows& x, int64_t m, int64_t t0,
    int64_t t1, float* y, int64_t n, const float* res) {
  // tiles of tr = min(M, 16) rows (a tile op's time grows with its rows); M > 16 is padded to 16s
  const int64_t tr = std::min<int64_t>(m, 16);
  TileConfig cfg;  // two sets of (A, B, C), so that one block's product runs while the other's is scaled
  for (int set = 0; set < 2; set++) {
    cfg.colsb[3 * set] = 32, cfg.rows[3 * set] = tr;          // A: tr rows x one block of activation quants
    cfg.colsb[3 * set + 1] = 64, cfg.rows[3 * set + 1] = 8;   // B: 8 chunks of 4 values x 16 columns
    cfg.colsb[3 * set + 2] = 64, cfg.rows[3 * set + 2] = tr;  // C: tr rows x 16 int32 block sums
  }
  _tile_loadconfig(&cfg);
  thread_local std::vector<uint8_t> buf;  // the column tile's blocks, unpacked, and their scales
  buf.resize(nb * (512 + 128) + 64);
  uint8_t* bt = (uint8_t*)(((uintptr_t)buf.data() + 63) & ~(uintptr_t)63);
  float* dws = (float*)(bt + 512 * nb);
  // one row tile (M <= 16) uses each unpacked block once: a ring of 16 (8 KB) instead of all nb blocks keeps
  // L1 for the activations (K = 1536: 24 KB of them and as many of unpacked blocks overflowed its 48 KB)
  const int64_t slots = m > tr ? ~(int64_t)0 : 15;
  thread_local std::vector<uint8_t> zeros;  // stands in for the missing second group of an odd group count
  zeros.assign(gstride, 0);
  alignas(64) float acc[16 * 16];
  for (int64_t t = t0; t < t1; t++) {  // a tile of 16 output columns: groups 2t and 2t + 1
    const int64_t g0 = 2 * t, cols = std::min<int64_t>(2 * GROUP, n - g0 * GROUP);
    const AmxTile tile{wp + g0 * gstride, g0 + 1 < groups ? wp + (g0 + 1) * gstride : zeros.data(), bt, slots,
                       dws, dws + 16 * nb, nb};
    for (int64_t r0 = 0; r0 < m; r0 += tr) {
      const int64_t rows = std::min<int64_t>(tr, m - r0);
      amx_rows_n<fmt>(rows, x, r0, nb, tile, r0 == 0, acc);
      store_rows(y, res, n, r0, rows, g0 * GROUP, cols, acc, 16);
    }
  }
  _tile_release();
}
#endif  // DFLASH_AMX

}  // namespace

void columns_vnni(int64_t fmt, const uint8_t* wp, int64_t gstride, int64_t groups, int64_t nb, const Rows& x,
                  int64_t m, int64_t p0, int64_t p1, float* y, int64_t n, const float* res) {
  if (fmt == Q4_0) columns_vnni_t<Q4_0>(wp, gstride, groups, nb, x, m, p0, p1, y, n, res);
  else if (fmt == Q4_1) columns_vnni_t<Q4_1>(wp, gstride, groups, nb, x, m, p0, p1, y, n, res);
  else columns_vnni_t<Q8_0>(wp, gstride, groups, nb, x, m, p0, p1, y, n, res);
}

void rows_vnni256_pair(int64_t fmt, const uint8_t* w, int64_t nb, const Rows& x, int64_t r0, int64_t r1,
                       float* acc) {
  // the next pair prefetched into L1 where it fits there beside this one (16 KB for the two), else into L2
  const bool l1 = 4 * nb * group_bytes(fmt) <= 16 * 1024;
#define DFLASH_PAIR(F)                                                                      \
  if (r1 - r0 == 3) (l1 ? vnni256_rows_pair<F, 3, true> : vnni256_rows_pair<F, 3, false>)(w, nb, x, r0, acc); \
  else (l1 ? vnni256_rows_pair<F, 4, true> : vnni256_rows_pair<F, 4, false>)(w, nb, x, r0, acc);
  if (fmt == Q4_0) {
    DFLASH_PAIR(Q4_0)
  } else if (fmt == Q4_1) {
    DFLASH_PAIR(Q4_1)
  } else {
    DFLASH_PAIR(Q8_0)
  }
#undef DFLASH_PAIR
}

void rows_vnni256(int64_t fmt, const uint8_t* w, int64_t nb, const Rows& x, int64_t r0, int64_t r1, float* acc) {
  if (fmt == Q4_0) rows_vnni256_t<Q4_0>(w, nb, x, r0, r1, acc);
  else if (fmt == Q4_1) rows_vnni256_t<Q4_1>(w, nb, x, r0, r1, acc);
  else rows_vnni256_t<Q8_0>(w, nb, x, r0, r1, acc);
}

#ifdef DFLASH_AMX
void columns_amx(int64_t fmt, const uint8_t* wp, int64_t gstride, int64_t groups, int64_t nb, const Rows& x,
                 int64_t m, int64_t t0, int64_t t1, float* y, int64_t n, const float* res) {
  if (fmt == Q4_0) columns_amx_t<Q4_0>(wp, gstride, groups, nb, x, m, t0, t1, y, n, res);
  else if (fmt == Q4_1) columns_amx_t<Q4_1>(wp, gstride, groups, nb, x, m, t0, t1, y, n, res);
  else columns_amx_t<Q8_0>(wp, gstride, groups, nb, x, m, t0, t1, y, n, res);
}

bool amx_usable() {  // the CPU has AMX-TILE and AMX-INT8, and Linux grants this process the tile state
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}
#endif  // DFLASH_AMX

}  // namespace dflash_blocks
#endif  // DFLASH_X86
