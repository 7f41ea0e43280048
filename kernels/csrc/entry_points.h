// The C++ kernels' functions as another kernel module calls them, with no Python in between.
//
// A module that others call exports a struct of pointers to its own functions as a Python capsule
// (its `entry_points` attribute), named after the struct. A caller (decode_step.cpp) is handed the
// capsule once, checks its name, and calls through the pointers. The functions are the very ones the
// module's Python bindings call, built with that module's own flags (fused_ops: -ffp-contract=off),
// so the caller computes what the Python path computes, to the bit.
#pragma once

#include <torch/extension.h>

#include <cstring>
#include <vector>

namespace pagedserve {

struct FusedOpsEntries {  // kernels/csrc/fused_ops.cpp
  static constexpr const char* kName = "pagedserve.fused_ops";
  torch::Tensor (*add_rms_norm)(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                                double eps);
  std::vector<torch::Tensor> (*rope_qkv)(const torch::Tensor& qkv, const torch::Tensor& positions,
                                         const torch::Tensor& cos, const torch::Tensor& sin, int64_t num_q_heads,
                                         int64_t num_kv_heads);
  torch::Tensor (*silu_and_mul)(const torch::Tensor& gate_up);
};

struct GroupedMatmulEntries {  // kernels/csrc/grouped_matmul.cpp
  static constexpr const char* kName = "pagedserve.grouped_matmul";
  torch::Tensor (*grouped_matmul)(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                                  const torch::Tensor& scale_units, const torch::Tensor& zero,
                                  const torch::Tensor& zero_units, const torch::Tensor& table, int64_t group);
};

struct PagedDecodeEntries {  // kernels/csrc/paged_decode.cpp
  static constexpr const char* kName = "pagedserve.paged_decode";
  std::vector<torch::Tensor> (*paged_decode)(const torch::Tensor& q, const torch::Tensor& k_cache,
                                             const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                             const torch::Tensor& starts, const torch::Tensor& ends, double scale);
  void (*write_kv)(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache,
                   torch::Tensor& v_cache, const torch::Tensor& slot_mapping);
};

// the capsule a module exports: `entries` must live as long as the module (a static)
template <typename Entries>
py::capsule export_entries(const Entries* entries) {
  return py::capsule(static_cast<const void*>(entries), Entries::kName);
}

// the struct in a capsule from export_entries; raises (ValueError) for any other capsule
template <typename Entries>
const Entries* import_entries(const py::capsule& capsule) {
  const char* name = capsule.name();
  TORCH_CHECK_VALUE(name != nullptr && std::strcmp(name, Entries::kName) == 0, "expected the capsule ",
                    Entries::kName, ", got ", name == nullptr ? "an unnamed one" : name);
  return static_cast<const Entries*>(capsule.get_pointer());
}

}  // namespace pagedserve
