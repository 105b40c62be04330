#pragma once
// How a paged cache groups a model's layers: transformers' group_layers_by_attn_type
// (generation/continuous_batching/cache.py at a597f974). Layers are bucketed by attention type in
// the order each type first appears; every bucket is cut into consecutive groups of
// gcd(bucket sizes) layers; groups are listed type by type. A group's index is what block hashes,
// read/write index lists and block tables are keyed by, so the order is part of the contract.
// Layers at the same position of different groups share one K and one V pool tensor.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <kvc/config.hpp>
#include <kvc/errors.hpp>

namespace kvc::paged {

// A model's layers grouped by attention type (group_layers_by_attn_type's result): the groups in
// order, each group's type, and the common group size.
struct LayerGroups {
  std::vector<std::vector<std::int64_t>> groups;  // layer indices of each group
  std::vector<std::string> types;                 // the attention type of each group
  std::int64_t group_size = 0;                    // layers per group (the gcd)
};

// Groups `layer_types` (one entry per layer). Any type string groups; the cache accepts only
// "full_attention" and "sliding_attention" (PagedCache checks that, with transformers' message).
inline LayerGroups group_layers_by_attn_type(std::span<const std::string> layer_types) {
  std::vector<std::string> order;
  std::vector<std::vector<std::int64_t>> buckets;
  for (std::size_t i = 0; i < layer_types.size(); ++i) {
    std::size_t b = 0;
    while (b < order.size() && order[b] != layer_types[i]) ++b;
    if (b == order.size()) {
      order.push_back(layer_types[i]);
      buckets.emplace_back();
    }
    buckets[b].push_back(static_cast<std::int64_t>(i));
  }
  LayerGroups out;
  for (const auto& b : buckets) out.group_size = std::gcd(out.group_size, static_cast<std::int64_t>(b.size()));
  for (std::size_t b = 0; b < buckets.size(); ++b)
    for (std::size_t at = 0; at < buckets[b].size(); at += static_cast<std::size_t>(out.group_size)) {
      out.groups.emplace_back(buckets[b].begin() + static_cast<std::ptrdiff_t>(at),
                              buckets[b].begin() + static_cast<std::ptrdiff_t>(at) + out.group_size);
      out.types.push_back(order[b]);
    }
  return out;
}

// The layer types a paged cache sees for `config`: config.layer_types, or, without them, every
// layer "sliding_attention" when config.sliding_window is set and "full_attention" otherwise.
inline std::vector<std::string> paged_layer_types(const ModelConfig& config) {
  if (config.layer_types) return *config.layer_types;
  return std::vector<std::string>(static_cast<std::size_t>(std::max<std::int64_t>(config.num_hidden_layers, 0)),
                                  config.sliding_window ? "sliding_attention" : "full_attention");
}

// Groups the layers a paged cache sees for `config` (paged_layer_types(config)) by attention type.
inline LayerGroups group_layers_by_attn_type(const ModelConfig& config) {
  const std::vector<std::string> types = paged_layer_types(config);
  return group_layers_by_attn_type(std::span<const std::string>(types));
}

}  // namespace kvc::paged
