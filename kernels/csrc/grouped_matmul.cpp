// x @ W.T for a weight kept in ggml's own groups (kernels/grouped_matmul.py has the layouts):
//
//   value[n][k] = int(code[n][k]) * scale[n][k / G] (+ zero[n][k / G])
//
// codes are 4-bit (uint8 [N, K / 2]; per 32-input group 16 bytes, byte j = input j low nibble, input
// j + 16 high; a nibble is read through a 16-entry int8 table) or 8-bit (int8 [N, K]); scale and zero
// are float32 [N, K / G], G = 32 (or 16 for 8-bit codes). The weights are the file's: the integers
// and scales as stored, nothing rounded again.
//
// The activations are rounded to int16, per block of G inputs (one block per weight group):
//   d = max |x| / 32767, q = round(x / d) (to nearest even): |x - q d| <= d / 2, 2^-16 of the block's
//   largest value (llama.cpp rounds them to int8 per 32: 2^-8). A block holding a NaN or an infinity
//   gets d = NaN, so the outputs it reaches are NaN, as a float matmul's would be.
// Then per group the integer dot product is exact, and one float32 step adds it in:
//   acc[l] = fma(float(isum[l]), scale[g] * d[g], acc[l])     8 lanes; lane l holds the products of
//                                                              inputs 2l, 2l+1, 16+2l, 17+2l of the group
//   out = reduce(acc) + reduce(zacc)      zacc[l] = fma over g = l mod 8 of zero[g] * (d[g] * sum of q)
// (|isum| <= 4 * 32767 * 128 < 2^24: its float is exact.) reduce is one fixed tree of the 8 lanes.
// The sum of a row therefore never depends on the rows beside it, on how the rows are split into
// calls (a prefix-cache hit, whose last rows arrive alone, computes what the whole prompt did; a
// speculative verify computes what plain decoding does), or on the build: the AVX2 loops and the
// plain C++ ones give the same bits (tests/kernels/test_grouped_matmul.py).
//
// Loop: per output, a group's codes are decoded once (to int16 in registers) for a block of up to 8
// rows, and multiplied against each row's int16 block (vpmaddwd: 16 products an instruction). The
// rows run in chunks that stay in L2; the outputs are split between the threads (at::parallel_for).
// grouped_unpack: rows [start, end) of W as float32 (the references, and anything that wants W dense).
//
// AVX2 + FMA where the compiler targets it (-march=native): a group's nibbles become int8 through one
// byte shuffle (pshufb: the 16-entry table), then int16. Where the table is 16 consecutive integers
// (Q4_0's -8..7; Q4_1's and Q4_K's 0..15) the nibble itself is the factor (a widening load, a mask,
// a shift: half the instructions), and table[0] * (each product lane's sum of q), made once per row
// and group with the activations, is added to the integer sum: the same integers, so the same bits.
// Elsewhere the same arithmetic in plain C++.
// A weight in the quad layout (4 outputs' groups side by side: one stream of memory) runs dot_quad: each
// row's block, d and shift lanes loaded once per group for 4 outputs. With AVX-512 (F + BW) two outputs
// share a register (VNNI's vpdpwssd where the CPU has it) and a block of up to 8 rows shares each group's
// decoded codes and the quad's zeros made float once (quad_zero_terms: each row's zero terms two outputs a
// register); AVX2 and plain builds run dot_quad for one row and the row loops past it. Every lane holds the
// integers and float steps of dot_rows, so all builds still give the same bits.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "bindings.h"
#include "entry_points.h"

#if defined(__AVX2__) && defined(__FMA__)
#define PAGEDSERVE_GROUPED_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_GROUPED_AVX512 1
#endif
#endif

namespace {

constexpr int64_t kNibbleGroup = 32;              // inputs per group of 4-bit codes (16 bytes)
constexpr int kRowBlock = 8;                      // rows that share one decode of a group
constexpr int64_t kBlockOutputs = 8;              // outputs per unit of the threads' split
constexpr int64_t kQuad = 4;                      // outputs interleaved per group in the quad layout
constexpr int64_t kRowChunkBytes = 128 * 1024;    // int16 rows run against each output at a time (L2)
constexpr int64_t kPrefetchBytes = 2048;       // how far ahead of the decode loop its weight stream is fetched
constexpr float kActivationMax = 32767.0f;        // int16 activations: q in [-32767, 32767]

// how a 4-bit code becomes its integer: through the table, or (a table of 16 consecutive integers,
// as Q4_0's -8..7 and Q4_1's / Q4_K's 0..15 are) the nibble itself, plus table[0]
enum Nibbles { kLookup = 0, kPlain = 1, kShifted = 2 };

// A weight's scales, or its zeros, in one of two forms: float32 per group, or factored as the K-quants
// store them, an int8 per group times a float32 unit per run of `per_unit` groups (Q4_K's d * sc: an
// 11-bit f16 times a 6-bit integer). The product is exact in float32, so both forms give the same floats.
struct GroupScales {
  const float* floats;  // output n's group g at [at(n) + g * quad] (nullptr: factored)
  const int8_t* ints;   // factored: the same place
  const float* units;   // factored: output n's unit u at [unit_at(n) + u * quad]
  int64_t groups, per_unit, quad;  // per_unit: groups to a unit (factored)

  int64_t at(int64_t n) const { return (n / quad) * groups * quad + n % quad; }
  int64_t unit_at(int64_t n) const { return (n / quad) * (groups / per_unit) * quad + n % quad; }
  float value(int64_t n, int64_t g) const {  // output n's group g
    if (floats != nullptr) return floats[at(n) + g * quad];
    return units[unit_at(n) + (g / per_unit) * quad] * static_cast<float>(ints[at(n) + g * quad]);
  }
};

// output n's scales group after group from group 0 (the loops' order: no division per group)
class ScaleWalk {
 public:
  ScaleWalk(const GroupScales& s, int64_t n)
      : floats_(s.floats != nullptr ? s.floats + s.at(n) : nullptr),
        ints_(s.ints != nullptr ? s.ints + s.at(n) : nullptr),
        units_(s.units != nullptr ? s.units + s.unit_at(n) : nullptr),
        quad_(s.quad),
        per_unit_(s.per_unit) {}

  float next() {  // the next group's scale
    const float v = floats_ != nullptr ? *floats_ : *units_ * static_cast<float>(*ints_);
    advance();
    return v;
  }

  const float* floats() const { return floats_; }  // where the next group's scale lies (float32 form)
  const int8_t* ints() const { return ints_; }      // (factored form) its int, and its unit
  const float* unit() const { return units_; }
  const void* ahead(int64_t groups) const {  // where the scale `groups` on lies, for a prefetch
    return floats_ != nullptr ? static_cast<const void*>(floats_ + groups * quad_) : ints_ + groups * quad_;
  }
  void advance() {  // past one group, having read it through the pointers above
    if (floats_ != nullptr) {
      floats_ += quad_;
      return;
    }
    ints_ += quad_;
    if (++in_unit_ == per_unit_) {
      in_unit_ = 0;
      units_ += quad_;
    }
  }

 private:
  const float* floats_;
  const int8_t* ints_;
  const float* units_;
  int64_t quad_, per_unit_, in_unit_ = 0;
};

struct Weight {
  const uint8_t* codes;  // output n's group g at codes_of(n) + g * code_step()
  GroupScales scale;     // output n's group g: scale.value(n, g)
  GroupScales zero;      // row by row (quad 1); zero.floats and zero.ints nullptr: none
  int64_t groups;
  int64_t group_bytes;  // bytes of one output's group of codes: 16 (4-bit) or G
  int64_t quad;         // outputs whose groups lie side by side: 1 (rows) or kQuad
  const int8_t* table;  // 16 entries (4-bit codes)
  Nibbles nibbles;      // 4-bit codes: how the vector loop decodes them

  const uint8_t* codes_of(int64_t n) const {
    return codes + (n / quad) * groups * quad * group_bytes + (n % quad) * group_bytes;
  }
  int64_t code_step() const { return quad * group_bytes; }
  bool has_zero() const { return zero.floats != nullptr || zero.ints != nullptr; }
};

struct Activations {  // x [M, K] in int16 blocks of G: x ~= q * d
  const int16_t* q;   // [M][K]
  const float* d;     // [M][groups]
  const float* sum;   // [M][groups]: d * (sum of the block's q), for the zero term; nullptr: none
  const int32_t* shift;  // [M][groups][8]: table[0] * (the block's q summed in each product lane); kShifted only
  int64_t k;
  int64_t groups;
};

// the 8 lanes of an accumulator summed by one fixed tree: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float reduce_lanes(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// the zero term of one (row, output n): lane l sums zero[g] * sum[g] over g = l mod 8, in increasing g, from
// group g on (`walk` standing at g)
inline float zero_term_portable(ScaleWalk& walk, int64_t groups, const float* sum, int64_t g, float* lanes) {
  for (; g < groups; ++g) lanes[g & 7] = __builtin_fmaf(walk.next(), sum[g], lanes[g & 7]);
  return reduce_lanes(lanes);
}

// the scale of one block of activations, and its inverse (0 for an all-zero block)
inline void block_scale(float amax, bool finite, float* d, float* inverse) {
  if (!finite) {
    *d = __builtin_nanf("");
    *inverse = 0.0f;
  } else {
    *d = amax / kActivationMax;
    *inverse = amax > 0.0f ? kActivationMax / amax : 0.0f;
  }
}

#ifdef PAGEDSERVE_GROUPED_AVX2

inline float reduce(__m256 v) {  // reduce_lanes, in registers
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// the zero term of one (row, output n): zero_term_portable's lanes, 8 groups an fma (a factored zero made
// exactly in float32 first: per_unit is a multiple of 8, so 8 groups share one unit)
inline float zero_term(const GroupScales& zero, int64_t n, const float* sum) {
  __m256 z = _mm256_setzero_ps();
  float lanes[8];
  if (zero.floats != nullptr) {
    const float* row = zero.floats + zero.at(n);  // row by row: quad 1
    int64_t g = 0;
    for (; g + 8 <= zero.groups; g += 8) z = _mm256_fmadd_ps(_mm256_loadu_ps(row + g), _mm256_loadu_ps(sum + g), z);
    _mm256_storeu_ps(lanes, z);
    for (; g < zero.groups; ++g) lanes[g & 7] = __builtin_fmaf(row[g], sum[g], lanes[g & 7]);
    return reduce_lanes(lanes);
  }
  const int8_t* row = zero.ints + zero.at(n);  // groups: whole runs of 8 (check_scales), so no tail
  const float* unit = zero.units + zero.unit_at(n);
  for (int64_t g = 0, in_unit = 0; g < zero.groups; g += 8) {
    const __m256i ints = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + g)));
    z = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(*unit)), _mm256_loadu_ps(sum + g), z);
    if ((in_unit += 8) == zero.per_unit) {
      in_unit = 0;
      ++unit;
    }
  }
  _mm256_storeu_ps(lanes, z);
  return reduce_lanes(lanes);
}

// the next group's scales of the kQuad outputs of a quad (4 floats, exactly scale.value(n + o, g)), `walk` moved on
inline __m128 quad_scales(ScaleWalk& walk) {
  __m128 out;
  if (walk.floats() != nullptr) {
    out = _mm_loadu_ps(walk.floats());
  } else {
    int32_t four;
    __builtin_memcpy(&four, walk.ints(), 4);
    out = _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four))), _mm_loadu_ps(walk.unit()));
  }
  walk.advance();
  return out;
}

template <int G>
void quantize_block(const float* x, int16_t* q, float* d, float* sum, int32_t* shift, int16_t offset) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 largest = _mm256_set1_ps(__FLT_MAX__);
  __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int v = 0; v < G / 8; ++v) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + v * 8), abs_mask);
    amax = _mm256_max_ps(amax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, largest, _CMP_NLE_UQ));  // NaN or infinite
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  float inverse;
  block_scale(_mm_cvtss_f32(m), _mm256_movemask_ps(bad) == 0, d, &inverse);
  const __m256 inv = _mm256_set1_ps(inverse);
  const __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(*d == *d ? -1 : 0));  // a NaN block's q are 0
  __m256i total = _mm256_setzero_si256();
  for (int v = 0; v < G / 16; ++v) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_and_ps(_mm256_mul_ps(_mm256_loadu_ps(x + v * 16), inv), keep));
    const __m256i b = _mm256_cvtps_epi32(_mm256_and_ps(_mm256_mul_ps(_mm256_loadu_ps(x + v * 16 + 8), inv), keep));
    total = _mm256_add_epi32(total, _mm256_add_epi32(a, b));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // back in input order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + v * 16), packed);
  }
  if (sum != nullptr) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    *sum = *d * static_cast<float>(_mm_cvtsi128_si32(t));
  }
  if (shift != nullptr) {  // lane l: offset * (q[2l] + q[2l+1] + q[16+2l] + q[17+2l]), the lanes of dot_rows' isum
    const __m256i c = _mm256_set1_epi16(offset);
    __m256i lanes = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), c);
    if constexpr (G == 32) {
      lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16)), c));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(shift), lanes);
  }
}

// group g of an output's codes as int16: w[0] inputs 0..15, w[1] inputs 16..31 (G = 32)
template <int G, bool kFour, int kNib = kLookup>
inline void decode_ints(const uint8_t* group, __m128i table, __m256i* w) {
  if constexpr (kFour && kNib != kLookup) {  // the nibble itself: one widening load, a mask, a shift
    const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
    w[0] = _mm256_and_si256(words, _mm256_set1_epi16(0x0F));
    w[1] = _mm256_srli_epi16(words, 4);
  } else if constexpr (kFour) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group));
    const __m128i mask = _mm_set1_epi8(0x0F);
    w[0] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(bytes, mask)));
    w[1] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
  } else {
    for (int v = 0; v < G / 16; ++v) {
      w[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + v * 16)));
    }
  }
}

// rows [0, R) of the activations against output n -> out[r * ldo]
template <int R, int G, bool kFour, bool kZero, int kNib = kLookup>
void dot_rows(const Weight& wt, int64_t n, const Activations& a, int64_t row, float* out, int64_t ldo) {
  const uint8_t* codes = wt.codes_of(n);
  const int64_t step = wt.code_step();
  const __m128i table =
      kFour ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(wt.table)) : _mm_setzero_si128();
  const int16_t* xq = a.q + row * a.k;
  const float* xd = a.d + row * a.groups;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  ScaleWalk scales(wt.scale, n);
  auto rows = [&](const __m256i* w, int64_t g) {  // group g's term into each row's lanes
    const __m256 dw = _mm256_set1_ps(scales.next());
    for (int r = 0; r < R; ++r) {
      const int16_t* x = xq + r * a.k + g * G;
      __m256i isum = _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
      if constexpr (G == 32) {
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
      }
      if constexpr (kFour && kNib == kShifted) {
        isum = _mm256_add_epi32(isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.shift + ((row + r) * a.groups + g) * 8)));
      }
      const __m256 s = _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + r * a.groups + g));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, acc[r]);
    }
  };
  int64_t g = 0;
  for (; g < wt.groups; ++g) {
    __m256i w[G / 16];
    decode_ints<G, kFour, kNib>(codes + g * step, table, w);
    rows(w, g);
  }
  for (int r = 0; r < R; ++r) {
    float total = reduce(acc[r]);
    if constexpr (kZero) total += zero_term(wt.zero, n, a.sum + (row + r) * a.groups);
    out[r * ldo] = total;
  }
}

#ifdef PAGEDSERVE_GROUPED_AVX512

// zero_term for rows [0, R) (their sums at sum + r * stride) and the kQuad outputs [n, n + kQuad), each
// (row, output) with zero_term's lanes, order and tree (so the same bits), two outputs a register: the four
// outputs' zeros are made float32 once (a factored zero exactly as zero_term makes it) into `zeros`, pair p's
// eight groups from 8j side by side at [(2j + p) * 16], and then each row takes one fma per pair and 8 groups
// where zero_term took 8 groups' conversion and one fma per output
template <int R>
void quad_zero_terms(const GroupScales& zero, int64_t n, const float* sum, int64_t stride, std::vector<float>& zeros,
                     float (*terms)[kQuad]) {
  const int64_t groups = zero.groups, runs = groups / 8;  // whole runs of 8 groups; a factored zero has no tail
  zeros.resize(static_cast<size_t>(runs * kQuad * 8));
  for (int o = 0; o < kQuad; ++o) {
    float* to = zeros.data() + (o / 2) * 16 + (o % 2) * 8;
    if (zero.floats != nullptr) {
      const float* row = zero.floats + zero.at(n + o);
      for (int64_t j = 0; j < runs; ++j) _mm256_storeu_ps(to + j * 32, _mm256_loadu_ps(row + j * 8));
    } else {
      const int8_t* row = zero.ints + zero.at(n + o);
      const float* unit = zero.units + zero.unit_at(n + o);
      for (int64_t j = 0, in_unit = 0; j < runs; ++j) {
        const __m256i ints = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j * 8)));
        _mm256_storeu_ps(to + j * 32, _mm256_mul_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(*unit)));
        if ((in_unit += 8) == zero.per_unit) {
          in_unit = 0;
          ++unit;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* s = sum + r * stride;
    __m512 z[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t j = 0; j < runs; ++j) {
      const __m512 sums = _mm512_broadcast_f32x8(_mm256_loadu_ps(s + j * 8));  // both halves: groups 8j..8j+7
      z[0] = _mm512_fmadd_ps(_mm512_loadu_ps(zeros.data() + j * 32), sums, z[0]);
      z[1] = _mm512_fmadd_ps(_mm512_loadu_ps(zeros.data() + j * 32 + 16), sums, z[1]);
    }
    float lanes[kQuad][8];
    _mm512_storeu_ps(lanes[0], z[0]);
    _mm512_storeu_ps(lanes[2], z[1]);
    for (int o = 0; o < kQuad; ++o) {
      if (zero.floats != nullptr) {  // the tail past the whole runs, lane by lane as zero_term does
        const float* row = zero.floats + zero.at(n + o);
        for (int64_t g = runs * 8; g < groups; ++g) lanes[o][g & 7] = __builtin_fmaf(row[g], s[g], lanes[o][g & 7]);
      }
      terms[r][o] = reduce_lanes(lanes[o]);
    }
  }
}

// rows [0, R) of the activations against the kQuad outputs [n, n + kQuad) of the quad layout ->
// out[r * ldo + o], AVX-512: two outputs a register, the low 256 bits output 2p's lanes and the high ones
// output 2p+1's, each lane the integers and the float steps of dot_rows<1> (so the same bits), with VNNI's
// fused multiply-add of int16 pairs where the CPU has it (integer sums: exact in any order). The four
// outputs' codes are decoded once per group for all R rows.
template <int R, int G, bool kFour, bool kZero, int kNib>
void dot_quad(const Weight& wt, int64_t n, const Activations& a, int64_t row, float* out, int64_t ldo) {
  const __m256i table = kFour ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wt.table)))
                              : _mm256_setzero_si256();
  const int16_t* xq = a.q + row * a.k;
  const float* xd = a.d + row * a.groups;
  const uint8_t* codes = wt.codes_of(n);  // group g: kQuad runs of group_bytes
  constexpr int64_t kGroupBytes = kFour ? 16 : G;
  constexpr int kPairs = kQuad / 2;
  const __m512i pick[kPairs] = {_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2)};
  __m512 acc[R][kPairs];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < kPairs; ++p) acc[r][p] = _mm512_setzero_ps();
  }
  ScaleWalk walk(wt.scale, n);
  for (int64_t g = 0; g < wt.groups; ++g) {
    const uint8_t* group = codes + g * kQuad * kGroupBytes;
    _mm_prefetch(reinterpret_cast<const char*>(group + kPrefetchBytes), _MM_HINT_T0);
    // the scales' stream, as far ahead in groups as the codes'
    _mm_prefetch(static_cast<const char*>(walk.ahead(kPrefetchBytes / (kQuad * kGroupBytes))), _MM_HINT_T0);
    __m512i w[kPairs][G / 16];  // pair p: output 2p's inputs 16v..16v+15, then output 2p+1's
    __m512 pair_scale[kPairs];  // the pair's scales, each in its output's 8 lanes
    const __m512 scales = _mm512_castps128_ps512(quad_scales(walk));
#pragma GCC unroll 2
    for (int p = 0; p < kPairs; ++p) {
      const uint8_t* pair = group + 2 * p * kGroupBytes;  // output 2p's group, then output 2p+1's
      pair_scale[p] = _mm512_permutexvar_ps(pick[p], scales);
      if constexpr (kFour && kNib != kLookup) {
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair)));
        w[p][0] = _mm512_and_si512(words, _mm512_set1_epi16(0x0F));
        w[p][1] = _mm512_srli_epi16(words, 4);
      } else if constexpr (kFour) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
        const __m256i mask = _mm256_set1_epi8(0x0F);
        w[p][0] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(bytes, mask)));
        w[p][1] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask)));
      } else {
        for (int v = 0; v < G / 16; ++v) {
          const __m256i bytes = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + G + v * 16)),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + v * 16)));
          w[p][v] = _mm512_cvtepi8_epi16(bytes);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512i x[G / 16];  // the row's block, inputs 16v..16v+15 in both halves
      for (int v = 0; v < G / 16; ++v) {
        x[v] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * a.k + g * G + v * 16)));
      }
      __m512i shift = _mm512_setzero_si512();
      if constexpr (kFour && kNib == kShifted) {
        shift = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.shift + ((row + r) * a.groups + g) * 8)));
      }
      const __m512 d = _mm512_set1_ps(xd[r * a.groups + g]);
#pragma GCC unroll 2
      for (int p = 0; p < kPairs; ++p) {
        __m512i isum = shift;
        for (int v = 0; v < G / 16; ++v) {
#if defined(__AVX512VNNI__)
          isum = _mm512_dpwssd_epi32(isum, w[p][v], x[v]);
#else
          isum = _mm512_add_epi32(isum, _mm512_madd_epi16(w[p][v], x[v]));
#endif
        }
        // scale * d: the product dot_rows makes
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(pair_scale[p], d), acc[r][p]);
      }
    }
  }
  float terms[R][kQuad];
  if constexpr (kZero && R > 1) {  // one row: zero_term per output below (making the float zeros costs more there)
    thread_local std::vector<float> zeros;  // quad_zero_terms' float zeros, grown to the longest row seen
    quad_zero_terms<R>(wt.zero, n, a.sum + row * a.groups, a.groups, zeros, terms);
  }
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < kQuad; ++o) {
      const __m512 pair = acc[r][o / 2];
      float total = reduce(o % 2 ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(pair), 1))
                                 : _mm512_castps512_ps256(pair));
      if constexpr (kZero) total += R > 1 ? terms[r][o] : zero_term(wt.zero, n + o, a.sum + (row + r) * a.groups);
      out[r * ldo + o] = total;
    }
  }
}

constexpr bool kQuadRows = true;  // dot_quad serves any row count

#else  // AVX2

constexpr bool kQuadRows = false;  // dot_quad serves one row (R = 1); more rows take dot_rows

// one row of activations against the kQuad outputs [n, n + kQuad) of the quad layout -> out[0, kQuad):
// dot_rows<1> for each of them, the same arithmetic (so the same bits), with the four outputs' group read as
// one run of bytes, the row's block, its d and its shift lanes loaded once, and four sums in flight
template <int R, int G, bool kFour, bool kZero, int kNib>
void dot_quad(const Weight& wt, int64_t n, const Activations& a, int64_t row, float* out, int64_t /*ldo*/) {
  static_assert(R == 1, "the AVX2 quad loop serves one row");
  const __m128i table =
      kFour ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(wt.table)) : _mm_setzero_si128();
  const int16_t* xq = a.q + row * a.k;
  const float* xd = a.d + row * a.groups;
  const uint8_t* codes = wt.codes_of(n);  // group g: kQuad runs of group_bytes
  constexpr int64_t kGroupBytes = kFour ? 16 : G;
  __m256 acc[kQuad];
  for (int o = 0; o < kQuad; ++o) acc[o] = _mm256_setzero_ps();
  ScaleWalk walk(wt.scale, n);
  for (int64_t g = 0; g < wt.groups; ++g) {
    __m256i x[G / 16];
    for (int v = 0; v < G / 16; ++v) x[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * G + v * 16));
    const __m256 d = _mm256_broadcast_ss(xd + g);
    __m256i shift = _mm256_setzero_si256();
    if constexpr (kFour && kNib == kShifted) {
      shift = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.shift + (row * a.groups + g) * 8));
    }
    const uint8_t* group = codes + g * kQuad * kGroupBytes;
    float scales[kQuad];
    _mm_storeu_ps(scales, quad_scales(walk));
#pragma GCC unroll 4
    for (int o = 0; o < kQuad; ++o) {
      __m256i w[G / 16];
      decode_ints<G, kFour, kNib>(group + o * kGroupBytes, table, w);
      __m256i isum = _mm256_madd_epi16(w[0], x[0]);
      if constexpr (G == 32) isum = _mm256_add_epi32(isum, _mm256_madd_epi16(w[1], x[1]));
      if constexpr (kFour && kNib == kShifted) isum = _mm256_add_epi32(isum, shift);
      const __m256 s = _mm256_mul_ps(_mm256_set1_ps(scales[o]), d);
      acc[o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, acc[o]);
    }
  }
  for (int o = 0; o < kQuad; ++o) {
    float total = reduce(acc[o]);
    if constexpr (kZero) total += zero_term(wt.zero, n + o, a.sum + row * a.groups);
    out[o] = total;
  }
}

#endif

// group g of a row as float32 (the unpack): exactly the file's values
template <int G, bool kFour, bool kZero>
void unpack_group(const Weight& wt, int64_t n, int64_t g, float* out) {
  const __m128i table =
      kFour ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(wt.table)) : _mm_setzero_si128();
  __m256i w[G / 16];
  decode_ints<G, kFour>(wt.codes_of(n) + g * wt.code_step(), table, w);
  const __m256 s = _mm256_set1_ps(wt.scale.value(n, g));
  const __m256 z = _mm256_set1_ps(kZero ? wt.zero.value(n, g) : 0.0f);
  for (int v = 0; v < G / 16; ++v) {
    const __m256i halves[2] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w[v])),
                               _mm256_cvtepi16_epi32(_mm256_extracti128_si256(w[v], 1))};
    for (int h = 0; h < 2; ++h) {
      const __m256 f = _mm256_cvtepi32_ps(halves[h]);
      _mm256_storeu_ps(out + v * 16 + h * 8, kZero ? _mm256_fmadd_ps(f, s, z) : _mm256_mul_ps(f, s));
    }
  }
}

bool vectorized() { return true; }

#else  // portable: the same arithmetic, lane by lane

template <int G>
void quantize_block(const float* x, int16_t* q, float* d, float* sum, int32_t* /*shift*/, int16_t /*offset*/) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < G; ++i) {
    const float a = __builtin_fabsf(x[i]);
    finite = finite && a <= __FLT_MAX__;
    amax = a > amax ? a : amax;
  }
  float inverse;
  block_scale(amax, finite, d, &inverse);
  int32_t total = 0;
  for (int i = 0; i < G; ++i) {
    const float scaled = finite ? x[i] * inverse : 0.0f;  // a NaN block's q are 0
    const int32_t v = std::clamp(static_cast<int32_t>(__builtin_nearbyintf(scaled)), -32767, 32767);
    q[i] = static_cast<int16_t>(v);
    total += v;
  }
  if (sum != nullptr) *sum = *d * static_cast<float>(total);
}

inline int code_at(const uint8_t* group, int i, const int8_t* table, bool four) {
  if (four) {
    const uint8_t byte = group[i & 15];
    return table[i < 16 ? (byte & 0x0F) : (byte >> 4)];
  }
  return static_cast<int8_t>(group[i]);
}

template <int R, int G, bool kFour, bool kZero, int kNib = kLookup>  // kNib: the vector loop's concern
void dot_rows(const Weight& wt, int64_t n, const Activations& a, int64_t row, float* out, int64_t ldo) {
  const uint8_t* codes = wt.codes_of(n);
  for (int r = 0; r < R; ++r) {
    const int16_t* xq = a.q + (row + r) * a.k;
    const float* xd = a.d + (row + r) * a.groups;
    float acc[8] = {};
    ScaleWalk scales(wt.scale, n);
    for (int64_t g = 0; g < wt.groups; ++g) {
      int32_t isum[8] = {};
      const uint8_t* group = codes + g * wt.code_step();
      for (int i = 0; i < G; ++i) isum[(i & 15) >> 1] += code_at(group, i, wt.table, kFour) * xq[g * G + i];
      const float s = scales.next() * xd[g];
      for (int l = 0; l < 8; ++l) acc[l] = __builtin_fmaf(static_cast<float>(isum[l]), s, acc[l]);
    }
    float total = reduce_lanes(acc);
    if constexpr (kZero) {
      float lanes[8] = {};
      ScaleWalk zeros(wt.zero, n);
      total += zero_term_portable(zeros, wt.groups, a.sum + (row + r) * a.groups, 0, lanes);
    }
    out[r * ldo] = total;
  }
}

constexpr bool kQuadRows = false;  // dot_quad serves one row (R = 1); more rows take dot_rows

template <int R, int G, bool kFour, bool kZero, int kNib>  // dot_rows<R> for each of the quad's outputs
void dot_quad(const Weight& wt, int64_t n, const Activations& a, int64_t row, float* out, int64_t ldo) {
  for (int64_t o = 0; o < kQuad; ++o) dot_rows<R, G, kFour, kZero, kNib>(wt, n + o, a, row, out + o, ldo);
}

template <int G, bool kFour, bool kZero>
void unpack_group(const Weight& wt, int64_t n, int64_t g, float* out) {
  const uint8_t* group = wt.codes_of(n) + g * wt.code_step();
  const float s = wt.scale.value(n, g);
  for (int i = 0; i < G; ++i) {
    const float f = static_cast<float>(code_at(group, i, wt.table, kFour));
    out[i] = kZero ? __builtin_fmaf(f, s, wt.zero.value(n, g)) : f * s;
  }
}

bool vectorized() { return false; }

#endif

// x float32 [M, K] -> its int16 blocks (and their sums when the weight has a zero term, and the
// shift lanes when its nibbles are shifted: the vector loop only)
template <int G>
void quantize_rows(const float* x, int64_t m, int64_t k, int16_t* q, float* d, float* sum, int32_t* shift = nullptr,
                   int16_t offset = 0) {
  const int64_t groups = k / G;
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        quantize_block<G>(x + r * k + g * G, q + r * k + g * G, d + r * groups + g,
                          sum != nullptr ? sum + r * groups + g : nullptr,
                          shift != nullptr ? shift + (r * groups + g) * 8 : nullptr, offset);
      }
    }
  });
}

// quantize_rows for the group size of the call (32, or 16 for 8-bit codes: no shift lanes there)
void quantize_for(int64_t group, const float* x, int64_t m, int64_t k, int16_t* q, float* d, float* sum,
                  int32_t* shift = nullptr, int16_t offset = 0) {
  if (group == 32) {
    quantize_rows<32>(x, m, k, q, d, sum, shift, offset);
  } else {
    quantize_rows<16>(x, m, k, q, d, sum);
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

// rows [row, end) in blocks of kRowBlock, then one of 4, 2 and 1 as they fit: run(std::integral_constant<int, R>,
// first row) for each block
template <typename Run>
inline void row_blocks(int64_t row, int64_t end, Run&& run) {
  for (; row + kRowBlock <= end; row += kRowBlock) run(std::integral_constant<int, kRowBlock>{}, row);
  if (end - row >= 4) {
    run(std::integral_constant<int, 4>{}, row);
    row += 4;
  }
  if (end - row >= 2) {
    run(std::integral_constant<int, 2>{}, row);
    row += 2;
  }
  if (end - row >= 1) run(std::integral_constant<int, 1>{}, row);
}

template <int G, bool kFour, bool kZero>
struct MatmulKernel {
  static void run(const Weight& wt, const Activations& a, int64_t m, float* out, int64_t n) {
    if constexpr (kFour) {
      switch (wt.nibbles) {
        case kPlain: return loop<kPlain>(wt, a, m, out, n);
        case kShifted: return loop<kShifted>(wt, a, m, out, n);
        default: return loop<kLookup>(wt, a, m, out, n);
      }
    } else {
      loop<kLookup>(wt, a, m, out, n);
    }
  }

  template <int kNib>
  static void loop(const Weight& wt, const Activations& a, int64_t m, float* out, int64_t n) {
    const int64_t blocks = (n + kBlockOutputs - 1) / kBlockOutputs;
    const int64_t grain = std::max<int64_t>(1, blocks / (4 * at::get_num_threads()));
    const int64_t chunk = std::max<int64_t>(kRowBlock, kRowChunkBytes / (2 * a.k) / kRowBlock * kRowBlock);
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      const int64_t first = begin * kBlockOutputs, last = std::min(n, end * kBlockOutputs);
      if (m == 1 && wt.quad == kQuad) {  // a decode step's one row, four outputs at a time (first: a multiple of 8)
        for (int64_t o = first; o < last; o += kQuad) dot_quad<1, G, kFour, kZero, kNib>(wt, o, a, 0, out + o, n);
        return;
      }
      if constexpr (kQuadRows) {
        if (wt.quad == kQuad) {  // blocks of up to 8 rows against four outputs, in chunks of rows that stay in L2
          for (int64_t row0 = 0; row0 < m; row0 += chunk) {
            const int64_t rows_end = std::min(m, row0 + chunk);
            for (int64_t o = first; o < last; o += kQuad) {
              row_blocks(row0, rows_end, [&](auto rows, int64_t r) {
                constexpr int R = decltype(rows)::value;
                // as in the row loop below: at 4 rows and more the shift's add per row costs more than the
                // shared table lookup (the same integers either way)
                constexpr int kRowsNib = R >= 4 && kNib == kShifted ? kLookup : kNib;
                dot_quad<R, G, kFour, kZero, kRowsNib>(wt, o, a, r, out + r * n + o, n);
              });
            }
          }
          return;
        }
      }
      for (int64_t row0 = 0; row0 < m; row0 += chunk) {
        const int64_t rows_end = std::min(m, row0 + chunk);
        for (int64_t o = first; o < last; ++o) {
          row_blocks(row0, rows_end, [&](auto rows, int64_t r) {
            constexpr int R = decltype(rows)::value;
            // at 4 rows and more a group's decode is shared, and the shift's add per row would cost more than
            // the table lookup saves: those blocks look the nibbles up (the same integers either way)
            constexpr int kRowsNib = R >= 4 && kNib == kShifted ? kLookup : kNib;
            dot_rows<R, G, kFour, kZero, kRowsNib>(wt, o, a, r, out + r * n + o, n);
          });
        }
      }
    });
  }
};

template <int G, bool kFour, bool kZero>
struct UnpackKernel {
  static void run(const Weight& wt, int64_t start, int64_t end, int64_t k, float* out) {
    at::parallel_for(start, end, 16, [&](int64_t begin, int64_t stop) {
      for (int64_t row = begin; row < stop; ++row) {
        for (int64_t g = 0; g < wt.groups; ++g) unpack_group<G, kFour, kZero>(wt, row, g, out + (row - start) * k + g * G);
      }
    });
  }
};

// the weight's outputs N: codes [N, K / 2] or [N, K] (rows), or [N / kQuad, K / G, kQuad, group bytes] (quads)
int64_t outputs_of(const torch::Tensor& codes) { return codes.dim() == 4 ? codes.size(0) * kQuad : codes.size(0); }

// scale (or zero): float32 in the weight's layout, or int8 in it with `units` float32 [.., groups / per_unit, ..]
// beside it (factored); `what` names it in errors. quad: kQuad (the quad layout: [N / 4, groups, 4]) or 1 ([N, groups])
GroupScales check_scales(const torch::Tensor& values, const torch::Tensor& units, const char* what, int64_t n,
                         int64_t groups, int64_t quad) {
  const bool factored = values.scalar_type() == torch::kInt8;
  TORCH_CHECK(factored || values.scalar_type() == torch::kFloat32, what, ": float32, or int8 with its units");
  const auto fits = [&](const torch::Tensor& t, int64_t count) {
    return t.is_contiguous() && t.device().is_cpu() &&
           (quad == kQuad ? (t.dim() == 3 && t.size(0) * kQuad == n && t.size(1) == count && t.size(2) == kQuad)
                          : (t.dim() == 2 && t.size(0) == n && t.size(1) == count));
  };
  TORCH_CHECK(fits(values, groups), what, ": contiguous [N, K / group] (rows) or [N / 4, K / group, 4] (quads), "
              "got ", values.sizes());
  if (!factored) {
    TORCH_CHECK(units.numel() == 0, what, ": float32 values take no units");
    return GroupScales{values.data_ptr<float>(), nullptr, nullptr, groups, 1, quad};
  }
  TORCH_CHECK(units.scalar_type() == torch::kFloat32 && units.dim() == values.dim(), what, "'s units: float32");
  const int64_t count = units.size(1);
  TORCH_CHECK(count > 0 && groups % count == 0 && (groups / count) % 8 == 0 && fits(units, count), what,
              "'s units: one per 8k groups, shaped as its values, got ", units.sizes(), " for ", groups, " groups");
  return GroupScales{nullptr, values.data_ptr<int8_t>(), units.data_ptr<float>(), groups, groups / count, quad};
}

Weight check_weight(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& scale_units,
                    const torch::Tensor& zero, const torch::Tensor& zero_units, const torch::Tensor& table,
                    int64_t group, int64_t k) {
  TORCH_CHECK((codes.dim() == 2 || codes.dim() == 4) && codes.is_contiguous() && codes.device().is_cpu(),
              "codes: contiguous [N, K] or [N, K / 2] (rows), or [N / 4, K / G, 4, G or 16] (quads), on the CPU");
  const bool four = codes.scalar_type() == torch::kUInt8;
  TORCH_CHECK(four || codes.scalar_type() == torch::kInt8, "codes: uint8 nibbles or int8");
  TORCH_CHECK(four ? group == kNibbleGroup : (group == 16 || group == 32), "4-bit codes come in groups of 32, 8-bit in 16 or 32");
  TORCH_CHECK(k % group == 0, "K = ", k, " is not a multiple of the group ", group);
  const int64_t n = outputs_of(codes), groups = k / group, group_bytes = four ? 16 : group;
  const bool quads = codes.dim() == 4;
  TORCH_CHECK(quads ? (codes.size(1) == groups && codes.size(2) == kQuad && codes.size(3) == group_bytes)
                    : codes.size(1) == groups * group_bytes,
              "codes ", codes.sizes(), " do not fit K = ", k, " in groups of ", group);
  const GroupScales scales = check_scales(scale, scale_units, "scale", n, groups, quads ? kQuad : 1);
  GroupScales zeros{nullptr, nullptr, nullptr, groups, 1, 1};
  if (zero.numel() > 0) zeros = check_scales(zero, zero_units, "zero", n, groups, 1);
  TORCH_CHECK(!four || (table.scalar_type() == torch::kInt8 && table.numel() == 16 && table.is_contiguous()),
              "table: int8 [16] for 4-bit codes");
  Nibbles nibbles = kLookup;
  if (four && vectorized()) {
    const int8_t* t = table.data_ptr<int8_t>();
    bool consecutive = true;
    for (int i = 1; i < 16; ++i) consecutive = consecutive && t[i] == t[0] + i;
    if (consecutive) nibbles = t[0] == 0 ? kPlain : kShifted;
  }
  return Weight{static_cast<const uint8_t*>(codes.data_ptr()), scales, zeros, groups, group_bytes, quads ? kQuad : 1,
                four ? table.data_ptr<int8_t>() : nullptr, nibbles};
}

// x's int16 blocks (q int16 [M, K], d float32 [M, K / group], sum float32 [M, K / group] or empty)
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x, int64_t group, bool with_sum) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(group == 16 || group == 32, "activation blocks of 16 or 32");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % group == 0, "K = ", k, " is not a multiple of the group ", group);
  auto q = torch::empty({m, k}, x.options().dtype(torch::kInt16));
  auto d = torch::empty({m, k / group}, x.options());
  auto sum = with_sum ? torch::empty({m, k / group}, x.options()) : torch::empty({0}, x.options());
  quantize_for(group, x.data_ptr<float>(), m, k, q.data_ptr<int16_t>(), d.data_ptr<float>(),
               with_sum ? sum.data_ptr<float>() : nullptr);
  return {q, d, sum};
}

torch::Tensor grouped_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                             const torch::Tensor& scale_units, const torch::Tensor& zero,
                             const torch::Tensor& zero_units, const torch::Tensor& table, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  const Weight wt = check_weight(codes, scale, scale_units, zero, zero_units, table, group, k);
  const int64_t n = outputs_of(codes);
  auto out = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const int64_t groups = k / group;
  std::unique_ptr<int16_t[]> q(new int16_t[m * k]);
  std::unique_ptr<float[]> d(new float[m * groups]);
  std::unique_ptr<float[]> sum(wt.has_zero() ? new float[m * groups] : nullptr);
  std::unique_ptr<int32_t[]> shift(wt.nibbles == kShifted ? new int32_t[m * groups * 8] : nullptr);
  quantize_for(group, x.data_ptr<float>(), m, k, q.get(), d.get(), sum.get(), shift.get(),
               wt.nibbles == kShifted ? wt.table[0] : 0);
  const Activations a{q.get(), d.get(), sum.get(), shift.get(), k, groups};
  dispatch<MatmulKernel>(codes.scalar_type() == torch::kUInt8, group, wt.has_zero(), wt, a, m,
                         out.data_ptr<float>(), n);
  return out;
}

torch::Tensor grouped_unpack(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& scale_units,
                             const torch::Tensor& zero, const torch::Tensor& zero_units, const torch::Tensor& table,
                             int64_t group, int64_t start, int64_t end) {
  TORCH_CHECK(scale.dim() == 2 || scale.dim() == 3, "scale: [N, K / group] or [N / 4, K / group, 4]");
  const int64_t k = scale.size(1) * group;
  const Weight wt = check_weight(codes, scale, scale_units, zero, zero_units, table, group, k);
  TORCH_CHECK(0 <= start && start <= end && end <= outputs_of(codes), "rows [", start, ", ", end, ") out of range");
  auto out = torch::empty({end - start, k}, codes.options().dtype(torch::kFloat32));
  dispatch<UnpackKernel>(codes.scalar_type() == torch::kUInt8, group, wt.has_zero(), wt, start, end, k,
                         out.data_ptr<float>());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pagedserve::kReleaseGil;
  m.def("grouped_matmul", &grouped_matmul, kReleaseGil,
        "x float32 [M, K] @ grouped weight.T -> float32 [M, N] (CPU), x rounded to int16 per group");
  m.def("quantize_activations", &quantize_activations, kReleaseGil,
        "x float32 [M, K] -> (q int16 [M, K], d float32 [M, K / group], sum float32 [M, K / group] or empty)");
  m.def("grouped_unpack", &grouped_unpack, kReleaseGil, "rows [start, end) of a grouped weight as float32 (CPU)");
  m.def("vectorized", &vectorized, "whether this build has the AVX2/FMA path");
  static const pagedserve::GroupedMatmulEntries entries{&grouped_matmul};
  m.attr("entry_points") = pagedserve::export_entries(&entries);
}
