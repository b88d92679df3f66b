// y = x @ W^T in fp32 on x86-64 CPUs (AVX-512, or AVX2 + FMA + F16C: simd.h), fast for the few
// rows a decoding step feeds.
//
// Stock sgemm re-packs the weight matrix on every call, so a forward over 2-64 rows streams the
// weights twice and costs ~2x a one-row forward. Here the weights are packed once, at load, into
// column blocks of 16 outputs laid out [block][k][16]: sixteen lanes (F32x16) per k feed every row
// of a tile, and the next block group is prefetched into L2 while this one computes.
//
// Weights come in three forms with the same values. Fp32Weights holds them as they are.
// Int8Weights and Int4Weights hold weights that are exactly fl(fl(d * q) + m) for an integer q
// and one (d, m) per 16 or 32 inputs, fp16 or fp32, as a model dequantised from a 4- to 8-bit checkpoint
// is: the kernel rebuilds every weight bit for bit (one fused multiply-add, exact where d * q is:
// see ScaleRegisters) from 1 byte (q in a byte) or half a byte (q in 0..15, two per byte) plus
// the scales, rather than 4, and memory bandwidth is what bounds a decoding step on a CPU.
//
// Every output is the same sequential fused multiply-add chain over k whatever the number of
// rows, the weight form or the instruction set, so a token's logits do not depend on how many
// tokens share its forward: verifying a draft reproduces plain decoding bit for bit.
#include "packed_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace {

constexpr int64_t kLanes = 16;  // outputs per packed block
// From kRebuildTiles row tiles on (simd.h), int8 and int4 blocks are rebuilt once per group rather
// than in every tile; at fewer tiles writing and re-reading the rebuilt copy costs more than it saves.

// Every form loads the weights of k + H for an even k and H = 0 or 1 (a compile-time constant),
// so that Int4Weights knows which half of a byte it wants, and prefetches the lines a pair of
// k's reads. The integer forms rebuild weights from the scales of a span of 16 or 32 inputs
// (`group`); fp32 has no scales, and one span covers all of K.
struct Fp32Weights {
  const float* w;  // [blocks][K][16]
  int64_t K;

  template <int Blocks>
  struct Group {};

  Fp32Weights at(int64_t block) const { return {w + block * K * kLanes, K}; }
  int64_t span() const { return K; }
  template <int Blocks>
  Group<Blocks> group(int64_t) const { return {}; }
  template <int H, class G>
  F32x16 load(int64_t j, int64_t k, const G&) const { return F32x16::load(w + (j * K + k + H) * kLanes); }
  void prefetch(int64_t j, int64_t k) const {
    for (int64_t h = 0; h < 2; ++h)
      _mm_prefetch(reinterpret_cast<const char*>(w + (j * K + k + h) * kLanes), _MM_HINT_T1);
  }
};

// The (d, m) of Blocks blocks for one span of 32 inputs, widened to fp32.
template <int Blocks>
struct ScaleRegisters {
  F32x16 d[Blocks], m[Blocks];

  // fl(fl(d * q) + m) in one instruction wherever d * q is exact in fp32: always for an fp16 d (at
  // most 11 significant bits) and |q| <= 255 (8 bits); for fp32 scales lookahead.cpu.packed_linear
  // keeps an integer form only where every product is exact.
  F32x16 rebuild(int j, const F32x16& q) const { return F32x16::fmadd(d[j], q, m[j]); }
};

// Sixteen scales widened to fp32: Scale is uint16_t (fp16 bits) or float.
template <class Scale>
F32x16 widen(const Scale* p) {
  if constexpr (std::is_same_v<Scale, float>)
    return F32x16::load(p);
  else
    return F32x16::from_half(p);
}

// The (d, m) of Blocks blocks for one span, read from memory at every use (fp32 scales, an
// operand of the multiply-add): what a register-poor instruction set uses instead of
// ScaleRegisters. The empty asm keeps the compiler from hoisting the loads out of the k loop,
// which would only spill them.
template <int Blocks, class Scale>
struct ScaleLoads {
  const Scale* d;
  const Scale* m;
  int64_t stride;  // scales from one block's to the next one's

  F32x16 rebuild(int j, const F32x16& q) const {
    const Scale* dj = d + j * stride;
    const Scale* mj = m + j * stride;
    asm("" : "+r"(dj), "+r"(mj));
    return F32x16::fmadd(widen(dj), q, widen(mj));
  }
};

// One (d, m) per `group` inputs (16 or 32): [blocks][K / group][16] each; Scale is uint16_t (fp16
// bits) or float (always float where !kScalesInRegisters: PackedMatrix widens fp16 at load).
template <class Scale>
struct Scales {
  const Scale* d;
  const Scale* m;
  int64_t group;

  Scales at(int64_t block, int64_t K) const {
    const int64_t offset = block * (K / group) * kLanes;
    return {d + offset, m + offset, group};
  }
  template <int Blocks>
  using Group = std::conditional_t<kScalesInRegisters, ScaleRegisters<Blocks>, ScaleLoads<Blocks, Scale>>;

  // The scales of the span holding input k, as Group<Blocks> reads them: in registers or from memory.
  template <int Blocks>
  Group<Blocks> span_scales(int64_t K, int64_t k) const {
    if constexpr (!kScalesInRegisters) {
      const int64_t offset = (k / group) * kLanes;
      return {d + offset, m + offset, (K / group) * kLanes};
    } else {
      return in_registers<Blocks>(K, k);
    }
  }

  template <int Blocks>
  ScaleRegisters<Blocks> in_registers(int64_t K, int64_t k) const {
    ScaleRegisters<Blocks> registers;
#pragma GCC unroll 16
    for (int j = 0; j < Blocks; ++j) {
      const int64_t offset = (j * (K / group) + k / group) * kLanes;
      registers.d[j] = widen(d + offset);
      registers.m[j] = widen(m + offset);
    }
    return registers;
  }
};

// What Int8Weights and Int4Weights share: K inputs whose spans of 32 have their own scales.
template <class Scale>
struct ScaledWeights {
  Scales<Scale> scales;
  int64_t K;

  template <int Blocks>
  using Group = typename Scales<Scale>::template Group<Blocks>;

  int64_t span() const { return scales.group; }
  template <int Blocks>
  Group<Blocks> group(int64_t k) const { return scales.template span_scales<Blocks>(K, k); }
};

template <class Scale>
struct Int8Weights : ScaledWeights<Scale> {
  using ScaledWeights<Scale>::K;
  using ScaledWeights<Scale>::scales;
  const int8_t* q;  // [blocks][K][16]

  Int8Weights at(int64_t block) const { return {{scales.at(block, K), K}, q + block * K * kLanes}; }
  template <int H, class G>
  F32x16 load(int64_t j, int64_t k, const G& group) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (j * K + k + H) * kLanes));
    return group.rebuild(j, F32x16::from_int8(bytes));
  }
  void prefetch(int64_t j, int64_t k) const {
    if (k % 4 == 0)  // a cache line holds 4 k's of int8 weights
      _mm_prefetch(reinterpret_cast<const char*>(q + (j * K + k) * kLanes), _MM_HINT_T1);
  }
};

template <class Scale>
struct Int4Weights : ScaledWeights<Scale> {
  using ScaledWeights<Scale>::K;
  using ScaledWeights<Scale>::scales;
  const uint8_t* q;  // [blocks][K / 2][16]: q of k in the low nibble, of k + 1 in the high one

  Int4Weights at(int64_t block) const { return {{scales.at(block, K), K}, q + block * (K / 2) * kLanes}; }
  template <int H, class G>
  F32x16 load(int64_t j, int64_t k, const G& group) const {
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (j * (K / 2) + k / 2) * kLanes));
    if constexpr (H == 1) bytes = _mm_srli_epi16(bytes, 4);
    bytes = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    return group.rebuild(j, F32x16::from_uint8(bytes));
  }
  void prefetch(int64_t j, int64_t k) const {
    if (k % 8 == 0)  // a cache line holds 8 k's of int4 weights
      _mm_prefetch(reinterpret_cast<const char*>(q + (j * (K / 2) + k / 2) * kLanes), _MM_HINT_T1);
  }
};

template <int Rows, int Blocks, class Weights>
inline void tile(const float* x, const Weights& w, float* y, int64_t ldy, int64_t n0, int64_t N, const Weights* next) {
  const int64_t K = w.K;
  F32x16 acc[Rows][Blocks];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < Blocks; ++j) acc[r][j] = F32x16::zero();
  // The step for input k + H; k advances by pairs, so Int4Weights' nibble choice is a constant.
  auto step = [&](int64_t k, const auto& group, auto h) {
    constexpr int H = decltype(h)::value;
    F32x16 wk[Blocks];
#pragma GCC unroll 16
    for (int j = 0; j < Blocks; ++j) wk[j] = w.template load<H>(j, k, group);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const F32x16 xr = F32x16::broadcast(x[r * K + k + H]);
#pragma GCC unroll 16
      for (int j = 0; j < Blocks; ++j) acc[r][j] = F32x16::fmadd(xr, wk[j], acc[r][j]);
    }
  };
  for (int64_t k0 = 0; k0 < K; k0 += w.span()) {
    const auto group = w.template group<Blocks>(k0);
    const int64_t end = std::min(K, k0 + w.span());
    int64_t k = k0;
    for (; k + 1 < end; k += 2) {
      if (next)
#pragma GCC unroll 16
        for (int j = 0; j < Blocks; ++j) next->prefetch(j, k);
      step(k, group, std::integral_constant<int, 0>{});
      step(k, group, std::integral_constant<int, 1>{});
    }
    if (k < end) step(k, group, std::integral_constant<int, 0>{});  // fp32 with an odd K
  }
#pragma GCC unroll 16
  for (int j = 0; j < Blocks; ++j) {
    const int64_t n = n0 + j * kLanes;
    const int64_t left = N - n;
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      if (left >= kLanes)
        acc[r][j].store(y + r * ldy + n);
      else
        acc[r][j].store_first(y + r * ldy + n, left);
    }
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
#if defined(__AVX512F__)
    ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
#endif
#undef ROWS_CASE
  }
}

// Int8 or int4 blocks of a group that several row tiles read, rebuilt once into fp32: the same
// fl(fl(d * q) + m) values load() computes, so every result keeps its bits, and the tiles then
// spend their cycles on multiply-adds rather than on rebuilding the same weights again.
template <class Weights>
inline Fp32Weights rebuilt(const Weights& w, int64_t blocks, float* scratch) {
  for (int64_t j = 0; j < blocks; ++j) {
    const Weights block = w.at(j);
    for (int64_t k0 = 0; k0 < w.K; k0 += w.span()) {
      const auto group = block.template group<1>(k0);
      for (int64_t k = k0; k < k0 + w.span(); k += 2) {
        block.template load<0>(0, k, group).store(scratch + (j * w.K + k) * kLanes);
        block.template load<1>(0, k, group).store(scratch + (j * w.K + k + 1) * kLanes);
      }
    }
  }
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

// Groups [begin, end) of `Blocks` blocks; the caller picks Blocks so that rows x Blocks
// accumulators keep enough independent FMA chains in flight.
template <int Blocks, class Weights>
void group_range(const float* xp, const Weights& weights, int64_t blocks, float* yp, int64_t M, int64_t N,
                 int64_t begin, int64_t end) {
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t rows_per_tile = (M + tiles - 1) / tiles;  // balanced: 16 rows are 8 + 8, not 12 + 4
  constexpr bool kQuantised = !std::is_same_v<Weights, Fp32Weights>;
  const bool rebuild = kQuantised && tiles >= kRebuildTiles;
  std::vector<float> scratch(rebuild ? Blocks * weights.K * kLanes : 0);
  for (int64_t g = begin; g < end; ++g) {
    const int64_t b0 = g * Blocks;
    const int64_t width = std::min<int64_t>(Blocks, blocks - b0);
    if constexpr (kQuantised) {
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
}

int64_t fp32_blocks_per_unit(int64_t M) { return M <= kFewRows ? kWideBlocks : kBlocks; }

template <class Weights>
void fp32_units(const float* x, const Weights& weights, int64_t blocks, float* y, int64_t M, int64_t N, int64_t begin,
                int64_t end) {
  if (M <= kFewRows)
    group_range<kWideBlocks>(x, weights, blocks, y, M, N, begin, end);
  else
    group_range<kBlocks>(x, weights, blocks, y, M, N, begin, end);
}

void check_packed(const torch::Tensor& t, torch::ScalarType type, int64_t dims, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == type && t.dim() == dims && t.size(dims == 4 ? 2 : -1) == kLanes,
              name, " is not a packed tensor from lookahead.cpu.packed_linear");
  if (dims == 4) TORCH_CHECK(t.size(3) == 4, name, " is not a packed tensor from lookahead.cpu.packed_linear");
}

void check_scales(const torch::Tensor& d, const torch::Tensor& m, int64_t K) {
  TORCH_CHECK(d.scalar_type() == torch::kHalf || d.scalar_type() == torch::kFloat32, "scales are fp16 or fp32");
  check_packed(d, d.scalar_type(), 3, "d");
  check_packed(m, d.scalar_type(), 3, "m");
  TORCH_CHECK(d.sizes() == m.sizes() && d.size(1) > 0 && K % d.size(1) == 0, "scale shapes");
  const int64_t group = K / d.size(1);
  TORCH_CHECK(group == 16 || group == 32, "a group of 16 or 32 inputs shares one scale, not ", group);
}

// Int8 sub-scales per group (16 or 32 inputs) and fp16 super-scales per 256 inputs.
void check_factored_scales(const torch::Tensor& d, const torch::Tensor& m, const torch::Tensor& d_super,
                           const torch::Tensor& m_super, int64_t K) {
  check_packed(d, torch::kInt8, 3, "d");
  check_packed(m, torch::kInt8, 3, "m");
  TORCH_CHECK(d.sizes() == m.sizes() && d.size(1) > 0 && K % d.size(1) == 0, "scale shapes");
  const int64_t group = K / d.size(1);
  TORCH_CHECK(group == 16 || group == 32, "a group of 16 or 32 inputs shares one scale, not ", group);
  TORCH_CHECK(K % 256 == 0, "factored scales need a multiple of 256 inputs, not ", K);
  TORCH_CHECK(d_super.defined() && m_super.defined(), "factored scales need their super-scales");
  check_packed(d_super, torch::kHalf, 3, "d_super");
  check_packed(m_super, torch::kHalf, 3, "m_super");
  TORCH_CHECK(d_super.sizes() == m_super.sizes() && d_super.size(0) == d.size(0) && d_super.size(1) * 256 == K,
              "super-scale shapes");
}

template <class Scale>
Scales<Scale> scales_of(const torch::Tensor& d, const torch::Tensor& m, int64_t K) {
  const int64_t group = K / d.size(1);
  if constexpr (std::is_same_v<Scale, float>)
    return {d.data_ptr<float>(), m.data_ptr<float>(), group};
  else
    return {reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
            reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()), group};
}

// Units [begin, end) with fp32 activations, whatever the weights' form; Scale as Scales<Scale>.
template <class Scale>
void fp32_activation_units(const PackedMatrix& matrix, const float* x, int64_t M, float* y, int64_t begin,
                           int64_t end) {
  const int64_t blocks = matrix.weights.size(0), K = matrix.K, N = matrix.N;
  switch (matrix.form) {
    case PackedMatrix::Form::kFp32:
      return fp32_units(x, Fp32Weights{matrix.weights.data_ptr<float>(), K}, blocks, y, M, N, begin, end);
    case PackedMatrix::Form::kInt8: {
      const Int8Weights<Scale> w{{scales_of<Scale>(matrix.d, matrix.m, K), K}, matrix.weights.data_ptr<int8_t>()};
      return fp32_units(x, w, blocks, y, M, N, begin, end);
    }
    case PackedMatrix::Form::kInt4: {
      const Int4Weights<Scale> w{{scales_of<Scale>(matrix.d, matrix.m, K), K}, matrix.weights.data_ptr<uint8_t>()};
      return fp32_units(x, w, blocks, y, M, N, begin, end);
    }
    case PackedMatrix::Form::kInt5:
    case PackedMatrix::Form::kInt6:
      TORCH_CHECK(false, "int5 and int6 forms take int8 activations only");
  }
}

}  // namespace

PackedMatrix::PackedMatrix(Form form, bool integer_activations, torch::Tensor weights, torch::Tensor d,
                           torch::Tensor m, torch::Tensor bias, int64_t N, IntegerExtras extras)
    : form(form),
      integer_activations(integer_activations),
      weights(std::move(weights)),
      d(std::move(d)),
      m(std::move(m)),
      bias(std::move(bias)),
      extras(std::move(extras)),
      N(N),
      integer{} {
  TORCH_CHECK(!this->bias.defined() || (this->bias.is_contiguous() && this->bias.scalar_type() == torch::kFloat32 &&
                                        this->bias.numel() == N),
              "bias must be [N] fp32");
  TORCH_CHECK(N > 0 && this->weights.dim() >= 3 && (N + kLanes - 1) / kLanes == this->weights.size(0),
              "the packed weights do not hold ", N, " outputs");
  if (form == Form::kFp32) {
    TORCH_CHECK(!integer_activations, "int8 activations need integer weights");
    check_packed(this->weights, torch::kFloat32, 3, "w");
    K = this->weights.size(1);
    return;
  }
  const bool int8 = form == Form::kInt8;
  const bool planes = form == Form::kInt5 || form == Form::kInt6;
  if (integer_activations) {
    check_packed(this->weights, int8 ? torch::kInt8 : torch::kUInt8, 4, "q");
    K = this->weights.size(1) * (int8 ? 4 : 8);
    TORCH_CHECK(K % 32 == 0, "int8 activations need a multiple of 32 inputs, not ", K);
    const bool factored = this->d.scalar_type() == torch::kInt8;
    if (factored)
      check_factored_scales(this->d, this->m, this->extras.d_super, this->extras.m_super, K);
    else
      check_scales(this->d, this->m, K);
    const uint8_t* high = nullptr;
    if (planes) {
      const int64_t span = form == Form::kInt5 ? 4 : 2;
      const auto& bits = this->extras.high;
      TORCH_CHECK(bits.defined() && bits.is_contiguous() && bits.scalar_type() == torch::kUInt8 && bits.dim() == 3 &&
                      bits.size(0) == this->weights.size(0) && bits.size(1) * span * 8 == K && bits.size(2) == 64,
                  "high is not a packed tensor from lookahead.cpu.packed_linear");
      high = bits.data_ptr<uint8_t>();
    } else {
      TORCH_CHECK(this->extras.zero_point == 0, "only int5 and int6 forms have a zero point");
    }
    integer = IntegerWeights{
        int8 ? 8 : form == Form::kInt4 ? 4 : form == Form::kInt5 ? 5 : 6,
        this->weights.data_ptr(),
        high,
        static_cast<int32_t>(this->extras.zero_point),
        this->d.data_ptr(),
        this->m.data_ptr(),
        factored ? reinterpret_cast<const uint16_t*>(this->extras.d_super.data_ptr<at::Half>()) : nullptr,
        factored ? reinterpret_cast<const uint16_t*>(this->extras.m_super.data_ptr<at::Half>()) : nullptr,
        this->d.scalar_type() == torch::kHalf,
        factored,
        factored ? (this->m.abs().max().item<int64_t>() != 0 && this->extras.m_super.abs().max().item<double>() != 0.0)
                 : this->m.abs().max().item<double>() != 0.0,
        this->bias.defined() ? this->bias.data_ptr<float>() : nullptr,
        K,
        N,
        K / this->d.size(1),
        this->weights.size(0)};
    return;
  }
  TORCH_CHECK(!planes, "int5 and int6 forms take int8 activations only");
  check_packed(this->weights, int8 ? torch::kInt8 : torch::kUInt8, 3, "q");
  K = (int8 ? 1 : 2) * this->weights.size(1);
  check_scales(this->d, this->m, K);
  integer.group = K / this->d.size(1);
  if (!kScalesInRegisters && this->d.scalar_type() == torch::kHalf) {  // exact: fp16 -> fp32
    this->d = this->d.to(torch::kFloat32);
    this->m = this->m.to(torch::kFloat32);
  }
}

int64_t PackedMatrix::units(int64_t M) const {
  const int64_t blocks = weights.size(0);
  if (integer_activations) return blocks;
  const int64_t width = fp32_blocks_per_unit(M);
  return (blocks + width - 1) / width;
}

void PackedMatrix::run_units(const float* x, const QuantisedRows* quantised, int64_t M, float* y, int64_t begin,
                             int64_t end) const {
  if (begin >= end || M == 0) return;
  if (integer_activations) {
    integer_linear_blocks(*quantised, integer, y, begin, end);
    return;
  }
  if (form != Form::kFp32 && kScalesInRegisters && d.scalar_type() == torch::kHalf)
    fp32_activation_units<uint16_t>(*this, x, M, y, begin, end);
  else
    fp32_activation_units<float>(*this, x, M, y, begin, end);
  if (bias.defined()) {  // as y += bias: one fp32 addition per output
    const int64_t width = fp32_blocks_per_unit(M) * kLanes;
    const int64_t first = begin * width, last = std::min(end * width, N);
    const float* b = bias.data_ptr<float>();
    for (int64_t r = 0; r < M; ++r)
      for (int64_t n = first; n < last; ++n) y[r * N + n] += b[n];
  }
}

torch::Tensor PackedMatrix::operator()(const torch::Tensor& rows) const {
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.scalar_type() == torch::kFloat32,
              "x must be [M, K] fp32");
  TORCH_CHECK(rows.size(1) == K, "x has ", rows.size(1), " inputs, the weight ", K);
  const int64_t M = rows.size(0);
  auto y = torch::empty({M, N}, rows.options());
  if (M == 0) return y;
  const float* x = rows.data_ptr<float>();
  float* out = y.data_ptr<float>();
  QuantisedRows quantised;
  if (integer_activations) quantised.resize(M, K, integer.group);
  const int64_t total = units(M);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total)));
#pragma omp parallel num_threads(threads)
  {
    const int thread = omp_get_thread_num(), team = omp_get_num_threads();
    if (integer_activations) {
      const auto [first, last] = thread_share(M, thread, team);
      quantised.quantise(x, first, last);
#pragma omp barrier
    }
    const auto [begin, end] = thread_share(total, thread, team);
    run_units(x, &quantised, M, out, begin, end);
  }
  return y;
}
