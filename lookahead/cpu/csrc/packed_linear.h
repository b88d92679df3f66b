// The packed linear kernel (packed_linear.cpp) for the Python bindings and for the lean decoder
// layers, which call it without a round trip through Python.
#pragma once

#include <torch/extension.h>

// One matrix as lookahead.cpu.packed_linear.PackedWeights packs it (fp32, int8 or int4 form with
// fp16 or fp32 scales [ceil(N / 16), K / 32, 16]), callable on [M, K] rows. The constructor checks
// the tensors' layout once.
struct PackedMatrix {
  enum class Form { kFp32, kInt8, kInt4 };
  Form form;
  torch::Tensor weights;  // fp32 blocks, or the integer q blocks
  torch::Tensor d, m;     // scales of the integer forms (undefined for fp32)
  torch::Tensor bias;     // undefined when the layer has none
  int64_t N;

  PackedMatrix(Form form, torch::Tensor weights, torch::Tensor d, torch::Tensor m, torch::Tensor bias, int64_t N);
  torch::Tensor operator()(const torch::Tensor& rows) const;
};
