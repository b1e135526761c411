// Block-quantized matmul for CPUs: y[M, N] = x[M, K] @ W^T, W in GGUF's Q4_0 / Q4_1 / Q8_0 blocks of
// 32 values, x quantized per row into 8-bit blocks of 32 with one float scale each (q8_0 activations).
//
// Why it exists: verifying a drafted block runs the target on 2-16 rows at once, and lossless greedy
// decoding needs each row's result to be the same whether it is computed alone (a decode step) or among
// other rows (a verify pass). Every row here is computed by the same sequence of operations whatever the
// number of rows: its activations are quantized from its own values only, each block's dot product is
// an exact integer, and the float sum over blocks runs in block order with separate (unfused) multiplies
// and adds:
//
//     acc = 0;  for b in blocks:  acc = acc + float(isum_b) * (dx_b * dw_b)      [Q4_1: + mw_b * (dx_b * sx_b)]
//
// where isum_b is sum(qx * qw) over the block (Q4_0: qw = nibble - 8), sx_b = sum(qx). The AVX2, the
// VNNI, the AMX and the scalar paths compute exactly these operations, so they agree bit for bit with each other
// and with the PyTorch reference (reference.py); tests/test_kernels.py checks it. The file is compiled
// with -ffp-contract=off so that no multiply-add is fused behind our back.
//
// Weights are repacked once (pack.py) from GGUF's block rows into groups of 8 output columns: for each
// group and block, the 8 fp16 scales (Q4_1: then the 8 fp16 minimums), then the 8 columns' quant bytes
// exactly as GGUF stores them (Q4: 16 bytes, value j in the low nibble of byte j and j + 16 in its
// high nibble; Q8: 32 signed bytes), reordered in chunks of 4 bytes so that one 32-byte load holds 4
// values of each of the 8 columns. The scalar twin unpacks each weight block once per call for up to
// TILE_ROWS rows; the AVX2 paths (blocks_avx2.cpp) once per strip of 4 rows; threads split the column
// groups. The 512-bit VNNI path and the AMX path (blocks_avx512.cpp) take two groups (16 columns) per
// vector or tile.

#include "blocks.h"

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>
#include <torch/types.h>

#include <utility>

namespace dflash_norm {
void norm_row(const float* x, const float* w, int64_t n, float eps, float* y);  // norm.cpp
}

namespace {

using namespace dflash_blocks;

inline float half_to_float(uint16_t h) {  // exact
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; exp--; }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- activations: one row's blocks -> int8 quants, a float scale and the quants' sum per block ----

void quantize_row_scalar(const float* x, int64_t k, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < k / QK; b++) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int i = 0; i < QK; i++) amax = std::fmax(amax, std::fabs(xb[i]));
    const float db = amax / 127.f;
    const float id = db != 0.f ? 1.f / db : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < QK; i++) {
      float v = std::nearbyint(xb[i] * id);  // round half to even, as the vector paths and torch.round
      v = std::fmin(127.f, std::fmax(-127.f, v));
      q[b * QK + i] = (int8_t)v;
      sum += (int32_t)v;
    }
    d[b] = db;
    s[b] = sum;
  }
}

#ifdef DFLASH_X86
// 8 vectors' horizontal reductions at once: lane i of the result is vector i's 8 lanes combined (max, or an
// integer add through the float shuffles' bit patterns). Both are exact in any order, so a block's maximum and
// sum are the per-block reductions' own.
template <bool MAX>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 combine(__m256 a, __m256 b) {
  if constexpr (MAX) return _mm256_max_ps(a, b);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
}
template <bool MAX>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 reduce8(const __m256* v) {
  __m256 p[4], h[2];
  for (int i = 0; i < 4; i++)  // pairs: [a01 a23 b01 b23 | a45 a67 b45 b67]
    p[i] = combine<MAX>(_mm256_shuffle_ps(v[2 * i], v[2 * i + 1], 0x88),
                        _mm256_shuffle_ps(v[2 * i], v[2 * i + 1], 0xdd));
  for (int i = 0; i < 2; i++)  // quads: [a b c d | a b c d], each a half's
    h[i] = combine<MAX>(_mm256_shuffle_ps(p[2 * i], p[2 * i + 1], 0x88),
                        _mm256_shuffle_ps(p[2 * i], p[2 * i + 1], 0xdd));
  return combine<MAX>(_mm256_permute2f128_ps(h[0], h[1], 0x20), _mm256_permute2f128_ps(h[0], h[1], 0x31));
}

// quantize_row_scalar's operations on 8 blocks at a time: their maxima reduced together and their scales
// divided by one vector instruction each (IEEE division rounds alike in any width), the quants as before, the
// sums reduced together. Also writes ds = d * s (rounded once) and, where s8 is given, s8mul * s: from
// registers, where a separate loop over d and s just stored would wait on store forwarding.
__attribute__((target("avx2,fma,f16c"))) void quantize_row_avx2(const float* x, int64_t k, int8_t* q, float* d,
                                                                int32_t* s, float* ds, int32_t* s8, int32_t s8mul) {
  const __m256 sign = _mm256_set1_ps(-0.f), lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t nb = k / QK;
  for (int64_t g = 0; g < nb; g += 8) {
    const int n = (int)std::min<int64_t>(8, nb - g);
    __m256 m[8];
    for (int i = 0; i < 8; i++) {
      m[i] = _mm256_setzero_ps();
      if (i < n)
        for (int j = 0; j < 4; j++)
          m[i] = _mm256_max_ps(m[i], _mm256_andnot_ps(sign, _mm256_loadu_ps(x + (g + i) * QK + 8 * j)));
    }
    const __m256 amax = reduce8<true>(m);
    const __m256 db = _mm256_div_ps(amax, lim);
    const __m256 id = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.f), db),  // 0 where db is 0 (db != 0.f)
                                    _mm256_cmp_ps(db, _mm256_setzero_ps(), _CMP_NEQ_UQ));
    alignas(32) float ids[8];
    _mm256_store_ps(ids, id);
    __m256 acc[8];
    for (int i = 0; i < 8; i++) {
      __m256i sum = _mm256_setzero_si256(), iv[4];
      if (i < n) {
        const float* xb = x + (g + i) * QK;
        const __m256 idv = _mm256_set1_ps(ids[i]);
        for (int j = 0; j < 4; j++) {
          __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), idv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          r = _mm256_min_ps(lim, _mm256_max_ps(nlim, r));
          iv[j] = _mm256_cvtps_epi32(r);
          sum = _mm256_add_epi32(sum, iv[j]);
        }
        // the 32 values (all within [-127, 127], so the saturating packs are exact) to bytes in one store: the
        // packs interleave 128-bit lanes, dwords [v0 0-3, v1 0-3, v2 0-3, v3 0-3, v0 4-7, ...], and the
        // permutation restores the order (a byte-by-byte copy cost more than the rest of the block)
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256((__m256i*)(q + (g + i) * QK), _mm256_permutevar8x32_epi32(bytes, order));
      }
      acc[i] = _mm256_castsi256_ps(sum);
    }
    const __m256i sums = _mm256_castps_si256(reduce8<false>(acc));
    const __m256 dsv = _mm256_mul_ps(db, _mm256_cvtepi32_ps(sums));
    const __m256i s8v = _mm256_mullo_epi32(sums, _mm256_set1_epi32(s8mul));
    if (n == 8) {
      _mm256_storeu_ps(d + g, db);
      _mm256_storeu_si256((__m256i*)(s + g), sums);
      _mm256_storeu_ps(ds + g, dsv);
      if (s8 != nullptr) _mm256_storeu_si256((__m256i*)(s8 + g), s8v);
    } else {
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      _mm256_maskstore_ps(d + g, mask, db);
      _mm256_maskstore_epi32(s + g, mask, sums);
      _mm256_maskstore_ps(ds + g, mask, dsv);
      if (s8 != nullptr) _mm256_maskstore_epi32(s8 + g, mask, s8v);
    }
  }
}
#endif

// ---- the scalar twin: exact integer block sums, then the float steps of the vector paths ----

// A record's quants are GGUF's bytes in chunks of 4: for chunk j and column c, bytes 4j..4j+3 of column
// c's quants sit at 32 j + 4 c. Q4: the low nibbles of chunk j are values 4j..4j+3, the high nibbles
// values 16 + 4j..; Q8: chunk j is values 4j..4j+3.
inline int quant_at(int64_t fmt, const uint8_t* qs, int c, int i) {
  if (fmt == Q8_0) return (int8_t)qs[32 * (i / 4) + 4 * c + i % 4];
  const int e = i % 16;
  const uint8_t byte = qs[32 * (e / 4) + 4 * c + e % 4];
  return i < 16 ? byte & 0x0f : byte >> 4;
}

void tile_scalar(int64_t fmt, const uint8_t* w, int64_t nb, const Rows& x, int64_t r0, int64_t r1, float* acc) {
  // acc [r1 - r0, GROUP] accumulates the tile's rows for one column group
  const int64_t gb = group_bytes(fmt);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* rec = w + b * gb;
    const uint16_t* hd = (const uint16_t*)rec;
    float dw[GROUP], mw[GROUP];
    for (int c = 0; c < GROUP; c++) dw[c] = half_to_float(hd[c]);
    if (fmt == Q4_1)
      for (int c = 0; c < GROUP; c++) mw[c] = half_to_float(hd[GROUP + c]);
    const uint8_t* qs = rec + (fmt == Q4_1 ? 4 : 2) * GROUP;
    int32_t wq[GROUP][QK];
    for (int c = 0; c < GROUP; c++)
      for (int i = 0; i < QK; i++) wq[c][i] = quant_at(fmt, qs, c, i);
    for (int64_t r = r0; r < r1; r++) {
      const int8_t* xq = x.q + r * x.k + b * QK;
      const float dx = x.d[r * x.nb + b];
      const int32_t sx = x.s[r * x.nb + b];
      float* a = acc + (r - r0) * GROUP;
      for (int c = 0; c < GROUP; c++) {
        int32_t isum = 0;
        for (int i = 0; i < QK; i++) isum += (int32_t)xq[i] * wq[c][i];
        if (fmt == Q4_0) isum -= 8 * sx;
        const float dd = dx * dw[c];
        a[c] = a[c] + (float)isum * dd;
        if (fmt == Q4_1) a[c] = a[c] + mw[c] * x.ds[r * x.nb + b];
      }
    }
  }
}

// ---- dispatch ----

// Below this many rows the 512-bit VNNI path is faster: up to 8 rows its sums stay in registers, while a
// tile's fixed costs (the unpacking to bytes, the sums stored and reloaded) outweigh a few rows' work. With
// the 512-bit path this holds for Q8_0 too (`python tools/kernel_ab.py HEAD --isa 2 --new-isa 3`: AMX 2-47%
// slower at 2-7 rows in 28 of 30 Q8_0 cells, level at 8, faster from 9). DFLASH_AMX_MIN_ROWS overrides it, for
// measuring (the paths give the same bits, so only speed changes).
int64_t amx_min_rows() {
  static const int64_t forced = [] {
    const char* v = std::getenv("DFLASH_AMX_MIN_ROWS");
    return v && *v ? std::max<int64_t>(1, std::atoll(v)) : 0;
  }();
  return forced ? forced : 8;
}

// Up to this many rows the AVX2 path keeps a Q4 matmul's float sums in registers (columns_rows_avx2: 4 rows per
// pass over one column group's weights); past it the rows go in strips of 4 rows x 2 column groups (columns_avx2).
// Q8_0 stays on the register rows at every row count: its sign step per product leaves the strips no gain.
// Measured on an AMD Zen 3 (docs/performance.md, "AVX2 only: AMD EPYC (Zen 3)"): whole verify passes of 3 rows
// 0.96-1.00 of the register rows' time, 2 rows level. DFLASH_AVX2_ROWS overrides the count, for measuring (the
// paths give the same bits).
int64_t avx2_tile_rows() {
  static const int64_t forced = [] {
    const char* v = std::getenv("DFLASH_AVX2_ROWS");
    return v && *v ? std::atoll(v) : -1;
  }();
  return forced >= 0 ? forced : 2;
}

// AMD Zen 4 (family 0x19 with AVX-512) runs each 512-bit instruction as two 256-bit halves. There the
// 512-bit VNNI path's per-block work (two column groups' loads and lane inserts, 16 columns a vector) made a
// decode step's matmuls about a quarter slower than the AVX2 path's, while VNNI's dpbusd takes fewer
// instructions per row than AVX2's maddubs chains. So below vnni_min_rows() rows such a CPU runs the AVX2
// path's layout with 256-bit dpbusd (rows_vnni256 in blocks_avx512.cpp): a decode step as fast as the AVX2
// path's, and 2-4 rows cheaper than either path (with the weights from memory the 512-bit path took 0.90-1.12x
// their time, most cells over 1). From 5 rows the 512-bit path: since its pairs of column groups are prefetched in
// address order (pairs_in_address_order), its broadcasts ride inside dpbusd and its tiles go straight to the
// output, 5-8-row matmuls take 0.85-1.00x the time of the 256-bit rows' and 16-row verify passes about 0.9x
// (docs/performance.md, "The 512-bit path's broadcasts inside dpbusd"; before those changes the 256-bit rows had
// been the faster ones up to 16 rows: "Few rows on 256-bit VNNI (AMD Zen 4)"). Every path gives the same bits, so
// only speed changes. DFLASH_VNNI_MIN_ROWS=N overrides the row count (0: the 512-bit path at every row count), and
// DFLASH_VNNI256=0 runs those rows on the AVX2 path's maddubs instead, both for measuring.
bool zen4() {
#ifdef DFLASH_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541u || d != 0x69746e65u || c != 0x444d4163u)  // AuthenticAMD
    return false;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned base = (a >> 8) & 0xf, family = base == 0xf ? base + ((a >> 20) & 0xff) : base;
  return family == 0x19;  // Zen 3 (no AVX-512, never on the VNNI path) and Zen 4
#else
  return false;
#endif
}

bool vnni256() {
  static const bool on = [] {
    const char* v = std::getenv("DFLASH_VNNI256");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

int64_t vnni_min_rows() {
  static const int64_t rows = [] {
    const char* v = std::getenv("DFLASH_VNNI_MIN_ROWS");
    if (v && *v) return std::max<int64_t>(0, std::atoll(v));
    return zen4() ? (int64_t)5 : (int64_t)0;
  }();
  return rows;
}

int64_t detect_isa() {
#ifdef DFLASH_X86
  // ATEN_CPU_CAPABILITY caps PyTorch's own kernels (avx2, default = no vectors); it caps ours alike, so
  // one variable runs a whole pass on the kernels of a smaller CPU
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  if (cap && std::strcmp(cap, "default") == 0) return SCALAR;
  const bool avx2_cap = cap && std::strcmp(cap, "avx2") == 0;
  __builtin_cpu_init();
  if (avx2_cap) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? AVX2 : SCALAR;
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
#ifdef DFLASH_AMX
    if (amx_usable()) return AMX;
#endif
    return VNNI;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return AVX2;
#endif
  return SCALAR;
}

int64_t best_isa() {  // read once: the CPU and the environment do not change under a process
  static const int64_t isa = detect_isa();
  return isa;
}

int64_t resolve(int64_t isa) {  // -1: the best this CPU has; asking for more than it has is an error
  const int64_t best = best_isa();
  if (isa < 0) return best;
  TORCH_CHECK(isa <= best, "dflash block kernels: this CPU lacks instruction set ", isa, " (best: ", best, ")");
  return isa;
}

void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* q, float* d, int32_t* s, int64_t isa) {
  const int64_t nb = k / QK;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
#ifdef DFLASH_X86
      if (isa >= AVX2) {
        thread_local std::vector<float> ds;  // (not returned)
        ds.resize(nb);
        quantize_row_avx2(x + r * k, k, q + r * k, d + r * nb, s + r * nb, ds.data(), nullptr, 0);
        continue;
      }
#endif
      quantize_row_scalar(x + r * k, k, q + r * k, d + r * nb, s + r * nb);
    }
  });
}

void check_packed(const torch::Tensor& packed, int64_t fmt, int64_t n, int64_t k) {
  TORCH_CHECK(fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0, "unknown block format ", fmt);
  TORCH_CHECK(k % QK == 0, "in_features must be a multiple of 32, got ", k);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.device().is_cpu(),
              "packed weights must be a contiguous CPU uint8 tensor");
  TORCH_CHECK(packed.numel() == packed_bytes(fmt, n, k), "packed weights hold ", packed.numel(), " bytes, a ", n,
              "x", k, " matrix needs ", packed_bytes(fmt, n, k));
}

}  // namespace

namespace dflash_blocks {

void mm_setup(MmCall& c, MmScratch& scratch, int64_t fmt, int64_t isa, bool asked, const uint8_t* wp, int64_t n,
              int64_t k, int64_t m, const float* x, const float* norm_w, float eps, float* y, const float* res,
              bool prepare) {
  const int64_t nb = k / QK;
  // AMX where asked for, or where it is the best path and the rows fill enough of a tile; else VNNI
  const bool amx = isa == AMX && (asked || m >= amx_min_rows());
  if (isa == AMX && !amx) isa = VNNI;
  const bool narrow = isa == VNNI && !asked && m < vnni_min_rows();  // a few rows on Zen 4
  if (narrow) isa = AVX2;  // the AVX2 path's layout and activations, its sums by 256-bit dpbusd
  const int64_t mpad = amx && m > 16 ? (m + 15) / 16 * 16 : m;  // AMX reads whole 16-row tiles past 16 rows
  // the scratch only grows: a pass alternates matmuls of 576 and 1536 inputs, and a vector resized up again
  // zero-fills what it regains (about 1 us of the calling thread's, alone, per matmul of a 16-row pass)
  auto fit = [prepare](auto& v, int64_t size) {
    if (prepare && (int64_t)v.size() < size) v.resize(size);
  };
  fit(scratch.q, mpad * k);
  if (prepare) std::memset(scratch.q.data() + m * k, 0, (mpad - m) * k);
  fit(scratch.d, m * nb);
  fit(scratch.ds, m * nb);
  fit(scratch.s, m * nb);
  // the VNNI sums start at Q4_0's -8 * s or Q8_0's -128 * s (its weights go in as w + 128, unsigned): no shift,
  // no subtract (the 512-bit path and the 256-bit rows alike)
  const bool narrow256 = narrow && vnni256();
  const bool start = fmt != Q4_1 && (isa == VNNI || narrow256);
  if (start) fit(scratch.s8, m * nb);
  const int64_t groups = (n + GROUP - 1) / GROUP;
  const bool wide = amx || isa == VNNI;
  c = MmCall{fmt, isa, amx, wide, narrow256, narrow256 && m >= BM_MIN_ROWS, m, n, k, nb, groups, nb * group_bytes(fmt),
             wide ? (groups + 1) / 2 : groups, wp, x, norm_w, eps, y, res,
             scratch.q.data(), scratch.d.data(), scratch.ds.data(), scratch.s.data(),
             start ? scratch.s8.data() : nullptr};
}

// rows [r0, r1) of x (normalized first where the call has a norm weight): quants, scales, sums, Q4_1's d * sum;
// on block-major activations only blocks [b0, b1) of them (b1 < 0: all; each block is quantized on its own)
void mm_quantize(const MmCall& c, int64_t r0, int64_t r1, int64_t b0, int64_t b1) {
  thread_local std::vector<float> normed;  // the row normalized (block_mm_norm)
  if (c.norm_w != nullptr) normed.resize(c.k);
  const int64_t k = c.k, nb = c.nb;
  if (b1 < 0) b1 = nb;
  if (b0 >= b1) return;  // (a share of the blocks is given on block-major rows only: quantize_share)
  for (int64_t r = r0; r < r1; r++) {
    const float* row = c.x + r * k;
    if (c.norm_w != nullptr) {
      dflash_norm::norm_row(row, c.norm_w, k, c.eps, normed.data());
      row = normed.data();
    }
    const int32_t s8mul = c.fmt == Q8_0 ? -128 : -8;
#ifdef DFLASH_X86
    if (c.block_major) {  // (Rows, block_at): the row's blocks scattered to their places
      thread_local std::vector<int8_t> qr;
      thread_local std::vector<float> dr, dsr;
      thread_local std::vector<int32_t> sr, s8r;
      qr.resize(k), dr.resize(nb), dsr.resize(nb), sr.resize(nb), s8r.resize(nb);
      quantize_row_avx2(row + b0 * QK, (b1 - b0) * QK, qr.data(), dr.data(), sr.data(), dsr.data(), s8r.data(),
                        s8mul);
      for (int64_t b = b0; b < b1; b++) {
        const int64_t i = block_at(b, r, c.m, nb), j = b - b0;
        std::memcpy(c.q + i * QK, qr.data() + j * QK, QK);
        c.d[i] = dr[j], c.s[i] = sr[j], c.ds[i] = dsr[j];
        if (c.s8 != nullptr) c.s8[i] = s8r[j];
      }
      continue;
    }
    if (c.isa >= AVX2) {
      quantize_row_avx2(row, k, c.q + r * k, c.d + r * nb, c.s + r * nb, c.ds + r * nb,
                        c.s8 != nullptr ? c.s8 + r * nb : nullptr, s8mul);
    } else
#endif
    {
      quantize_row_scalar(row, k, c.q + r * k, c.d + r * nb, c.s + r * nb);
      for (int64_t i = r * nb; i < (r + 1) * nb; i++) c.ds[i] = c.d[i] * (float)c.s[i];  // rounded once
      if (c.s8 != nullptr)
        for (int64_t i = r * nb; i < (r + 1) * nb; i++) c.s8[i] = s8mul * c.s[i];
    }
  }
}

void ColumnShare::reset(int64_t units, int64_t nth) {
  units_ = units;
  nth_ = std::max<int64_t>(1, nth);
  // about 8 chunks a thread (so a slow thread's rest is shared finely), an even count of column groups each (the
  // AVX2 strips take groups in pairs)
  chunk_ = std::max<int64_t>(1, (units + 8 * nth_ - 1) / (8 * nth_));
  if (chunk_ > 1 && chunk_ % 2) chunk_++;
  if (nth_ > MAX_THREADS) return;
  const int64_t chunks = (units + chunk_ - 1) / chunk_;
  for (int64_t t = 0; t < nth_; t++) {
    const auto [b, e] = even_share(chunks, t, nth_);
    left_[t].v.store((uint64_t)b << 32 | (uint64_t)e, std::memory_order_relaxed);
  }
}

void ColumnShare::run(const MmCall& c, int64_t tid) {
  if (nth_ > MAX_THREADS) {
    const auto [u0, u1] = even_share(units_, tid, nth_);
    mm_columns(c, u0, u1);
    return;
  }
  // take one chunk of thread t's: from the front (its own) or from the back (another's); false when none is left
  auto take = [&](int64_t t, bool front, int64_t& i) {
    uint64_t v = left_[t].v.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t f = v >> 32, b = v & 0xffffffffu;
      if (f >= b) return false;
      const uint64_t next = front ? (f + 1) << 32 | b : f << 32 | (b - 1);
      if (left_[t].v.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
        i = (int64_t)(front ? f : b - 1);
        return true;
      }
    }
  };
  // (the columns each chunk writes reach the other threads through the barrier after `run`)
  auto columns = [&](int64_t i) { mm_columns(c, i * chunk_, std::min(units_, (i + 1) * chunk_)); };
  int64_t i;
  while (take(tid, true, i)) columns(i);
  for (int64_t v = 1; v < nth_; v++)
    while (take((tid + v) % nth_, false, i)) columns(i);
}

// output column units [u0, u1) (tiles of 16 columns: AMX tiles or pairs of VNNI column groups; else groups of 8)
void mm_columns(const MmCall& c, int64_t u0, int64_t u1) {
  if (u0 >= u1) return;
  const Rows rows{c.q, c.d, c.s, c.ds, c.s8, c.k, c.nb, c.m};
  const int64_t fmt = c.fmt, m = c.m, n = c.n, nb = c.nb;
  if (c.wide) {
#ifdef DFLASH_X86
#ifdef DFLASH_AMX
    if (c.amx)
      columns_amx(fmt, c.wp, c.gstride, c.groups, nb, rows, m, u0, u1, c.y, n, c.res);
    else
#endif
      columns_vnni(fmt, c.wp, c.gstride, c.groups, nb, rows, m, u0, u1, c.y, n, c.res);
#endif
    return;
  }
#ifdef DFLASH_X86
  if (c.isa == AVX2 && !c.narrow) {
    if (fmt != Q8_0 && m > avx2_tile_rows())  // strips of 4 rows x 2 groups
      columns_avx2(fmt, c.wp, c.gstride, nb, rows, m, u0, u1, c.y, n, c.res);
    else
      columns_rows_avx2(fmt, c.wp, c.gstride, nb, rows, m, u0, u1, c.y, n, c.res);
    return;
  }
#endif
  float acc[TILE_ROWS * GROUP];
#ifdef DFLASH_X86
  // 3-4 row-major rows: two column groups at a time where there are two (rows_vnni256_pair). Fewer rows are bound
  // by the weights' reads, which it did not speed up (tools/kernel_ab.py --mb 96, 2 threads, AMD Zen 4)
  if (c.narrow && !c.block_major && m >= 3 && m <= 4) {
    for (int64_t g = u0; g + 1 < u1; g += 2) {
      rows_vnni256_pair(fmt, c.wp + g * c.gstride, nb, rows, 0, m, acc);
      const int64_t cols = std::min<int64_t>(2 * GROUP, n - g * GROUP);
      store_rows(c.y, c.res, n, 0, m, g * GROUP, cols, acc, 2 * GROUP);
    }
    if ((u1 - u0) % 2 == 0) return;
    u0 = u1 - 1;  // the last group alone, below
  }
#endif
  for (int64_t t0 = 0; t0 < m; t0 += TILE_ROWS) {
    const int64_t t1 = std::min(m, t0 + TILE_ROWS);
    for (int64_t g = u0; g < u1; g++) {
      std::memset(acc, 0, sizeof(float) * (t1 - t0) * GROUP);
      const uint8_t* wg = c.wp + g * c.gstride;
#ifdef DFLASH_X86
      if (c.narrow)
        rows_vnni256(fmt, wg, nb, rows, t0, t1, acc);
      else
#endif
        tile_scalar(fmt, wg, nb, rows, t0, t1, acc);
      const int64_t cols = std::min<int64_t>(GROUP, n - g * GROUP);
      store_rows(c.y, c.res, n, t0, t1 - t0, g * GROUP, cols, acc, GROUP);
    }
  }
}

int64_t resolve_isa(int64_t isa) { return resolve(isa); }

// The 512-bit path reads a pair of column groups, two streams of records. On AMD Zen 4, prefetched each on its
// own, they came from DRAM at under half the rate of one stream: with the next pair's records prefetched in address
// order its 1-4-row matmuls took 0.49-0.99x the time (tools/kernel_ab.py REV --isa 2 --mb 96). Elsewhere (Intel
// VNNI CPUs, where a decode step's matmuls read at the memory's rate) each stream keeps its own prefetch.
// DFLASH_PAIR_ORDER=0/1 overrides, for measuring.
bool pairs_in_address_order() {
  static const bool on = [] {
    const char* v = std::getenv("DFLASH_PAIR_ORDER");
    if (v && *v) return std::strcmp(v, "0") != 0;
    return zen4();
  }();
  return on;
}

// From this many rows on two threads (as many rows per thread on more) a pass in layers.cpp's rows_region runs by
// rows, each thread its own rows through every layer with all of each matmul's columns, instead of every thread taking
// its share of each matmul's columns for all rows.
// By columns, each matmul's rows are quantized by the threads in shares, its output written by the threads in
// column shares and read back whole by the next step on every thread: per layer four matmuls, the rotation, the
// attention's three steps and the activation, each ended by a barrier, and most of the data a thread reads last
// written on the other core. By rows, a thread's data stay its own and the threads meet once per layer (the keys
// and values written, before the attention); each thread reads every weight, which costs where a pass is bound by
// reading them (few rows) and not where it is bound by the multiplies (many rows). On AMD Zen 4 (2 threads, the
// default model, q4_0, verify passes after 128 / 512 keys, the two alternating in one process): 16 rows 0.771-0.962x
// / 0.815x the time by columns, 12 rows 0.853x / 0.868x, 9 rows 0.888-0.985x, 8 rows 0.852-1.049x / 0.914x,
// 5-7 rows 1.05-1.09x slower, 32 and 64 rows 0.760x and 0.811x (docs/performance.md, "Verify passes by
// rows"). Every row is computed alike either way, so only speed changes. Elsewhere by columns (the AVX2 kernels
// gained nothing by rows on that CPU; other CPUs not measured).
// DFLASH_ROWS_BY_THREAD=N overrides it (0: never), read on every pass so that a process can time both.
int64_t rows_by_thread() {
  const char* v = std::getenv("DFLASH_ROWS_BY_THREAD");
  if (v && *v) return std::max<int64_t>(0, std::atoll(v));
  static const int64_t rows = zen4() && best_isa() >= VNNI ? 9 : 0;
  return rows;
}

}  // namespace dflash_blocks

namespace {

// y [M, N] = x [M, K] @ W^T (+ r [M, N]: a residual added to each output, as `r + y` would); with norm_w,
// each row of x is first normalized as rms_norm(x, norm_w, eps) would (on the way to its quantization:
// no separate call, and in a verify pass the threads share the rows)
torch::Tensor block_mm_impl(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t fmt, int64_t n,
                            int64_t isa, const torch::Tensor* residual, const torch::Tensor* norm_w = nullptr,
                            double eps = 0.0) {
  TORCH_CHECK(x_in.dim() == 2, "block_mm takes x [M, K]");
  const int64_t m = x_in.size(0), k = x_in.size(1);
  check_packed(packed, fmt, n, k);
  torch::Tensor nw;
  if (norm_w != nullptr) {
    TORCH_CHECK(norm_w->scalar_type() == torch::kFloat32 && norm_w->numel() == k,
                "block_mm_norm: a float32 norm weight of ", k, " values");
    nw = norm_w->contiguous();
  }
  const bool asked = isa >= 0;
  isa = resolve(isa);
  torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  torch::Tensor r;
  if (residual != nullptr) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == m && residual->size(1) == n &&
                    residual->scalar_type() == torch::kFloat32, "the residual must be float32 [M, N]");
    r = residual->contiguous();
  }
  auto y = torch::empty({m, n}, torch::kFloat32);
  // the activations' quants and scales: the calling thread's scratch, reused across calls (no allocation
  // per call); the other threads of the region write into it through the call's raw pointers
  thread_local MmScratch scratch;
  MmCall c;
  mm_setup(c, scratch, fmt, isa, asked, packed.data_ptr<uint8_t>(), n, k, m, x.data_ptr<float>(),
           norm_w != nullptr ? nw.data_ptr<float>() : nullptr, (float)eps, y.data_ptr<float>(),
           residual != nullptr ? r.data_ptr<float>() : nullptr);
  // One parallel region for both steps: each thread quantizes its share of the rows, and after a barrier
  // takes its share of the output columns. A verify pass's rows are quantized in parallel, and the call
  // forks once.
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), c.units));
  // Fewer rows than threads (a decode step's one): the calling thread quantizes them before the fork, and
  // the region has no barrier inside (the others would only wait at it; ~1% of a decode step).
  const bool before = m < threads;
  if (before) mm_quantize(c, 0, m);
  ColumnShare share;
  share.reset(c.units, threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    if (!before) {
      const QuantShare q = quantize_share(c, tid, nth);
      mm_quantize(c, q.r0, q.r1, q.b0, q.b1);
#pragma omp barrier
    }
    share.run(c, tid);  // (a region given fewer threads: they take the missing threads' shares too)
  }
  return y;
}

torch::Tensor block_mm(const torch::Tensor& x, const torch::Tensor& packed, int64_t fmt, int64_t n, int64_t isa) {
  return block_mm_impl(x, packed, fmt, n, isa, nullptr);
}

torch::Tensor block_mm_add(const torch::Tensor& x, const torch::Tensor& packed, int64_t fmt, int64_t n,
                           const torch::Tensor& residual, int64_t isa) {
  return block_mm_impl(x, packed, fmt, n, isa, &residual);
}

// block_mm(rms_norm(x, norm_w, eps), ...) in one call, the same bits
torch::Tensor block_mm_norm(const torch::Tensor& x, const torch::Tensor& norm_w, double eps, const torch::Tensor& packed,
                            int64_t fmt, int64_t n, int64_t isa) {
  return block_mm_impl(x, packed, fmt, n, isa, nullptr, &norm_w, eps);
}

// The activation quantization alone (for the reference's tests): (q [M, K] int8, d [M, nb], s [M, nb]).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_act(const torch::Tensor& x_in, int64_t isa) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % QK == 0, "quantize_act takes x [M, K], K a multiple of 32");
  isa = resolve(isa);
  const int64_t m = x_in.size(0), k = x_in.size(1), nb = k / QK;
  torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  auto q = torch::empty({m, k}, torch::kInt8);
  auto d = torch::empty({m, nb}, torch::kFloat32);
  auto s = torch::empty({m, nb}, torch::kInt32);
  quantize_rows(x.data_ptr<float>(), m, k, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), isa);
  return {q, d, s};
}

int64_t isa_available() { return best_isa(); }

// matmuls of fewer rows than this take the 256-bit VNNI rows (0: none on this CPU)
int64_t narrow_rows_below() { return best_isa() >= VNNI ? vnni_min_rows() : 0; }

}  // namespace

TORCH_LIBRARY(dflash, m) {
  m.def("block_mm(Tensor x, Tensor packed, int fmt, int n, int isa=-1) -> Tensor");
  m.def("block_mm_add(Tensor x, Tensor packed, int fmt, int n, Tensor residual, int isa=-1) -> Tensor");
  m.def("block_mm_norm(Tensor x, Tensor norm_w, float eps, Tensor packed, int fmt, int n, int isa=-1) -> Tensor");
  m.def("quantize_act(Tensor x, int isa=-1) -> (Tensor, Tensor, Tensor)");
  m.def("best_isa", &isa_available);
  m.def("narrow_rows", &narrow_rows_below);
  m.impl("block_mm", torch::kCPU, &block_mm);
  m.impl("block_mm_add", torch::kCPU, &block_mm_add);
  m.impl("block_mm_norm", torch::kCPU, &block_mm_norm);
  m.impl("quantize_act", torch::kCPU, &quantize_act);
}
