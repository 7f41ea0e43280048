// x @ W.T for weight-only quantized CPU weights, in AVX512-BF16 dot products (vdpbf16ps), the
// weight unpacked to bfloat16 in cache only.
//
// torch's int4 and int8 CPU kernels (aten._weight_int4pack_mm_for_cpu, _weight_int8pack_mm)
// compute in float32 FMAs and unpack the weight again for every few rows of x, so a batch of
// 16-64 decode rows costs them 5-20x one row. Unpacking the whole layer into a bfloat16 copy
// first (weight_unpack.cpp) writes and rereads that copy. Here a weight is unpacked once per
// call, into a buffer that stays in L1/L2, and every row of x is multiplied against it there.
//
// int4_matmul_few_rows: torch's packed int4 CPU layout (weight_unpack.cpp has it in full): blocks of 64
// weight rows (outputs), each [K][32] bytes; byte j of input k holds row j's nibble low and row j + 32's
// high. scales_zeros bfloat16 [K / 32, N, 2]: value = (q - 8) * scale + zero. Read once from memory, each
// nibble becomes bfloat16(q - 8) by a table lookup (exact), and a group's scale and zero are applied to
// its 32-input dot-product sums, so the weight is never rounded (as torch's int4 kernel). Each unpacked
// group serves up to 6 rows of x; their scaled sums wait in L1, leaving the registers to the partial
// sums. A row's result does not depend on which rows came with it.
//
// int4_matmul: the same arithmetic for many rows (prefill): one task per 64-output block unpacks the
// block's whole depth once per call into a buffer that stays in L1/L2, in the order the few-rows loop
// consumes it, and every 6 rows of x run the few-rows loop against that buffer. The words and the
// order of every sum are the same, so the two kernels agree bit for bit: a prompt computed whole and
// the same prompt's last rows after a prefix-cache hit see one function. (Until this, the many-rows
// kernel multiplied by the weight rounded to bfloat16, and a cache hit could change a greedy answer.)
//
// int8_matmul: an int8 weight [N, K] with one float32 scale per output row (the LM head). Its
// values are exact in bfloat16, so 16 rows at a time are converted into a bfloat16 buffer, dot
// products run along K (16 lanes of partial sums per (output, row of x) pair), 16 such sums are
// reduced across lanes together, and the scale is applied once at the end.
//
// Built where the compiler targets AVX512-BF16 (-march=native on a CPU with it); elsewhere
// `available()` is false and the Python side keeps torch's kernels.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bindings.h"
#include "cpu_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define PAGEDSERVE_BF16_DOT 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockRows = 64;      // weight rows per packed int4 block: four 16-output vectors
constexpr int64_t kGroup = 32;          // inputs per (scale, zero); also one bfloat16 vector of inputs
constexpr int64_t kGroupWords = 2048;   // bfloat16 values of one unpacked group: 4 x 16 pairs x 32
constexpr int64_t kOutputsPerRow = 16;  // int8: weight rows converted and reduced together

#ifdef PAGEDSERVE_BF16_DOT

// Where results go: float32, or bfloat16 (rounded to nearest even, as torch's .to(bfloat16)), by element offset
struct Out {
  float* f32;
  uint16_t* bf16;
  Out at(int64_t offset) const { return bf16 ? Out{nullptr, bf16 + offset} : Out{f32 + offset, nullptr}; }
  void store16(int64_t offset, __m512 v) const {
    if (bf16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bf16 + offset), (__m256i)_mm512_cvtneps_pbh(v));
    } else {
      _mm512_storeu_ps(f32 + offset, v);
    }
  }
  void store1(int64_t offset, float v) const {
    if (bf16) {
      bf16[offset] = pagedserve::round_bf16(v);
    } else {
      f32[offset] = v;
    }
  }
};

// Few rows (int4_matmul_few_rows): rows [0, R) of x against one packed 64-output block -> out[R][64]
// (row stride n). The weight is never rounded: a nibble becomes bfloat16(q - 8) by a table lookup
// (exact), a group's sum over x (q - 8) runs in dot products, and the group's scale and zero are
// applied to that sum:  out[n] += scale[n] * sum_k x[k] (q[n][k] - 8) + zero[n] * sum_k x[k].
// Vector v of a step holds outputs 16v .. 16v + 15: bytes 0-15 (v = 0) or 16-31 (v = 1) of the
// block's rows, low nibbles; v = 2, 3 the same bytes' high nibbles (weight_unpack.cpp's layout).
// bfloat16(i - 8) for i = 0 .. 15: -8 .. 7 are exact
inline __m512i q_minus_8_table() {
  return _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                          0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
                          static_cast<short>(0xBF80), static_cast<short>(0xC000),
                          static_cast<short>(0xC040), static_cast<short>(0xC080),
                          static_cast<short>(0xC0A0), static_cast<short>(0xC0C0),
                          static_cast<short>(0xC0E0), static_cast<short>(0xC100));
}

// Step p of a packed group -> w[4]: bfloat16(q - 8) pairs (inputs 2p, 2p + 1) of outputs 16v .. 16v + 15, exact
inline void unpack_int4_step(const uint8_t* in, int p, const __m512i& table, __m512bh* w) {
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  for (int byte_half = 0; byte_half < 2; ++byte_half) {
    const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + (2 * p) * 32 + 16 * byte_half));
    const __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + (2 * p + 1) * 32 + 16 * byte_half));
    // byte pairs (input 2p, 2p + 1) of 16 outputs, in output order, widened to 16-bit words
    const __m512i words = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(even, odd),
                                                                _mm_unpacklo_epi8(even, odd)));
    w[byte_half] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(words, low_nibble), table);
    w[2 + byte_half] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
  }
}

// A packed block's group g -> out[16 steps][4 vectors][32 words]: what unpack_int4_step gives, kept (int4_matmul)
inline void unpack_int4_group(const uint8_t* block, int64_t g, uint16_t* out) {
  const __m512i table = q_minus_8_table();
  const uint8_t* in = block + g * kGroup * 32;
  for (int p = 0; p < 16; ++p) {
    __m512bh w[4];
    unpack_int4_step(in, p, table, w);
    for (int v = 0; v < 4; ++v) _mm512_storeu_si512(out + (p * 4 + v) * 32, (__m512i)w[v]);
  }
}

// Rows [0, R) of x against one 64-output block -> out[R][64] (row stride n). The weight comes packed
// (`unpacked` null: unpacked here, step by step) or already unpacked by unpack_int4_group (`unpacked`:
// the block's groups, [group][16][4][32] words); both give the same words, so the same sums, bit for bit.
template <int R>
inline void int4_few_rows(const uint16_t* x, int64_t k, const float* x_sums, const uint8_t* block,
                          const uint16_t* unpacked, int64_t groups, const uint16_t* scales_zeros, int64_t n_total,
                          int64_t block_row0, Out out, int64_t n) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i table = q_minus_8_table();
  // the scaled sums live in L1, not registers: R x 4 partial sums, 4 weight vectors, an input and two
  // constants fill the 32 registers at R = 6, so the weight is unpacked once per 6 rows, not per 3
  alignas(64) float total[R][64] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* in = block + g * kGroup * 32;
    const uint16_t* xg = x + g * kGroup;
    if (g + 2 < groups) {  // a later group's scales: 4 lines a row of N apart, which the hardware does not foresee
      const uint16_t* ahead = scales_zeros + ((g + 2) * n_total + block_row0) * 2;
      for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(ahead + 32 * line), _MM_HINT_T0);
    }
    __m512 partial[R][4];
    for (int i = 0; i < R; ++i) {
      for (int v = 0; v < 4; ++v) partial[i][v] = _mm512_setzero_ps();
    }
    const uint16_t* kept = unpacked != nullptr ? unpacked + g * kGroupWords : nullptr;
    for (int p = 0; p < 16; ++p) {
      __m512bh w[4];
      if (kept != nullptr) {
        for (int v = 0; v < 4; ++v) w[v] = (__m512bh)_mm512_loadu_si512(kept + (p * 4 + v) * 32);
      } else {
        unpack_int4_step(in, p, table, w);
      }
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, xg + i * k + 2 * p, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < 4; ++v) partial[i][v] = _mm512_dpbf16_ps(partial[i][v], a, w[v]);
      }
    }
    for (int v = 0; v < 4; ++v) {
      const __m512i pairs = _mm512_loadu_si512(scales_zeros + (g * n_total + block_row0 + 16 * v) * 2);
      const __m512 scales = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 zeros = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
      for (int i = 0; i < R; ++i) {
        __m512 sum = _mm512_fmadd_ps(partial[i][v], scales, _mm512_load_ps(total[i] + 16 * v));
        sum = _mm512_fmadd_ps(zeros, _mm512_set1_ps(x_sums[i * groups + g]), sum);
        _mm512_store_ps(total[i] + 16 * v, sum);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < 4; ++v) out.store16(i * n + 16 * v, _mm512_load_ps(total[i] + 16 * v));
  }
}

constexpr int kFewRowBlock = 6;  // 6 x 4 partial sums + 4 weight vectors + 1 input + 2 constants of 32 registers

inline void int4_few_row_block(int64_t rows, const uint16_t* x, int64_t k, const float* x_sums, const uint8_t* block,
                               const uint16_t* unpacked, int64_t groups, const uint16_t* sz, int64_t n_total,
                               int64_t block_row0, Out out, int64_t n) {
  switch (rows) {
    case 1: int4_few_rows<1>(x, k, x_sums, block, unpacked, groups, sz, n_total, block_row0, out, n); break;
    case 2: int4_few_rows<2>(x, k, x_sums, block, unpacked, groups, sz, n_total, block_row0, out, n); break;
    case 3: int4_few_rows<3>(x, k, x_sums, block, unpacked, groups, sz, n_total, block_row0, out, n); break;
    case 4: int4_few_rows<4>(x, k, x_sums, block, unpacked, groups, sz, n_total, block_row0, out, n); break;
    case 5: int4_few_rows<5>(x, k, x_sums, block, unpacked, groups, sz, n_total, block_row0, out, n); break;
    default: int4_few_rows<6>(x, k, x_sums, block, unpacked, groups, sz, n_total, block_row0, out, n); break;
  }
}

// lane i of the result = the sum of v[i]'s 16 lanes
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: (v2i[0]+v2i[2], v2i+1[0]+v2i+1[2], v2i[1]+v2i[3], v2i+1[1]+v2i+1[3])
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v4i .. v4i+3
    const __m512 a = pairs[2 * i], b = pairs[2 * i + 1];
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes: (quads2i: lanes 0+1, 2+3; quads2i+1: lanes 0+1, 2+3)
    const __m512 a = quads[2 * i], b = quads[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// NB converted weight rows (bfloat16, row stride k) x MB rows of x -> out[MB][NB] * scale (NB * MB == 16)
template <int NB, int MB>
inline void int8_block(const uint16_t* x, const uint16_t* w, int64_t k, const float* scale, Out out, int64_t n) {
  static_assert(NB * MB == 16, "one reduction covers 16 dot products");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += kGroup) {
    __m512bh a[MB];
    for (int i = 0; i < MB; ++i) a[i] = (__m512bh)_mm512_loadu_si512(x + i * k + c);
    for (int j = 0; j < NB; ++j) {
      const __m512bh b = (__m512bh)_mm512_loadu_si512(w + j * k + c);
      for (int i = 0; i < MB; ++i) acc[j * MB + i] = _mm512_dpbf16_ps(acc[j * MB + i], a[i], b);
    }
  }
  alignas(64) float sums[16];  // [output j][row i]
  _mm512_store_ps(sums, sum_lanes16(acc));
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) out.store1(i * n + j, sums[j * MB + i] * scale[j]);
  }
}

// 32 int8 weights -> bfloat16 (exact)
inline __m512bh int8_to_bf16(const int8_t* q) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// rows int8 [16][k] -> bfloat16 [16][k] (exact)
inline void convert_int8_rows(const int8_t* q, int64_t k, uint16_t* out) {
  for (int64_t r = 0; r < kOutputsPerRow; ++r) {
    for (int64_t c = 0; c < k; c += kGroup) _mm512_storeu_si512(out + r * k + c, (__m512i)int8_to_bf16(q + r * k + c));
  }
}

#endif  // PAGEDSERVE_BF16_DOT

torch::Tensor empty_out(const torch::Tensor& x, int64_t m, int64_t n, bool bf16_out) {  // [m, n]
  return torch::empty({m, n}, x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
}

#ifdef PAGEDSERVE_BF16_DOT
Out out_of(torch::Tensor& out) {
  return out.scalar_type() == torch::kBFloat16 ? Out{nullptr, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>())}
                                               : Out{out.data_ptr<float>(), nullptr};
}

const uint16_t* bf16_data(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

// [row][group]: the sum of each group's 32 inputs of x, in float32, in input order
std::vector<float> group_sums(const uint16_t* xs, int64_t m, int64_t k, int64_t groups) {
  std::vector<float> sums(static_cast<size_t>(m * groups));
  for (int64_t row = 0; row < m; ++row) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t c = 0; c < kGroup; ++c) {
        sum += __builtin_bit_cast(float, static_cast<uint32_t>(xs[row * k + g * kGroup + c]) << 16);
      }
      sums[row * groups + g] = sum;
    }
  }
  return sums;
}

struct Int4Call {  // an int4 matmul's raw operands and sizes
  const uint16_t* x;
  const uint8_t* packed;
  const uint16_t* scales_zeros;
  Out out;
  int64_t m, k, n, groups, blocks;
};

Int4Call int4_call(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales_zeros,
                   torch::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  return {bf16_data(x), packed.data_ptr<uint8_t>(), bf16_data(scales_zeros), out_of(out), m, k, n, k / kGroup,
          n / kBlockRows};
}
#endif

void check_x(const torch::Tensor& x, const char* op) {
  TORCH_CHECK_VALUE(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), op,
                    ": x must be contiguous bfloat16 [M, K]");
}

}  // namespace

bool available() {
#ifdef PAGEDSERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

void check_int4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales_zeros, const char* op) {
  TORCH_CHECK_VALUE(available(), op, ": this CPU or build has no AVX512-BF16");
  check_x(x, op);
  TORCH_CHECK_VALUE(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(), op,
                    ": packed must be contiguous uint8 [N, K / 2]");
  const int64_t k = x.size(1), n = packed.size(0);
  TORCH_CHECK_VALUE(packed.size(1) * 2 == k, op, ": x has ", k, " inputs, the weight ", packed.size(1) * 2);
  TORCH_CHECK_VALUE(n % kBlockRows == 0 && k % kGroup == 0, op,
                    ": the weight must be [a multiple of 64, a multiple of 32], got [", n, ", ", k, "]");
  TORCH_CHECK_VALUE(scales_zeros.dtype() == torch::kBFloat16 && scales_zeros.is_contiguous() &&
                        scales_zeros.dim() == 3 && scales_zeros.size(0) == k / kGroup && scales_zeros.size(1) == n &&
                        scales_zeros.size(2) == 2,
                    op, ": scales_zeros must be contiguous bfloat16 [K / 32, N, 2]");
}

// x bfloat16 [M, K] (a few rows), packed, scales_zeros as int4_matmul's -> [M, N] = x @ W.T (float32, or
// bfloat16 if bf16_out), W = (q - 8) * scale + zero unrounded (as torch's int4 kernel multiplies by)
torch::Tensor int4_matmul_few_rows(const torch::Tensor& x, const torch::Tensor& packed,
                                   const torch::Tensor& scales_zeros, bool bf16_out) {
  check_int4(x, packed, scales_zeros, "int4_matmul_few_rows");
  auto out = empty_out(x, x.size(0), packed.size(0), bf16_out);
#ifdef PAGEDSERVE_BF16_DOT
  const auto [xs, src, sz, dst, m, k, n, groups, blocks] = int4_call(x, packed, scales_zeros, out);
  const std::vector<float> x_sums = group_sums(xs, m, k, groups);
  // one task per 64-output block, over the whole depth
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t block = b0; block < b1; ++block) {
      for (int64_t row0 = 0; row0 < m; row0 += kFewRowBlock) {
        int4_few_row_block(std::min<int64_t>(kFewRowBlock, m - row0), xs + row0 * k, k, x_sums.data() + row0 * groups,
                           src + block * 32 * k, nullptr, groups, sz, n, block * kBlockRows,
                           dst.at(row0 * n + block * kBlockRows), n);
      }
    }
  });
#endif
  return out;
}

// x bfloat16 [M, K], packed uint8 [N, K / 2] (torch's layout, N a multiple of 64, K of 32),
// scales_zeros bfloat16 [K / 32, N, 2] -> [M, N] = x @ W.T (float32, or bfloat16 if bf16_out): the same sums as
// int4_matmul_few_rows, bit for bit (W unrounded), the block unpacked once per call for every row
torch::Tensor int4_matmul(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales_zeros,
                          bool bf16_out) {
  check_int4(x, packed, scales_zeros, "int4_matmul");
  auto out = empty_out(x, x.size(0), packed.size(0), bf16_out);
#ifdef PAGEDSERVE_BF16_DOT
  const auto [xs, src, sz, dst, m, k, n, groups, blocks] = int4_call(x, packed, scales_zeros, out);
  const std::vector<float> x_sums = group_sums(xs, m, k, groups);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint16_t> unpacked(static_cast<size_t>(groups * kGroupWords));  // one block's depth, in L1/L2
    for (int64_t block = b0; block < b1; ++block) {
      const uint8_t* in = src + block * 32 * k;
      for (int64_t g = 0; g < groups; ++g) unpack_int4_group(in, g, unpacked.data() + g * kGroupWords);
      for (int64_t row0 = 0; row0 < m; row0 += kFewRowBlock) {
        int4_few_row_block(std::min<int64_t>(kFewRowBlock, m - row0), xs + row0 * k, k, x_sums.data() + row0 * groups,
                           in, unpacked.data(), groups, sz, n, block * kBlockRows,
                           dst.at(row0 * n + block * kBlockRows), n);
      }
    }
  });
#endif
  return out;
}

// x bfloat16 [M, K] (K a multiple of 32), q int8 [N, K] (N a multiple of 16), scale float32 [N]
// -> [M, N] = x @ (q * scale).T (float32, or bfloat16 if bf16_out)
torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale, bool bf16_out) {
  TORCH_CHECK_VALUE(available(), "int8_matmul: this CPU or build has no AVX512-BF16");
  check_x(x, "int8_matmul");
  TORCH_CHECK_VALUE(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(),
                    "int8_matmul: q must be contiguous int8 [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK_VALUE(q.size(1) == k, "int8_matmul: x has ", k, " inputs, the weight ", q.size(1));
  TORCH_CHECK_VALUE(k % kGroup == 0 && n % kOutputsPerRow == 0,
                    "int8_matmul: the weight must be [a multiple of 16, a multiple of 32], got [", n, ", ", k, "]");
  TORCH_CHECK_VALUE(scale.dtype() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 1 && scale.size(0) == n,
                    "int8_matmul: scale must be contiguous float32 [N]");
  auto out = empty_out(x, m, n, bf16_out);
#ifdef PAGEDSERVE_BF16_DOT
  const uint16_t* xs = bf16_data(x);
  const int8_t* src = q.data_ptr<int8_t>();
  const float* scales = scale.data_ptr<float>();
  const Out dst = out_of(out);
  at::parallel_for(0, n / kOutputsPerRow, 4, [&](int64_t t0, int64_t t1) {
    std::vector<uint16_t> weights(static_cast<size_t>(kOutputsPerRow * k));  // 16 rows in bfloat16
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t n0 = tile * kOutputsPerRow;
      convert_int8_rows(src + n0 * k, k, weights.data());
      const uint16_t* w = weights.data();
      int64_t row = 0;
      for (; row + 4 <= m; row += 4) {
        for (int64_t j = 0; j < 16; j += 4) int8_block<4, 4>(xs + row * k, w + j * k, k, scales + n0 + j, dst.at(row * n + n0 + j), n);
      }
      for (; row + 2 <= m; row += 2) {
        for (int64_t j = 0; j < 16; j += 8) int8_block<8, 2>(xs + row * k, w + j * k, k, scales + n0 + j, dst.at(row * n + n0 + j), n);
      }
      for (; row < m; ++row) int8_block<16, 1>(xs + row * k, w, k, scales + n0, dst.at(row * n + n0), n);
    }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pagedserve::kReleaseGil;
  m.def("available", &available, "whether this build has the AVX512-BF16 kernels");
  m.def("int4_matmul", &int4_matmul, kReleaseGil, "x bfloat16 [M, K] @ int4 weight (torch's CPU layout).T -> float32 or bfloat16 [M, N]");
  m.def("int4_matmul_few_rows", &int4_matmul_few_rows, kReleaseGil,
        "x bfloat16 [M, K] (a few rows) @ int4 weight (torch's CPU layout).T -> float32 or bfloat16 [M, N], scales factored out");
  m.def("int8_matmul", &int8_matmul, kReleaseGil, "x bfloat16 [M, K] @ (int8 weight [N, K] * scale [N]).T -> float32 or bfloat16 [M, N]");
}
