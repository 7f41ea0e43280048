// What the CPU kernels in this folder share: bf16 as raw bits, and an exp that vectorizes.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pagedserve {

using bf16_bits = uint16_t;  // bf16 read as its raw bits

inline float to_float(float x) { return x; }
inline float to_float(bf16_bits x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// float -> bf16 bits, round to nearest even (as c10::BFloat16), branch-free so that loops vectorize
inline bf16_bits round_bf16(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded_bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<bf16_bits>(x != x ? 0x7FC0u : rounded_bits);  // NaN stays a quiet NaN
}

// exp(x) in float32 (Cephes' expf: range reduction by ln 2, degree-6 polynomial, relative
// error ~1e-7), written so that a loop over it vectorizes (with -fno-trapping-math). exp(0)
// is exactly 1.
inline float exp_approx(float x) {
  x = std::max(-87.0f, std::min(88.0f, x));
  // floor(x log2 e + 1/2), as a truncation of a positive number: floor itself does not vectorize here
  const float n = static_cast<float>(static_cast<int32_t>(x * 1.44269504088896341f + 128.5f) - 128);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}

}  // namespace pagedserve
