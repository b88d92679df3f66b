// What this CPU can do, measured with the instructions the kernels use: read bandwidth from memory,
// fp32 fused multiply-adds and int8 dot products per second (lookahead/benchmarks/roofline.py).
#include "roofline.h"

#include <chrono>

#include "parallel.h"
#include "simd.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

volatile float float_sink;
volatile int32_t int_sink;

}  // namespace

double read_bandwidth(const torch::Tensor& buffer, int64_t threads, int64_t repeats) {
  TORCH_CHECK(buffer.is_contiguous() && buffer.scalar_type() == torch::kFloat32 && buffer.numel() % 256 == 0,
              "buffer must be contiguous fp32, a multiple of 256 values");
  const float* data = buffer.data_ptr<float>();
  const int64_t vectors = buffer.numel() / 16;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const auto [first, last] = thread_share(vectors / 16, omp_get_thread_num(), omp_get_num_threads());
    F32x16 acc[4] = {F32x16::zero(), F32x16::zero(), F32x16::zero(), F32x16::zero()};
    for (int64_t repeat = 0; repeat < repeats; ++repeat)
      for (int64_t v = first * 16; v < last * 16; v += 4)
        for (int j = 0; j < 4; ++j) acc[j] = F32x16::add(acc[j], F32x16::load(data + (v + j) * 16));
    float_sink = reduce_add(F32x16::add(F32x16::add(acc[0], acc[1]), F32x16::add(acc[2], acc[3])));
  }
  return static_cast<double>(buffer.numel()) * 4 * repeats / seconds_since(start);
}

double fma_peak(int64_t threads, int64_t iterations) {
  constexpr int kChains = 12;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    F32x16 acc[kChains];
    for (int j = 0; j < kChains; ++j) acc[j] = F32x16::broadcast(static_cast<float>(j));
    const F32x16 a = F32x16::broadcast(0.999f), b = F32x16::broadcast(0.001f);
    for (int64_t i = 0; i < iterations; ++i)
#pragma GCC unroll 12
      for (int j = 0; j < kChains; ++j) acc[j] = F32x16::fmadd(acc[j], a, b);
    F32x16 total = F32x16::zero();
    for (int j = 0; j < kChains; ++j) total = F32x16::add(total, acc[j]);
    float_sink = reduce_add(total);
  }
  return 2.0 * 16 * kChains * iterations * threads / seconds_since(start);
}

double int8_dot_peak(int64_t threads, int64_t iterations) {
  constexpr int kChains = 12;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    // The int4 kernel's inner step: unsigned nibbles by signed activations (its lanes may wrap
    // here; only the rate counts).
    NibbleSums sums[kChains];
    for (int j = 0; j < kChains; ++j) sums[j] = NibbleSums::zero();
    alignas(64) uint8_t bytes[64];
    for (int i = 0; i < 64; ++i) bytes[i] = static_cast<uint8_t>(i & 15);
    const Q8x64 w = Q8x64::load(bytes);
    const int32_t x = 0x01FF01FF;
    for (int64_t i = 0; i < iterations; ++i)
#pragma GCC unroll 12
      for (int j = 0; j < kChains; ++j) sums[j].add(w, x);
    F32x16 total = F32x16::zero();
    for (int j = 0; j < kChains; ++j) total = F32x16::add(total, sums[j].total().to_float());
    int_sink = static_cast<int32_t>(reduce_add(total));
  }
  return 2.0 * 64 * kChains * iterations * threads / seconds_since(start);
}
