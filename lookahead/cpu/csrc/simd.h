// Sixteen lanes (one packed block of outputs) on the instruction set this build targets: one zmm
// register with AVX-512, a pair of ymm registers with AVX2 + FMA + F16C.
//
// F32x16: sixteen fp32 lanes. Each lane's arithmetic is the same IEEE operation (a fused
// multiply-add, an exact integer or fp16 widening, a correctly rounded division) on both, and the
// reductions across lanes add in one fixed order, so every variant of the kernel computes the
// same bits.
//
// I32x16 and Q8x64: sixteen int32 lanes, and the 64 bytes of four consecutive inputs of sixteen
// outputs that feed them. `dot_unsigned` adds to each lane the dot product of its four unsigned
// bytes (weights in 0..15) with four signed bytes (a quantised activation), `dot_signed` the same
// with signed weights: VNNI's vpdpbusd where there is one, AVX2's vpmaddubsw + vpmaddwd elsewhere,
// exact in int32 either way, so every variant computes the same integers.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)

struct F32x16 {
  __m512 v;

  static F32x16 zero() { return {_mm512_setzero_ps()}; }
  static F32x16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static F32x16 broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static F32x16 fmadd(const F32x16& a, const F32x16& b, const F32x16& c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static F32x16 add(const F32x16& a, const F32x16& b) { return {_mm512_add_ps(a.v, b.v)}; }
  static F32x16 sub(const F32x16& a, const F32x16& b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static F32x16 mul(const F32x16& a, const F32x16& b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static F32x16 div(const F32x16& a, const F32x16& b) { return {_mm512_div_ps(a.v, b.v)}; }
  static F32x16 max(const F32x16& a, const F32x16& b) { return {_mm512_max_ps(a.v, b.v)}; }
  static F32x16 min(const F32x16& a, const F32x16& b) { return {_mm512_min_ps(a.v, b.v)}; }
  static F32x16 abs(const F32x16& a) { return {_mm512_abs_ps(a.v)}; }
  static F32x16 from_half(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static F32x16 from_int8(__m128i bytes) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))}; }
  static F32x16 from_uint8(__m128i bytes) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes))}; }
  // Lanes (i, i + 8) first: the same order as the AVX2 pair of registers (lo + hi).
  __m256 halves_added() const {
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(lo, hi);
  }
  // Rounded to the nearest integer, ties to even (the default rounding mode), as int32 lanes.
  __m512i to_int32() const { return _mm512_cvtps_epi32(v); }
  // 2^n for integer lanes n in [-126, 127].
  static F32x16 pow2(__m512i n) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23))};
  }
  static F32x16 from_int32(__m512i n) { return {_mm512_cvtepi32_ps(n)}; }
  // Rounded to the nearest integer (ties to even) into 16 bytes; the lanes must be within -128..127.
  void round_to_int8(int8_t* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_first(float* p, int64_t n) const { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
  // As IEEE halves, rounded to the nearest (ties to even), as the AVX2 variant rounds.
  void store_half(uint16_t* p) const {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, kRound));
  }
};

struct I32x16 {
  __m512i v;

  static I32x16 zero() { return {_mm512_setzero_si512()}; }
  static I32x16 broadcast(int32_t x) { return {_mm512_set1_epi32(x)}; }
  F32x16 to_float() const { return {_mm512_cvtepi32_ps(v)}; }
};

struct Q8x64 {
  __m512i v;

  static Q8x64 load(const void* p) { return {_mm512_loadu_si512(p)}; }
  void store(void* p) const { _mm512_storeu_si512(p, v); }
  Q8x64 low_nibbles() const { return {_mm512_and_si512(v, _mm512_set1_epi8(0x0F))}; }
  Q8x64 high_nibbles() const { return {_mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F))}; }
  // This | (each byte of `high` moved so that its bit `position` lands on bit 4) & mask. The shifts
  // are of 16-bit lanes: for the positions used (bits 4..5 read from 0..7 of the same byte) no bit
  // of the neighbouring byte reaches the mask.
  Q8x64 with_high(const Q8x64& high, int position, int mask) const {
    const __m512i moved = position >= 4 ? _mm512_srl_epi16(high.v, _mm_cvtsi32_si128(position - 4))
                                        : _mm512_sll_epi16(high.v, _mm_cvtsi32_si128(4 - position));
    return {_mm512_ternarylogic_epi32(v, moved, _mm512_set1_epi8(static_cast<char>(mask)), 0xF8)};  // v | (moved & mask)
  }
};

constexpr const char* kInstructionSet = "avx512";
// Register budget (32 zmm): up to 4 rows 4 blocks wide, else up to 12 rows 2 blocks wide; an
// integer form's scales stay in registers for their span of inputs.
constexpr int64_t kFewRows = 4, kWideBlocks = 4, kBlocks = 2, kMaxRows = 12;
constexpr bool kScalesInRegisters = true;
// From this many row tiles on, integer blocks are rebuilt once per group (packed_linear.cpp).
constexpr int64_t kRebuildTiles = 8;
// Attention's fp32 accumulators held in registers at once (fused_stack.cpp).
constexpr int64_t kAttentionAccumulators = 16;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr const char* kIntegerDot = "avx512-vnni";
inline I32x16 dot_unsigned(const I32x16& acc, const Q8x64& u, int32_t x4) {
  return {_mm512_dpbusd_epi32(acc.v, u.v, _mm512_set1_epi32(x4))};
}
// Signed weights w enter vpdpbusd as w + 128 (unsigned): each lane then holds its dot product plus
// 128 x the sum of the four activations, which `signed_start` takes off beforehand, per group.
struct SignedQ8x64 {
  __m512i biased;
};
inline SignedQ8x64 signed_weights(const Q8x64& w) { return {_mm512_xor_si512(w.v, _mm512_set1_epi8(-128))}; }
inline I32x16 dot_signed(const I32x16& acc, const SignedQ8x64& w, int32_t x4) {
  return {_mm512_dpbusd_epi32(acc.v, w.biased, _mm512_set1_epi32(x4))};
}
inline I32x16 signed_start(int32_t activation_sum) { return I32x16::broadcast(-128 * activation_sum); }
// Integer tiles: rows x blocks of int32 and fp32 accumulators. A scale group's chunks unroll: with
// a run-time count GCC copies every sum between registers on each pass.
constexpr int64_t kIntFewRows = 2, kIntWideBlocks = 4, kIntBlocks = 2, kIntMaxRows = 6;
constexpr bool kIntUnrollGroups = true;
// From this many row tiles on, int5 / int6 blocks and factored scales are prepared once for all
// tiles (integer_linear.cpp).
constexpr int64_t kIntPrepareTiles = 4;
#define LOOKAHEAD_DOT_INTO_INT32 1
#else
#error "the avx512 variant needs AVX512-VNNI and AVX512BW (-mavx512vnni -mavx512bw)"
#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

struct F32x16 {
  __m256 lo, hi;

  static F32x16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F32x16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static F32x16 broadcast(float x) {
    const __m256 v = _mm256_set1_ps(x);
    return {v, v};
  }
  static F32x16 fmadd(const F32x16& a, const F32x16& b, const F32x16& c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  static F32x16 add(const F32x16& a, const F32x16& b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static F32x16 sub(const F32x16& a, const F32x16& b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static F32x16 mul(const F32x16& a, const F32x16& b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static F32x16 div(const F32x16& a, const F32x16& b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  static F32x16 max(const F32x16& a, const F32x16& b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  static F32x16 min(const F32x16& a, const F32x16& b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
  static F32x16 abs(const F32x16& a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
  }
  static F32x16 from_half(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static F32x16 from_int8(__m128i bytes) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
  }
  static F32x16 from_uint8(__m128i bytes) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))};
  }
  __m256 halves_added() const { return _mm256_add_ps(lo, hi); }
  struct Int32 {
    __m256i lo, hi;
  };
  Int32 to_int32() const { return {_mm256_cvtps_epi32(lo), _mm256_cvtps_epi32(hi)}; }
  static F32x16 pow2(const Int32& n) {
    const __m256i bias = _mm256_set1_epi32(127);
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n.lo, bias), 23)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n.hi, bias), 23))};
  }
  static F32x16 from_int32(const Int32& n) { return {_mm256_cvtepi32_ps(n.lo), _mm256_cvtepi32_ps(n.hi)}; }
  void round_to_int8(int8_t* p) const {
    // packs works within 128-bit lanes: 0xD8 puts the four quarters back in order.
    const __m256i words =
        _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(lo), _mm256_cvtps_epi32(hi)), 0xD8);
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  void store_first(float* p, int64_t n) const {
    float lanes[16];
    store(lanes);
    std::memcpy(p, lanes, static_cast<size_t>(n) * sizeof(float));
  }
  void store_half(uint16_t* p) const {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(lo, kRound));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(hi, kRound));
  }
};

struct I32x16 {
  __m256i lo, hi;

  static I32x16 zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static I32x16 broadcast(int32_t x) {
    const __m256i v = _mm256_set1_epi32(x);
    return {v, v};
  }
  F32x16 to_float() const { return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)}; }
};

struct Q8x64 {
  __m256i lo, hi;

  static Q8x64 load(const void* p) {
    const auto* q = reinterpret_cast<const __m256i*>(p);
    return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
  }
  void store(void* p) const {
    auto* q = reinterpret_cast<__m256i*>(p);
    _mm256_storeu_si256(q, lo);
    _mm256_storeu_si256(q + 1, hi);
  }
  Q8x64 low_nibbles() const {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(lo, mask), _mm256_and_si256(hi, mask)};
  }
  Q8x64 high_nibbles() const {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(_mm256_srli_epi16(lo, 4), mask), _mm256_and_si256(_mm256_srli_epi16(hi, 4), mask)};
  }
  // As the AVX-512 variant's.
  Q8x64 with_high(const Q8x64& high, int position, int mask) const {
    const __m128i count = _mm_cvtsi32_si128(position >= 4 ? position - 4 : 4 - position);
    const __m256i keep = _mm256_set1_epi8(static_cast<char>(mask));
    const auto moved = [&](__m256i bits) {
      return _mm256_and_si256(position >= 4 ? _mm256_srl_epi16(bits, count) : _mm256_sll_epi16(bits, count), keep);
    };
    return {_mm256_or_si256(lo, moved(high.lo)), _mm256_or_si256(hi, moved(high.hi))};
  }
};

constexpr const char* kInstructionSet = "avx2";
// Register budget (16 ymm, two per block): one or two rows 2 blocks wide, else up to 6 rows 1
// block wide. The accumulators take most registers, so an integer form's scales are read from
// memory (fp32: an operand of the multiply-add) at every use, and a forward of more than one
// tile rebuilds each group's weights once.
constexpr int64_t kFewRows = 2, kWideBlocks = 2, kBlocks = 1, kMaxRows = 6;
constexpr bool kScalesInRegisters = false;
constexpr int64_t kRebuildTiles = 2;
constexpr int64_t kAttentionAccumulators = 4;
// Integer tiles (two int32 and two fp32 registers per row and block). Unrolling a scale group's
// chunks would spill: sixteen registers do not hold them.
constexpr int64_t kIntFewRows = 1, kIntWideBlocks = 2, kIntBlocks = 1, kIntMaxRows = 2;
constexpr bool kIntUnrollGroups = false;
constexpr int64_t kIntPrepareTiles = 3;

#if defined(__AVXVNNI__)
constexpr const char* kIntegerDot = "avx-vnni";
inline I32x16 dot_unsigned(const I32x16& acc, const Q8x64& u, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {_mm256_dpbusd_avx_epi32(acc.lo, u.lo, x), _mm256_dpbusd_avx_epi32(acc.hi, u.hi, x)};
}
struct SignedQ8x64 {
  __m256i lo, hi;  // w + 128, as in the AVX-512 variant
};
inline SignedQ8x64 signed_weights(const Q8x64& w) {
  const __m256i flip = _mm256_set1_epi8(-128);
  return {_mm256_xor_si256(w.lo, flip), _mm256_xor_si256(w.hi, flip)};
}
inline I32x16 dot_signed(const I32x16& acc, const SignedQ8x64& w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {_mm256_dpbusd_avx_epi32(acc.lo, w.lo, x), _mm256_dpbusd_avx_epi32(acc.hi, w.hi, x)};
}
inline I32x16 signed_start(int32_t activation_sum) { return I32x16::broadcast(-128 * activation_sum); }
#define LOOKAHEAD_DOT_INTO_INT32 1
#else
constexpr const char* kIntegerDot = "avx2";
// vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16 (saturating), vpmaddwd
// adds those pairs into int32. Weights in 0..15 against activations in -127..127 stay far from
// int16's limits: 2 x 15 x 127 = 3810.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline I32x16 dot_unsigned(const I32x16& acc, const Q8x64& u, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {dot4(acc.lo, u.lo, x), dot4(acc.hi, u.hi, x)};
}
// Signed weights as ggml multiplies them: |w| (unsigned) by the activation with the sign of w, so
// that a pair stays within int16: 2 x 128 x 127 = 32512.
struct SignedQ8x64 {
  __m256i abs_lo, abs_hi, lo, hi;
};
inline SignedQ8x64 signed_weights(const Q8x64& w) {
  return {_mm256_abs_epi8(w.lo), _mm256_abs_epi8(w.hi), w.lo, w.hi};
}
inline I32x16 dot_signed(const I32x16& acc, const SignedQ8x64& w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {dot4(acc.lo, w.abs_lo, _mm256_sign_epi8(x, w.lo)), dot4(acc.hi, w.abs_hi, _mm256_sign_epi8(x, w.hi))};
}
inline I32x16 signed_start(int32_t) { return I32x16::zero(); }

// The dot products of unsigned nibbles over one group of inputs, kept as vpmaddubsw's int16 pair
// sums until the group ends (one vpmaddwd then, not one per four inputs): a group of 32 inputs adds
// 8 pairs per int16 lane, at most 8 x 3810 = 30480 < 32767.
struct NibbleSums {
  __m256i lo, hi;

  static NibbleSums zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  void add(const Q8x64& u, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
    lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(u.lo, x));
    hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(u.hi, x));
  }
  I32x16 total() const {
    const __m256i ones = _mm256_set1_epi16(1);
    return {_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)};
  }
};
#endif

#else
#error "the packed kernel needs AVX-512 (-mavx512f -mavx512vl -mfma) or AVX2 (-mavx2 -mfma -mf16c)"
#endif

#if defined(LOOKAHEAD_DOT_INTO_INT32)
// With VNNI the dot products go straight into int32 lanes.
struct NibbleSums {
  I32x16 acc;

  static NibbleSums zero() { return {I32x16::zero()}; }
  void add(const Q8x64& u, int32_t x4) { acc = dot_unsigned(acc, u, x4); }
  I32x16 total() const { return acc; }
};
#endif

// The dot products of unsigned bytes u = q + zero point over one group of inputs, in int32 lanes
// from the start, which takes the zero point times the group's activation sum off. Any u up to 63
// on every variant: a vpmaddubsw pair stays within int16 (2 x 63 x 127 = 16002).
struct OffsetSums {
  I32x16 acc;

  static OffsetSums start(int32_t correction) { return {I32x16::broadcast(correction)}; }
  void add(const Q8x64& u, int32_t x4) { acc = dot_unsigned(acc, u, x4); }
  I32x16 total() const { return acc; }
};

// The dot products of signed bytes over one group of inputs, in int32 lanes from the start
// (`signed_start`: what a variant's trick adds takes the group's activation sum off).
struct SignedSums {
  I32x16 acc;

  static SignedSums start(int32_t activation_sum) { return {signed_start(activation_sum)}; }
  void add(const SignedQ8x64& w, int32_t x4) { acc = dot_signed(acc, w, x4); }
  I32x16 total() const { return acc; }
};

// The sum of the sixteen lanes, added in one fixed order on every variant: lanes (i, i + 8), then
// (i, i + 4), (i, i + 2), (i, i + 1).
inline float reduce_add(const F32x16& x) {
  const __m256 eight = x.halves_added();
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  const __m128 one = _mm_add_ss(two, _mm_shuffle_ps(two, two, 1));
  return _mm_cvtss_f32(one);
}

// Sixteen reductions at once: lane k of the result is reduce_add(x[k]), bit for bit (the same
// pairs added in the same tree, four levels of shuffles shared by all sixteen).
inline F32x16 reduce_add16(const F32x16 (&x)[16]) {
#if defined(__AVX512F__)
  __m512 pairs[8], quads[4], octets[2];
  for (int m = 0; m < 8; ++m)  // (i, i + 8): key 2m in lanes 0..7, key 2m + 1 in lanes 8..15
    pairs[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m].v, x[2 * m + 1].v, 0x44),
                             _mm512_shuffle_f32x4(x[2 * m].v, x[2 * m + 1].v, 0xEE));
  for (int m = 0; m < 4; ++m)  // (i, i + 4): key 4m + j in quarter j
    quads[m] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2 * m], pairs[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(pairs[2 * m], pairs[2 * m + 1], 0xDD));
  for (int m = 0; m < 2; ++m)  // (i, i + 2): quarter j holds keys 8m + j and 8m + 4 + j
    octets[m] = _mm512_add_ps(_mm512_shuffle_ps(quads[2 * m], quads[2 * m + 1], 0x44),
                              _mm512_shuffle_ps(quads[2 * m], quads[2 * m + 1], 0xEE));
  // (i, i + 1): lane 4j + i holds key 4i + j; a 4 x 4 transpose puts key k in lane k.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(octets[0], octets[1], 0x88),
                                    _mm512_shuffle_ps(octets[0], octets[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(order, sums)};
#else
  __m256 eights[16], fours[8], twos[4], ones[2];
  for (int k = 0; k < 16; ++k) eights[k] = _mm256_add_ps(x[k].lo, x[k].hi);  // (i, i + 8)
  for (int m = 0; m < 8; ++m)  // (i, i + 4): key 2m + h in half h
    fours[m] = _mm256_add_ps(_mm256_permute2f128_ps(eights[2 * m], eights[2 * m + 1], 0x20),
                             _mm256_permute2f128_ps(eights[2 * m], eights[2 * m + 1], 0x31));
  for (int m = 0; m < 4; ++m)  // (i, i + 2): half h holds keys 4m + h and 4m + 2 + h
    twos[m] = _mm256_add_ps(_mm256_shuffle_ps(fours[2 * m], fours[2 * m + 1], 0x44),
                            _mm256_shuffle_ps(fours[2 * m], fours[2 * m + 1], 0xEE));
  for (int m = 0; m < 2; ++m)  // (i, i + 1): lane 4h + i holds key 8m + h + 2i
    ones[m] = _mm256_add_ps(_mm256_shuffle_ps(twos[2 * m], twos[2 * m + 1], 0x88),
                            _mm256_shuffle_ps(twos[2 * m], twos[2 * m + 1], 0xDD));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return {_mm256_permutevar8x32_ps(ones[0], order), _mm256_permutevar8x32_ps(ones[1], order)};
#endif
}

// The largest lane (exact in any order).
inline float reduce_max(const F32x16& x) {
  float lanes[16];
  x.store(lanes);
  float best = lanes[0];
  for (int i = 1; i < 16; ++i) best = lanes[i] > best ? lanes[i] : best;
  return best;
}

// e^x lane by lane (Cephes' single-precision polynomial, relative error ~2e-7), from the same
// operations on every variant. Inputs below -87.3 give 2^-126 * e^(x + 87.3...) clamped there, so
// what would be a denormal or zero is ~1e-38.
inline F32x16 exp(const F32x16& input) {
  const F32x16 x = F32x16::max(F32x16::min(input, F32x16::broadcast(88.3762626647949f)),
                               F32x16::broadcast(-87.3365447505531f));
  const auto n = F32x16::mul(x, F32x16::broadcast(1.44269504088896341f)).to_int32();
  const F32x16 nf = F32x16::from_int32(n);
  F32x16 r = F32x16::fmadd(nf, F32x16::broadcast(-0.693359375f), x);
  r = F32x16::fmadd(nf, F32x16::broadcast(2.12194440e-4f), r);
  F32x16 p = F32x16::broadcast(1.9875691500e-4f);
  p = F32x16::fmadd(p, r, F32x16::broadcast(1.3981999507e-3f));
  p = F32x16::fmadd(p, r, F32x16::broadcast(8.3334519073e-3f));
  p = F32x16::fmadd(p, r, F32x16::broadcast(4.1665795894e-2f));
  p = F32x16::fmadd(p, r, F32x16::broadcast(1.6666665459e-1f));
  p = F32x16::fmadd(p, r, F32x16::broadcast(5.0000001201e-1f));
  const F32x16 y = F32x16::add(F32x16::fmadd(p, F32x16::mul(r, r), r), F32x16::broadcast(1.0f));
  return F32x16::mul(y, F32x16::pow2(n));
}
