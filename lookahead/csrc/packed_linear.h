// The packed linear kernel's entry points (packed_linear.cpp), for the Python bindings and for
// the lean decoder layers that call it without a round trip through Python.
#pragma once

#include <torch/extension.h>

// x: [M, K]; w: [ceil(N / 16), K, 16] fp32. Returns [M, N].
torch::Tensor fp32_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t N);
// x: [M, K]; q: [ceil(N / 16), K, 16] int8; d, m: [ceil(N / 16), K / 32, 16] fp16. Returns [M, N].
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                          const torch::Tensor& m, int64_t N);
// As int8_linear with q in 0..15, two k's per byte: q: [ceil(N / 16), K / 2, 16] uint8.
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                          const torch::Tensor& m, int64_t N);

// One matrix as lookahead.packed_linear.PackedWeights packs it, callable on [M, K] rows.
struct PackedMatrix {
  enum class Form { kFp32, kInt8, kInt4 };
  Form form;
  torch::Tensor weights;  // fp32 blocks, or the integer q blocks
  torch::Tensor d, m;     // scales of the integer forms (undefined for fp32)
  torch::Tensor bias;     // undefined when the layer has none
  int64_t N;

  torch::Tensor operator()(const torch::Tensor& rows) const;
};
