// y = x @ W^T in fp32 on AVX-512 CPUs, fast for the few rows a decoding step feeds.
//
// Stock sgemm re-packs the weight matrix on every call, so a forward over 2-64 rows streams the
// weights twice and costs ~2x a one-row forward. Here the weights are packed once, at load, into
// column blocks of 16 outputs laid out [block][k][16]: one 512-bit weight vector per k feeds
// every row of a tile, and the next block pair is prefetched into L2 while this one computes.
//
// Weights come in two forms with the same values. Fp32Weights holds them as they are.
// Int8Weights holds weights that are exactly fl(fl(d * q) + m) for an int8 q and one (d, m) per
// 32 inputs, as a model dequantised from a 4- or 8-bit checkpoint is: the kernel rebuilds every
// weight bit for bit (multiply, then add: this file is built with -ffp-contract=off) from a
// quarter of the bytes, and memory bandwidth is what bounds a decoding step on a CPU.
//
// Every output is the same sequential fused multiply-add chain over k whatever the number of
// rows or the weight form, so a token's logits do not depend on how many tokens share its
// forward: verifying a draft reproduces plain decoding bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;    // outputs per packed block: one zmm register
constexpr int64_t kGroup = 32;    // inputs sharing one (d, m) in Int8Weights
constexpr int64_t kBlocks = 2;    // blocks per tile
constexpr int64_t kFewRows = 4, kWideBlocks = 4;  // up to 4 rows: 4 blocks per tile
constexpr int64_t kMaxRows = 12;  // 12 rows x 2 blocks = 24 accumulators, room left for the weights
// From this many row tiles on, int8 blocks are rebuilt once per group rather than in every tile:
// measured, a 256-token prefill 305 -> 270 ms; at 2-3 tiles (16-32 rows) writing and re-reading
// the rebuilt copy cost more than it saved (lm_head, 16 rows: 4.1 -> 5.3 ms), at 6 it was even.
constexpr int64_t kRebuildTiles = 8;

struct Fp32Weights {
  const float* w;  // [blocks][K][16]
  int64_t K;

  Fp32Weights at(int64_t block) const { return {w + block * K * kLanes, K}; }
  __m512 load(int64_t j, int64_t k) const { return _mm512_loadu_ps(w + (j * K + k) * kLanes); }
  void prefetch(int64_t j, int64_t k) const {
    _mm_prefetch(reinterpret_cast<const char*>(w + (j * K + k) * kLanes), _MM_HINT_T1);
  }
};

struct Int8Weights {
  const int8_t* q;  // [blocks][K][16]
  const float* d;   // [blocks][K / 32][16]
  const float* m;   // [blocks][K / 32][16]
  int64_t K;

  Int8Weights at(int64_t block) const {
    const int64_t scales = block * (K / kGroup) * kLanes;
    return {q + block * K * kLanes, d + scales, m + scales, K};
  }
  __m512 load(int64_t j, int64_t k) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (j * K + k) * kLanes));
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const int64_t scale = (j * (K / kGroup) + k / kGroup) * kLanes;
    return _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(d + scale), values), _mm512_loadu_ps(m + scale));
  }
  void prefetch(int64_t j, int64_t k) const {
    if (k % 4 == 0)  // a cache line holds 4 k's of int8 weights
      _mm_prefetch(reinterpret_cast<const char*>(q + (j * K + k) * kLanes), _MM_HINT_T1);
  }
};

template <int Rows, int Blocks, class Weights>
inline void tile(const float* x, const Weights& w, float* y, int64_t ldy, int64_t n0, int64_t N, const Weights* next) {
  const int64_t K = w.K;
  __m512 acc[Rows][Blocks];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < Blocks; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wk[Blocks];
#pragma GCC unroll 16
    for (int j = 0; j < Blocks; ++j) {
      wk[j] = w.load(j, k);
      if (next) next->prefetch(j, k);
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * K + k]);
#pragma GCC unroll 16
      for (int j = 0; j < Blocks; ++j) acc[r][j] = _mm512_fmadd_ps(xr, wk[j], acc[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < Blocks; ++j) {
    const int64_t n = n0 + j * kLanes;
    const int64_t left = N - n;
    const __mmask16 mask = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) _mm512_mask_storeu_ps(y + r * ldy + n, mask, acc[r][j]);
  }
}

template <int Blocks, class Weights>
void tile_rows(int rows, const float* x, const Weights& w, float* y, int64_t ldy, int64_t n0, int64_t N,
               const Weights* next) {
  switch (rows) {
#define ROWS_CASE(R) \
  case R:            \
    return tile<R, Blocks>(x, w, y, ldy, n0, N, next);
    ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
    ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
#undef ROWS_CASE
  }
}

// Int8 blocks of a group that several row tiles read, rebuilt once into fp32: the same
// fl(fl(d * q) + m) values load() computes, so every result keeps its bits, and the tiles then
// spend their cycles on multiply-adds rather than on rebuilding the same weights again.
inline Fp32Weights rebuilt(const Int8Weights& w, int64_t blocks, float* scratch) {
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t k = 0; k < w.K; ++k) _mm512_storeu_ps(scratch + (j * w.K + k) * kLanes, w.load(j, k));
  return {scratch, w.K};
}

// Every row tile of one group: `width` (<= Blocks) blocks from block b0, held by `w`. The first
// tile pulls `next`, the following group, into L2 (the later tiles find this group there).
template <int Blocks, class Weights>
void group_tiles(const float* xp, const Weights& w, int64_t width, int64_t b0, float* yp, int64_t M,
                 int64_t N, int64_t rows_per_tile, const Weights* next) {
  const int64_t K = w.K;
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_tile) {
    const int rows = static_cast<int>(std::min(rows_per_tile, M - m0));
    if (width == Blocks) {
      tile_rows<Blocks, Weights>(rows, xp + m0 * K, w, yp + m0 * N, N, b0 * kLanes, N, m0 == 0 ? next : nullptr);
    } else {
      for (int64_t j = 0; j < width; ++j)  // the last, narrower group
        tile_rows<1, Weights>(rows, xp + m0 * K, w.at(j), yp + m0 * N, N, (b0 + j) * kLanes, N, nullptr);
    }
  }
}

// Groups of `Blocks` blocks, split between threads; the caller picks Blocks so that rows x Blocks
// accumulators keep enough independent FMA chains in flight.
template <int Blocks, class Weights>
void linear_tiles(const float* xp, const Weights& weights, int64_t blocks, float* yp, int64_t M, int64_t N) {
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t rows_per_tile = (M + tiles - 1) / tiles;  // balanced: 16 rows are 8 + 8, not 12 + 4
  const int64_t groups = (blocks + Blocks - 1) / Blocks;
  constexpr bool kInt8 = std::is_same_v<Weights, Int8Weights>;
  const bool rebuild = kInt8 && tiles >= kRebuildTiles;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(rebuild ? Blocks * weights.K * kLanes : 0);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t b0 = g * Blocks;
      const int64_t width = std::min<int64_t>(Blocks, blocks - b0);
      if constexpr (kInt8) {
        if (rebuild) {
          const Fp32Weights w = rebuilt(weights.at(b0), width, scratch.data());
          group_tiles<Blocks, Fp32Weights>(xp, w, width, b0, yp, M, N, rows_per_tile, nullptr);
          continue;
        }
      }
      const Weights next = weights.at(b0 + Blocks);
      const Weights* prefetch = g + 1 < end ? &next : nullptr;
      group_tiles<Blocks, Weights>(xp, weights.at(b0), width, b0, yp, M, N, rows_per_tile, prefetch);
    }
  });
}

template <class Weights>
torch::Tensor linear(const torch::Tensor& x, const Weights& weights, int64_t blocks, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x must be [M, K] fp32");
  TORCH_CHECK(x.size(1) == weights.K, "x has ", x.size(1), " inputs, the weight ", weights.K);
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  if (M <= kFewRows)
    linear_tiles<kWideBlocks>(x.data_ptr<float>(), weights, blocks, y.data_ptr<float>(), M, N);
  else
    linear_tiles<kBlocks>(x.data_ptr<float>(), weights, blocks, y.data_ptr<float>(), M, N);
  return y;
}

void check_packed(const torch::Tensor& t, torch::ScalarType type, int64_t dims, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == type && t.dim() == dims && t.size(-1) == kLanes,
              name, " is not a packed tensor from lookahead.packed_linear");
}

}  // namespace

// x: [M, K]; w: [ceil(N / 16), K, 16] fp32. Returns [M, N].
torch::Tensor fp32_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t N) {
  check_packed(w, torch::kFloat32, 3, "w");
  return linear(x, Fp32Weights{w.data_ptr<float>(), w.size(1)}, w.size(0), N);
}

// x: [M, K]; q: [ceil(N / 16), K, 16] int8; d, m: [ceil(N / 16), K / 32, 16] fp32. Returns [M, N].
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                          const torch::Tensor& m, int64_t N) {
  check_packed(q, torch::kInt8, 3, "q");
  check_packed(d, torch::kFloat32, 3, "d");
  check_packed(m, torch::kFloat32, 3, "m");
  TORCH_CHECK(q.size(1) % kGroup == 0 && d.sizes() == m.sizes() && d.size(1) * kGroup == q.size(1), "scale shapes");
  return linear(x, Int8Weights{q.data_ptr<int8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), q.size(1)}, q.size(0), N);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("fp32_linear", &fp32_linear, "x @ W^T, W packed [N/16, K, 16]");
  module.def("int8_linear", &int8_linear, "x @ W^T, W = d * q + m packed [N/16, K, 16] + [N/16, K/32, 16] x 2");
}
