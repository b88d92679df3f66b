// See integer_linear.h. Tiles of rows x blocks (of 16 outputs) keep an int32 accumulator per row
// and block for the current group of inputs and an fp32 one for the whole row; the weights of a
// chunk of 8 inputs are loaded once per tile and meet every row of it.
#include "integer_linear.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;  // inputs per activation scale

// Four-input chunks of the int4 form: one load of 64 bytes holds inputs k..k+3 (low nibbles) and
// k+4..k+7 (high nibbles) of 16 outputs.
struct Int4Chunks {
  using Prepared = Q8x64;
  const uint8_t* q;
  int64_t K;

  void load(int64_t block, int64_t chunk, Prepared& first, Prepared& second) const {
    const Q8x64 bytes = Q8x64::load(q + (block * (K / 8) + chunk) * 64);
    first = bytes.low_nibbles();
    second = bytes.high_nibbles();
  }
  void prefetch(int64_t block, int64_t chunk) const {
    _mm_prefetch(reinterpret_cast<const char*>(q + (block * (K / 8) + chunk) * 64), _MM_HINT_T0);
  }
  using Sums = NibbleSums;
  Sums start(int32_t) const { return NibbleSums::zero(); }
};

// Nibbles plus one (int5) or two (int6) planes of high bits (integer_linear.h): u = q + zero_point
// in 0..31 or 0..63. One 64-byte vector of high bits serves a span of chunks.
template <int Planes>
struct PlaneChunks {
  static constexpr int64_t kSpan = 4 / Planes;
  static constexpr int kMask = Planes == 1 ? 0x10 : 0x30;
  using Prepared = Q8x64;
  const uint8_t* q;
  const uint8_t* high;
  int64_t K;
  int32_t zero_point;

  void load(int64_t block, int64_t chunk, Prepared& first, Prepared& second) const {
    const Q8x64 bytes = Q8x64::load(q + (block * (K / 8) + chunk) * 64);
    const Q8x64 bits = Q8x64::load(high + (block * (K / 8 / kSpan) + chunk / kSpan) * 64);
    const int half = 2 * static_cast<int>(chunk % kSpan);
    first = bytes.low_nibbles().with_high(bits, (4 + Planes * half) % 8, kMask);
    second = bytes.high_nibbles().with_high(bits, (4 + Planes * (half + 1)) % 8, kMask);
  }
  void prefetch(int64_t block, int64_t chunk) const {
    _mm_prefetch(reinterpret_cast<const char*>(q + (block * (K / 8) + chunk) * 64), _MM_HINT_T0);
    if (chunk % kSpan == 0)
      _mm_prefetch(reinterpret_cast<const char*>(high + (block * (K / 8 / kSpan) + chunk / kSpan) * 64),
                   _MM_HINT_T0);
  }
  using Sums = OffsetSums;
  Sums start(int32_t activation_sum) const { return OffsetSums::start(-zero_point * activation_sum); }

  // Every chunk of `block` as the bytes load() gives, [K / 8][2][64], into `out`.
  void unpack(int64_t block, uint8_t* out) const {
    for (int64_t c = 0; c < K / 8; ++c) {
      Q8x64 first, second;
      load(block, c, first, second);
      first.store(out + c * 128);
      second.store(out + c * 128 + 64);
    }
  }
};

// Blocks of a PlaneChunks form unpacked into bytes (PlaneChunks::unpack), from block `first_block`
// on: two loads per chunk, for the row tiles that would each unpack them again.
struct UnpackedChunks {
  using Prepared = Q8x64;
  const uint8_t* u;
  int64_t first_block;
  int64_t K;
  int32_t zero_point;

  void load(int64_t block, int64_t chunk, Prepared& first, Prepared& second) const {
    const uint8_t* p = u + ((block - first_block) * (K / 8) + chunk) * 128;
    first = Q8x64::load(p);
    second = Q8x64::load(p + 64);
  }
  void prefetch(int64_t, int64_t) const {}
  using Sums = OffsetSums;
  Sums start(int32_t activation_sum) const { return OffsetSums::start(-zero_point * activation_sum); }
};

// The int8 form: two loads of 64 bytes per 8 inputs.
struct Int8Chunks {
  using Prepared = SignedQ8x64;
  const int8_t* q;
  int64_t K;

  void load(int64_t block, int64_t chunk, Prepared& first, Prepared& second) const {
    const int8_t* p = q + (block * (K / 4) + 2 * chunk) * 64;
    first = signed_weights(Q8x64::load(p));
    second = signed_weights(Q8x64::load(p + 64));
  }
  void prefetch(int64_t block, int64_t chunk) const {
    const char* p = reinterpret_cast<const char*>(q + (block * (K / 4) + 2 * chunk) * 64);
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 64, _MM_HINT_T0);
  }
  using Sums = SignedSums;
  Sums start(int32_t activation_sum) const { return SignedSums::start(activation_sum); }
};

// One (d, m) per group of a block, stored as Scale: uint16_t (fp16 bits) or float.
template <class Scale>
struct GroupScales {
  const Scale* d;
  const Scale* m;
  int64_t groups;
  int64_t first_block = 0;  // the block d and m start at

  static F32x16 lanes(const Scale* p) {
    if constexpr (std::is_same_v<Scale, float>)
      return F32x16::load(p);
    else
      return F32x16::from_half(p);
  }
  F32x16 d_at(int64_t block, int64_t g) const { return lanes(d + ((block - first_block) * groups + g) * kLanes); }
  F32x16 m_at(int64_t block, int64_t g) const { return lanes(m + ((block - first_block) * groups + g) * kLanes); }
};

// An int8 sub-scale per group times an fp16 super-scale per 256 inputs (2^shift groups): at most
// 11 x 8 significant bits, so the fp32 product is exact, the very value of the scale it factors.
struct FactoredScales {
  const int8_t* d;
  const int8_t* m;
  const uint16_t* d_super;
  const uint16_t* m_super;
  int64_t groups;
  int shift;

  F32x16 product(const uint16_t* super, const int8_t* sub, int64_t block, int64_t g) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + (block * groups + g) * kLanes));
    return F32x16::mul(F32x16::from_half(super + (block * (groups >> shift) + (g >> shift)) * kLanes),
                       F32x16::from_int8(bytes));
  }
  F32x16 d_at(int64_t block, int64_t g) const { return product(d_super, d, block, g); }
  F32x16 m_at(int64_t block, int64_t g) const { return product(m_super, m, block, g); }

  // The scales of `block` multiplied out, [groups][16] fp32 each (m only with `offsets`).
  void expand(int64_t block, float* d_out, float* m_out, bool offsets) const {
    for (int64_t g = 0; g < groups; ++g) {
      d_at(block, g).store(d_out + g * kLanes);
      if (offsets) m_at(block, g).store(m_out + g * kLanes);
    }
  }
};

template <class Chunks>
constexpr bool kUnpackable = false;
template <int Planes>
constexpr bool kUnpackable<PlaneChunks<Planes>> = true;
// Whether row tiles would each redo work on these weights that can be done once per block:
// unpacking int5 / int6 bytes, multiplying factored scales out.
template <class Chunks, class Scales>
constexpr bool kPreparable = kUnpackable<Chunks> || std::is_same_v<Scales, FactoredScales>;

inline int32_t four_bytes(const int8_t* p) {
  int32_t value;
  std::memcpy(&value, p, 4);
  return value;
}

// Rows [r0, r0 + Rows) x blocks [b0, b0 + Blocks). `next`: the first block of the tile that follows
// (prefetched while this one computes), or -1.
// GroupChunks: the chunks of 8 inputs in a scale group when fixed at compile time (kIntUnrollGroups:
// the chunk loop unrolls and every sum keeps its register), 0 to count them at run time.
template <int Rows, int Blocks, int GroupChunks, class Chunks, class Scales, bool Offsets>
void tile(const QuantisedRows& x, int64_t r0, const Chunks& w, const Scales& scales, const IntegerWeights& form,
          int64_t b0, float* y, int64_t next) {
  const int64_t K = form.K, group = form.group, groups = K / group;
  F32x16 acc[Rows][Blocks];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < Blocks; ++j) acc[r][j] = F32x16::zero();
  const int8_t* xq[Rows];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) xq[r] = x.q.data() + (r0 + r) * K;
  for (int64_t g = 0; g < groups; ++g) {
    typename Chunks::Sums sums[Rows][Blocks];
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const auto start = w.start(x.sums[(r0 + r) * groups + g]);
#pragma GCC unroll 16
      for (int j = 0; j < Blocks; ++j) sums[r][j] = start;
    }
    const auto chunk = [&](int64_t c) {
      typename Chunks::Prepared first[Blocks], second[Blocks];
#pragma GCC unroll 16
      for (int j = 0; j < Blocks; ++j) {
        w.load(b0 + j, c, first[j], second[j]);
        if (next >= 0) w.prefetch(next + j, c);
      }
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        const int32_t x0 = four_bytes(xq[r] + c * 8), x1 = four_bytes(xq[r] + c * 8 + 4);
#pragma GCC unroll 16
        for (int j = 0; j < Blocks; ++j) {
          sums[r][j].add(first[j], x0);
          sums[r][j].add(second[j], x1);
        }
      }
    };
    if constexpr (GroupChunks > 0) {
#pragma GCC unroll 4
      for (int i = 0; i < GroupChunks; ++i) chunk(g * GroupChunks + i);
    } else {
      for (int64_t c = g * (group / 8); c < (g + 1) * (group / 8); ++c) chunk(c);
    }
#pragma GCC unroll 16
    for (int j = 0; j < Blocks; ++j) {
      const F32x16 dw = scales.d_at(b0 + j, g);
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        const F32x16 dx = F32x16::broadcast(x.d[(r0 + r) * (K / kBlock) + g * group / kBlock]);
        acc[r][j] = F32x16::fmadd(F32x16::mul(dw, dx), sums[r][j].total().to_float(), acc[r][j]);
      }
      if constexpr (Offsets) {
        const F32x16 mw = scales.m_at(b0 + j, g);
#pragma GCC unroll 16
        for (int r = 0; r < Rows; ++r)
          acc[r][j] = F32x16::fmadd(mw, F32x16::broadcast(x.scaled_sums[(r0 + r) * groups + g]), acc[r][j]);
      }
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < Blocks; ++j) {
    const int64_t n = (b0 + j) * kLanes, left = form.N - n;
    F32x16 bias = F32x16::zero();
    if (form.bias) {
      if (left >= kLanes) {
        bias = F32x16::load(form.bias + n);
      } else {
        float lanes[kLanes] = {};
        std::memcpy(lanes, form.bias + n, left * sizeof(float));
        bias = F32x16::load(lanes);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const F32x16 out = form.bias ? F32x16::add(acc[r][j], bias) : acc[r][j];
      float* row = y + (r0 + r) * form.N + n;
      if (left >= kLanes)
        out.store(row);
      else
        out.store_first(row, left);
    }
  }
}

// tile<Rows, ...> with the group's chunk count fixed where the variant unrolls it: a group is 16 or 32
// inputs (PackedMatrix checks it).
template <int Rows, int Blocks, class Chunks, class Scales, bool Offsets>
void tile_of_group(const QuantisedRows& x, int64_t r0, const Chunks& w, const Scales& scales,
                   const IntegerWeights& form, int64_t b0, float* y, int64_t next) {
  if constexpr (kIntUnrollGroups) {
    if (form.group == 16) return tile<Rows, Blocks, 2, Chunks, Scales, Offsets>(x, r0, w, scales, form, b0, y, next);
    return tile<Rows, Blocks, 4, Chunks, Scales, Offsets>(x, r0, w, scales, form, b0, y, next);
  } else {
    return tile<Rows, Blocks, 0, Chunks, Scales, Offsets>(x, r0, w, scales, form, b0, y, next);
  }
}

template <int Blocks, class Chunks, class Scales, bool Offsets>
void tile_rows(int rows, const QuantisedRows& x, int64_t r0, const Chunks& w, const Scales& scales,
               const IntegerWeights& form, int64_t b0, float* y, int64_t next) {
  switch (rows) {
#define ROWS_CASE(R) \
  case R:            \
    return tile_of_group<R, Blocks, Chunks, Scales, Offsets>(x, r0, w, scales, form, b0, y, next);
    ROWS_CASE(1) ROWS_CASE(2)
#if defined(__AVX512F__)
    ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
#endif
#undef ROWS_CASE
  }
}

// blocks_range through many row tiles for weights kPreparable: each group of Blocks blocks (then
// single ones) is prepared once into buffers of this thread (int5 / int6 unpacked into bytes,
// factored scales multiplied out), which every row tile then reads.
template <int Blocks, class Chunks, class Scales, bool Offsets>
void prepared_range(const QuantisedRows& x, const Chunks& w, const Scales& scales, const IntegerWeights& form,
                    float* y, int64_t begin, int64_t end, int64_t rows_per_tile) {
  thread_local std::vector<uint8_t> bytes;
  thread_local std::vector<float> d, m;
  const int64_t block_bytes = form.K / 8 * 128, groups = form.K / form.group;
  if constexpr (kUnpackable<Chunks>) bytes.resize(Blocks * block_bytes);
  if constexpr (std::is_same_v<Scales, FactoredScales>) {
    d.resize(Blocks * groups * kLanes);
    m.resize(Blocks * groups * kLanes);
  }
  const auto run = [&]<int Width>(int64_t b) {
    const auto weights = [&] {
      if constexpr (kUnpackable<Chunks>) {
        for (int j = 0; j < Width; ++j) w.unpack(b + j, bytes.data() + j * block_bytes);
        return UnpackedChunks{bytes.data(), b, form.K, w.zero_point};
      } else {
        return w;
      }
    }();
    const auto prepared_scales = [&] {
      if constexpr (std::is_same_v<Scales, FactoredScales>) {
        for (int j = 0; j < Width; ++j)
          scales.expand(b + j, d.data() + j * groups * kLanes, m.data() + j * groups * kLanes, Offsets);
        return GroupScales<float>{d.data(), m.data(), groups, b};
      } else {
        return scales;
      }
    }();
    using PreparedChunks = std::decay_t<decltype(weights)>;
    using PreparedScales = std::decay_t<decltype(prepared_scales)>;
    const int64_t next = b + Width + Width <= end ? b + Width : -1;  // prefetched where still packed
    for (int64_t r0 = 0; r0 < x.rows; r0 += rows_per_tile) {
      const int rows = static_cast<int>(std::min(rows_per_tile, x.rows - r0));
      tile_rows<Width, PreparedChunks, PreparedScales, Offsets>(rows, x, r0, weights, prepared_scales, form, b, y,
                                                                r0 == 0 ? next : -1);
    }
  };
  int64_t b = begin;
  for (; b + Blocks <= end; b += Blocks) run.template operator()<Blocks>(b);
  for (; b < end; ++b) run.template operator()<1>(b);
}

// Blocks [begin, end): groups of Blocks blocks (then single ones), each through every row tile.
template <int Blocks, class Chunks, class Scales, bool Offsets>
void blocks_range(const QuantisedRows& x, const Chunks& w, const Scales& scales, const IntegerWeights& form, float* y,
                  int64_t begin, int64_t end, int64_t max_rows) {
  const int64_t M = x.rows;
  const int64_t tiles = (M + max_rows - 1) / max_rows;
  const int64_t rows_per_tile = (M + tiles - 1) / tiles;
  if constexpr (kPreparable<Chunks, Scales>) {
    if (tiles >= kIntPrepareTiles)
      return prepared_range<Blocks, Chunks, Scales, Offsets>(x, w, scales, form, y, begin, end, rows_per_tile);
  }
  int64_t b = begin;
  for (; b + Blocks <= end; b += Blocks) {
    const int64_t next = b + 2 * Blocks <= end ? b + Blocks : -1;
    for (int64_t r0 = 0; r0 < M; r0 += rows_per_tile) {
      const int rows = static_cast<int>(std::min(rows_per_tile, M - r0));
      tile_rows<Blocks, Chunks, Scales, Offsets>(rows, x, r0, w, scales, form, b, y, r0 == 0 ? next : -1);
    }
  }
  for (; b < end; ++b)
    for (int64_t r0 = 0; r0 < M; r0 += rows_per_tile) {
      const int rows = static_cast<int>(std::min(rows_per_tile, M - r0));
      tile_rows<1, Chunks, Scales, Offsets>(rows, x, r0, w, scales, form, b, y, -1);
    }
}

template <class Chunks, class Scales, bool Offsets>
void dispatch_rows(const QuantisedRows& x, const Chunks& w, const Scales& scales, const IntegerWeights& form, float* y,
                   int64_t begin, int64_t end) {
  if (x.rows <= kIntFewRows)
    blocks_range<kIntWideBlocks, Chunks, Scales, Offsets>(x, w, scales, form, y, begin, end, kIntFewRows);
  else
    blocks_range<kIntBlocks, Chunks, Scales, Offsets>(x, w, scales, form, y, begin, end, kIntMaxRows);
}

template <class Chunks, class Scales>
void dispatch_offsets(const QuantisedRows& x, const Chunks& w, const Scales& scales, const IntegerWeights& form,
                      float* y, int64_t begin, int64_t end) {
  if (form.offsets)
    dispatch_rows<Chunks, Scales, true>(x, w, scales, form, y, begin, end);
  else
    dispatch_rows<Chunks, Scales, false>(x, w, scales, form, y, begin, end);
}

template <class Chunks>
void dispatch_scales(const QuantisedRows& x, const Chunks& w, const IntegerWeights& form, float* y, int64_t begin,
                     int64_t end) {
  const int64_t groups = form.K / form.group;
  if (form.factored) {
    const FactoredScales scales{static_cast<const int8_t*>(form.d), static_cast<const int8_t*>(form.m),
                                form.d_super, form.m_super, groups, form.group == 16 ? 4 : 3};
    dispatch_offsets(x, w, scales, form, y, begin, end);
  } else if (form.half_scales) {
    const GroupScales<uint16_t> scales{static_cast<const uint16_t*>(form.d), static_cast<const uint16_t*>(form.m),
                                       groups};
    dispatch_offsets(x, w, scales, form, y, begin, end);
  } else {
    const GroupScales<float> scales{static_cast<const float*>(form.d), static_cast<const float*>(form.m), groups};
    dispatch_offsets(x, w, scales, form, y, begin, end);
  }
}

}  // namespace

void QuantisedRows::resize(int64_t rows_, int64_t K_, int64_t group_) {
  rows = rows_;
  K = K_;
  group = group_;
  q.resize(rows * K);
  d.resize(rows * (K / kBlock));
  sums.resize(rows * (K / group));
  scaled_sums.resize(rows * (K / group));
}

void QuantisedRows::quantise(const float* x, int64_t begin, int64_t end) {
  const int64_t blocks = K / kBlock, groups = K / group;
  for (int64_t r = begin; r < end; ++r) {
    const float* row = x + r * K;
    int8_t* out = q.data() + r * K;
    for (int64_t b = 0; b < blocks; ++b) {
      const F32x16 lo = F32x16::load(row + b * kBlock), hi = F32x16::load(row + b * kBlock + 16);
      const float amax = reduce_max(F32x16::max(F32x16::abs(lo), F32x16::abs(hi)));
      const float scale = amax / 127.0f;
      const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
      d[r * blocks + b] = scale;
      const F32x16 factor = F32x16::broadcast(inverse);
      F32x16::mul(lo, factor).round_to_int8(out + b * kBlock);
      F32x16::mul(hi, factor).round_to_int8(out + b * kBlock + 16);
    }
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t i = 0; i < group; ++i) sum += out[g * group + i];
      sums[r * groups + g] = sum;
      scaled_sums[r * groups + g] = d[r * blocks + g * group / kBlock] * static_cast<float>(sum);
    }
  }
}

void integer_linear_blocks(const QuantisedRows& x, const IntegerWeights& w, float* y, int64_t begin, int64_t end) {
  if (x.rows == 0 || begin >= end) return;
  const auto* nibbles = static_cast<const uint8_t*>(w.q);
  switch (w.bits) {
    case 4:
      return dispatch_scales(x, Int4Chunks{nibbles, w.K}, w, y, begin, end);
    case 5:
      return dispatch_scales(x, PlaneChunks<1>{nibbles, w.high, w.K, w.zero_point}, w, y, begin, end);
    case 6:
      return dispatch_scales(x, PlaneChunks<2>{nibbles, w.high, w.K, w.zero_point}, w, y, begin, end);
    default:
      return dispatch_scales(x, Int8Chunks{static_cast<const int8_t*>(w.q), w.K}, w, y, begin, end);
  }
}
