// x @ W.T for a weight kept in ggml's own groups (kernels/grouped_matmul.py has the layouts):
//
//   value[n][k] = int(code[n][k]) * scale[n][k / G] (+ zero[n][k / G])
//
// codes are 4-bit (uint8 [N, K / 2]; per 32-input group 16 bytes, byte j = input j low nibble, input
// j + 16 high; a nibble is read through a 16-entry int8 table) or 8-bit (int8 [N, K]); scale and zero
// are float32 [N, K / G], G = 32 (or 16 for 8-bit codes). Each weight is made in float32 as
// fma(int, scale, zero) (or int * scale without a zero): int * scale is exact for every ggml type
// (<= 24 significant bits), so that is one rounding, the same as ggml's, and the kernel multiplies by
// exactly the file's values.
//
// One arithmetic for every number of rows: out[r][n] is 8 float32 lanes, lane l summing
// x[r][k] * w[n][k] for k = l mod 8 in increasing k by FMA, then the lanes reduced by one fixed tree.
// Two loops compute it; which one runs moves only time, never a bit (a prefix-cache hit, whose last
// rows arrive alone, computes what the whole prompt did):
//
//   few rows (m <= kDirectMaxRows): per output, its weights decoded in registers, a group at a time,
//       once per block of up to 8 rows of x, and multiplied against each row there.
//   many rows: per task, kBlockOutputs outputs' weights decoded once into a float32 scratch block
//       (in L1/L2), then tiles of 2 rows x 4 outputs run from it, each (row, output) in the same order.
//
// grouped_unpack: rows [start, end) of W as float32 (the references, and anything that wants W dense).
// The outputs are split between the threads (at::parallel_for).
//
// AVX2 + FMA where the compiler targets it (-march=native): a group's nibbles become int8 through one
// byte shuffle (pshufb: the 16-entry table), then int32, then float. Elsewhere the same loops in plain
// C++ (the compiler vectorizes what it can). No AVX-512 path (none to measure it on yet).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bindings.h"

#if defined(__AVX2__) && defined(__FMA__)
#define PAGEDSERVE_GROUPED_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kNibbleGroup = 32;   // inputs per group of 4-bit codes (16 bytes)
constexpr int64_t kDirectMaxRows = 8;  // up to here the few-rows loop (bench/bench_ggml_types.py)
constexpr int64_t kBlockOutputs = 8;   // many rows: outputs decoded into scratch at a time

struct Weight {
  const uint8_t* codes;  // row n at codes + n * code_stride
  int64_t code_stride;
  const float* scale;  // row n at scale + n * groups
  const float* zero;   // nullptr: none
  int64_t groups;
  const int8_t* table;  // 16 entries (4-bit codes)
};

#ifdef PAGEDSERVE_GROUPED_AVX2

using Lanes = __m256;  // 8 float32 partial sums

inline Lanes lanes_zero() { return _mm256_setzero_ps(); }
inline Lanes lanes_fma(const float* x, Lanes w, Lanes acc) { return _mm256_fmadd_ps(_mm256_loadu_ps(x), w, acc); }
inline Lanes lanes_load(const float* p) { return _mm256_loadu_ps(p); }

inline float reduce(Lanes v) {  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 int8x8_to_float(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// group g of row `codes` as w[G / 8], exactly the file's values
template <int G, bool kFour, bool kZero>
inline void decode_group(const uint8_t* codes, const float* scale, const float* zero, int64_t g, __m128i table,
                         Lanes* w) {
  if constexpr (kFour) {
    static_assert(G == kNibbleGroup, "4-bit codes come in groups of 32");
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_shuffle_epi8(table, _mm_and_si128(bytes, mask));                       // inputs 0..15
    const __m128i high = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));  // 16..31
    w[0] = int8x8_to_float(low);
    w[1] = int8x8_to_float(_mm_srli_si128(low, 8));
    w[2] = int8x8_to_float(high);
    w[3] = int8x8_to_float(_mm_srli_si128(high, 8));
  } else {
    for (int v = 0; v < G / 8; ++v) {
      w[v] = int8x8_to_float(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + g * G + v * 8)));
    }
  }
  const __m256 s = _mm256_set1_ps(scale[g]);
  if constexpr (kZero) {
    const __m256 z = _mm256_set1_ps(zero[g]);
    for (int v = 0; v < G / 8; ++v) w[v] = _mm256_fmadd_ps(w[v], s, z);
  } else {
    for (int v = 0; v < G / 8; ++v) w[v] = _mm256_mul_ps(w[v], s);
  }
}

inline __m128i load_table(const Weight& wt, bool four) {
  return four ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(wt.table)) : _mm_setzero_si128();
}

inline void store_lanes(float* out, Lanes v) { _mm256_storeu_ps(out, v); }

#else  // portable: the same arithmetic, lane by lane

struct Lanes {
  float v[8];
};

inline Lanes lanes_zero() { return Lanes{}; }
inline Lanes lanes_fma(const float* x, const Lanes& w, Lanes acc) {
  for (int l = 0; l < 8; ++l) acc.v[l] = __builtin_fmaf(x[l], w.v[l], acc.v[l]);
  return acc;
}
inline Lanes lanes_load(const float* p) {
  Lanes out;
  for (int l = 0; l < 8; ++l) out.v[l] = p[l];
  return out;
}
inline float reduce(const Lanes& a) {
  return ((a.v[0] + a.v[4]) + (a.v[2] + a.v[6])) + ((a.v[1] + a.v[5]) + (a.v[3] + a.v[7]));
}

using Table = const int8_t*;

template <int G, bool kFour, bool kZero>
inline void decode_group(const uint8_t* codes, const float* scale, const float* zero, int64_t g, Table table, Lanes* w) {
  for (int i = 0; i < G; ++i) {
    int q;
    if constexpr (kFour) {
      const uint8_t byte = codes[g * 16 + (i & 15)];
      q = table[i < 16 ? (byte & 0x0F) : (byte >> 4)];
    } else {
      q = static_cast<int8_t>(codes[g * G + i]);
    }
    const float f = static_cast<float>(q);
    w[i / 8].v[i % 8] = kZero ? __builtin_fmaf(f, scale[g], zero[g]) : f * scale[g];
  }
}

inline Table load_table(const Weight& wt, bool) { return wt.table; }

inline void store_lanes(float* out, const Lanes& v) {
  for (int l = 0; l < 8; ++l) out[l] = v.v[l];
}

#endif

template <int G, bool kFour, bool kZero>
void unpack_row(const Weight& wt, int64_t n, float* out) {
  const uint8_t* codes = wt.codes + n * wt.code_stride;
  const float* scale = wt.scale + n * wt.groups;
  const float* zero = kZero ? wt.zero + n * wt.groups : nullptr;
  const auto table = load_table(wt, kFour);
  for (int64_t g = 0; g < wt.groups; ++g) {
    Lanes w[G / 8];
    decode_group<G, kFour, kZero>(codes, scale, zero, g, table, w);
    for (int v = 0; v < G / 8; ++v) store_lanes(out + g * G + v * 8, w[v]);
  }
}

// few rows: rows [0, R) of x (stride k) against output n, its weights decoded in registers -> out[r * ldo]
template <int R, int G, bool kFour, bool kZero>
void dot_rows(const Weight& wt, int64_t n, const float* x, int64_t k, float* out, int64_t ldo) {
  const uint8_t* codes = wt.codes + n * wt.code_stride;
  const float* scale = wt.scale + n * wt.groups;
  const float* zero = kZero ? wt.zero + n * wt.groups : nullptr;
  const auto table = load_table(wt, kFour);
  Lanes acc[R];
  for (int r = 0; r < R; ++r) acc[r] = lanes_zero();
  for (int64_t g = 0; g < wt.groups; ++g) {
    Lanes w[G / 8];
    decode_group<G, kFour, kZero>(codes, scale, zero, g, table, w);
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < G / 8; ++v) acc[r] = lanes_fma(x + r * k + g * G + v * 8, w[v], acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = reduce(acc[r]);
}

template <int G, bool kFour, bool kZero>
void few_rows(const Weight& wt, const float* x, int64_t m, int64_t k, float* out, int64_t n_total, int64_t begin,
              int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    int64_t r = 0;
    for (; r + 8 <= m; r += 8) dot_rows<8, G, kFour, kZero>(wt, n, x + r * k, k, out + r * n_total + n, n_total);
    if (m - r >= 4) {
      dot_rows<4, G, kFour, kZero>(wt, n, x + r * k, k, out + r * n_total + n, n_total);
      r += 4;
    }
    if (m - r >= 2) {
      dot_rows<2, G, kFour, kZero>(wt, n, x + r * k, k, out + r * n_total + n, n_total);
      r += 2;
    }
    if (m - r >= 1) dot_rows<1, G, kFour, kZero>(wt, n, x + r * k, k, out + r * n_total + n, n_total);
  }
}

// many rows: rows [0, R) of x against O decoded weight rows w (stride k) -> out[r * ldo + o]
template <int R, int O>
void tile(const float* x, const float* w, int64_t k, float* out, int64_t ldo) {
  Lanes acc[R][O];
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < O; ++o) acc[r][o] = lanes_zero();
  }
  for (int64_t i = 0; i < k; i += 8) {
    Lanes wv[O];
    for (int o = 0; o < O; ++o) wv[o] = lanes_load(w + o * k + i);
    for (int r = 0; r < R; ++r) {
      for (int o = 0; o < O; ++o) acc[r][o] = lanes_fma(x + r * k + i, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < O; ++o) out[r * ldo + o] = reduce(acc[r][o]);
  }
}

template <int O>
void tile_rows(const float* x, int64_t m, const float* w, int64_t k, float* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) tile<2, O>(x + r * k, w, k, out + r * ldo, ldo);
  if (r < m) tile<1, O>(x + r * k, w, k, out + r * ldo, ldo);
}

template <int G, bool kFour, bool kZero>
void many_rows(const Weight& wt, const float* x, int64_t m, int64_t k, float* out, int64_t n_total, int64_t begin,
               int64_t end) {
  std::vector<float> scratch(kBlockOutputs * k);  // [kBlockOutputs][k]: the block's weights, decoded
  for (int64_t n0 = begin; n0 < end; n0 += kBlockOutputs) {
    const int64_t outputs = std::min(kBlockOutputs, end - n0);
    for (int64_t o = 0; o < outputs; ++o) unpack_row<G, kFour, kZero>(wt, n0 + o, scratch.data() + o * k);
    int64_t o = 0;
    for (; o + 4 <= outputs; o += 4) tile_rows<4>(x, m, scratch.data() + o * k, k, out + n0 + o, n_total);
    for (; o < outputs; ++o) tile_rows<1>(x, m, scratch.data() + o * k, k, out + n0 + o, n_total);
  }
}

// the weight's kind -> the instance of Kernel<G, kFour, kZero>::run that serves it
template <template <int, bool, bool> class Kernel, typename... Args>
void dispatch(bool four, int64_t group, bool has_zero, Args&&... args) {
  if (four) {
    has_zero ? Kernel<32, true, true>::run(args...) : Kernel<32, true, false>::run(args...);
  } else if (group == 32) {
    has_zero ? Kernel<32, false, true>::run(args...) : Kernel<32, false, false>::run(args...);
  } else {
    has_zero ? Kernel<16, false, true>::run(args...) : Kernel<16, false, false>::run(args...);
  }
}

template <int G, bool kFour, bool kZero>
struct MatmulKernel {
  static void run(const Weight& wt, const float* x, int64_t m, int64_t k, float* out, int64_t n, bool direct) {
    const int64_t blocks = (n + kBlockOutputs - 1) / kBlockOutputs;
    const int64_t grain = std::max<int64_t>(1, blocks / (4 * at::get_num_threads()));
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      const int64_t first = begin * kBlockOutputs, last = std::min(n, end * kBlockOutputs);
      if (direct) {
        few_rows<G, kFour, kZero>(wt, x, m, k, out, n, first, last);
      } else {
        many_rows<G, kFour, kZero>(wt, x, m, k, out, n, first, last);
      }
    });
  }
};

template <int G, bool kFour, bool kZero>
struct UnpackKernel {
  static void run(const Weight& wt, int64_t start, int64_t end, int64_t k, float* out) {
    at::parallel_for(start, end, 16, [&](int64_t begin, int64_t stop) {
      for (int64_t row = begin; row < stop; ++row) unpack_row<G, kFour, kZero>(wt, row, out + (row - start) * k);
    });
  }
};

Weight check_weight(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& zero,
                    const torch::Tensor& table, int64_t group, int64_t k) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.device().is_cpu(),
              "codes: contiguous [N, K] or [N, K / 2] on the CPU");
  const bool four = codes.scalar_type() == torch::kUInt8;
  TORCH_CHECK(four || codes.scalar_type() == torch::kInt8, "codes: uint8 nibbles or int8");
  TORCH_CHECK(four ? (codes.size(1) * 2 == k && group == kNibbleGroup)
                   : (codes.size(1) == k && (group == 16 || group == 32)),
              "codes [", codes.size(0), ", ", codes.size(1), "] do not fit K = ", k, " in groups of ", group);
  TORCH_CHECK(k % group == 0, "K = ", k, " is not a multiple of the group ", group);
  const int64_t n = codes.size(0), groups = k / group;
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == n && scale.size(1) == groups,
              "scale: contiguous float32 [N, K / group]");
  const bool has_zero = zero.numel() > 0;
  TORCH_CHECK(!has_zero || (zero.scalar_type() == torch::kFloat32 && zero.is_contiguous() && zero.sizes() == scale.sizes()),
              "zero: empty, or contiguous float32 like scale");
  TORCH_CHECK(!four || (table.scalar_type() == torch::kInt8 && table.numel() == 16 && table.is_contiguous()),
              "table: int8 [16] for 4-bit codes");
  return Weight{static_cast<const uint8_t*>(codes.data_ptr()), codes.size(1), scale.data_ptr<float>(),
                has_zero ? zero.data_ptr<float>() : nullptr, groups, four ? table.data_ptr<int8_t>() : nullptr};
}

// direct: -1 picks by the number of rows; 1 / 0 force the few-rows / many-rows loop (the tests)
torch::Tensor grouped_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                             const torch::Tensor& zero, const torch::Tensor& table, int64_t group, int64_t direct) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  const Weight wt = check_weight(codes, scale, zero, table, group, k);
  const int64_t n = codes.size(0);
  auto out = torch::empty({m, n}, x.options());
  const bool few = direct < 0 ? m <= kDirectMaxRows : direct > 0;
  dispatch<MatmulKernel>(codes.scalar_type() == torch::kUInt8, group, wt.zero != nullptr, wt, x.data_ptr<float>(), m,
                         k, out.data_ptr<float>(), n, few);
  return out;
}

torch::Tensor grouped_unpack(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& zero,
                             const torch::Tensor& table, int64_t group, int64_t start, int64_t end) {
  TORCH_CHECK(scale.dim() == 2, "scale: [N, K / group]");
  const int64_t k = scale.size(1) * group;
  const Weight wt = check_weight(codes, scale, zero, table, group, k);
  TORCH_CHECK(0 <= start && start <= end && end <= codes.size(0), "rows [", start, ", ", end, ") out of range");
  auto out = torch::empty({end - start, k}, scale.options());
  dispatch<UnpackKernel>(codes.scalar_type() == torch::kUInt8, group, wt.zero != nullptr, wt, start, end, k,
                         out.data_ptr<float>());
  return out;
}

bool vectorized() {
#ifdef PAGEDSERVE_GROUPED_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pagedserve::kReleaseGil;
  m.def("grouped_matmul", &grouped_matmul, kReleaseGil,
        "x float32 [M, K] @ grouped weight.T -> float32 [M, N] (CPU); direct: -1 auto, 1 few-rows, 0 many-rows loop");
  m.def("grouped_unpack", &grouped_unpack, kReleaseGil, "rows [start, end) of a grouped weight as float32 (CPU)");
  m.def("vectorized", &vectorized, "whether this build has the AVX2/FMA path");
}
