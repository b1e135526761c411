// What blocks.cpp (activations, scalar twin, AVX2, dispatch) and blocks_avx512.cpp (VNNI on 512-bit
// registers, AMX tiles) share: the block formats, the packed record layout and the quantized rows.
#pragma once

// Plain C++ and intrinsics only: the SIMD files that include this need none of torch's headers, whose
// parsing took most of each file's build (the op bindings in blocks.cpp include them).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DFLASH_X86 1
#if defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DFLASH_AMX 1  // a compiler with AMX intrinsics, and Linux's way of asking for the tile registers
#endif
#endif

namespace dflash_blocks {

enum Format : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
constexpr int QK = 32;    // values per block
constexpr int GROUP = 8;  // output columns per packed group
constexpr int TILE_ROWS = 64;  // rows a column group takes before the next (a prefill's quants stay in L2)

inline int64_t group_bytes(int64_t fmt) {  // bytes of one (group, block) record
  return fmt == Q4_0 ? 2 * GROUP + 16 * GROUP : fmt == Q4_1 ? 4 * GROUP + 16 * GROUP : 2 * GROUP + 32 * GROUP;
}

inline int64_t packed_bytes(int64_t fmt, int64_t n, int64_t k) {  // an n x k matrix's packed records
  return (n + GROUP - 1) / GROUP * (k / QK) * group_bytes(fmt);
}

struct Rows {  // quantized activations of the rows of one call
  const int8_t* q;   // [rows, K]
  const float* d;    // [rows, nb]
  const int32_t* s;  // [rows, nb]
  const float* ds;   // [rows, nb]: d * float(s), Q4_1's minimum term
  const int32_t* s8; // [rows, nb]: where a VNNI sum starts (else null): Q4_0's correction -8 * s, Q8_0's
                     // -128 * s (its weights taken as w + 128)
  int64_t k, nb;
  int64_t m;  // the call's rows; on the 256-bit VNNI rows the arrays above are block-major (block_at)
};

// From BM_MIN_ROWS rows the 256-bit VNNI rows (rows_vnni256) read the activations block-major in tiles of 8 rows,
// the rows they run together: tile r / 8 holds its rows' blocks in block order, block b's rows side by side (q: 32
// bytes a row; d, s, ds, s8: one value a row), so a kernel reaches a block's rows from one pointer with constant
// offsets, and the next block a constant stride on. Row-major ([r * K + b * QK], [r * nb + b]), each row's own
// pointer, left fewer registers than 8 rows need: the addresses were spilled to the stack and reloaded every block.
// Which thread writes which part of a tile: quantize_share. Fewer rows stay row-major: their few pointers fit the
// registers, and 2-4 rows in a shared tile ran the small matrices slower (tools/kernel_ab.py, weights from
// memory). Every other path reads row-major. (On AMD Zen 4 the 512-bit path takes 5 rows and more by default
// (vnni_min_rows): the block-major rows run where DFLASH_VNNI_MIN_ROWS sends more rows to the 256-bit ones.)
constexpr int64_t BM_TILE = 8, BM_MIN_ROWS = 5;
static_assert(TILE_ROWS % BM_TILE == 0, "the narrow path's row tiles start on block-major tiles");
inline int64_t block_at(int64_t b, int64_t r, int64_t m, int64_t nb) {  // index of row r's block b
  const int64_t t0 = r / BM_TILE * BM_TILE;  // the tile's first row
  return t0 * nb + b * std::min(BM_TILE, m - t0) + (r - t0);
}

// rows [r0, r0 + rows), columns [c0, c0 + cols) of y [., n] from a tile's sums acc [rows, stride]; with res,
// each output is res + sum (as `r + y` would be)
inline void store_rows(float* y, const float* res, int64_t n, int64_t r0, int64_t rows, int64_t c0, int64_t cols,
                       const float* acc, int64_t stride) {
  for (int64_t r = 0; r < rows; r++) {
    float* out = y + (r0 + r) * n + c0;
    const float* a = acc + r * stride;
    if (res != nullptr) {
      const float* rr = res + (r0 + r) * n + c0;
      for (int64_t c = 0; c < cols; c++) out[c] = rr[c] + a[c];
    } else if (cols == GROUP) {
      std::memcpy(out, a, sizeof(float) * GROUP);  // a constant size: inlined, where a call took longer than the copy
    } else if (cols == 2 * GROUP) {
      std::memcpy(out, a, sizeof(float) * 2 * GROUP);
    } else {
      std::memcpy(out, a, sizeof(float) * cols);
    }
  }
}

#ifdef DFLASH_X86
// Weights are prefetched PF blocks ahead on each stream a path reads: the hardware prefetcher alone left a
// decode step's matmuls 10-45% short of this (tools/kernel_ab.py --mb 400, weights from memory).
constexpr int64_t PF = 32;

inline void prefetch_ahead(const uint8_t* rec, int64_t gb) {  // the record PF blocks after rec (gb bytes each)
  for (int64_t off = PF * gb; off < (PF + 1) * gb; off += 64) _mm_prefetch((const char*)(rec + off), _MM_HINT_T0);
}

// Prefetch for block b of a pair of column groups whose records lie one after the other from w0 (group g's nb
// records, then group g + 1's; the next pair's after them): each group's stream PF blocks ahead, and where that
// passes the end of its group, the same block of the next pair's group. Each stream's plain PF ahead
// (prefetch_ahead) ran into the other group's records once nb > PF, so the second group's first PF blocks were
// never fetched ahead of their loads (inputs over 1,024: the default model's down projection, every matrix of
// larger models; docs/performance.md, "What is left in the kernels on AMD Zen 4"). With nb <= PF both ways fetch
// the same records.
__attribute__((always_inline)) inline void prefetch_pair(const uint8_t* w0, int64_t b, int64_t nb, int64_t gb) {
  if (nb <= PF) {
    prefetch_ahead(w0 + b * gb, gb);
    prefetch_ahead(w0 + (nb + b) * gb, gb);
    return;
  }
  // b < nb and PF < nb here, so b + PF lies in this pair's group or in the next pair's (no division per block)
  const int64_t v = b + PF, at = v < nb ? v : nb + v;  // records from w0: this pair's block v, or the next's v - nb
  const uint8_t* a0 = w0 + at * gb;                    // group g's stream (or the next pair's first group)
  const uint8_t* a1 = a0 + nb * gb;                    // group g + 1's
  for (int64_t off = 0; off < gb; off += 64) {
    _mm_prefetch((const char*)(a0 + off), _MM_HINT_T0);
    _mm_prefetch((const char*)(a1 + off), _MM_HINT_T0);
  }
}

// Prefetch for block b of a pair of column groups whose records lie one after the other from w0 (as prefetch_pair):
// the next pair's records in address order, two records' bytes a block, so that DRAM serves one stream where the
// pair's loads read two (on AMD Zen 4 two streams came at under half the rate of one: docs/performance.md, "Two
// column groups for 3-4 rows"). L1: into L1, else into L2 (where this pair and the next do not fit L1).
template <bool L1>
__attribute__((always_inline)) inline void prefetch_next_pair(const uint8_t* w0, int64_t b, int64_t nb, int64_t gb) {
  const uint8_t* next = w0 + 2 * nb * gb;
  for (int64_t off = 2 * b * gb; off < 2 * (b + 1) * gb; off += 64) {
    if constexpr (L1) _mm_prefetch((const char*)(next + off), _MM_HINT_T0);
    else _mm_prefetch((const char*)(next + off), _MM_HINT_T1);
  }
}

// One row's float step for one block on 8 columns (the AVX2 rows and the 256-bit VNNI rows share it), the
// operations of DFLASH_FLOAT_STEP_AT in its order: acc + float(isum [- 8 s]) * (d_x * d_w) [+ m_w * (d_x s_x)].
// dw, mw: the block's weight scales and Q4_1 minimums, widened; at: the row's block index into x.d / s / ds.
// started: Q4_0's sum already holds the - 8 s (its chain started there), the same integer.
// RowStep8: a row's part of it, broadcast once for all the column groups a kernel runs that row against.
struct RowStep8 {
  __m256 d, ds;  // d_x, d_x s_x (Q4_1)
  __m256i s8;    // 8 s (Q4_0)
};

template <int64_t fmt, bool started = false>
__attribute__((target("avx2,fma,f16c"))) inline RowStep8 row_step8(const Rows& x, int64_t at) {
  RowStep8 r;
  r.d = _mm256_set1_ps(x.d[at]);
  r.ds = fmt == Q4_1 ? _mm256_set1_ps(x.ds[at]) : _mm256_setzero_ps();
  r.s8 = fmt == Q4_0 && !started ? _mm256_slli_epi32(_mm256_set1_epi32(x.s[at]), 3) : _mm256_setzero_si256();
  return r;
}

template <int64_t fmt, bool started = false>
__attribute__((target("avx2,fma,f16c"))) inline __m256 float_step8(__m256 acc, __m256i isum, __m256 dw, __m256 mw,
                                                                   const RowStep8& x) {
  if (fmt == Q4_0 && !started) isum = _mm256_sub_epi32(isum, x.s8);
  const __m256 dd = _mm256_mul_ps(x.d, dw);
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), dd));
  if (fmt == Q4_1) acc = _mm256_add_ps(acc, _mm256_mul_ps(mw, x.ds));
  return acc;
}

template <int64_t fmt, bool started = false>
__attribute__((target("avx2,fma,f16c"))) inline __m256 float_step8(__m256 acc, __m256i isum, __m256 dw, __m256 mw,
                                                                   const Rows& x, int64_t at) {
  return float_step8<fmt, started>(acc, isum, dw, mw, row_step8<fmt, started>(x, at));
}
#endif

// Threads split pairs of column groups [p0, p1) (16 output columns each); y [m, n] (+ res [m, n]).
#ifdef DFLASH_X86
// blocks_avx2.cpp: column groups [g0, g1) for all m rows into y (+ res): 4 rows per pass over a group, their
// float sums in registers (columns_rows_avx2); or Q4 in strips of 4 rows x 2 groups (columns_avx2)
void columns_rows_avx2(int64_t fmt, const uint8_t* wp, int64_t gstride, int64_t nb, const Rows& x, int64_t m,
                       int64_t g0, int64_t g1, float* y, int64_t n, const float* res);
void columns_avx2(int64_t fmt, const uint8_t* wp, int64_t gstride, int64_t nb, const Rows& x, int64_t m, int64_t g0,
                  int64_t g1, float* y, int64_t n, const float* res);
void columns_vnni(int64_t fmt, const uint8_t* wp, int64_t gstride, int64_t groups, int64_t nb, const Rows& x,
                  int64_t m, int64_t p0, int64_t p1, float* y, int64_t n, const float* res);
// one 8-column group's sums for rows [r0, r1) into acc [r1 - r0, GROUP], VNNI on 256-bit registers
void rows_vnni256(int64_t fmt, const uint8_t* w, int64_t nb, const Rows& x, int64_t r0, int64_t r1, float* acc);
// whether the 512-bit path prefetches the next pair of column groups' records in address order (AMD Zen 4, where
// DRAM served its two streams at under half the rate of one) or each group's stream on its own (blocks.cpp)
bool pairs_in_address_order();
// the same for groups g (w) and g + 1 (its records after g's) at once into acc [r1 - r0, 2 * GROUP]: 3-4
// row-major rows
void rows_vnni256_pair(int64_t fmt, const uint8_t* w, int64_t nb, const Rows& x, int64_t r0, int64_t r1,
                       float* acc);
#endif
#ifdef DFLASH_AMX
void columns_amx(int64_t fmt, const uint8_t* wp, int64_t gstride, int64_t groups, int64_t nb, const Rows& x,
                 int64_t m, int64_t t0, int64_t t1, float* y, int64_t n, const float* res);
bool amx_usable();
#endif

// One block matmul, for callers that run its two steps inside their own parallel region (block_mm itself,
// and layers.cpp's decode stack): `mm_setup` on the calling thread, `mm_quantize` on row ranges, a barrier,
// then `mm_columns` on the threads' shares of `units` (ColumnShare below). Every row and column is computed alike
// however the ranges fall, so the bits are block_mm's.
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, VNNI = 2, AMX = 3 };

struct MmScratch {  // the activations' quants and scales, reused across calls
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> s, s8;
};

struct MmCall {
  int64_t fmt, isa;
  bool amx, wide, narrow;  // narrow: a few rows of a VNNI CPU on 256-bit registers (rows_vnni256)
  bool block_major;        // the activations block-major (block_at): the 256-bit rows, from BM_MIN_ROWS rows
  int64_t m, n, k, nb, groups, gstride, units;
  const uint8_t* wp;
  const float* x;       // [m, k] float32
  const float* norm_w;  // RMSNorm weight [k] applied to each row before its quantization, or null
  float eps;
  float* y;             // [m, n]
  const float* res;     // [m, n] added to each output, or null
  int8_t* q;
  float *d, *ds;
  int32_t *s, *s8;
};

// isa: resolved (resolve_isa); asked: the caller named it (then AMX whatever the rows). prepare: size the scratch
// and clear AMX's padding rows; without it, only c is set (each thread of a region its own copy of the call, the
// scratch sized for it beforehand and its padding cleared by one thread)
void mm_setup(MmCall& c, MmScratch& scratch, int64_t fmt, int64_t isa, bool asked, const uint8_t* wp, int64_t n,
              int64_t k, int64_t m, const float* x, const float* norm_w, float eps, float* y, const float* res,
              bool prepare = true);
void mm_quantize(const MmCall& c, int64_t r0, int64_t r1, int64_t b0 = 0, int64_t b1 = -1);
void mm_columns(const MmCall& c, int64_t u0, int64_t u1);
int64_t resolve_isa(int64_t isa);  // -1: the best this CPU has
int64_t rows_by_thread();  // from this many rows layers.cpp's rows_region runs by rows (0: never)

inline std::pair<int64_t, int64_t> even_share(int64_t total, int64_t tid, int64_t nth) {  // [begin, end) of tid
  const int64_t per = (total + nth - 1) / nth, begin = std::min(total, tid * per);
  return {begin, std::min(total, begin + per)};
}

// What thread tid quantizes: rows [r0, r1), their blocks [b0, b1) (b1 < 0: all). Row-major activations: its even
// share of the rows. Block-major: its even share of whole tiles, so that no two threads write one tile (a tile's
// scales share cache lines; with a tile's rows split between the threads the down projection ran slower at 5-8
// rows, tools/kernel_ab.py); with fewer tiles than threads (up to 8 rows on two) every row and an even share of the
// blocks, each thread writing its own stretch of the tile, which one thread alone had quantized.
struct QuantShare {
  int64_t r0, r1, b0, b1;
};
inline QuantShare quantize_share(const MmCall& c, int64_t tid, int64_t nth) {
  if (!c.block_major) {
    const auto [r0, r1] = even_share(c.m, tid, nth);
    return {r0, r1, 0, -1};
  }
  const int64_t tiles = (c.m + BM_TILE - 1) / BM_TILE;
  if (tiles < nth) {
    const auto [b0, b1] = even_share(c.nb, tid, nth);
    return {0, c.m, b0, b1};
  }
  const auto [t0, t1] = even_share(tiles, tid, nth);
  return {std::min(c.m, t0 * BM_TILE), std::min(c.m, t1 * BM_TILE), 0, -1};
}

// A matmul's columns shared out as the threads go: each thread takes chunks of its even share from the front, in
// order, then chunks from the back of the other threads' shares. With cores running alike that is the even share,
// each thread's chunks one stream; where one core runs slower for a while (another process on it, the hypervisor)
// the others take the rest of its share instead of waiting for it at the barrier. Every column is computed alike
// whichever thread takes it, so the bits are the even share's.
class ColumnShare {
 public:
  // on one thread, before the barrier that precedes `run` (the previous `run` over: past its barrier)
  void reset(int64_t units, int64_t nth);
  void run(const MmCall& c, int64_t tid);  // on every thread of the region, then a barrier
 private:
  static constexpr int64_t MAX_THREADS = 256;  // past this, the even share
  // thread t's chunks not yet taken: front << 32 | back, each on its own cache line (side by side, every chunk a
  // thread took from its own front moved the line away from the other cores, and it back)
  struct alignas(64) Left {
    std::atomic<uint64_t> v;
  };
  Left left_[MAX_THREADS];
  int64_t nth_ = 1, chunk_ = 1, units_ = 0;
};

}  // namespace dflash_blocks
