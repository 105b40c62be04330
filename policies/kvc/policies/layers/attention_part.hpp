#pragma once
// detail::with_attention_part<A>: the K/V part of a composed layer state (a linear-attention hybrid,
// an indexed layer) and the members such a state answers from it unchanged. The composed state
// derives from it and adds its own part (linear states, indexer keys).

#include <cstdint>
#include <utility>

#include <kvc/tensor.hpp>

namespace kvc::detail {

template <class A>
class with_attention_part {
 public:
  const A& attention_part() const noexcept { return attn_; }

  bool is_initialized() const noexcept { return attn_.is_initialized(); }
  LayerShape shape() const noexcept { return attn_.shape(); }
  std::int64_t get_seq_length() const noexcept { return attn_.get_seq_length(); }
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t q) const noexcept {
    return attn_.get_mask_sizes(q);
  }
  std::int64_t get_max_length() const noexcept { return attn_.get_max_length(); }
  auto stored() const noexcept { return attn_.stored(); }

 protected:
  explicit with_attention_part(A attn) : attn_(std::move(attn)) {}

  A attn_;
};

}  // namespace kvc::detail
