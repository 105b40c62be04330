#pragma once
// How a paged cache groups a model's layers: transformers' group_layers_by_attn_type
// (generation/continuous_batching/cache.py at a597f974). Layers are bucketed by attention type in
// the order each type first appears; every bucket is cut into consecutive groups of
// gcd(bucket sizes) layers; groups are listed type by type. A group's index is what block hashes,
// read/write index lists and block tables are keyed by, so the order is part of the contract.
// Layers at the same position of different groups share one K and one V pool tensor.
//
// A paged cache also serves layers with linear-attention states (group_paged_layers): a
// "linear_attention" or "conv" layer holds per-request conv and recurrent states and no keys and
// values, so it joins no group; a "hybrid" layer is a full-attention layer with states, a
// "hybrid_sliding" one a sliding-window layer with states. The groups are then made from the
// attention layers alone (transformers' continuous batching refuses these models).

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
  std::vector<std::int64_t> state_layers;         // layers with linear-attention states, ascending
  std::int64_t num_layers = 0;                    // the model's layers, with and without keys and values
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
  out.num_layers = static_cast<std::int64_t>(layer_types.size());
  for (const auto& b : buckets) out.group_size = std::gcd(out.group_size, static_cast<std::int64_t>(b.size()));
  for (std::size_t b = 0; b < buckets.size(); ++b)
    for (std::size_t at = 0; at < buckets[b].size(); at += static_cast<std::size_t>(out.group_size)) {
      out.groups.emplace_back(buckets[b].begin() + static_cast<std::ptrdiff_t>(at),
                              buckets[b].begin() + static_cast<std::ptrdiff_t>(at) + out.group_size);
      out.types.push_back(order[b]);
    }
  return out;
}

// Groups a paged cache's layers: the attention layers as group_layers_by_attn_type does ("hybrid"
// counted as "full_attention", "hybrid_sliding" as "sliding_attention"), and the layers with
// linear-attention states ("linear_attention", "conv" and the two hybrids) listed in
// state_layers. Other types group under their own name (the cache refuses them).
inline LayerGroups group_paged_layers(std::span<const std::string> layer_types) {
  std::vector<std::string> attention;
  std::vector<std::int64_t> index;  // the model layer of each entry of `attention`
  std::vector<std::int64_t> states;
  for (std::size_t i = 0; i < layer_types.size(); ++i) {
    const std::string& t = layer_types[i];
    const auto layer = static_cast<std::int64_t>(i);
    const bool hybrid = t == "hybrid" || t == "hybrid_sliding";
    if (hybrid || t == "linear_attention" || t == "conv") states.push_back(layer);
    if (t == "linear_attention" || t == "conv") continue;
    attention.push_back(t == "hybrid" ? "full_attention" : t == "hybrid_sliding" ? "sliding_attention" : t);
    index.push_back(layer);
  }
  LayerGroups out = group_layers_by_attn_type(std::span<const std::string>(attention));
  for (auto& g : out.groups)
    for (std::int64_t& l : g) l = index[static_cast<std::size_t>(l)];
  out.state_layers = std::move(states);
  out.num_layers = static_cast<std::int64_t>(layer_types.size());
  return out;
}

// The layer types a paged cache sees for `config`: config.layer_types, or, without them, every
// layer "sliding_attention" when config.sliding_window is set and "full_attention" otherwise.
inline std::vector<std::string> paged_layer_types(const ModelConfig& config) {
  if (config.layer_types) return *config.layer_types;
  return std::vector<std::string>(static_cast<std::size_t>(std::max<std::int64_t>(config.num_hidden_layers, 0)),
                                  config.sliding_window ? "sliding_attention" : "full_attention");
}

// Groups the layers a paged cache sees for `config` (paged_layer_types(config)): group_paged_layers.
inline LayerGroups group_paged_layers(const ModelConfig& config) {
  const std::vector<std::string> types = paged_layer_types(config);
  return group_paged_layers(std::span<const std::string>(types));
}

}  // namespace kvc::paged
