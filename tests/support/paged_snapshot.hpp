#pragma once
// Everything a caller can observe of a kvc::PagedCache's state (blocks, tables, free lists, pools,
// swap pool, prefix statistic, the requests' keys), for tests that check that a refused or failed call changed nothing.

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include <kvc/paged/paged_cache.hpp>

namespace kvc_test {

struct paged_snapshot {
  std::int64_t free_blocks = 0, free_swap = 0, prefix = 0;
  std::vector<std::int64_t> uninit, init;
  std::vector<std::map<std::string, std::vector<std::int64_t>>> tables;
  std::vector<std::string> names;  // every request the cache knows: key, id, and whether it is open
  std::vector<float> keys, values;
  std::vector<bool> offloaded;      // is_offloaded of each request named
  std::vector<std::string> blocks;  // each block's repr and ref count, and whether its hash is registered
  std::int64_t free_state_slots = 0, free_swap_state_slots = 0, state_snapshots = 0;
  std::vector<std::vector<float>> states;  // per request named: its slot, then each state and its flag
  bool operator==(const paged_snapshot&) const = default;
};

template <class Cache>
paged_snapshot take_paged_snapshot(const Cache& c, const std::vector<std::string>& requests) {
  paged_snapshot s;
  s.free_blocks = c.get_num_free_blocks();
  s.free_swap = c.free_swap_blocks();
  s.prefix = c.total_prefix_length();
  s.uninit = c.manager().uninitialized_blocks();
  s.init = c.manager().initialized_blocks();
  for (std::int64_t g = 0; g < c.num_groups(); ++g) {
    std::map<std::string, std::vector<std::int64_t>> t;
    for (const std::string& r : c.block_tables().requests(g)) t[r] = c.block_table(g, r);
    s.tables.push_back(std::move(t));
  }
  for (const kvc::paged::RequestKey k : c.block_tables().names().keys())
    s.names.push_back(std::to_string(k.index) + "." + std::to_string(k.generation) + " " + c.request_name(k) +
                      (c.block_tables().names().opened(k) ? " open" : ""));
  const std::int64_t n = (c.num_blocks() + 2) * c.block_size() * c.num_key_value_heads();
  for (std::int64_t j = 0; j < c.group_size(); ++j) {
    s.keys.insert(s.keys.end(), c.key_pool(j), c.key_pool(j) + n * c.row_width());
    s.values.insert(s.values.end(), c.value_pool(j), c.value_pool(j) + n * c.value_row_width());
  }
  for (const std::string& r : requests) s.offloaded.push_back(c.is_offloaded(r));
  s.free_state_slots = c.free_state_slots();
  s.free_swap_state_slots = c.free_swap_state_slots();
  if constexpr (requires { c.num_state_snapshots(); }) s.state_snapshots = c.num_state_snapshots();
  for (const std::string& r : requests) {
    const std::int64_t slot = c.state_slot(r);
    s.states.push_back({static_cast<float>(slot)});
    if (slot < 0) continue;
    for (const std::int64_t l : c.state_layers())
      for (std::int64_t i = 0; i < c.states_per_layer(); ++i) {
        for (const auto& v : {c.conv_state(r, l, i), c.recurrent_state(r, l, i)})
          s.states.emplace_back(v.data(), v.data() + (v.rank > 0 ? v.size() : 0));
        s.states.push_back({c.has_previous_state(r, l, i) ? 1.f : 0.f});
      }
  }
  for (std::int64_t b = 0; b < c.num_blocks(); ++b) {
    const kvc::paged::Block* block = c.manager().block(b);
    if (!block) {
      s.blocks.emplace_back();
      continue;
    }
    const bool registered = block->hash && c.manager().find_hash(*block->hash) == b;
    s.blocks.push_back(kvc::paged::block_repr(*block) + " refs " + std::to_string(block->ref_count) +
                       (registered ? " registered" : ""));
  }
  return s;
}

}  // namespace kvc_test
