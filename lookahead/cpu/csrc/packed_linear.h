// The packed linear kernels (packed_linear.cpp with fp32 activations, integer_linear.cpp with int8
// ones) for the Python bindings and for the C++ layers, which call them without a round trip
// through Python.
#pragma once

#include <torch/extension.h>

#include "integer_linear.h"

// One matrix as lookahead.cpu.packed_linear.PackedWeights packs it, callable on [M, K] rows.
//
// Fp32 activations: fp32, int8 or int4 weights as [ceil(N / 16), K, 16] blocks (int4: two inputs
// a byte, [ceil(N / 16), K / 2, 16]) with fp16 or fp32 scales [ceil(N / 16), K / group, 16]; the
// weights are rebuilt exactly and every output is one fp32 chain of fused multiply-adds.
// Int8 activations (integer weights only): the rows are quantised and multiplied in integers,
// the weights laid out as integer_linear.h says, in int8, int4, int5 or int6 form, with scales
// per group or factored. The constructor checks the tensors' layout once.
// What only int8 activations use: int5 and int6's high bits, factored scales.
struct IntegerExtras {
  torch::Tensor high;              // int5 / int6: [blocks][K / 8 / span][64] uint8
  int64_t zero_point = 0;          // the integers stored are q + zero_point
  torch::Tensor d_super, m_super;  // factored scales: [blocks][K / 256][16] fp16
};

struct PackedMatrix {
  enum class Form { kFp32, kInt8, kInt4, kInt5, kInt6 };
  Form form;
  bool integer_activations;
  torch::Tensor weights;  // fp32 blocks, or the integer q blocks
  torch::Tensor d, m;     // scales of the integer forms (undefined for fp32)
  torch::Tensor bias;     // undefined when the layer has none
  IntegerExtras extras;
  int64_t N, K;
  IntegerWeights integer;  // the integer-activation view of the tensors above

  PackedMatrix(Form form, bool integer_activations, torch::Tensor weights, torch::Tensor d, torch::Tensor m,
               torch::Tensor bias, int64_t N, IntegerExtras extras = {});
  // rows [M, K] -> [M, N], on at::get_num_threads() threads.
  torch::Tensor operator()(const torch::Tensor& rows) const;

  // Work shared between threads by units (groups of output blocks): how many a forward of M rows
  // has, and units [begin, end) of y [M, N] = x @ W^T + bias from the fp32 rows x, or from their
  // quantised form `quantised` where integer_activations.
  int64_t units(int64_t M) const;
  void run_units(const float* x, const QuantisedRows* quantised, int64_t M, float* y, int64_t begin,
                 int64_t end) const;
  int64_t group() const { return integer.group; }
};
