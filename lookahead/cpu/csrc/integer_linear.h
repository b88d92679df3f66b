// y = x @ W^T with int8 activations against int8 or int4 weights (integer_linear.cpp).
//
// Each row of x is quantised on its own, per block of 32 inputs, as ggml's q8_0 does: d = max|x| /
// 127, q = round(x / d) (ties to even) in -127..127. The weights are an integer form, w = d_w * q_w
// + m_w with one (d_w, m_w) per group of 16 or 32 inputs. Per group, the integer dot product of
// the two q's is exact in int32 (vpdpbusd, or vpmaddubsw + vpmaddwd), and the fp32 result gathers
// the groups in input order:
//
//     acc = fma(d_w * d_x, float(sum q_w q_x), acc)
//     acc = fma(m_w, d_x * float(sum q_x), acc)        (forms with offsets only)
//
// then y = acc (+ bias). The same operations in the same order on every variant and for any number
// of rows: a row's result depends on that row alone, bit for bit.
#pragma once

#include <cstdint>
#include <vector>

// Rows of activations quantised for one matrix: q per input, d per block of 32 inputs, and for
// each group of `group` inputs (the weights' scale group) the sum of the q's and d times it.
struct QuantisedRows {
  int64_t rows = 0, K = 0, group = 32;
  std::vector<int8_t> q;              // [rows][K]
  std::vector<float> d;               // [rows][K / 32]
  std::vector<int32_t> sums;          // [rows][K / group]
  std::vector<float> scaled_sums;     // [rows][K / group]: fl(d * float(sum))

  void resize(int64_t rows, int64_t K, int64_t group);
  // Rows [begin, end) of x [rows][K] (K a multiple of 32).
  void quantise(const float* x, int64_t begin, int64_t end);
};

// An integer form packed for the dot products. The integers stored are u = q + zero_point, u >= 0
// for every form but int8:
// - int8 (`bits` 8): q as [blocks][K / 4][16][4] int8, the four consecutive inputs of each of 16
//   outputs side by side;
// - int4 (4): u in 0..15 as [blocks][K / 8][16][4] uint8, input k + i in the low nibble of byte i,
//   k + 4 + i in the high one;
// - int5 and int6 (5, 6): u's low four bits as int4, its one or two high bits in `high`, one
//   [blocks][K / 8 / span][64] uint8 vector per span of chunks (int5: 4 chunks of 8 inputs, int6:
//   2). Byte b of a vector holds the high bits of byte b (as int4 places inputs) of each of the
//   span's 2 x span four-input halves, half h at bit (4 + planes * h) % 8.
// Scales d and m as [blocks][K / group][16] fp16 or fp32, or factored (`factored`): int8 sub-scales
// there times fp16 super-scales [blocks][K / 256][16] (d_super, m_super), a product exact in fp32.
struct IntegerWeights {
  int bits;
  const void* q;
  const uint8_t* high;  // int5 and int6 only
  int32_t zero_point;
  const void* d;
  const void* m;
  const uint16_t* d_super;  // factored scales only
  const uint16_t* m_super;
  bool half_scales;
  bool factored;
  bool offsets;  // false when every m is zero: the offset term is skipped
  const float* bias;  // nullptr when there is none
  int64_t K, N, group, blocks;
};

// Blocks [block_begin, block_end) of 16 outputs of y [x.rows][N] = x @ W^T (+ bias).
void integer_linear_blocks(const QuantisedRows& x, const IntegerWeights& w, float* y, int64_t block_begin,
                           int64_t block_end);
