// Sixteen fp32 lanes (one packed block of outputs) on the instruction set this build targets: one
// zmm register with AVX-512, a pair of ymm registers with AVX2 + FMA + F16C. Each lane's arithmetic
// is the same IEEE operation (a fused multiply-add, an exact integer or fp16 widening) on both, so
// every variant of the kernel computes the same bits.
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
  static F32x16 from_half(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static F32x16 from_int8(__m128i bytes) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))}; }
  static F32x16 from_uint8(__m128i bytes) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes))}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_first(float* p, int64_t n) const { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
};

constexpr const char* kInstructionSet = "avx512";
// Register budget (32 zmm): up to 4 rows 4 blocks wide, else up to 12 rows 2 blocks wide; an
// integer form's scales stay in registers for their span of inputs.
constexpr int64_t kFewRows = 4, kWideBlocks = 4, kBlocks = 2, kMaxRows = 12;
constexpr bool kScalesInRegisters = true;
// From this many row tiles on, integer blocks are rebuilt once per group (packed_linear.cpp).
constexpr int64_t kRebuildTiles = 8;

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
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  void store_first(float* p, int64_t n) const {
    float lanes[16];
    store(lanes);
    std::memcpy(p, lanes, static_cast<size_t>(n) * sizeof(float));
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

#else
#error "the packed kernel needs AVX-512 (-mavx512f -mavx512vl -mfma) or AVX2 (-mavx2 -mfma -mf16c)"
#endif
