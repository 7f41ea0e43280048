// Paged decode attention on the CPU, reading K/V straight from the pages.
//
// One query token per sequence attends to the token positions [starts[i], ends[i]) of its
// own page table. K/V are never gathered: the kernel walks the table, scores a chunk of up
// to kChunk tokens for every query head, updates an online softmax (running max m, running
// sum l, accumulators rescaled by exp(m_old - m_new)), then accumulates V for that chunk.
// Each token's row [num_kv_heads, head_dim] is contiguous in the cache, so a work item that
// covers several KV heads reads whole rows, and the query heads of a GQA group share the
// K/V loads.
//
//   work item = (sequence, KV heads [h0, h1), positions [t0, t1))
//
// Normally one item is one sequence with all its heads. When one sequence would be more
// than a fair share of a thread's work (a long context among short ones, or few sequences),
// it is split by KV heads first (exact, nothing to merge), then by positions; the partial
// results over positions are merged through their log-sum-exps afterwards. Items are dealt
// to the intra-op threads in contiguous runs of equal cost.
//
// Everything accumulates in float32; bf16 inputs are widened on load. Head dims that are a
// multiple of 16 with GQA groups of 1-8 take a vector path (GCC vector types, so AVX2 machines
// build it too) that keeps a group's queries and accumulators in registers; the rest take a
// scalar loop the compiler vectorizes over head_dim.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bindings.h"
#include "cpu_math.h"
#include "entry_points.h"

namespace {

constexpr int64_t kChunk = 32;           // tokens scored together per online-softmax update
constexpr int64_t kMinPartTokens = 128;  // a position split never makes parts shorter than this
constexpr int64_t kItemOverhead = 8;     // what starting an item costs, in token-rows

using pagedserve::bf16_bits;
using pagedserve::to_float;
using pagedserve::exp_approx;

struct Item {
  int64_t seq;
  int64_t h0, h1;     // KV heads
  int64_t t0, t1;     // token positions
  int64_t partial;    // -1: write out/lse directly; else offset of its (acc, m, l) in the scratch
  int64_t cost;
};

struct Problem {
  int64_t num_q_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t row_stride;  // elements between consecutive token rows: num_kv_heads * head_dim
  float scale;
};

// Scratch of one thread, sized once per call.
struct Buffers {
  std::vector<float> q, acc, m, l, scores;
  std::vector<int64_t> rows;
  explicit Buffers(const Problem& p)
      : q(p.num_q_heads * p.head_dim),
        acc(p.num_q_heads * p.head_dim),
        m(p.num_q_heads),
        l(p.num_q_heads),
        scores(p.num_q_heads * kChunk),
        rows(kChunk) {}
};

// The online softmax of `nq` query heads over positions [t0, t1) of one table row.
// q [nq, D] is pre-scaled; kv_off[j] is query head j's KV head offset within a token row.
// Leaves acc [nq, D] unnormalized, m the running max, l the running sum.
template <typename scalar_t, int kD>
void attend(const scalar_t* __restrict k_base, const scalar_t* __restrict v_base, const int32_t* __restrict table,
            const Problem& p, int64_t t0, int64_t t1, int64_t nq, const int64_t* __restrict kv_off,
            const float* __restrict q, float* __restrict acc, float* __restrict m, float* __restrict l,
            float* __restrict scores, int64_t* __restrict rows) {
  const int64_t D = kD > 0 ? kD : p.head_dim;
  const int64_t bs = p.block_size;
  for (int64_t j = 0; j < nq; ++j) {
    m[j] = -std::numeric_limits<float>::infinity();
    l[j] = 0.0f;
  }
  std::fill(acc, acc + nq * D, 0.0f);
  int64_t page = t0 / bs, off = t0 % bs;
  for (int64_t pos = t0; pos < t1; pos += kChunk) {
    const int64_t n = std::min(kChunk, t1 - pos);
    for (int64_t t = 0; t < n; ++t) {  // where each token's row starts
      rows[t] = (static_cast<int64_t>(table[page]) * bs + off) * p.row_stride;
      if (++off == bs) {
        off = 0;
        ++page;
      }
    }
    // scores[j, t] = q_j . k_t
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* __restrict k_row = k_base + rows[t];
      for (int64_t j = 0; j < nq; ++j) {
        const scalar_t* __restrict k = k_row + kv_off[j];
        const float* __restrict qj = q + j * D;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qj[d] * to_float(k[d]);
        scores[j * kChunk + t] = s;
      }
    }
    // online softmax: scores become probabilities relative to the new running max
    for (int64_t j = 0; j < nq; ++j) {
      float* __restrict sj = scores + j * kChunk;
      float mx = m[j];
      for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sj[t]);
      const float alpha = std::exp(m[j] - mx);  // 0 on the first chunk (m = -inf)
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        const float e = exp_approx(sj[t] - mx);
        sj[t] = e;
        sum += e;
      }
      l[j] = l[j] * alpha + sum;
      m[j] = mx;
      if (alpha != 1.0f) {
        float* __restrict a = acc + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      }
    }
    // acc_j += sum_t p[j, t] v_t
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* __restrict v_row = v_base + rows[t];
      for (int64_t j = 0; j < nq; ++j) {
        const scalar_t* __restrict v = v_row + kv_off[j];
        const float pj = scores[j * kChunk + t];
        float* __restrict a = acc + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += pj * to_float(v[d]);
      }
    }
  }
}

// --- the vector path: head_dim a multiple of 16, a GQA group of 1-8 query heads -----------------
// One KV head at a time: its group's query rows and accumulators stay in registers while
// the chunk's K rows (then V rows) stream past, each loaded once for the whole group.

// The lane width is the machine's: 16 floats where AVX-512 is, else 8 (one ymm). A wider GCC vector
// than the target has is lowered piece by piece, and with a group's queries and accumulators in
// play it spilled to scalar code on AVX2 (an 18x slower kernel).
#ifdef __AVX512F__
constexpr int kL = 16;
#else
constexpr int kL = 8;
#endif
typedef float vf __attribute__((vector_size(kL * 4)));      // kL floats
typedef uint16_t vh __attribute__((vector_size(kL * 2)));   // kL bf16
typedef uint32_t vu __attribute__((vector_size(kL * 4)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf vload(const bf16_bits* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu w = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline float hsum(vf v) {
#ifdef __AVX512F__
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vf8 a = v;
#endif
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// One chunk of n tokens (their row offsets in `rows`) for the kG query rows q [kG, kD]
// (pre-scaled) of one KV head (kv_off within a token row): updates the online softmax state
// acc [kG, kD] (unnormalized), m, l in place.
template <typename scalar_t, int kD, int kG>
void attend_head_chunk(const scalar_t* __restrict k_base, const scalar_t* __restrict v_base,
                       const int64_t* __restrict rows, int64_t n, int64_t kv_off, const float* __restrict q,
                       float* __restrict acc_io, float* __restrict m, float* __restrict l) {
  constexpr int kV = kD / kL;
  vf qv[kG][kV], acc[kG][kV];
  alignas(64) float scores[kG][kChunk];
#pragma GCC unroll 8
  for (int j = 0; j < kG; ++j) {
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) {
      qv[j][v] = vload(q + j * kD + v * kL);
      acc[j][v] = vload(acc_io + j * kD + v * kL);
    }
  }
  for (int64_t t = 0; t < n; ++t) {  // scores[j, t] = q_j . k_t, each k_t loaded once
    const scalar_t* __restrict k = k_base + rows[t] + kv_off;
    vf kv[kV];
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) kv[v] = vload(k + v * kL);
#pragma GCC unroll 8
    for (int j = 0; j < kG; ++j) {
      vf a = qv[j][0] * kv[0], b = {};  // two chains (even and odd lanes' vectors): half the fma latency
#pragma GCC unroll 16
      for (int v = 1; v < kV; ++v) {
        if (v % 2) b += qv[j][v] * kv[v];
        else a += qv[j][v] * kv[v];
      }
      scores[j][t] = hsum(a + b);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < kG; ++j) {  // online softmax
    float mx = m[j];
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, scores[j][t]);
    const float alpha = std::exp(m[j] - mx);  // 0 on the first chunk (m = -inf)
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      const float e = exp_approx(scores[j][t] - mx);
      scores[j][t] = e;
      sum += e;
    }
    l[j] = l[j] * alpha + sum;
    m[j] = mx;
    if (alpha != 1.0f) {
#pragma GCC unroll 16
      for (int v = 0; v < kV; ++v) acc[j][v] *= alpha;
    }
  }
  for (int64_t t = 0; t < n; ++t) {  // acc_j += p[j, t] v_t, each v_t loaded once
    const scalar_t* __restrict vr = v_base + rows[t] + kv_off;
    vf vv[kV];
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) vv[v] = vload(vr + v * kL);
#pragma GCC unroll 8
    for (int j = 0; j < kG; ++j) {
      const float pj = scores[j][t];
#pragma GCC unroll 16
      for (int v = 0; v < kV; ++v) acc[j][v] += pj * vv[v];
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < kG; ++j) {
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) std::memcpy(acc_io + j * kD + v * kL, &acc[j][v], sizeof(vf));
  }
}

// One item's heads [h0, h1) through the vector path when its shape has one; returns false if not.
template <typename scalar_t, int kD>
bool attend_vector(const scalar_t* k_base, const scalar_t* v_base, const int32_t* table, const Problem& p,
                   int64_t t0, int64_t t1, int64_t h0, int64_t h1, const float* q, float* acc, float* m, float* l) {
  if constexpr (kD == 0 || kD % 16 != 0) {
    return false;
  } else {
    auto heads = [&](auto group) {
      constexpr int kG = decltype(group)::value;
      const int64_t nq = (h1 - h0) * kG;
      for (int64_t j = 0; j < nq; ++j) {
        m[j] = -std::numeric_limits<float>::infinity();
        l[j] = 0.0f;
      }
      std::fill(acc, acc + nq * kD, 0.0f);
      int64_t rows[kChunk];
      const int64_t bs = p.block_size;
      int64_t page = t0 / bs, off = t0 % bs;
      // chunk by chunk, every head of the item: the chunk's K/V rows stay in L1 across heads
      for (int64_t pos = t0; pos < t1; pos += kChunk) {
        const int64_t n = std::min(kChunk, t1 - pos);
        for (int64_t t = 0; t < n; ++t) {
          rows[t] = (static_cast<int64_t>(table[page]) * bs + off) * p.row_stride;
          if (++off == bs) {
            off = 0;
            ++page;
          }
        }
        {  // ask for the next chunk's K/V lines of these heads now: pages are scattered, so the
           // hardware prefetcher cannot guess them, and the loads would wait on memory
          int64_t next_page = page, next_off = off;
          const int64_t n_next = std::min(kChunk, t1 - pos - n);
          const int64_t span = (h1 - h0) * kD * static_cast<int64_t>(sizeof(scalar_t));  // bytes per token row
          for (int64_t t = 0; t < n_next; ++t) {
            const int64_t row = (static_cast<int64_t>(table[next_page]) * bs + next_off) * p.row_stride + h0 * kD;
            const char* kr = reinterpret_cast<const char*>(k_base + row);
            const char* vr = reinterpret_cast<const char*>(v_base + row);
            for (int64_t b = 0; b < span; b += 64) {
              __builtin_prefetch(kr + b);
              __builtin_prefetch(vr + b);
            }
            if (++next_off == bs) {
              next_off = 0;
              ++next_page;
            }
          }
        }
        for (int64_t h = h0; h < h1; ++h) {
          const int64_t r = (h - h0) * kG;
          attend_head_chunk<scalar_t, kD, kG>(k_base, v_base, rows, n, h * kD, q + r * kD, acc + r * kD, m + r,
                                              l + r);
        }
      }
      return true;
    };
    switch (p.group) {
      case 1: return heads(std::integral_constant<int, 1>{});
      case 2: return heads(std::integral_constant<int, 2>{});
      case 3: return heads(std::integral_constant<int, 3>{});
      case 4: return heads(std::integral_constant<int, 4>{});
      case 5: return heads(std::integral_constant<int, 5>{});
      case 6: return heads(std::integral_constant<int, 6>{});
      case 7: return heads(std::integral_constant<int, 7>{});
      case 8: return heads(std::integral_constant<int, 8>{});
      default: return false;
    }
  }
}

inline void store(float* dst, const float* src, int64_t n, float mul) {
  for (int64_t d = 0; d < n; ++d) dst[d] = src[d] * mul;
}

inline void store(bf16_bits* dst, const float* src, int64_t n, float mul) {
  for (int64_t d = 0; d < n; ++d) dst[d] = pagedserve::round_bf16(src[d] * mul);
}

// Splits the rows into items and deals them to `num_tasks` contiguous runs of equal cost.
// Returns the item list; `task_begin` gets num_tasks + 1 boundaries into it.
std::vector<Item> plan_items(const Problem& p, const int32_t* starts, const int32_t* ends, int64_t num_seqs,
                             int64_t num_tasks, std::vector<int64_t>& task_begin, int64_t& scratch_floats) {
  int64_t total = 0;
  for (int64_t i = 0; i < num_seqs; ++i) total += (ends[i] - starts[i]) * p.num_kv_heads + kItemOverhead;
  // a sequence costing more than this is split (at most ~4 pieces per task on average)
  const int64_t limit = num_tasks > 1 ? std::max<int64_t>(1, total / (4 * num_tasks)) : total + 1;
  std::vector<Item> items;
  items.reserve(num_seqs);
  scratch_floats = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t len = ends[i] - starts[i];
    const int64_t cost = len * p.num_kv_heads;
    int64_t head_groups = 1, parts = 1;
    if (cost > limit) {
      const int64_t pieces = (cost + limit - 1) / limit;
      head_groups = std::min(p.num_kv_heads, pieces);
      parts = (pieces + head_groups - 1) / head_groups;
      parts = std::max<int64_t>(1, std::min(parts, len / kMinPartTokens));
    }
    for (int64_t g = 0; g < head_groups; ++g) {
      const int64_t h0 = p.num_kv_heads * g / head_groups, h1 = p.num_kv_heads * (g + 1) / head_groups;
      for (int64_t k = 0; k < parts; ++k) {
        const int64_t t0 = starts[i] + len * k / parts, t1 = starts[i] + len * (k + 1) / parts;
        int64_t partial = -1;
        if (parts > 1) {
          partial = scratch_floats;
          scratch_floats += (h1 - h0) * p.group * (p.head_dim + 2);
        }
        items.push_back({i, h0, h1, t0, t1, partial, (t1 - t0) * (h1 - h0) + kItemOverhead});
      }
    }
  }
  // contiguous runs: item k goes to the task its cost midpoint falls in
  task_begin.assign(num_tasks + 1, static_cast<int64_t>(items.size()));
  task_begin[0] = 0;
  int64_t done = 0, task = 0;
  const int64_t items_total = std::max<int64_t>(1, [&] {
    int64_t s = 0;
    for (const Item& it : items) s += it.cost;
    return s;
  }());
  for (int64_t k = 0; k < static_cast<int64_t>(items.size()); ++k) {
    const int64_t mid = done + items[k].cost / 2;
    while (task + 1 < num_tasks && mid * num_tasks >= (task + 1) * items_total) task_begin[++task] = k;
    done += items[k].cost;
  }
  return items;
}

template <typename scalar_t, int kD>
void run(const scalar_t* q_data, const scalar_t* k_base, const scalar_t* v_base, const int32_t* tables,
         const std::vector<Item>& items, const std::vector<int64_t>& task_begin, const Problem& p, scalar_t* out,
         float* lse, float* scratch) {
  const int64_t num_tasks = static_cast<int64_t>(task_begin.size()) - 1;
  const int64_t D = p.head_dim;
  at::parallel_for(0, num_tasks, 1, [&](int64_t task0, int64_t task1) {
    Buffers buf(p);
    std::vector<int64_t> kv_off(p.num_q_heads);
    for (int64_t k = task_begin[task0]; k < task_begin[task1]; ++k) {
      const Item& it = items[k];
      const int64_t nq = (it.h1 - it.h0) * p.group;
      const int64_t qh0 = it.h0 * p.group;  // first query head of the item
      const scalar_t* q_row = q_data + (it.seq * p.num_q_heads + qh0) * D;
      for (int64_t x = 0; x < nq * D; ++x) buf.q[x] = to_float(q_row[x]) * p.scale;
      const int32_t* table = tables + it.seq * p.max_blocks;
      if (!attend_vector<scalar_t, kD>(k_base, v_base, table, p, it.t0, it.t1, it.h0, it.h1, buf.q.data(),
                                       buf.acc.data(), buf.m.data(), buf.l.data())) {
        for (int64_t j = 0; j < nq; ++j) kv_off[j] = (it.h0 + j / p.group) * D;
        attend<scalar_t, kD>(k_base, v_base, table, p, it.t0, it.t1, nq, kv_off.data(), buf.q.data(),
                             buf.acc.data(), buf.m.data(), buf.l.data(), buf.scores.data(), buf.rows.data());
      }
      if (it.partial >= 0) {  // a part of a split sequence: keep (acc, m, l) for the merge
        float* dst = scratch + it.partial;
        std::memcpy(dst, buf.acc.data(), sizeof(float) * nq * D);
        std::memcpy(dst + nq * D, buf.m.data(), sizeof(float) * nq);
        std::memcpy(dst + nq * D + nq, buf.l.data(), sizeof(float) * nq);
        continue;
      }
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t row = it.seq * p.num_q_heads + qh0 + j;
        const bool empty = buf.l[j] == 0.0f;  // no positions
        store(out + row * D, buf.acc.data() + j * D, D, empty ? 0.0f : 1.0f / buf.l[j]);
        lse[row] = empty ? -std::numeric_limits<float>::infinity() : buf.m[j] + std::log(buf.l[j]);
      }
    }
  });
  // merge the parts of split sequences: consecutive items with the same (seq, h0)
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first, last) items of one split
  for (int64_t k = 0; k < static_cast<int64_t>(items.size());) {
    int64_t e = k + 1;
    while (e < static_cast<int64_t>(items.size()) && items[e].seq == items[k].seq && items[e].h0 == items[k].h0) ++e;
    if (items[k].partial >= 0) runs.emplace_back(k, e);
    k = e;
  }
  at::parallel_for(0, static_cast<int64_t>(runs.size()), 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> acc(D);
    for (int64_t r = r0; r < r1; ++r) {
      const Item& first = items[runs[r].first];
      const int64_t nq = (first.h1 - first.h0) * p.group;
      for (int64_t j = 0; j < nq; ++j) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t k = runs[r].first; k < runs[r].second; ++k) mx = std::max(mx, scratch[items[k].partial + nq * D + j]);
        float total = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k = runs[r].first; k < runs[r].second; ++k) {
          const float* part = scratch + items[k].partial;
          const float w = std::exp(part[nq * D + j] - mx);
          total += part[nq * D + nq + j] * w;
          for (int64_t d = 0; d < D; ++d) acc[d] += part[j * D + d] * w;
        }
        const int64_t row = first.seq * p.num_q_heads + first.h0 * p.group + j;
        store(out + row * D, acc.data(), D, 1.0f / total);
        lse[row] = mx + std::log(total);
      }
    }
  });
}

template <typename scalar_t>
void dispatch_head_dim(int64_t head_dim, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                       const int32_t* tables, const std::vector<Item>& items, const std::vector<int64_t>& task_begin,
                       const Problem& p, scalar_t* out, float* lse, float* scratch) {
  switch (head_dim) {
    case 64: return run<scalar_t, 64>(q, k, v, tables, items, task_begin, p, out, lse, scratch);
    case 128: return run<scalar_t, 128>(q, k, v, tables, items, task_begin, p, out, lse, scratch);
    case 96: return run<scalar_t, 96>(q, k, v, tables, items, task_begin, p, out, lse, scratch);
    case 80: return run<scalar_t, 80>(q, k, v, tables, items, task_begin, p, out, lse, scratch);
    case 256: return run<scalar_t, 256>(q, k, v, tables, items, task_begin, p, out, lse, scratch);
    default: return run<scalar_t, 0>(q, k, v, tables, items, task_begin, p, out, lse, scratch);
  }
}

}  // namespace

// q [num_seqs, num_q_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables int32 [num_seqs, max_blocks]; starts, ends int32 [num_seqs].
// Returns (out [num_seqs, num_q_heads, head_dim] in q's dtype, lse float32 [num_seqs, num_q_heads]).
std::vector<torch::Tensor> paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache,
                                        const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                        const torch::Tensor& starts, const torch::Tensor& ends, double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4 && block_tables.dim() == 2 &&
                        starts.dim() == 1 && ends.dim() == 1,
                    "paged_decode: bad ranks");
  TORCH_CHECK_VALUE(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                        block_tables.is_contiguous() && starts.is_contiguous() && ends.is_contiguous(),
                    "paged_decode: every input must be contiguous");
  TORCH_CHECK_VALUE(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                        (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
                    "paged_decode: q, k_cache, v_cache must all be float32 or all bfloat16");
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && starts.scalar_type() == at::kInt &&
                        ends.scalar_type() == at::kInt,
                    "paged_decode: block_tables, starts, ends must be int32");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), "paged_decode: k_cache and v_cache shapes differ");
  Problem p;
  const int64_t num_seqs = q.size(0);
  p.num_q_heads = q.size(1);
  p.head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0);
  p.block_size = k_cache.size(1);
  p.num_kv_heads = k_cache.size(2);
  p.max_blocks = block_tables.size(1);
  p.row_stride = p.num_kv_heads * p.head_dim;
  p.scale = static_cast<float>(scale);
  TORCH_CHECK_VALUE(k_cache.size(3) == p.head_dim, "paged_decode: head_dim of q and the cache differ");
  TORCH_CHECK_VALUE(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0,
                    "paged_decode: num_q_heads must be a multiple of num_kv_heads");
  TORCH_CHECK_VALUE(block_tables.size(0) == num_seqs && starts.size(0) == num_seqs && ends.size(0) == num_seqs,
                    "paged_decode: block_tables, starts, ends must have one row per sequence");
  TORCH_CHECK_VALUE(p.block_size > 0, "paged_decode: block_size must be positive");
  p.group = p.num_q_heads / p.num_kv_heads;

  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* s = starts.data_ptr<int32_t>();
  const int32_t* e = ends.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_seqs; ++i) {  // nothing outside the cache is ever read
    TORCH_CHECK_VALUE(0 <= s[i] && s[i] <= e[i] && e[i] <= p.max_blocks * p.block_size, "paged_decode: row ", i,
                      " attends to positions [", s[i], ", ", e[i], ") outside its table of ", p.max_blocks,
                      " pages of ", p.block_size);
    if (s[i] == e[i]) continue;
    for (int64_t b = s[i] / p.block_size; b <= (e[i] - 1) / p.block_size; ++b) {
      const int32_t page = tables[i * p.max_blocks + b];
      TORCH_CHECK_VALUE(0 <= page && page < num_blocks, "paged_decode: row ", i, " page ", b, " is ", page,
                        ", outside the cache of ", num_blocks, " blocks");
    }
  }

  auto out = torch::empty_like(q);
  auto lse = torch::empty({num_seqs, p.num_q_heads}, q.options().dtype(at::kFloat));
  if (num_seqs == 0 || p.num_q_heads == 0) return {out, lse};
  const int64_t num_tasks = at::in_parallel_region() ? 1 : std::max<int64_t>(1, at::get_num_threads());
  std::vector<int64_t> task_begin;
  int64_t scratch_floats = 0;
  const std::vector<Item> items = plan_items(p, s, e, num_seqs, num_tasks, task_begin, scratch_floats);
  std::vector<float> scratch(scratch_floats);
  if (q.scalar_type() == at::kFloat) {
    dispatch_head_dim<float>(p.head_dim, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                             tables, items, task_begin, p, out.data_ptr<float>(), lse.data_ptr<float>(),
                             scratch.data());
  } else {
    auto bits = [](const torch::Tensor& t) { return reinterpret_cast<const bf16_bits*>(t.data_ptr<at::BFloat16>()); };
    dispatch_head_dim<bf16_bits>(p.head_dim, bits(q), bits(k_cache), bits(v_cache), tables, items, task_begin, p,
                                 reinterpret_cast<bf16_bits*>(out.data_ptr<at::BFloat16>()), lse.data_ptr<float>(),
                                 scratch.data());
  }
  return {out, lse};
}

// key, value [T, num_kv_heads, head_dim] (rows may be strided, each row contiguous) -> their slots of the
// caches [num_blocks, block_size, num_kv_heads, head_dim]: one call for both, where torch takes two index_copy_
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache, torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key.dim() == 3 && value.sizes() == key.sizes() && k_cache.dim() == 4 &&
                        v_cache.sizes() == k_cache.sizes() && slot_mapping.dim() == 1 &&
                        slot_mapping.size(0) == key.size(0) && k_cache.size(2) == key.size(1) &&
                        k_cache.size(3) == key.size(2),
                    "write_kv: key, value [T, H, D], caches [B, S, H, D] and slot_mapping [T] do not match");
  TORCH_CHECK_VALUE(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                        v_cache.scalar_type() == k_cache.scalar_type() && slot_mapping.scalar_type() == at::kLong,
                    "write_kv: key, value and caches must share a dtype; slot_mapping must be int64");
  const int64_t heads = key.size(1), dim = key.size(2), row = heads * dim;
  for (const torch::Tensor* t : {&key, &value}) {
    TORCH_CHECK_VALUE(t->stride(2) == 1 && t->stride(1) == dim, "write_kv: each token's [H, D] must be contiguous");
  }
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: the caches must be contiguous");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), tokens = key.size(0);
  const int64_t bytes = row * static_cast<int64_t>(key.element_size());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot ", slots[t], " outside the cache's ",
                      num_slots);
  }
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(k_dst + slots[t] * bytes, k_src + t * k_stride, bytes);
    std::memcpy(v_dst + slots[t] * bytes, v_src + t * v_stride, bytes);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pagedserve::kReleaseGil;
  m.def("write_kv", &write_kv, kReleaseGil, "key/value rows into their slots of the paged caches (CPU)");
  m.def("paged_decode", &paged_decode, kReleaseGil, "Paged decode attention over [starts, ends) of each row's pages (CPU)");
  static const pagedserve::PagedDecodeEntries entries{&paged_decode, &write_kv};
  m.attr("entry_points") = pagedserve::export_entries(&entries);
}
