// Quantized CPU weights back to bfloat16 rows: torch's packed int4 layout
// (aten._convert_weight_to_int4pack_for_cpu) and per-row int8.
//
// For a batch of many rows a bfloat16 matmul on a dense weight (oneDNN, AMX where there is
// one) beats torch's int4 and int8 kernels, which compute in float32 FMAs; so the weight is
// unpacked into a scratch bfloat16 weight, one layer at a time, and that is multiplied.
//
// The packed layout (read off the packing op, for weights of a multiple of 64 rows; rows are
// padded to one): blocks of B rows, each [in_features][B / 2] bytes; byte j of column k holds
// row j of the block in its low nibble and row j + B / 2 in its high nibble. B depends on the
// CPU torch packs for: 64 with AVX-512, 32 with AVX2 (kernels/weight_unpack.py reads it off):
//
//   packed[block * B/2 * K + k * B/2 + j] = q[B block + j][k] | q[B block + B/2 + j][k] << 4
//
// scales_zeros [K / 32, N, 2] (bfloat16) holds each 32-input group's scale and zero:
// value = (q - 8) * scale + zero, computed in float32 and rounded to bfloat16 once.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>

#include "bindings.h"
#include "cpu_math.h"

namespace {

using pagedserve::bf16_bits;
using pagedserve::round_bf16;
using pagedserve::to_float;

constexpr int64_t kGroup = 32;

}  // namespace

// packed uint8 [N, K / 2] (torch's layout, blocks of block_rows), scales_zeros bfloat16 [K / 32, N, 2]
// -> bfloat16 [N, K]
torch::Tensor unpack_int4(const torch::Tensor& packed, const torch::Tensor& scales_zeros, int64_t block_rows) {
  TORCH_CHECK_VALUE(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(),
                    "unpack_int4: packed must be contiguous uint8 [N, K / 2]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK_VALUE(block_rows == 32 || block_rows == 64, "unpack_int4: blocks of 32 or 64 rows, got ", block_rows);
  TORCH_CHECK_VALUE(n % block_rows == 0, "unpack_int4: rows must be a multiple of ", block_rows, ", got ", n);
  TORCH_CHECK_VALUE(k % kGroup == 0, "unpack_int4: inputs must be a multiple of 32, got ", k);
  TORCH_CHECK_VALUE(scales_zeros.dtype() == torch::kBFloat16 && scales_zeros.is_contiguous() &&
                        scales_zeros.dim() == 3 && scales_zeros.size(0) == k / kGroup && scales_zeros.size(1) == n &&
                        scales_zeros.size(2) == 2,
                    "unpack_int4: scales_zeros must be contiguous bfloat16 [K / 32, N, 2]");
  auto out = torch::empty({n, k}, packed.options().dtype(torch::kBFloat16));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const bf16_bits* sz = reinterpret_cast<const bf16_bits*>(scales_zeros.data_ptr<at::BFloat16>());
  bf16_bits* dst = reinterpret_cast<bf16_bits*>(out.data_ptr<at::BFloat16>());
  const int64_t groups = k / kGroup;
  const int64_t half_rows = block_rows / 2;  // bytes per column of a block
  // one task per (block, group): a 32 x half_rows-byte tile in, block_rows rows x 32 values out
  at::parallel_for(0, (n / block_rows) * groups, 8, [&](int64_t t0, int64_t t1) {
    uint8_t tile[32][kGroup];  // [j][kk]: the tile transposed, so each row's bytes are contiguous
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t block = t / groups, group = t % groups;
      const uint8_t* in = src + block * half_rows * k + group * kGroup * half_rows;
      for (int64_t kk = 0; kk < kGroup; ++kk) {
        for (int64_t j = 0; j < half_rows; ++j) tile[j][kk] = in[kk * half_rows + j];
      }
      for (int64_t j = 0; j < half_rows; ++j) {
        for (int64_t half = 0; half < 2; ++half) {
          const int64_t row = block * block_rows + half * half_rows + j;
          const float scale = to_float(sz[(group * n + row) * 2]);
          const float zero = to_float(sz[(group * n + row) * 2 + 1]);
          bf16_bits* o = dst + row * k + group * kGroup;
          const int shift = static_cast<int>(half * 4);
#pragma omp simd
          for (int64_t kk = 0; kk < kGroup; ++kk) {
            const float q = static_cast<float>((tile[j][kk] >> shift) & 0x0F) - 8.0f;
            o[kk] = round_bf16(q * scale + zero);
          }
        }
      }
    }
  });
  return out;
}

// q int8 [N, K], scale float32 [N] -> bfloat16 [N, K]: q * scale, rounded once
torch::Tensor unpack_int8(const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK_VALUE(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(),
                    "unpack_int8: q must be contiguous int8 [N, K]");
  TORCH_CHECK_VALUE(scale.dtype() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 1 &&
                        scale.size(0) == q.size(0),
                    "unpack_int8: scale must be contiguous float32 [N]");
  const int64_t n = q.size(0), k = q.size(1);
  auto out = torch::empty({n, k}, q.options().dtype(torch::kBFloat16));
  const int8_t* src = q.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  bf16_bits* dst = reinterpret_cast<bf16_bits*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* in = src + r * k;
      bf16_bits* o = dst + r * k;
      const float row_scale = s[r];
#pragma omp simd
      for (int64_t c = 0; c < k; ++c) o[c] = round_bf16(static_cast<float>(in[c]) * row_scale);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pagedserve::kReleaseGil;
  m.def("unpack_int4", &unpack_int4, kReleaseGil, "torch's packed int4 CPU weight -> bfloat16 [N, K] (CPU)");
  m.def("unpack_int8", &unpack_int8, kReleaseGil, "per-row int8 weight -> bfloat16 [N, K] (CPU)");
}
