// The decoder layer's elementwise work on the CPU, one pass over memory per op instead of five to ten.
//
//   add_rms_norm   residual += x (in place), out = weight * rms_norm(residual)      (x may be absent)
//   rope_qkv       q, k rotated (rotate-half RoPE) out of the fused qkv rows, written contiguous
//   silu_and_mul   out = silu(gate) * up, from the fused gate_up rows
//
// Each rounds where transformers' torch code rounds: in bfloat16 the residual sum, the
// normalized row, the rotation's two products and its sum, and silu(gate) are each rounded to
// bfloat16 before the next operation, as separate torch ops would. Built with
// -ffp-contract=off so that float32 products and sums are not fused into FMAs either: rope and
// the residual sum come out bit for bit as torch's, the norm's reduction and silu's exp to
// float32 rounding.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bindings.h"
#include "cpu_math.h"
#include "entry_points.h"

namespace {

using pagedserve::bf16_bits;
using pagedserve::exp_approx;
using pagedserve::round_bf16;
using pagedserve::to_float;

inline void store(float* p, float x) { *p = x; }
inline void store(bf16_bits* p, float x) { *p = round_bf16(x); }
// x as stored in dtype T, read back as float
template <typename T>
inline float rounded(float x);
template <>
inline float rounded<float>(float x) {
  return x;
}
template <>
inline float rounded<bf16_bits>(float x) {
  return to_float(round_bf16(x));
}

template <typename T>
void add_rms_norm_impl(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t size, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> h(size);
    for (int64_t r = r0; r < r1; ++r) {
      T* res = residual + r * size;
      const T* xr = x ? x + r * size : nullptr;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < size; ++d) {
        float v = to_float(res[d]);
        if (xr) {
          v = rounded<T>(to_float(xr[d]) + v);
          store(res + d, v);
        }
        h[d] = v;
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(size) + eps);
      T* o = out + r * size;
#pragma omp simd
      for (int64_t d = 0; d < size; ++d) store(o + d, to_float(weight[d]) * rounded<T>(h[d] * inv));
    }
  });
}

template <typename T>
void rope_impl(const T* qkv, const int64_t* positions, const float* cos, const float* sin, T* q, T* k,
               int64_t tokens, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const int64_t row = (num_q_heads + 2 * num_kv_heads) * head_dim;
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> c(head_dim), s(head_dim);
    for (int64_t t = t0; t < t1; ++t) {
      const float* cr = cos + positions[t] * head_dim;
      const float* sr = sin + positions[t] * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {  // the tables cast to the activations' dtype, as torch does
        c[d] = rounded<T>(cr[d]);
        s[d] = rounded<T>(sr[d]);
      }
      const T* src = qkv + t * row;
      for (int64_t h = 0; h < num_q_heads + num_kv_heads; ++h) {
        const T* x = src + h * head_dim;
        T* dst = h < num_q_heads ? q + (t * num_q_heads + h) * head_dim
                                 : k + (t * num_kv_heads + h - num_q_heads) * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = rounded<T>(to_float(x[d]) * c[d]), b = rounded<T>(-to_float(x[d + half]) * s[d]);
          store(dst + d, a + b);
        }
#pragma omp simd
        for (int64_t d = half; d < head_dim; ++d) {
          const float a = rounded<T>(to_float(x[d]) * c[d]), b = rounded<T>(to_float(x[d - half]) * s[d]);
          store(dst + d, a + b);
        }
      }
    }
  });
}

template <typename T>
void silu_row(const T* __restrict g, const T* __restrict u, T* __restrict o, int64_t n) {
  for (int64_t d = 0; d < n; ++d) {
    const float x = to_float(g[d]);
    const float silu = rounded<T>(x / (1.0f + exp_approx(-x)));
    store(o + d, silu * to_float(u[d]));
  }
}

template <typename T>
void silu_and_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t size) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_row(gate_up + r * 2 * size, gate_up + r * 2 * size + size, out + r * size, size);
  });
}

bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == at::kBFloat16; }
template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check_float(const torch::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous() &&
                        (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
                    what, " must be a contiguous float32 or bfloat16 CPU tensor");
}

}  // namespace

// residual [rows, size] (updated in place: += x), x [rows, size] or an empty tensor, weight [size].
// Returns weight * rms_norm(residual) [rows, size].
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  check_float(residual, "add_rms_norm: residual");
  check_float(weight, "add_rms_norm: weight");
  const bool has_x = x.numel() > 0;
  if (has_x) {
    check_float(x, "add_rms_norm: x");
    TORCH_CHECK_VALUE(x.sizes() == residual.sizes(), "add_rms_norm: x and residual shapes differ");
  }
  TORCH_CHECK_VALUE(residual.dim() == 2 && weight.dim() == 1 && weight.size(0) == residual.size(1),
                    "add_rms_norm: residual [rows, size] and weight [size] expected");
  TORCH_CHECK_VALUE(residual.scalar_type() == weight.scalar_type() && (!has_x || x.scalar_type() == residual.scalar_type()),
                    "add_rms_norm: one dtype for x, residual and weight");
  auto out = torch::empty_like(residual);
  const int64_t rows = residual.size(0), size = residual.size(1);
  if (is_bf16(residual)) {
    add_rms_norm_impl<bf16_bits>(has_x ? ptr<bf16_bits>(x) : nullptr, ptr<bf16_bits>(residual), ptr<bf16_bits>(weight),
                                 ptr<bf16_bits>(out), rows, size, static_cast<float>(eps));
  } else {
    add_rms_norm_impl<float>(has_x ? ptr<float>(x) : nullptr, ptr<float>(residual), ptr<float>(weight), ptr<float>(out),
                             rows, size, static_cast<float>(eps));
  }
  return out;
}

// qkv [tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]; positions int64 [tokens];
// cos, sin float32 [max_positions, head_dim]. Returns q [tokens, num_q_heads, head_dim] and
// k [tokens, num_kv_heads, head_dim], rotated.
std::vector<torch::Tensor> rope_qkv(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                                    const torch::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads) {
  check_float(qkv, "rope_qkv: qkv");
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1 &&
                        positions.size(0) == qkv.size(0),
                    "rope_qkv: positions must be int64 [tokens]");
  TORCH_CHECK_VALUE(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                        sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes(),
                    "rope_qkv: cos and sin must be float32 [max_positions, head_dim]");
  const int64_t head_dim = cos.size(1);
  TORCH_CHECK_VALUE(head_dim % 2 == 0 && qkv.dim() == 2 && qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * head_dim,
                    "rope_qkv: qkv rows must hold num_q_heads + 2 * num_kv_heads heads of head_dim");
  const int64_t tokens = qkv.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_VALUE(0 <= pos[t] && pos[t] < cos.size(0), "rope_qkv: position ", pos[t], " outside the table of ",
                      cos.size(0));
  }
  auto q = torch::empty({tokens, num_q_heads, head_dim}, qkv.options());
  auto k = torch::empty({tokens, num_kv_heads, head_dim}, qkv.options());
  if (is_bf16(qkv)) {
    rope_impl<bf16_bits>(ptr<bf16_bits>(qkv), pos, cos.data_ptr<float>(), sin.data_ptr<float>(), ptr<bf16_bits>(q),
                         ptr<bf16_bits>(k), tokens, num_q_heads, num_kv_heads, head_dim);
  } else {
    rope_impl<float>(ptr<float>(qkv), pos, cos.data_ptr<float>(), sin.data_ptr<float>(), ptr<float>(q), ptr<float>(k),
                     tokens, num_q_heads, num_kv_heads, head_dim);
  }
  return {q, k};
}

// gate_up [rows, 2 * size]: gate columns, then up. Returns silu(gate) * up [rows, size].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_float(gate_up, "silu_and_mul: gate_up");
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up must be [rows, 2 * size]");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  auto out = torch::empty({rows, size}, gate_up.options());
  if (is_bf16(gate_up)) {
    silu_and_mul_impl<bf16_bits>(ptr<bf16_bits>(gate_up), ptr<bf16_bits>(out), rows, size);
  } else {
    silu_and_mul_impl<float>(ptr<float>(gate_up), ptr<float>(out), rows, size);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pagedserve::kReleaseGil;
  m.def("add_rms_norm", &add_rms_norm, kReleaseGil, "residual += x; weight * rms_norm(residual) (CPU)");
  m.def("rope_qkv", &rope_qkv, kReleaseGil, "rotate-half RoPE of q and k out of fused qkv rows (CPU)");
  m.def("silu_and_mul", &silu_and_mul, kReleaseGil, "silu(gate) * up from fused gate_up rows (CPU)");
  static const pagedserve::FusedOpsEntries entries{&add_rms_norm, &rope_qkv, &silu_and_mul};
  m.attr("entry_points") = pagedserve::export_entries(&entries);
}
