// act(gate) * up for the decoder stack (activation.cpp); act 0 silu, 1 gelu (tanh), 2 gelu.
#pragma once

#include <ATen/ATen.h>

namespace dflash_activation {

// act(gate) * up into a new [T, I] tensor, the bits of `F.silu(gate) * up` (or gelu); threads share rows from 4
at::Tensor act_mul(const at::Tensor& gate, const at::Tensor& up, int64_t act);
// the same into out's rows r0 .. r1, on the calling thread (the region's threads each take their rows)
void act_rows(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up, int64_t act, int64_t r0, int64_t r1);

}  // namespace dflash_activation
