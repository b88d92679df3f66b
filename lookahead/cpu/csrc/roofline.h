// Peak rates of this CPU on this variant's instructions (roofline.cpp): bytes read per second from
// a buffer larger than the caches, and operations (a multiply-add counts two) per second of fp32
// FMA and of int8 dot products, on `threads` threads.
#pragma once

#include <torch/extension.h>

double read_bandwidth(const torch::Tensor& buffer, int64_t threads, int64_t repeats);
double fma_peak(int64_t threads, int64_t iterations);
double int8_dot_peak(int64_t threads, int64_t iterations);
