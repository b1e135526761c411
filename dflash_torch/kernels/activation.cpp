// The MLP's activation for the decoder stack (layers.cpp): act(gate) * up as `F.silu(gate) * up` (or gelu)
// computes it, on all rows or on the rows a thread takes, every element with the operations one call on all
// rows gives it.

#include "activation.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace dflash_activation {

using at::Tensor;

namespace {

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

// act(gate) * up for rows r0 .. r1 into out (act 0 silu, 1 gelu (tanh), 2 gelu): the elementwise kernels on
// the rows' strided views (every row its own inner loop: the bits of one call on all rows; the exact gelu on a
// contiguous copy, whose bits do not depend on the rows either), the product by mul_rows where up is float32
// with a contiguous last dimension, else Tensor.mul_
void act_rows(Tensor& out, const Tensor& gate, const Tensor& up, int64_t act, int64_t r0, int64_t r1) {
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
