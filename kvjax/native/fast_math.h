// Vectorisable float math shared by the native kernels (kvjax/native/*.cc).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// The polynomial of fast_exp: exp(r) for r in [-ln2/2, ln2/2], degree 6, relative error
// ~2e-7. T is float or a GCC vector of floats (decode_attention.cc's vexp).
template <typename T>
static inline T fast_exp_poly(T r) {
  T p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (scores minus their running max), vectorisable: Cody-Waite range
// reduction and fast_exp_poly; relative error ~2e-7. Inputs below -87 give ~0.
#pragma omp declare simd
static inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float log2e = 1.44269504088896341f;
  float n = std::nearbyint(x * log2e);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const float p = fast_exp_poly(r);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
