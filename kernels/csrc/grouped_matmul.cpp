// x @ W.T for a weight kept in ggml's own groups (kernels/grouped_matmul.py has the layouts):
//
//   value[n][k] = int(code[n][k]) * scale[n][k / G] (+ zero[n][k / G])
//
// codes are 4-bit (a nibble read through a 16-entry int8 table), 6-bit (q in 0..63, the integer q - 32:
// Q6_K's codes, and Q5_x's, which fit; panels only) or 8-bit (int8); scale and zero are
// float32 per group, float16 per group (where that holds them exactly, as the f16 of Q4_0 or Q8_0 is),
// or factored as the K-quants store them (an int8 per group times a float32 or float16 unit per run of groups): the
// same floats in every form. G = 32 (or 16 for 8-bit codes). The weights are the file's: the
// integers and scales as stored, nothing rounded again.
//
// The activations are rounded to int8, per block of G inputs (one block per weight group):
//   d = max |x| / 127, q = round(x / d) (to nearest even): |x - q d| <= d / 2, 2^-8 of the block's
//   largest value (llama.cpp's Q8_0 and Q8_K activations round the same way, per 32 or 256 inputs). A
//   block holding a NaN or an infinity gets d = NaN, so the outputs it reaches are NaN, as a float
//   matmul's would be. (Until December 2026 they were int16; int8 doubles the products an instruction
//   makes, vpdpbusd against vpdpwssd, and the KL divergence stayed within llama.cpp's: BENCHMARKS.md.)
// Then, per (row, output), each group's integer dot product is exact (|isum| <= 32 * 127 * 255 < 2^31),
// and one float32 step adds it into one of 8 lanes, the lane of the group's number mod 8:
//   acc[g % 8] = fma(float(isum[g]), scale[g] * d[g], acc[g % 8])           g = 0, 1, ... in order
//   zacc[g % 8] = fma(zero[g], d[g] * (sum of the block's q), zacc[g % 8])  (a weight with zeros)
//   out = reduce(acc) + reduce(zacc)       reduce: one fixed tree of the 8 lanes
// (float(isum) rounds to nearest even past 2^24: every build converts the same integer the same way.)
// The unit arithmetic (factored scales, and zeros none or factored with the same units: the K-quants,
// IQ4_XS; Weight::units): the activations are rounded per unit span instead (P groups, Q4_K's and Q6_K's
// 256 inputs, as llama.cpp's Q8_K does), each unit's groups are summed in int32 with their ints, and one
// float step a unit goes into the lane of the unit's number mod 8:
//   acc[u % 8] = fma(float(sum over u's groups of sc[g] * isum[g]), unit[u] * d[u], acc[u % 8])
//   zacc[u % 8] = fma(float(sum over u's groups of m[g] * (sum of g's q)), zero_unit[u] * d[u], zacc[u % 8])
// exact integers below 2^31 while a span is at most kMaxUnitSpan inputs; the zeros' products come two
// groups to a vpmaddwd (m and the sums of q fit int16). A per-group float step cost ~4 instructions a row
// against a group's 8 byte dot products; this takes 2 (vpmulld, vpaddd) and one step a unit.
// A row's result therefore never depends on the rows beside it, on how the rows are split into calls
// (a prefix-cache hit, whose last rows arrive alone, computes what the whole prompt did; a speculative
// verify computes what plain decoding does), on the layout, or on the build: the AVX-512, AVX2 and plain
// C++ loops give the same bits (tests/kernels/test_grouped_matmul.py checks the build the CPU makes
// against the plain one; the AVX2 build was checked against both by hand, built with -mno-avx512f).
//
// Layouts. Rows: output n's groups one after another (4-bit: 16 bytes a group, byte j = input j in the
// low nibble, input j + 16 in the high one; 8-bit: G bytes). Panels (N a multiple of 16; what the models
// use): 16 outputs' groups side by side, so that one 64-byte load holds, for each of the 16 outputs, 8
// inputs in nibbles (4-bit) or 4 inputs in bytes (8-bit), and one byte shuffle gathers each output's bytes
// into its own 32-bit lane, 4 inputs a byte lane (quad_order). Within the 64 bytes, output o = 4c + t (c = 0..3, t = 0..3)
// owns bytes 16c + 2t + e and 16c + 8 + 2t + e (e = 0, 1); for load j of a group:
//   4-bit: byte 16c + 2t + e      = input 8j + e (low nibble),     input 8j + 4 + e (high)
//          byte 16c + 8 + 2t + e  = input 8j + 2 + e (low nibble), input 8j + 6 + e (high)
//   8-bit: byte 16c + 2t + e = input 4j + e, byte 16c + 8 + 2t + e = input 4j + 2 + e
//   6-bit: 96 bytes a load: the 4-bit layout of q's low 4 bits (64 bytes), then 32 bytes of their high 2
//          bits: byte position p (0..63) of the 64 owns a nibble h[p], bits 0-1 the low nibble's input's
//          and bits 2-3 the high nibble's; byte 64 + b holds h[b] in its low half and h[b + 32] in its high
// The panel's scales and zeros: [N / 16, groups, 16] (a factored one's units [N / 16, groups / P, 16]).
//
// Loop (the vector builds, panels): per 16 outputs and group, each 64-byte load becomes 1 or 2 vectors
// of 4 bytes a lane (the shuffle, a mask and a shift; the table through a byte shuffle; 6-bit: the high
// bits shifted into place and or-ed in, the -32 added as a sum of the block's q) shared by a block of
// rows; each row multiplies them against its 4 inputs broadcast. The byte dot product takes unsigned
// weight bytes: with VNNI (vpdpbusd), a signed code (8-bit, or a table's entry) enters plus 128 and the
// -128 comes back as a sum of the block's q; without it (vpmaddubsw and vpmaddwd), whose int16 pairs
// could saturate at 255 * 127 * 2, the signed code enters as its magnitude against the input signed by it.
// Either way the integers are exact, and 16 outputs' sums make a vector, so the float step is one
// conversion and one fma for 16 outputs. AVX2 runs the same loop 8 outputs at a time (each half of the 64 bytes). The outputs are split
// between the threads in panels (at::parallel_for); the rows run in chunks that stay in L2. Row layouts
// and the plain build take the scalar loop, which states the arithmetic.
// grouped_unpack: rows [start, end) of W in float32 (the references, and anything that wants W dense);
// grouped_rows: rows by id (an embedding lookup from a tied head's groups).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "bindings.h"
#include "entry_points.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_GROUPED_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_GROUPED_AVX512 1
#endif
#endif

namespace {

constexpr int64_t kNibbleGroup = 32;            // inputs per group of 4-bit codes (16 bytes)
constexpr int64_t kPanel = 16;                  // outputs side by side in the panel layout
constexpr int64_t kLoadBytes = 64;              // one load of a panel's group: 16 outputs x 8 nibbles or 4 bytes
constexpr int kRowBlock = 4;                    // rows that share one decode of a panel's group
constexpr int64_t kRowChunkBytes = 256 * 1024;  // int8 rows run against each panel at a time (L2)
constexpr int64_t kPrefetchBytes = 2048;        // how far ahead of the decode loop its weight stream is fetched
constexpr float kActivationMax = 127.0f;        // int8 activations: q in [-127, 127]
constexpr int64_t kMaxUnitSpan = 1024;          // a unit's inputs, at most, for its int32 sum: 1024 * 127 * 128 * 128 < 2^31

// how the vector loop makes a code's integer: a 4-bit one through the table, or (a table of 16
// consecutive integers, as Q4_0's -8..7 and Q4_1's / Q4_K's 0..15 are) the nibble itself, plus table[0] * (sum
// of q); or 6-bit codes (the nibble and its two high bits, plus -32 * (sum of q))
enum Nibbles { kLookup = 0, kPlain = 1, kShifted = 2, kSix = 3 };
constexpr int32_t kSixOffset = -32;             // a 6-bit code's integer: q + kSixOffset
constexpr int64_t kSixLoadBytes = 96;           // one load of a 6-bit panel's group: 64 bytes of low nibbles, 32 high

// A weight's scales, or its zeros, in one of three forms: float32 per group; float16 per group (the f16
// that Q4_0, Q8_0, Q5_x and IQ4_NL store, kept where float16 holds every value exactly: the same floats
// in half the bytes); or factored as the K-quants store them, an int8 per group times a unit per run of
// `per_unit` groups, float32 or float16 (Q4_K's d * sc: the file's f16 d times a 6-bit integer). The
// product is exact in float32, so every form gives the same floats.
struct GroupScales {
  const float* floats;    // output n's group g at [at(n) + g * panel] (nullptr: float16, factored, or none)
  const uint16_t* halves; // float16 bits: the same place
  const int8_t* ints;     // factored: the same place
  const float* units;   // factored: output n's unit u at [unit_at(n) + u * panel] (nullptr: float16 units)
  const uint16_t* half_units;  // float16 bits: the same place
  int64_t groups, per_unit, panel;  // per_unit: groups to a unit (factored); panel: 1 (rows) or kPanel

  bool present() const { return floats != nullptr || halves != nullptr || ints != nullptr; }
  int64_t at(int64_t n) const { return (n / panel) * groups * panel + n % panel; }
  int64_t unit_at(int64_t n) const { return (n / panel) * (groups / per_unit) * panel + n % panel; }
  float value(int64_t n, int64_t g) const {  // output n's group g
    if (floats != nullptr) return floats[at(n) + g * panel];
    if (halves != nullptr) return static_cast<float>(c10::Half(halves[at(n) + g * panel], c10::Half::from_bits()));
    return unit(n, g / per_unit) * static_cast<float>(int_at(n, g));
  }
  int32_t int_at(int64_t n, int64_t g) const { return ints[at(n) + g * panel]; }  // factored: output n's group g's int
  float unit(int64_t n, int64_t u) const {  // factored: output n's unit u
    const int64_t i = unit_at(n) + u * panel;
    return units != nullptr ? units[i] : static_cast<float>(c10::Half(half_units[i], c10::Half::from_bits()));
  }
};

struct Weight {
  const uint8_t* codes;
  GroupScales scale;  // output n's group g: scale.value(n, g)
  GroupScales zero;   // the same layout; !zero.present(): none
  int64_t groups;
  int64_t group;        // G: inputs per group
  int64_t group_bytes;  // bytes of one output's group of codes: 16 (4-bit), 3 G / 4 (6-bit) or G
  int64_t panel;        // outputs whose groups lie side by side: 1 (rows) or kPanel
  const int8_t* table;  // 16 entries (4-bit codes), else nullptr
  bool six;             // 6-bit codes (panels only)
  Nibbles nibbles;      // 4- and 6-bit codes: how the vector loop decodes them
  bool units;           // factored scales (and zeros, if any, with the same units): the unit arithmetic

  int64_t span() const { return units ? scale.per_unit * group : group; }  // inputs to an activation block

  bool four() const { return table != nullptr; }
  bool has_zero() const { return zero.present(); }
  // panel p's group g: kPanel * group_bytes bytes
  const uint8_t* panel_group(int64_t p, int64_t g) const { return codes + (p * groups + g) * kPanel * group_bytes; }

  // output n's group g as integers (the table applied), in input order: out[G]
  void decode_group(int64_t n, int64_t g, int32_t* out) const {
    if (panel == 1) {
      const uint8_t* bytes = codes + (n * groups + g) * group_bytes;
      for (int64_t i = 0; i < group; ++i) {
        out[i] = four() ? table[i < 16 ? (bytes[i] & 0x0F) : (bytes[i - 16] >> 4)] : static_cast<int8_t>(bytes[i]);
      }
      return;
    }
    const uint8_t* block = panel_group(n / kPanel, g);
    const int64_t o = n % kPanel, own = 16 * (o / 4) + 2 * (o % 4);  // output o's first byte in each load
    for (int64_t i = 0; i < group; ++i) {
      if (four()) {  // input 8j + 4h + 2s + e: load j, byte own + 8s + e, nibble h
        const int64_t j = i / 8, h = (i / 4) & 1, s = (i / 2) & 1, e = i & 1;
        const uint8_t byte = block[j * kLoadBytes + own + 8 * s + e];
        out[i] = table[h ? byte >> 4 : byte & 0x0F];
      } else if (six) {  // the same, and the high bits: position own + 8s + e's nibble of the 32 bytes after
        const int64_t j = i / 8, h = (i / 4) & 1, s = (i / 2) & 1, e = i & 1, at = own + 8 * s + e;
        const uint8_t* load = block + j * kSixLoadBytes;
        const int32_t high = (load[kLoadBytes + at % 32] >> (4 * (at / 32))) >> (2 * h) & 3;
        out[i] = ((h ? load[at] >> 4 : load[at] & 0x0F) | high << 4) + kSixOffset;
      } else {  // input 4j + 2s + e: load j, byte own + 8s + e
        const int64_t j = i / 4, s = (i / 2) & 1, e = i & 1;
        out[i] = static_cast<int8_t>(block[j * kLoadBytes + own + 8 * s + e]);
      }
    }
  }
};

struct Activations {  // x [M, K] in int8 blocks of `span` inputs (G, or a unit's span: Weight::units): x ~= q * d
  const int8_t* q;    // [M][K]
  const float* d;     // [M][spans]
  const float* sum;   // [M][groups]: d * (sum of the group's q), for the per-group zero term; nullptr: none
  const int32_t* shift;  // [M][groups]: offset * (sum of the group's q) where panel_shifts says so, else nullptr
  const int32_t* pairs;  // [M][groups / 2]: two groups' sums of q as int16s, for the unit zero term; nullptr: none
  int64_t k;
  int64_t groups;
  int64_t spans;      // K / span
};

// the 8 lanes of an accumulator summed by one fixed tree: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float reduce_lanes(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// the scale of one block of activations, and its inverse (0 for an all-zero block; a block whose largest
// value is below 127 / FLT_MAX, ~3.7e-37, where the inverse is no float, rounds to zeros: d = 0, q = 0)
inline void block_scale(float amax, bool finite, float* d, float* inverse) {
  if (!finite) {
    *d = __builtin_nanf("");
    *inverse = 0.0f;
  } else {
    const float inverse_of = amax > 0.0f ? kActivationMax / amax : 0.0f;
    const bool tiny = inverse_of > __FLT_MAX__;
    *d = tiny ? 0.0f : amax / kActivationMax;
    *inverse = tiny ? 0.0f : inverse_of;
  }
}

// the arithmetic itself, one (row, output) at a time, for any layout and build: what every loop computes
template <bool kZero>
float dot_scalar(const Weight& wt, int64_t n, const Activations& a, int64_t row) {
  const int8_t* xq = a.q + row * a.k;
  const float* xd = a.d + row * a.spans;
  float acc[8] = {}, zacc[8] = {};
  int32_t ints[32];
  if (wt.units) {  // per unit: integers to the end, then one float step for the scales and one for the zeros
    const int64_t per = wt.scale.per_unit;
    for (int64_t u = 0; u < a.spans; ++u) {
      int32_t scaled = 0, zeroed = 0;
      for (int64_t g = u * per; g < (u + 1) * per; ++g) {
        wt.decode_group(n, g, ints);
        int32_t isum = 0, qsum = 0;
        for (int64_t i = 0; i < wt.group; ++i) {
          isum += ints[i] * static_cast<int32_t>(xq[g * wt.group + i]);
          qsum += xq[g * wt.group + i];
        }
        scaled += wt.scale.int_at(n, g) * isum;
        if constexpr (kZero) zeroed += wt.zero.int_at(n, g) * qsum;
      }
      acc[u & 7] = __builtin_fmaf(static_cast<float>(scaled), wt.scale.unit(n, u) * xd[u], acc[u & 7]);
      if constexpr (kZero) zacc[u & 7] = __builtin_fmaf(static_cast<float>(zeroed), wt.zero.unit(n, u) * xd[u], zacc[u & 7]);
    }
  } else {
    for (int64_t g = 0; g < wt.groups; ++g) {
      wt.decode_group(n, g, ints);
      int32_t isum = 0;
      for (int64_t i = 0; i < wt.group; ++i) isum += ints[i] * static_cast<int32_t>(xq[g * wt.group + i]);
      const float s = wt.scale.value(n, g) * xd[g];
      acc[g & 7] = __builtin_fmaf(static_cast<float>(isum), s, acc[g & 7]);
      if constexpr (kZero) zacc[g & 7] = __builtin_fmaf(wt.zero.value(n, g), a.sum[row * a.groups + g], zacc[g & 7]);
    }
  }
  float total = reduce_lanes(acc);
  if constexpr (kZero) total += reduce_lanes(zacc);
  return total;
}

#ifdef PAGEDSERVE_GROUPED_AVX2

// the largest |x| of n inputs (n a multiple of 8), and whether all are finite
inline float block_amax(const float* x, int64_t n, bool* finite) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 largest = _mm256_set1_ps(__FLT_MAX__);
  __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int64_t v = 0; v < n / 8; ++v) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + v * 8), abs_mask);
    amax = _mm256_max_ps(amax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, largest, _CMP_NLE_UQ));  // NaN or infinite
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  *finite = _mm256_movemask_ps(bad) == 0;
  return _mm_cvtss_f32(m);
}

// G inputs (a multiple of 16) times `inverse` rounded to int8 (to nearest even) at q; the sum of their q
template <int G>
inline int32_t round_group(const float* x, float inverse, bool keep_any, int8_t* q) {
  const __m256 inv = _mm256_set1_ps(inverse);
  const __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(keep_any ? -1 : 0));  // a NaN block's q are 0
  __m256i total = _mm256_setzero_si256();
  for (int v = 0; v < G / 16; ++v) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_and_ps(_mm256_mul_ps(_mm256_loadu_ps(x + v * 16), inv), keep));
    const __m256i b = _mm256_cvtps_epi32(_mm256_and_ps(_mm256_mul_ps(_mm256_loadu_ps(x + v * 16 + 8), inv), keep));
    total = _mm256_add_epi32(total, _mm256_add_epi32(a, b));
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // back in input order
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + v * 16), bytes);
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

bool vectorized() { return true; }

// the byte shuffle that gathers each output's 4 bytes of a load into its 32-bit lane, per 16 bytes:
// output t's bytes 2t, 2t + 1, 8 + 2t, 9 + 2t (inputs 8j + 0..3 in their low nibbles, 8j + 4..7 in the
// high ones; 8-bit: inputs 4j + 0..3) become lane t's bytes 0..3
inline __m128i quad_order() { return _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15); }

#ifdef PAGEDSERVE_GROUPED_AVX512
using VecF = __m512;  // 16 outputs a vector
using VecI = __m512i;
constexpr int64_t kLanes = 16;
inline VecI load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VecI and_bytes(VecI a, VecI b) { return _mm512_and_si512(a, b); }
inline VecI shift_right_words(VecI a) { return _mm512_srli_epi16(a, 4); }
template <int kBits>
inline VecI shift_left_words(VecI a) { return _mm512_slli_epi16(a, kBits); }
inline VecI or_bytes(VecI a, VecI b) { return _mm512_or_si512(a, b); }
// a 6-bit load's high nibbles h[p], one a byte, from its 32 bytes at `p`: bytes 0..31 the low halves, 32..63
// the high halves (the one vector takes the whole panel: slice 0)
inline VecI high_nibbles(const uint8_t* p, int64_t) {
  const VecI both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const VecI counts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);  // words 16..31: 4
  return _mm512_and_si512(_mm512_srlv_epi16(both, counts), _mm512_set1_epi8(0x0F));
}
inline VecI lookup(VecI table, VecI index) { return _mm512_shuffle_epi8(table, index); }
inline VecI xor_bytes(VecI a, VecI b) { return _mm512_xor_si512(a, b); }
// each 16 bytes' output lanes: bytes (2t, 2t + 1, 8 + 2t, 9 + 2t) to 32-bit lane t (quad_order)
inline VecI shuffle_quads(VecI a) { return _mm512_shuffle_epi8(a, _mm512_broadcast_i32x4(quad_order())); }
inline VecI zero_int() { return _mm512_setzero_si512(); }
inline VecI splat_int(int32_t v) { return _mm512_set1_epi32(v); }
inline VecI splat_bytes(int8_t v) { return _mm512_set1_epi8(v); }
inline VecI table_of(const int8_t* t) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))); }
#if defined(__AVX512VNNI__)
constexpr bool kBiasedSigned = true;
inline VecI dot_quads(VecI acc, VecI w, int32_t x) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x)); }
inline VecI dot_quads_signed(VecI acc, VecI, int32_t) { return acc; }  // never called (kSignedDot is false): for the template's name lookup
#else
constexpr bool kBiasedSigned = false;
inline VecI dot_quads(VecI acc, VecI w, int32_t x) {  // w <= 127: the pairs' int16 sums cannot saturate
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, _mm512_set1_epi32(x)), _mm512_set1_epi16(1)));
}
inline VecI dot_quads_signed(VecI acc, VecI w, int32_t x) {  // |w| against x signed by w: |pair| <= 2 * 128 * 127
  const VecI xs = _mm512_set1_epi32(x);
  const VecI signed_x = _mm512_mask_sub_epi8(xs, _mm512_movepi8_mask(w), _mm512_setzero_si512(), xs);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_x), _mm512_set1_epi16(1)));
}
#endif
inline VecF zero_float() { return _mm512_setzero_ps(); }
inline VecF splat_float(float v) { return _mm512_set1_ps(v); }
inline VecF load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline VecF to_floats(VecI v) { return _mm512_cvtepi32_ps(v); }
inline VecI int8_ints(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VecI add_ints(VecI a, VecI b) { return _mm512_add_epi32(a, b); }
inline VecI mul_ints(VecI a, VecI b) { return _mm512_mullo_epi32(a, b); }
// each lane's two int16s: low * low + high * high (exact in int32)
inline VecI madd_pairs(VecI a, int32_t b) { return _mm512_madd_epi16(a, _mm512_set1_epi32(b)); }
// int32 lanes in int16 range, two to a lane: low | high << 16
inline VecI pair_ints(VecI low, VecI high) {
  return _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(high, 16));
}
inline VecF half_floats(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF mul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF add(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline void store_floats(float* p, VecF v) { _mm512_storeu_ps(p, v); }
#else
using VecF = __m256;  // 8 outputs a vector: a panel in two halves
using VecI = __m256i;
constexpr int64_t kLanes = 8;
inline VecI load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VecI and_bytes(VecI a, VecI b) { return _mm256_and_si256(a, b); }
inline VecI shift_right_words(VecI a) { return _mm256_srli_epi16(a, 4); }
template <int kBits>
inline VecI shift_left_words(VecI a) { return _mm256_slli_epi16(a, kBits); }
inline VecI or_bytes(VecI a, VecI b) { return _mm256_or_si256(a, b); }
// this slice's (positions 32 slice .. + 31) high nibbles of a 6-bit load, one a byte, from its 32 bytes at `p`
inline VecI high_nibbles(const uint8_t* p, int64_t slice) {
  const VecI v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(slice == 0 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
inline VecI lookup(VecI table, VecI index) { return _mm256_shuffle_epi8(table, index); }
inline VecI xor_bytes(VecI a, VecI b) { return _mm256_xor_si256(a, b); }
inline VecI shuffle_quads(VecI a) { return _mm256_shuffle_epi8(a, _mm256_broadcastsi128_si256(quad_order())); }
inline VecI zero_int() { return _mm256_setzero_si256(); }
inline VecI splat_int(int32_t v) { return _mm256_set1_epi32(v); }
inline VecI splat_bytes(int8_t v) { return _mm256_set1_epi8(v); }
inline VecI table_of(const int8_t* t) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))); }
#if defined(__AVXVNNI__)
constexpr bool kBiasedSigned = true;
inline VecI dot_quads(VecI acc, VecI w, int32_t x) { return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32(x)); }
inline VecI dot_quads_signed(VecI acc, VecI, int32_t) { return acc; }  // never called (kSignedDot is false): for the template's name lookup
#else
constexpr bool kBiasedSigned = false;
inline VecI dot_quads(VecI acc, VecI w, int32_t x) {  // w <= 127: the pairs' int16 sums cannot saturate
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(x)), _mm256_set1_epi16(1)));
}
inline VecI dot_quads_signed(VecI acc, VecI w, int32_t x) {  // |w| against x signed by w: |pair| <= 2 * 128 * 127
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(_mm256_set1_epi32(x), w)),
                                                 _mm256_set1_epi16(1)));
}
#endif
inline VecF zero_float() { return _mm256_setzero_ps(); }
inline VecF splat_float(float v) { return _mm256_set1_ps(v); }
inline VecF load_floats(const float* p) { return _mm256_loadu_ps(p); }
inline VecF to_floats(VecI v) { return _mm256_cvtepi32_ps(v); }
inline VecI int8_ints(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VecI add_ints(VecI a, VecI b) { return _mm256_add_epi32(a, b); }
inline VecI mul_ints(VecI a, VecI b) { return _mm256_mullo_epi32(a, b); }
inline VecI madd_pairs(VecI a, int32_t b) { return _mm256_madd_epi16(a, _mm256_set1_epi32(b)); }
inline VecI pair_ints(VecI low, VecI high) {
  return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(high, 16));
}
inline VecF half_floats(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF mul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF add(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline void store_floats(float* p, VecF v) { _mm256_storeu_ps(p, v); }
#endif

constexpr int64_t kSlices = kPanel / kLanes;  // vectors of outputs a panel: 1 (AVX-512) or 2 (AVX2)

// reduce_lanes for kLanes outputs at once (the same tree, so each output's bits)
inline VecF reduce_tree(const VecF* a) { return add(add(add(a[0], a[4]), add(a[2], a[6])), add(add(a[1], a[5]), add(a[3], a[7]))); }

// a factored form's ints (as int32 lanes, group after group) and units, for the kLanes outputs of one slice
// (a form that is not factored: nothing to walk)
class UnitWalk {
 public:
  UnitWalk(const GroupScales& s, int64_t panel, int64_t slice)
      : ints_(s.ints != nullptr ? s.ints + panel * s.groups * kPanel + slice * kLanes : nullptr),
        units_(s.units != nullptr ? s.units + panel * (s.groups / s.per_unit) * kPanel + slice * kLanes : nullptr),
        half_units_(s.half_units != nullptr ? s.half_units + panel * (s.groups / s.per_unit) * kPanel + slice * kLanes
                                            : nullptr) {}

  VecI next_ints() {
    const VecI v = int8_ints(ints_);
    ints_ += kPanel;
    return v;
  }
  VecF next_unit() {  // float32 or float16
    if (units_ != nullptr) {
      const VecF u = load_floats(units_);
      units_ += kPanel;
      return u;
    }
    const VecF u = half_floats(half_units_);
    half_units_ += kPanel;
    return u;
  }
  const int8_t* ahead(int64_t groups) const { return ints_ + groups * kPanel; }

 private:
  const int8_t* ints_;
  const float* units_;
  const uint16_t* half_units_;
};

// a panel's scales (or zeros) for the kLanes outputs of one slice, group after group: exactly GroupScales::value
class PanelWalk {
 public:
  PanelWalk(const GroupScales& s, int64_t panel, int64_t slice)
      : floats_(s.floats != nullptr ? s.floats + panel * s.groups * kPanel + slice * kLanes : nullptr),
        halves_(s.halves != nullptr ? s.halves + panel * s.groups * kPanel + slice * kLanes : nullptr),
        factored_(s, panel, slice),
        per_unit_(s.per_unit) {}

  VecF next() {
    VecF v;
    if (floats_ != nullptr) {
      v = load_floats(floats_);
      floats_ += kPanel;
      return v;
    }
    if (halves_ != nullptr) {
      v = half_floats(halves_);
      halves_ += kPanel;
      return v;
    }
    if (in_unit_ == 0) unit_ = factored_.next_unit();  // converted once per run of groups, not per group
    v = mul(unit_, to_floats(factored_.next_ints()));
    if (++in_unit_ == per_unit_) in_unit_ = 0;
    return v;
  }
  const void* ahead(int64_t groups) const {
    if (floats_ != nullptr) return floats_ + groups * kPanel;
    return halves_ != nullptr ? static_cast<const void*>(halves_ + groups * kPanel) : factored_.ahead(groups);
  }

 private:
  const float* floats_;
  const uint16_t* halves_;
  UnitWalk factored_;
  int64_t per_unit_, in_unit_ = 0;
  VecF unit_ = zero_float();
};

// one load (64 bytes at `bytes`, this slice's part of it) as bytes, one output a 32-bit lane, 4 inputs to
// a lane: quads[0] holds inputs first + 0..3 and (4- and 6-bit) quads[1] inputs first + 4..7, first = 8j
// (4- and 6-bit) or 4j (8-bit). The bytes are what the dot product takes: unsigned (the nibble; a 6-bit
// q, 0..63; a signed code plus 128 where signed codes come biased, the shifts taking the 128 back) or,
// for signed codes elsewhere, the signed integer itself. 6-bit: `top` is the load's 32 bytes of high bits
template <bool kFour, int kNib>
inline void decode_load(const uint8_t* bytes, const uint8_t* top, int64_t slice, VecI table, VecI* quads) {
  const VecI v = shuffle_quads(load_bytes(bytes));
  if constexpr (kFour) {
    const VecI mask = splat_bytes(0x0F);
    VecI low = and_bytes(v, mask), high = and_bytes(shift_right_words(v), mask);
    if constexpr (kNib == kSix) {  // h bits 0-1 above the low nibble's input, bits 2-3 above the high one's
      const VecI h = shuffle_quads(high_nibbles(top, slice)), bits = splat_bytes(0x30);
      low = or_bytes(low, and_bytes(shift_left_words<4>(h), bits));
      high = or_bytes(high, and_bytes(shift_left_words<2>(h), bits));
    }
    if constexpr (kNib == kLookup) {  // the table comes biased where signed codes do
      low = lookup(table, low);
      high = lookup(table, high);
    }
    quads[0] = low;
    quads[1] = high;
  } else {
    quads[0] = kBiasedSigned ? xor_bytes(v, splat_bytes(-128)) : v;
  }
}

// one group's exact integer dot products for rows [row, row + R) against panel p's outputs, slice `slice`
// (kLanes outputs a vector): dot_scalar's isum, the offset (shifts) included
template <int R, int G, bool kFour, int kNib>
struct GroupSums {
  static constexpr int kLoads = kFour ? G / 8 : G / 4;  // 64-byte loads a group
  static constexpr int kQuads = kFour ? 2 : 1;           // vectors of 4 inputs a lane, a load
  static constexpr int kInputs = kFour ? 8 : 4;          // inputs a load
  static constexpr int64_t kStride = kNib == kSix ? kSixLoadBytes : kLoadBytes;  // bytes from one load to the next
  static constexpr bool kSignedCodes = !kFour || kNib == kLookup;  // 8-bit codes, and a table's entries
  static constexpr bool kShifts = kSignedCodes ? kBiasedSigned : kNib != kPlain;  // the integers' offset as a sum of q
  static constexpr bool kSignedDot = kSignedCodes && !kBiasedSigned;

  static VecI table(const Weight& wt) {  // the table as the dot product takes it (4-bit codes looked up)
    if constexpr (kFour && kNib == kLookup) {
      return kBiasedSigned ? xor_bytes(table_of(wt.table), splat_bytes(-128)) : table_of(wt.table);
    }
    return zero_int();
  }

  // group g: codes the panel's first group, xq and shift row's (shift nullptr without kShifts), k and groups a.k, a.groups
  __attribute__((always_inline)) static inline void group(const uint8_t* codes, int64_t slice, VecI table, const int8_t* xq,
                                                          const int32_t* shift, int64_t k, int64_t groups, int64_t g,
                                                          VecI* isum) {
    const uint8_t* group = codes + g * kLoads * kStride;
    for (int r = 0; r < R; ++r) isum[r] = kShifts ? splat_int(shift[r * groups + g]) : zero_int();
    for (int j = 0; j < kLoads; ++j) {
      const uint8_t* load = group + j * kStride;
      _mm_prefetch(reinterpret_cast<const char*>(load + kPrefetchBytes), _MM_HINT_T0);
      if constexpr (kNib == kSix) _mm_prefetch(reinterpret_cast<const char*>(load + kLoadBytes + kPrefetchBytes), _MM_HINT_T0);
      VecI quads[kQuads];
      decode_load<kFour, kNib>(load + slice * (kLoadBytes / kSlices), load + kLoadBytes, slice, table, quads);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq + r * k + g * G + j * kInputs;
        for (int q = 0; q < kQuads; ++q) {
          int32_t four;  // inputs 4q .. 4q + 3 of this load, in the order of the weights' bytes in a lane
          std::memcpy(&four, x + 4 * q, 4);
          isum[r] = kSignedDot ? dot_quads_signed(isum[r], quads[q], four) : dot_quads(isum[r], quads[q], four);
        }
      }
    }
  }
};

// rows [row, row + R) against panel p's outputs, slice `slice` (kLanes outputs) -> out[r * ldo + o]:
// dot_scalar's integers and float steps, kLanes outputs a vector (per-group scales)
template <int R, int G, bool kFour, bool kZero, int kNib>
void dot_panel(const Weight& wt, int64_t p, int64_t slice, const Activations& a, int64_t row, float* out, int64_t ldo) {
  using Sums = GroupSums<R, G, kFour, kNib>;
  const VecI table = Sums::table(wt);
  const uint8_t* codes = wt.panel_group(p, 0);
  const int8_t* xq = a.q + row * a.k;
  const int32_t* shift = a.shift != nullptr ? a.shift + row * a.groups : nullptr;
  const float* xd = a.d + row * a.groups;  // per-group scales: a block of activations a group (spans == groups)
  const int64_t groups = wt.groups;
  VecF acc[R][8];
  for (int r = 0; r < R; ++r) {
    for (int l = 0; l < 8; ++l) acc[r][l] = zero_float();
  }
  PanelWalk scales(wt.scale, p, slice);
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      const int64_t g = g0 + l;
      if (g >= groups) continue;  // the last run's missing groups (the unrolled body keeps its lanes in registers)
      _mm_prefetch(static_cast<const char*>(scales.ahead(8)), _MM_HINT_T0);
      VecI isum[R];
      Sums::group(codes, slice, table, xq, shift, a.k, groups, g, isum);
      const VecF s = scales.next();
      for (int r = 0; r < R; ++r) acc[r][l] = fma(to_floats(isum[r]), mul(s, splat_float(xd[r * groups + g])), acc[r][l]);
    }
  }
  VecF total[R];
  for (int r = 0; r < R; ++r) total[r] = reduce_tree(acc[r]);
  if constexpr (kZero) {  // zero_term's lanes, apart from the main loop (its registers free again), the zeros made once
    PanelWalk zeros(wt.zero, p, slice);
    const float* sum = a.sum + row * a.groups;
    for (int r = 0; r < R; ++r) {
      for (int l = 0; l < 8; ++l) acc[r][l] = zero_float();
    }
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) {
        const int64_t g = g0 + l;
        if (g >= groups) continue;
        const VecF z = zeros.next();
        for (int r = 0; r < R; ++r) acc[r][l] = fma(z, splat_float(sum[r * a.groups + g]), acc[r][l]);
      }
    }
    for (int r = 0; r < R; ++r) total[r] = add(total[r], reduce_tree(acc[r]));
  }
  for (int r = 0; r < R; ++r) store_floats(out + r * ldo + slice * kLanes, total[r]);
}

// dot_panel for factored scales (Weight::units): per unit, the groups' integers times their ints summed in
// int32, then one float step into the lane of the unit's number mod 8 (the zeros likewise, from pairs of
// groups' sums of q)
template <int R, int G, bool kFour, bool kZero, int kNib>
void dot_panel_units(const Weight& wt, int64_t p, int64_t slice, const Activations& a, int64_t row, float* out,
                     int64_t ldo) {
  using Sums = GroupSums<R, G, kFour, kNib>;
  const VecI table = Sums::table(wt);
  const uint8_t* codes = wt.panel_group(p, 0);
  const int8_t* xq = a.q + row * a.k;
  const int32_t* shift = a.shift != nullptr ? a.shift + row * a.groups : nullptr;
  const float* xd = a.d + row * a.spans;
  const int64_t per = wt.scale.per_unit, groups = wt.groups;
  VecF acc[R][8];
  for (int r = 0; r < R; ++r) {
    for (int l = 0; l < 8; ++l) acc[r][l] = zero_float();
  }
  UnitWalk scales(wt.scale, p, slice);
  for (int64_t u = 0; u < a.spans; ++u) {
    VecI scaled[R];
    for (int r = 0; r < R; ++r) scaled[r] = zero_int();
    for (int64_t g = u * per; g < (u + 1) * per; ++g) {
      VecI isum[R];
      Sums::group(codes, slice, table, xq, shift, a.k, groups, g, isum);
      const VecI ints = scales.next_ints();
      for (int r = 0; r < R; ++r) scaled[r] = add_ints(scaled[r], mul_ints(isum[r], ints));
    }
    const VecF unit = scales.next_unit();
    for (int r = 0; r < R; ++r) acc[r][u & 7] = fma(to_floats(scaled[r]), mul(unit, splat_float(xd[r * a.spans + u])), acc[r][u & 7]);
  }
  VecF total[R];
  for (int r = 0; r < R; ++r) total[r] = reduce_tree(acc[r]);
  if constexpr (kZero) {
    UnitWalk zeros(wt.zero, p, slice);
    const int32_t* pairs = a.pairs + row * (a.groups / 2);
    for (int r = 0; r < R; ++r) {
      for (int l = 0; l < 8; ++l) acc[r][l] = zero_float();
    }
    for (int64_t u = 0; u < a.spans; ++u) {
      VecI zeroed[R];
      for (int r = 0; r < R; ++r) zeroed[r] = zero_int();
      for (int64_t g = u * per; g < (u + 1) * per; g += 2) {
        const VecI low = zeros.next_ints();
        const VecI both = pair_ints(low, zeros.next_ints());
        for (int r = 0; r < R; ++r) zeroed[r] = add_ints(zeroed[r], madd_pairs(both, pairs[r * (a.groups / 2) + g / 2]));
      }
      const VecF unit = zeros.next_unit();
      for (int r = 0; r < R; ++r) acc[r][u & 7] = fma(to_floats(zeroed[r]), mul(unit, splat_float(xd[r * a.spans + u])), acc[r][u & 7]);
    }
    for (int r = 0; r < R; ++r) total[r] = add(total[r], reduce_tree(acc[r]));
  }
  for (int r = 0; r < R; ++r) store_floats(out + r * ldo + slice * kLanes, total[r]);
}

constexpr bool kPanelLoops = true;

#else  // portable: the scalar loop only

// the largest |x| of n inputs, and whether all are finite
inline float block_amax(const float* x, int64_t n, bool* finite) {
  float amax = 0.0f;
  bool all = true;
  for (int64_t i = 0; i < n; ++i) {
    const float a = __builtin_fabsf(x[i]);
    all = all && a <= __FLT_MAX__;
    amax = a > amax ? a : amax;
  }
  *finite = all;
  return amax;
}

// G inputs times `inverse` rounded to int8 (to nearest even) at q; the sum of their q
template <int G>
inline int32_t round_group(const float* x, float inverse, bool keep_any, int8_t* q) {
  int32_t total = 0;
  for (int i = 0; i < G; ++i) {
    const float scaled = keep_any ? x[i] * inverse : 0.0f;  // a NaN block's q are 0
    const int32_t v = std::clamp(static_cast<int32_t>(__builtin_nearbyintf(scaled)), -127, 127);
    q[i] = static_cast<int8_t>(v);
    total += v;
  }
  return total;
}

bool vectorized() { return false; }

constexpr int64_t kSlices = 1;
constexpr bool kPanelLoops = false;
constexpr bool kBiasedSigned = false;

template <int R, int G, bool kFour, bool kZero, int kNib>  // never called: the panel loops are the vector builds'
void dot_panel(const Weight&, int64_t, int64_t, const Activations&, int64_t, float*, int64_t) {}
template <int R, int G, bool kFour, bool kZero, int kNib>
void dot_panel_units(const Weight&, int64_t, int64_t, const Activations&, int64_t, float*, int64_t) {}

#endif

// where a call's activation rounding puts each block's integers: per block of `span` inputs (G, or a factored
// weight's unit span) one d; per group of G the sum of its q as d * sum (sum: the per-group zero term), as
// offset * sum (shift: panel_shifts) and paired, (sum of group 2i) | (sum of group 2i + 1) << 16 as int16s
// (pairs: the unit arithmetic's zero term); each nullptr where the call needs none
struct Rounding {
  int64_t span;
  float* d;        // [M][K / span]
  float* sum;      // [M][groups]
  int32_t* shift;  // [M][groups]
  int32_t* pairs;  // [M][groups / 2]
  int32_t offset;
};

// one span of inputs at x (a multiple of G) rounded to int8 at q with one d: Rounding's values for row r's span s
template <int G>
void quantize_span(const float* x, int8_t* q, const Rounding& to, int64_t groups, int64_t r, int64_t s) {
  bool finite;
  const float amax = to.span == G ? block_amax(x, G, &finite) : block_amax(x, to.span, &finite);  // G: unrolled
  float* d = to.d + r * (groups * G / to.span) + s;
  float inverse;
  block_scale(amax, finite, d, &inverse);
  const bool keep = *d == *d;
  const int64_t per_span = to.span / G, first = s * per_span;
  for (int64_t i = 0; i < per_span; ++i) {
    const int64_t g = first + i;
    const int32_t total = round_group<G>(x + i * G, inverse, keep, q + i * G);
    if (to.sum != nullptr) to.sum[r * groups + g] = *d * static_cast<float>(total);
    if (to.shift != nullptr) to.shift[r * groups + g] = to.offset * total;
    if (to.pairs != nullptr) {
      const uint32_t half = static_cast<uint32_t>(total) & 0xFFFFu;
      uint32_t* pair = reinterpret_cast<uint32_t*>(to.pairs + r * (groups / 2) + g / 2);
      *pair = (g & 1) ? (*pair | half << 16) : half;
    }
  }
}

// x float32 [M, K] -> its int8 blocks, and what else `to` asks for
template <int G>
void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* q, const Rounding& to) {
  const int64_t groups = k / G, spans = k / to.span;
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t s = 0; s < spans; ++s) quantize_span<G>(x + r * k + s * to.span, q + r * k + s * to.span, to, groups, r, s);
    }
  });
}

// quantize_rows for the group size of the call (32, or 16: 8- and 6-bit codes)
void quantize_for(int64_t group, const float* x, int64_t m, int64_t k, int8_t* q, const Rounding& to) {
  if (group == 32) {
    quantize_rows<32>(x, m, k, q, to);
  } else {
    quantize_rows<16>(x, m, k, q, to);
  }
}

// the weight's kind -> the instance of Kernel<G, kFour, kZero>::run that serves it (kFour: codes in nibbles, 8
// inputs a load: 4-bit, and 6-bit with its high bits beside them)
template <template <int, bool, bool> class Kernel, typename... Args>
void dispatch(bool nibbles, int64_t group, bool has_zero, Args&&... args) {
  if (nibbles && group == 32) {
    has_zero ? Kernel<32, true, true>::run(args...) : Kernel<32, true, false>::run(args...);
  } else if (nibbles) {
    has_zero ? Kernel<16, true, true>::run(args...) : Kernel<16, true, false>::run(args...);
  } else if (group == 32) {
    has_zero ? Kernel<32, false, true>::run(args...) : Kernel<32, false, false>::run(args...);
  } else {
    has_zero ? Kernel<16, false, true>::run(args...) : Kernel<16, false, false>::run(args...);
  }
}

// rows [row, end) in blocks of kRowBlock, then one of 2 and 1 as they fit: run(std::integral_constant<int, R>,
// first row) for each block
template <typename Run>
inline void row_blocks(int64_t row, int64_t end, Run&& run) {
  for (; row + kRowBlock <= end; row += kRowBlock) run(std::integral_constant<int, kRowBlock>{}, row);
  if (end - row >= 2) {
    run(std::integral_constant<int, 2>{}, row);
    row += 2;
  }
  if (end - row >= 1) run(std::integral_constant<int, 1>{}, row);
}

template <int G, bool kFour, bool kZero>
struct MatmulKernel {
  static void run(const Weight& wt, const Activations& a, int64_t m, float* out, int64_t n) {
    if (kPanelLoops && wt.panel == kPanel) {
      if constexpr (kFour) {
        switch (wt.nibbles) {
          case kPlain: return panels<kPlain>(wt, a, m, out, n);
          case kShifted: return panels<kShifted>(wt, a, m, out, n);
          case kSix: return panels<kSix>(wt, a, m, out, n);
          default: return panels<kLookup>(wt, a, m, out, n);
        }
      } else {
        return panels<kLookup>(wt, a, m, out, n);
      }
    }
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t o = begin; o < end; ++o) out[r * n + o] = dot_scalar<kZero>(wt, o, a, r);
      }
    });
  }

  template <int kNib>
  static void panels(const Weight& wt, const Activations& a, int64_t m, float* out, int64_t n) {
    const int64_t count = n / kPanel;
    const int64_t grain = std::max<int64_t>(1, count / (4 * at::get_num_threads()));
    const int64_t chunk = std::max<int64_t>(kRowBlock, kRowChunkBytes / a.k / kRowBlock * kRowBlock);
    at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
      for (int64_t row0 = 0; row0 < m; row0 += chunk) {
        const int64_t rows_end = std::min(m, row0 + chunk);
        for (int64_t p = begin; p < end; ++p) {
          for (int64_t slice = 0; slice < kSlices; ++slice) {
            row_blocks(row0, rows_end, [&](auto rows, int64_t r) {
              constexpr int R = decltype(rows)::value;
              if (wt.units) {
                dot_panel_units<R, G, kFour, kZero, kNib>(wt, p, slice, a, r, out + r * n + p * kPanel, n);
              } else {
                dot_panel<R, G, kFour, kZero, kNib>(wt, p, slice, a, r, out + r * n + p * kPanel, n);
              }
            });
          }
        }
      }
    });
  }
};

// output n of W as float32 [K] at `to`: value = int * scale (+ zero), exactly the file's values
void unpack_output(const Weight& wt, int64_t n, float* to) {
  int32_t ints[32];
  for (int64_t g = 0; g < wt.groups; ++g, to += wt.group) {
    wt.decode_group(n, g, ints);
    const float s = wt.scale.value(n, g);
    if (wt.has_zero()) {
      const float z = wt.zero.value(n, g);
      for (int64_t i = 0; i < wt.group; ++i) to[i] = __builtin_fmaf(static_cast<float>(ints[i]), s, z);
    } else {
      for (int64_t i = 0; i < wt.group; ++i) to[i] = static_cast<float>(ints[i]) * s;
    }
  }
}

// rows [start, end) of W as float32
void unpack_rows(const Weight& wt, int64_t start, int64_t end, float* out) {
  const int64_t k = wt.groups * wt.group;
  at::parallel_for(start, end, 16, [&](int64_t begin, int64_t stop) {
    for (int64_t n = begin; n < stop; ++n) unpack_output(wt, n, out + (n - start) * k);
  });
}

// the weight's outputs N: codes [N, K / 2] or [N, K] (rows), or [N / 16, K / G, 16 * group bytes] (panels)
int64_t outputs_of(const torch::Tensor& codes) { return codes.dim() == 3 ? codes.size(0) * kPanel : codes.size(0); }

// scale (or zero): float32 or float16 in the weight's layout, or int8 in it with `units` float32 or float16 [.., groups / per_unit, ..]
// beside it (factored); `what` names it in errors. panel: kPanel ([N / 16, groups, 16]) or 1 ([N, groups])
GroupScales check_scales(const torch::Tensor& values, const torch::Tensor& units, const char* what, int64_t n,
                         int64_t groups, int64_t panel) {
  const bool factored = values.scalar_type() == torch::kInt8;
  const bool half = values.scalar_type() == torch::kHalf;
  TORCH_CHECK(factored || half || values.scalar_type() == torch::kFloat32, what, ": float32, float16, or int8 with its units");
  const auto fits = [&](const torch::Tensor& t, int64_t count) {
    return t.is_contiguous() && t.device().is_cpu() &&
           (panel == kPanel ? (t.dim() == 3 && t.size(0) * kPanel == n && t.size(1) == count && t.size(2) == kPanel)
                            : (t.dim() == 2 && t.size(0) == n && t.size(1) == count));
  };
  TORCH_CHECK(fits(values, groups), what, ": contiguous [N, K / group] (rows) or [N / 16, K / group, 16] (panels), "
              "got ", values.sizes());
  if (!factored) {
    TORCH_CHECK(units.numel() == 0, what, ": float values take no units");
    if (half) return GroupScales{nullptr, static_cast<const uint16_t*>(values.data_ptr()), nullptr, nullptr, nullptr, groups, 1, panel};
    return GroupScales{values.data_ptr<float>(), nullptr, nullptr, nullptr, nullptr, groups, 1, panel};
  }
  const bool half_units = units.scalar_type() == torch::kHalf;
  TORCH_CHECK((half_units || units.scalar_type() == torch::kFloat32) && units.dim() == values.dim(), what,
              "'s units: float32 or float16");
  const int64_t count = units.size(1);
  TORCH_CHECK(count > 0 && groups % count == 0 && (groups / count) % 8 == 0 && fits(units, count), what,
              "'s units: one per 8k groups, shaped as its values, got ", units.sizes(), " for ", groups, " groups");
  return GroupScales{nullptr, nullptr, values.data_ptr<int8_t>(), half_units ? nullptr : units.data_ptr<float>(),
                     half_units ? static_cast<const uint16_t*>(units.data_ptr()) : nullptr, groups, groups / count, panel};
}

Weight check_weight(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& scale_units,
                    const torch::Tensor& zero, const torch::Tensor& zero_units, const torch::Tensor& table,
                    int64_t group, int64_t k) {
  TORCH_CHECK((codes.dim() == 2 || codes.dim() == 3) && codes.is_contiguous() && codes.device().is_cpu(),
              "codes: contiguous [N, K] or [N, K / 2] (rows), or [N / 16, K / G, 16 * group bytes] (panels), on the CPU");
  const bool nibbles = codes.scalar_type() == torch::kUInt8;
  const bool four = nibbles && table.numel() > 0, six = nibbles && table.numel() == 0;  // 6-bit: uint8 and no table
  TORCH_CHECK(nibbles || codes.scalar_type() == torch::kInt8, "codes: uint8 nibbles (with a table: 4-bit, without: 6-bit) or int8");
  TORCH_CHECK(four ? group == kNibbleGroup : (group == 16 || group == 32),
              "4-bit codes come in groups of 32, 6- and 8-bit in 16 or 32");
  TORCH_CHECK(!six || codes.dim() == 3, "6-bit codes come in panels only");
  TORCH_CHECK(k % group == 0, "K = ", k, " is not a multiple of the group ", group);
  const int64_t n = outputs_of(codes), groups = k / group, group_bytes = four ? 16 : six ? group * 3 / 4 : group;
  const bool panels = codes.dim() == 3;
  TORCH_CHECK(panels ? (codes.size(1) == groups && codes.size(2) == kPanel * group_bytes)
                     : codes.size(1) == groups * group_bytes,
              "codes ", codes.sizes(), " do not fit K = ", k, " in groups of ", group);
  const int64_t panel = panels ? kPanel : 1;
  const GroupScales scales = check_scales(scale, scale_units, "scale", n, groups, panel);
  GroupScales zeros{nullptr, nullptr, nullptr, nullptr, nullptr, groups, 1, panel};
  if (zero.numel() > 0) zeros = check_scales(zero, zero_units, "zero", n, groups, panel);
  TORCH_CHECK(!four || (table.scalar_type() == torch::kInt8 && table.numel() == 16 && table.is_contiguous()),
              "table: int8 [16] for 4-bit codes");
  Nibbles decode = kLookup;
  if (four && vectorized()) {
    const int8_t* t = table.data_ptr<int8_t>();
    bool consecutive = true;
    for (int i = 1; i < 16; ++i) consecutive = consecutive && t[i] == t[0] + i;
    if (consecutive) decode = t[0] == 0 ? kPlain : kShifted;
  }
  if (six && vectorized()) decode = kSix;
  // the unit arithmetic: factored scales, zeros none or factored alike, a unit's span within kMaxUnitSpan
  const bool units = scales.ints != nullptr && scales.per_unit * group <= kMaxUnitSpan &&
                     (!zeros.present() || (zeros.ints != nullptr && zeros.per_unit == scales.per_unit));
  return Weight{static_cast<const uint8_t*>(codes.data_ptr()), scales, zeros, groups, group, group_bytes, panel,
                four ? table.data_ptr<int8_t>() : nullptr, six, decode, units};
}

// x's int8 blocks of `span` inputs (a multiple of 16): q int8 [M, K], d float32 [M, K / span]
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x, int64_t span) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(span > 0 && span % 16 == 0, "activation blocks of a multiple of 16 inputs");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % span == 0, "K = ", k, " is not a multiple of the block ", span);
  auto q = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({m, k / span}, x.options());
  quantize_for(16, x.data_ptr<float>(), m, k, q.data_ptr<int8_t>(), Rounding{span, d.data_ptr<float>(), nullptr, nullptr, nullptr, 0});
  return {q, d};
}

// whether the panel loop adds an offset to its integers as a sum of q (dot_panel's kShifts), and which:
// a 4-bit table's first entry (consecutive entries: the nibble is the rest), a 6-bit code's -32, or a signed
// code's -128 where the dot product takes signed codes biased to unsigned bytes
bool panel_shifts(const Weight& wt, int32_t* offset) {
  if (!kPanelLoops || wt.panel != kPanel) return false;
  if (!(wt.four() || wt.six) || wt.nibbles == kLookup) {  // signed codes: 8-bit, or through a table
    *offset = -128;
    return kBiasedSigned;
  }
  if (wt.nibbles == kPlain) return false;
  *offset = wt.six ? kSixOffset : wt.table[0];
  return true;
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
  int32_t offset = 0;
  const bool shifted = panel_shifts(wt, &offset);
  const int64_t spans = k / wt.span();
  std::unique_ptr<int8_t[]> q(new int8_t[m * k]);
  std::unique_ptr<float[]> d(new float[m * spans]);
  std::unique_ptr<float[]> sum(wt.has_zero() && !wt.units ? new float[m * groups] : nullptr);
  std::unique_ptr<int32_t[]> pairs(wt.has_zero() && wt.units ? new int32_t[m * groups / 2] : nullptr);
  std::unique_ptr<int32_t[]> shift(shifted ? new int32_t[m * groups] : nullptr);
  quantize_for(group, x.data_ptr<float>(), m, k, q.get(), Rounding{wt.span(), d.get(), sum.get(), shift.get(), pairs.get(), offset});
  const Activations a{q.get(), d.get(), sum.get(), shift.get(), pairs.get(), k, groups, spans};
  dispatch<MatmulKernel>(wt.four() || wt.six, group, wt.has_zero(), wt, a, m, out.data_ptr<float>(), n);
  return out;
}

// check_weight for a call without x: K from the scale's groups
Weight weight_alone(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& scale_units,
                    const torch::Tensor& zero, const torch::Tensor& zero_units, const torch::Tensor& table, int64_t group) {
  TORCH_CHECK(scale.dim() == 2 || scale.dim() == 3, "scale: [N, K / group] or [N / 16, K / group, 16]");
  return check_weight(codes, scale, scale_units, zero, zero_units, table, group, scale.size(1) * group);
}

// inputs to one block of the int8 activations grouped_matmul rounds for this weight (Weight::span)
int64_t activation_span(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& scale_units,
                        const torch::Tensor& zero, const torch::Tensor& zero_units, const torch::Tensor& table,
                        int64_t group) {
  return weight_alone(codes, scale, scale_units, zero, zero_units, table, group).span();
}

torch::Tensor grouped_unpack(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& scale_units,
                             const torch::Tensor& zero, const torch::Tensor& zero_units, const torch::Tensor& table,
                             int64_t group, int64_t start, int64_t end) {
  const Weight wt = weight_alone(codes, scale, scale_units, zero, zero_units, table, group);
  const int64_t k = wt.groups * wt.group;
  TORCH_CHECK(0 <= start && start <= end && end <= outputs_of(codes), "rows [", start, ", ", end, ") out of range");
  auto out = torch::empty({end - start, k}, codes.options().dtype(torch::kFloat32));
  unpack_rows(wt, start, end, out.data_ptr<float>());
  return out;
}

// rows `ids` [R] of W as float32 [R, K] (an embedding lookup from a tied head: each id's own bytes only)
torch::Tensor grouped_rows(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& scale_units,
                           const torch::Tensor& zero, const torch::Tensor& zero_units, const torch::Tensor& table,
                           int64_t group, const torch::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.device().is_cpu(), "ids: int64 [R] on the CPU");
  const Weight wt = weight_alone(codes, scale, scale_units, zero, zero_units, table, group);
  const int64_t k = wt.groups * wt.group;
  const auto wanted = ids.contiguous();
  const int64_t* id = wanted.data_ptr<int64_t>();
  const int64_t count = wanted.numel(), n = outputs_of(codes);
  for (int64_t r = 0; r < count; ++r) TORCH_CHECK(0 <= id[r] && id[r] < n, "row id ", id[r], " out of [0, ", n, ")");
  auto out = torch::empty({count, k}, codes.options().dtype(torch::kFloat32));
  float* rows = out.data_ptr<float>();
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) unpack_output(wt, id[r], rows + r * k);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pagedserve::kReleaseGil;
  m.def("grouped_matmul", &grouped_matmul, kReleaseGil,
        "x float32 [M, K] @ grouped weight.T -> float32 [M, N] (CPU), x rounded to int8 per group");
  m.def("quantize_activations", &quantize_activations, kReleaseGil,
        "x float32 [M, K] -> (q int8 [M, K], d float32 [M, K / span]): its int8 blocks of span inputs");
  m.def("activation_span", &activation_span, "inputs to one block of the activations grouped_matmul rounds for a weight");
  m.def("grouped_unpack", &grouped_unpack, kReleaseGil, "rows [start, end) of a grouped weight as float32 (CPU)");
  m.def("grouped_rows", &grouped_rows, kReleaseGil, "rows ids [R] of a grouped weight as float32 [R, K] (CPU)");
  m.def("vectorized", &vectorized, "whether this build has the vector loops (AVX2, FMA and F16C; AVX-512 where present)");
  static const pagedserve::GroupedMatmulEntries entries{&grouped_matmul};
  m.attr("entry_points") = pagedserve::export_entries(&entries);
}
