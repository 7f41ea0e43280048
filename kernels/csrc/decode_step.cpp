// A decode step's decoder layers in one call on the CPU: runtime/model/llama.py's forward, from the
// embedded rows to the final norm, with no Python between the operations.
//
// Per layer, as llama.py runs it (its docstring has the residual scheme):
//
//   qkv = x @ Wqkv.T (+ b)                       grouped matmul, one call per row block of the weight
//   q, k per-head RMSNorm (Qwen3, Gemma 3)       add_rms_norm over [tokens * heads, head_dim]
//   q, k = rope(qkv); v = qkv's last columns     rope_qkv (the layer's table: global or local)
//   K/V rows -> their slots; paged decode        write_kv, paged_decode over [starts, ends) of the tables,
//                                                merged with shared prefixes' part as kernels/cascade.py does
//   attn = out @ Wo.T (+ b) (, its norm)         the sandwich norms of Gemma where the layer has them
//   normed = norm_post(residual += attn)
//   act = silu(gate) * up, or gelu_tanh(gate) * up;  out = act @ Wdown.T (+ b) (, its norm)
//   normed = norm_next(residual += out)          the next layer's input norm, or the final norm
//
// Every operation is the function the Python path calls: the other kernel modules' own functions,
// reached through their entry points (entry_points.h) and built with their own flags, and ATen's for
// GeGLU, the bias sums and the joins. So the step computes what the Python path computes, to the bit
// (tests/runtime/test_native_decode.py). What it saves is the Python, the module and pybind calls
// and the tensor views between the ~15 operations of a layer: 0.1-0.2 ms a layer on this repo's CPUs.
//
// The matmul weights are GGUF-grouped (runtime/model/grouped.py) and the activations float32; the
// caller (runtime/model/native_decode.py) checks what the step serves and keeps the Python path for
// the rest.

#include <torch/extension.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "entry_points.h"

namespace {

using torch::Tensor;

// where a step's time goes, when profiling is on (bench/profile_decode.py): seconds per part
enum Part { kMatmul = 0, kAttention, kNorms, kElementwise, kParts };
constexpr size_t kSharedParts = 6;  // a window's shared prefixes: tables, member_rows, row_bias, rows, slots, empty
constexpr const char* kPartNames[kParts] = {"matmul", "attention", "norms", "elementwise"};

class PartClock {  // adds the time from its making (or the last lap) to a part, where profiling is on
 public:
  PartClock(std::array<double, kParts>* seconds) : seconds_(seconds), last_(now()) {}
  void lap(Part part) {
    if (seconds_ == nullptr) return;
    const auto t = now();
    (*seconds_)[part] += std::chrono::duration<double>(t - last_).count();
    last_ = t;
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  std::array<double, kParts>* seconds_;  // nullptr: not profiling
  std::chrono::steady_clock::time_point last_;
};

Tensor optional_tensor(const py::dict& spec, const char* key) {  // undefined where the key holds None
  if (!spec.contains(key) || spec[key].is_none()) return Tensor();
  return spec[key].cast<Tensor>();
}

// one matrix: its row blocks (each a grouped weight, called apart, outputs side by side) and its bias
struct Matmul {
  struct Block {
    Tensor codes, scale, scale_units, zero, zero_units, table;
    int64_t group;
  };
  std::vector<Block> blocks;
  Tensor bias;  // undefined: none

  Matmul() = default;
  Matmul(const py::dict& spec, const char* name) {
    const py::dict matmul = spec[name].cast<py::dict>();
    for (const py::handle block : matmul["blocks"].cast<py::list>()) {
      const py::tuple t = block.cast<py::tuple>();
      TORCH_CHECK_VALUE(t.size() == 7, name, ": a block is (codes, scale, scale_units, zero, zero_units, table, group)");
      blocks.push_back(Block{t[0].cast<Tensor>(), t[1].cast<Tensor>(), t[2].cast<Tensor>(), t[3].cast<Tensor>(),
                             t[4].cast<Tensor>(), t[5].cast<Tensor>(), t[6].cast<int64_t>()});
    }
    TORCH_CHECK_VALUE(!blocks.empty(), name, ": no row blocks");
    bias = optional_tensor(matmul, "bias");
  }

  // x float32 [tokens, in] (contiguous) -> [tokens, out]: GroupedWeight.linear, or SplitGroupedWeight's
  Tensor operator()(const Tensor& x, const pagedserve::GroupedMatmulEntries& kernel) const {
    auto run = [&](const Block& b) {
      return kernel.grouped_matmul(x, b.codes, b.scale, b.scale_units, b.zero, b.zero_units, b.table, b.group);
    };
    Tensor out;
    if (blocks.size() == 1) {
      out = run(blocks[0]);
    } else {
      std::vector<Tensor> parts;
      for (const Block& b : blocks) parts.push_back(run(b));
      out = at::cat(parts, 1);
    }
    return bias.defined() ? out + bias : out;
  }
};

struct Layer {
  Matmul qkv, o, gate_up, down;
  Tensor post_attention_norm, next_norm;       // the MLP's input norm; the next layer's input norm (or the final)
  Tensor q_norm, k_norm;                       // per-head norms of q and k (undefined: none)
  Tensor attn_output_norm, mlp_output_norm;    // sandwich norms (undefined: none)
  Tensor k_cache, v_cache;                     // [num_blocks, block_size, num_kv_heads, head_dim]
  int64_t window_index;                        // which of the step's (tables, starts, ends) this layer reads
  bool local_rope, gelu;
};

class DecodeStep {
 public:
  DecodeStep(const py::capsule& fused_ops, const py::capsule& grouped, const py::capsule& attention,
             const py::dict& config, const Tensor& first_norm)
      : ops_(*pagedserve::import_entries<pagedserve::FusedOpsEntries>(fused_ops)),
        matmul_(*pagedserve::import_entries<pagedserve::GroupedMatmulEntries>(grouped)),
        attention_(*pagedserve::import_entries<pagedserve::PagedDecodeEntries>(attention)),
        num_heads_(config["num_heads"].cast<int64_t>()),
        num_kv_heads_(config["num_kv_heads"].cast<int64_t>()),
        head_dim_(config["head_dim"].cast<int64_t>()),
        eps_(config["eps"].cast<double>()),
        scale_(config["scale"].cast<double>()),
        first_norm_(first_norm) {}

  void add_layer(const py::dict& spec) {
    Layer layer;
    const std::pair<Matmul Layer::*, const char*> matmuls[] = {
        {&Layer::qkv, "qkv"}, {&Layer::o, "o"}, {&Layer::gate_up, "gate_up"}, {&Layer::down, "down"}};
    for (const auto& [member, key] : matmuls) layer.*member = Matmul(spec, key);
    const std::pair<Tensor Layer::*, const char*> required[] = {
        {&Layer::post_attention_norm, "post_attention_norm"}, {&Layer::next_norm, "next_norm"},
        {&Layer::k_cache, "k_cache"}, {&Layer::v_cache, "v_cache"}};
    for (const auto& [member, key] : required) layer.*member = spec[key].cast<Tensor>();
    const std::pair<Tensor Layer::*, const char*> optional[] = {  // None where the family has none
        {&Layer::q_norm, "q_norm"}, {&Layer::k_norm, "k_norm"}, {&Layer::attn_output_norm, "attn_output_norm"},
        {&Layer::mlp_output_norm, "mlp_output_norm"}};
    for (const auto& [member, key] : optional) layer.*member = optional_tensor(spec, key);
    layer.window_index = spec["window_index"].cast<int64_t>();
    layer.local_rope = spec["local_rope"].cast<bool>();
    layer.gelu = spec["gelu"].cast<bool>();
    TORCH_CHECK_VALUE(layer.q_norm.defined() == layer.k_norm.defined(), "q and k norms come together");
    layers_.push_back(std::move(layer));
  }

  // profiling on (the parts' seconds zeroed) or off; the seconds each part took since it was turned on
  void set_profiling(bool on) {
    profiling_ = on;
    seconds_.fill(0.0);
  }
  py::dict profile() const {
    py::dict parts;
    for (int p = 0; p < kParts; ++p) parts[kPartNames[p]] = seconds_[p];
    return parts;
  }

  // residual float32 [tokens, hidden] (the embedded rows; updated in place) -> the final norm of the last
  // residual [tokens, hidden]. positions, slot_mapping int64 [tokens]; per distinct window of the layers
  // (tables int32 [tokens, max_blocks], starts, ends int32 [tokens], and the shared prefixes: none, or
  // with_shared_prefixes' six); cos, sin float32 [positions, head_dim], and the local-rope layers' own (read
  // only by layers marked local_rope: any tables where none is).
  Tensor forward(Tensor residual, const Tensor& positions, const Tensor& slot_mapping,
                 const std::vector<Tensor>& tables, const std::vector<Tensor>& starts, const std::vector<Tensor>& ends,
                 const std::vector<std::vector<Tensor>>& shared, const Tensor& cos, const Tensor& sin,
                 const Tensor& local_cos, const Tensor& local_sin) {
    TORCH_CHECK_VALUE(residual.dim() == 2 && residual.scalar_type() == at::kFloat && residual.is_contiguous(),
                      "residual: contiguous float32 [tokens, hidden]");
    TORCH_CHECK_VALUE(tables.size() == starts.size() && tables.size() == ends.size() && tables.size() == shared.size(),
                      "one (tables, starts, ends, shared) per window");
    for (const std::vector<Tensor>& groups : shared) {
      TORCH_CHECK_VALUE(groups.empty() || groups.size() == kSharedParts,
                        "shared prefixes: none, or (tables, member_rows, row_bias, rows, slots, empty)");
    }
    const Tensor none = residual.new_empty(0);  // add_rms_norm's "no x"
    Tensor normed = ops_.add_rms_norm(none, residual, first_norm_, eps_);
    for (const Layer& layer : layers_) {
      TORCH_CHECK_VALUE(layer.window_index < static_cast<int64_t>(tables.size()), "a layer's window has no tables");
      const size_t w = static_cast<size_t>(layer.window_index);
      normed = run_layer(layer, normed, residual, positions, slot_mapping, tables[w], starts[w], ends[w], shared[w],
                         layer.local_rope ? local_cos : cos, layer.local_rope ? local_sin : sin, none);
    }
    return normed;
  }

 private:
  Tensor run_layer(const Layer& layer, const Tensor& normed, Tensor& residual, const Tensor& positions,
                   const Tensor& slot_mapping, const Tensor& tables, const Tensor& starts, const Tensor& ends,
                   const std::vector<Tensor>& shared, const Tensor& cos, const Tensor& sin, const Tensor& none) {
    const int64_t tokens = normed.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    PartClock clock(profiling_ ? &seconds_ : nullptr);
    Tensor qkv = layer.qkv(normed, matmul_);  // [tokens, q_size + 2 * kv_size]
    clock.lap(kMatmul);
    if (layer.q_norm.defined()) {
      qkv = norm_heads(layer, qkv, none);
      clock.lap(kNorms);
    }
    const std::vector<Tensor> qk = ops_.rope_qkv(qkv.contiguous(), positions, cos, sin, num_heads_, num_kv_heads_);
    clock.lap(kElementwise);
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
    Tensor k_cache = layer.k_cache, v_cache = layer.v_cache;
    attention_.write_kv(qk[1], v, k_cache, v_cache, slot_mapping);
    const std::vector<Tensor> own = attention_.paged_decode(qk[0], k_cache, v_cache, tables, starts, ends, scale_);
    const Tensor out = shared.empty() ? own[0] : with_shared_prefixes(own[0], own[1], qk[0], layer, shared);
    clock.lap(kAttention);
    Tensor attn = layer.o(out.reshape({tokens, q_size}), matmul_);  // [tokens, hidden]
    clock.lap(kMatmul);
    if (layer.attn_output_norm.defined()) attn = ops_.add_rms_norm(none, attn, layer.attn_output_norm, eps_);
    const Tensor mlp_in = ops_.add_rms_norm(attn, residual, layer.post_attention_norm, eps_);
    clock.lap(kNorms);
    const Tensor gate_up = layer.gate_up(mlp_in, matmul_);  // [tokens, 2 * intermediate]
    clock.lap(kMatmul);
    Tensor hidden;  // [tokens, intermediate]
    if (layer.gelu) {  // fused_ops.gelu_tanh_and_mul's torch ops
      const std::vector<Tensor> halves = gate_up.chunk(2, -1);
      hidden = at::gelu(halves[0], "tanh") * halves[1];
    } else {
      hidden = ops_.silu_and_mul(gate_up);
    }
    clock.lap(kElementwise);
    Tensor mlp = layer.down(hidden.contiguous(), matmul_);  // [tokens, hidden]
    clock.lap(kMatmul);
    if (layer.mlp_output_norm.defined()) mlp = ops_.add_rms_norm(none, mlp, layer.mlp_output_norm, eps_);
    Tensor next = ops_.add_rms_norm(mlp, residual, layer.next_norm, eps_);
    clock.lap(kNorms);
    return next;
  }

  // the private parts merged with the shared prefixes' (cascade.cascade_decode_attention's ops, in its order):
  // out_n [rows, heads, head_dim], lse_n [rows, heads] over each row's own positions; shared as plan_decode
  // made it (row_bias: SharedPrefixes.bias_for this model's group size and the cache's dtype)
  Tensor with_shared_prefixes(const Tensor& out_n, const Tensor& lse_n, const Tensor& q, const Layer& layer,
                              const std::vector<Tensor>& shared) const {
    const Tensor &tables = shared[0], &member_rows = shared[1], &row_bias = shared[2], &rows = shared[3],
                 &slots = shared[4], &empty = shared[5];
    const int64_t num_seqs = q.size(0), group_size = num_heads_ / num_kv_heads_, d = head_dim_;
    const int64_t num_groups = member_rows.size(0), max_members = member_rows.size(1);
    Tensor out = out_n.to(at::kFloat).view({num_seqs, num_kv_heads_, group_size, d});
    const Tensor lse = lse_n.view({num_seqs, num_kv_heads_, group_size});
    const Tensor q_rows = q.to(at::kFloat).reshape({num_seqs, num_kv_heads_, group_size, d});
    const Tensor& k_cache = layer.k_cache;
    const Tensor& v_cache = layer.v_cache;
    const Tensor k_shared = k_cache.index_select(0, tables.reshape(-1)).view({num_groups, -1, num_kv_heads_, d});
    const Tensor v_shared = v_cache.index_select(0, tables.reshape(-1)).view({num_groups, -1, num_kv_heads_, d});
    const int64_t rows_per_group = max_members * group_size;
    Tensor q_groups = q_rows.index_select(0, member_rows.reshape(-1));
    q_groups = q_groups.view({num_groups, max_members, num_kv_heads_, group_size, d}).transpose(1, 2);
    auto flash = at::_scaled_dot_product_flash_attention_for_cpu(
        q_groups.reshape({num_groups, num_kv_heads_, rows_per_group, d}).to(k_cache.scalar_type()),
        k_shared.transpose(1, 2), v_shared.transpose(1, 2), 0.0, false, row_bias, scale_);
    Tensor out_s = std::get<0>(flash).to(at::kFloat);
    out_s = out_s.view({num_groups, num_kv_heads_, max_members, group_size, d}).transpose(1, 2);
    out_s = out_s.reshape({num_groups * max_members, num_kv_heads_, group_size, d}).index_select(0, slots);
    Tensor lse_s = std::get<1>(flash).view({num_groups, num_kv_heads_, max_members, group_size}).transpose(1, 2);
    lse_s = lse_s.reshape({num_groups * max_members, num_kv_heads_, group_size}).index_select(0, slots);
    if (empty.numel() > 0) {  // a row that sees nothing shared gets weight 0
      lse_s = lse_s.masked_fill(empty.index({torch::indexing::Slice(), torch::indexing::None, torch::indexing::None}),
                                -std::numeric_limits<double>::infinity());
    }
    const Tensor out_p = out.index_select(0, rows), lse_p = lse.index_select(0, rows);
    const Tensor lse_all = at::logaddexp(lse_p, lse_s);
    const Tensor merged = out_p * at::exp(lse_p - lse_all).unsqueeze(-1) + out_s * at::exp(lse_s - lse_all).unsqueeze(-1);
    out.index_copy_(0, rows, merged);
    return out.reshape({num_seqs, num_heads_, d}).to(q.scalar_type());
  }

  // qkv with each head of q and of k RMS-normed over head_dim: llama.Attention._norm_heads
  Tensor norm_heads(const Layer& layer, const Tensor& qkv, const Tensor& none) {
    const int64_t tokens = qkv.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    Tensor q_rows = qkv.narrow(1, 0, q_size).reshape({-1, head_dim_}).contiguous();
    Tensor k_rows = qkv.narrow(1, q_size, kv_size).reshape({-1, head_dim_}).contiguous();
    const Tensor q = ops_.add_rms_norm(none, q_rows, layer.q_norm, eps_);
    const Tensor k = ops_.add_rms_norm(none, k_rows, layer.k_norm, eps_);
    return at::cat({q.view({tokens, -1}), k.view({tokens, -1}), qkv.narrow(1, q_size + kv_size, kv_size)}, 1);
  }

  const pagedserve::FusedOpsEntries ops_;
  const pagedserve::GroupedMatmulEntries matmul_;
  const pagedserve::PagedDecodeEntries attention_;
  const int64_t num_heads_, num_kv_heads_, head_dim_;
  const double eps_, scale_;
  const Tensor first_norm_;  // layer 0's input norm
  std::vector<Layer> layers_;
  bool profiling_ = false;
  std::array<double, kParts> seconds_{};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pagedserve::kReleaseGil;
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<const py::capsule&, const py::capsule&, const py::capsule&, const py::dict&, const Tensor&>())
      .def("add_layer", &DecodeStep::add_layer, "one decoder layer's weights, norms, caches and kind (a dict)")
      .def("set_profiling", &DecodeStep::set_profiling, "time each part of the layers from now on (or stop)")
      .def("profile", &DecodeStep::profile, "seconds per part (matmul, attention, norms, elementwise) while profiling")
      .def("forward", &DecodeStep::forward, kReleaseGil,
           "the decoder layers over a decode step's embedded rows -> the final norm of the residual (CPU)");
}
