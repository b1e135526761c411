// The MLP's activation for the decoder stack (layers.cpp): act(gate) * up as `F.silu(gate) * up` (or gelu)
// computes it, on all rows or on the rows a thread takes, every element with the operations one call on all
// rows gives it.

#include "activation.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DFLASH_SILU_X86 1
// The exps that PyTorch's silu kernel calls through Vectorized<float>::exp() where ATen's CPU capability is AVX2
// (ATen/cpu/vec/vec256) or AVX512 (vec512), exported by libtorch_cpu; weak, so that a build of torch without them
// still loads this library (an address is then null, and PyTorch's own call runs)
extern "C" __attribute__((weak)) __m256 Sleef_expf8_u10(__m256);
extern "C" __attribute__((weak)) __m512 Sleef_expf16_u10(__m512);
#endif

namespace dflash_activation {

using at::Tensor;

namespace {

// silu(g) * u for one row of n floats, the bits `F.silu(g) * u` gives it: where ATen's CPU capability is AVX2
// (ATEN_CPU_CAPABILITY included) or AVX512, PyTorch's silu kernel (x / (1 + exp(-x))) runs a row in steps of two
// vectors of 8 or 16 floats through Sleef's exp and the rest one element at a time through std::exp
// (ATen/native/cpu/Loops.h, vectorized_loop), so these loops do the same with the same functions; then the product
// with up, one IEEE multiply as mul_rows. What it saves is the elementwise call's dispatch and setup, a serial step
// of every layer in a decode step's region (docs/performance.md, "The activation in one loop"). Each loop was
// checked against every float32 input on its capability. Others keep PyTorch's call.
float silu_scalar(float x) { return x / (1.0f + std::exp(-x)); }

#ifdef DFLASH_SILU_X86
__attribute__((target("avx2,fma"))) int64_t silu_mul_avx2(const float* g, const float* u, float* o, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i < n; i += 8) {  // n: whole steps of two vectors (PyTorch's step; one vector at a time gives the same)
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(x, sign))));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  return i;
}

// the same with AVX512's 16-float vectors (its neg: an xor with -0.0, as vec512's)
__attribute__((target("avx512f"))) int64_t silu_mul_avx512(const float* g, const float* u, float* o, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
  int64_t i = 0;
  for (; i < n; i += 16) {  // n: whole steps of two vectors
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(neg)));
    _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
  return i;
}
#endif

// The floats in one vector of the PyTorch silu kernel that silu_mul_row reproduces, or 0 where it reproduces none:
// ATen's CPU capability (as torch.backends.cpu.get_cpu_capability() reports it, fixed once ATen has dispatched) AVX2
// or AVX512, with that capability's exp exported
int64_t silu_width() {
#ifdef DFLASH_SILU_X86
  static const int64_t width = [] {
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX2" && &Sleef_expf8_u10 != nullptr) return (int64_t)8;
    if (cap == "AVX512" && &Sleef_expf16_u10 != nullptr) return (int64_t)16;
    return (int64_t)0;
  }();
  return width;
#else
  return 0;
#endif
}

// silu(g) * u into o for a row of n floats (where silu_width() > 0)
void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
#ifdef DFLASH_SILU_X86
  const int64_t step = 2 * silu_width();  // whole steps of two vectors, then one element at a time
  if (step > 0) i = step == 32 ? silu_mul_avx512(g, u, o, n / step * step) : silu_mul_avx2(g, u, o, n / step * step);
#endif
  for (; i < n; i++) o[i] = silu_scalar(g[i]) * u[i];
}

// Whether silu(gate) * up into out (t rows) takes silu_mul_rows: PyTorch's kernel is one it reproduces, float32
// rows with contiguous last dimensions, and one row or rows of whole steps of PyTorch's loop (a multiple of two
// vectors' floats), since a call on several contiguous rows runs them as one range, whose steps then cross the rows
bool native_silu(const Tensor& out, const Tensor& gate, const Tensor& up, int64_t t) {
  return silu_width() > 0 && gate.dim() == 2 && gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat &&
         out.scalar_type() == at::kFloat && gate.stride(1) == 1 && up.stride(1) == 1 && out.stride(1) == 1 &&
         (t == 1 || gate.size(1) % (2 * silu_width()) == 0);
}

// silu(gate) * up for rows r0 .. r1 (where native_silu)
void silu_mul_rows(Tensor& out, const Tensor& gate, const Tensor& up, int64_t r0, int64_t r1) {
  const int64_t n = gate.size(1), gs = gate.stride(0), us = up.stride(0), os = out.stride(0);
  const float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t r = r0; r < r1; r++) silu_mul_row(g + r * gs, u + r * us, o + r * os, n);
}

// act_mul's product for rows r0 .. r1: a plain loop, one IEEE multiply per element as Tensor.mul_
// computes it, without the elementwise machinery's setup (4 us of a 16-row call's 13, 8 rows of 1536).
void mul_rows(Tensor& out, const Tensor& up, int64_t r0, int64_t r1) {
  const int64_t n = out.size(1), us = up.stride(0);
  float* o = out.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  for (int64_t r = r0; r < r1; r++)
    for (int64_t i = 0; i < n; i++) o[r * n + i] *= u[r * us + i];
}

}  // namespace

// act(gate) * up for rows r0 .. r1 into out (act 0 silu, 1 gelu (tanh), 2 gelu): silu by silu_mul_rows where it can;
// else the elementwise kernels on the rows' strided views (every row its own inner loop: the bits of one call on all
// rows; the exact gelu on a contiguous copy, whose bits do not depend on the rows either), the product by mul_rows
// where up is float32 with a contiguous last dimension, else Tensor.mul_
void act_rows(Tensor& out, const Tensor& gate, const Tensor& up, int64_t act, int64_t r0, int64_t r1) {
  if (act == 0 && native_silu(out, gate, up, r1 - r0)) {
    silu_mul_rows(out, gate, up, r0, r1);
    return;
  }
  Tensor o = out.slice(0, r0, r1), g = gate.slice(0, r0, r1);
  if (act == 0) at::silu_out(o, g);
  else if (act == 1) at::gelu_out(o, g, "tanh");
  else at::gelu_out(o, g.contiguous(), "none");  // contiguous: models/layers.py, _gelu, says why
  const bool plain = gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && up.stride(1) == 1;
  if (plain) mul_rows(out, up, r0, r1);
  else o.mul_(up.slice(0, r0, r1));
}

// act(gate) * up (act 0 silu, 1 gelu (tanh), 2 gelu) as `F.silu(gate) * up` computes it; from 4 rows the
// threads take the rows in shares. Each element gets the operations it gets from one call on all rows
// (the views are strided, so every row is its own inner loop of the elementwise kernels), so the bits
// are the same.
Tensor act_mul(const Tensor& gate, const Tensor& up, int64_t act) {
  auto apply = [act](Tensor& out, const Tensor& g) {
    if (act == 0) at::silu_out(out, g);
    else if (act == 1) at::gelu_out(out, g, "tanh");
    else at::gelu_out(out, g.contiguous(), "none");  // contiguous: models/layers.py, _gelu, says why
  };
  const int64_t t = gate.size(0);
  Tensor out = at::empty({t, gate.size(1)}, gate.options());
  if (act == 0 && native_silu(out, gate, up, t)) {  // silu by its own loop, from 4 rows in the threads' shares
    if (t < 4) silu_mul_rows(out, gate, up, 0, t);
    else at::parallel_for(0, t, 1, [&](int64_t r0, int64_t r1) { silu_mul_rows(out, gate, up, r0, r1); });
    return out;
  }
  // float32 rows with a contiguous last dimension take the loop (the other dtypes, Tensor.mul_)
  const bool plain = gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && up.stride(1) == 1;
  if (t < 4) {
    apply(out, gate);
    if (!plain) return out.mul_(up);
    mul_rows(out, up, 0, t);
    return out;
  }
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the other threads are told
  at::parallel_for(0, t, 1, [&](int64_t r0, int64_t r1) {
    c10::InferenceMode mode(inference);
    Tensor o = out.slice(0, r0, r1);
    apply(o, gate.slice(0, r0, r1));
    if (plain) mul_rows(out, up, r0, r1);
    else o.mul_(up.slice(0, r0, r1));
  });
  return out;
}

}  // namespace dflash_activation

// act(gate) * up as the decoder stack runs it (tests/test_kernels.py compares it with `F.silu(gate) * up` bit for bit)
TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("act_mul(Tensor gate, Tensor up, int act) -> Tensor");
  m.impl("act_mul", c10::DispatchKey::CPU, &dflash_activation::act_mul);
}
