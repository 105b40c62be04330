#pragma once
// What the offload engine (offload/engine.hpp) and its tiers share about a layer's buffers:
// reaching them through the layer state's for_each_buffer (required by kvc::concepts::CacheLayer),
// and holding a buffer aside (read back from a tier, or pooled) with a tag that checks it goes
// back to a buffer of the same type.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvc::detail::offload_buffers {

template <class B>
inline constexpr char type_tag = 0;

struct held_base {
  virtual ~held_base() = default;
  const void* tag = nullptr;
  std::int64_t count = 0;  // elements
  std::byte* bytes = nullptr;
  std::size_t size = 0;  // bytes
};

// A buffer of type B held by an engine, outside any layer.
template <class B>
struct held_buffer final : held_base {
  B buf;
  held_buffer() noexcept { tag = &type_tag<B>; }
  explicit held_buffer(std::int64_t n) : buf(n) {
    tag = &type_tag<B>;
    refresh();
  }
  void refresh() noexcept {
    count = buf.size();
    bytes = reinterpret_cast<std::byte*>(buf.data());
    size = sizeof(*buf.data()) * static_cast<std::size_t>(buf.size());
  }
};
// One entry per buffer of a layer, in for_each_buffer order; null for buffers that are empty.
using held_layer = std::vector<std::unique_ptr<held_base>>;

template <class B>
std::size_t buffer_bytes(B& b) noexcept {
  return sizeof(*b.data()) * static_cast<std::size_t>(b.size());
}

template <class St>
concept has_buffers = requires(St& l) { l.for_each_buffer([](auto&) {}); };

// Calls f(buffer&) for every buffer of layer i, if its state exposes them (a state that does not is
// never offloaded).
template <class Cache, class F>
void for_each_buffer_of(Cache& cache, std::int64_t i, F&& f) {
  cache.visit_layer(i, [&](auto& l) {
    if constexpr (has_buffers<std::decay_t<decltype(l)>>) l.for_each_buffer(f);
  });
}

// Where layer i's bytes are, buffer by buffer (for_each_buffer order): what an engine copies out.
struct layer_pieces {
  std::vector<std::pair<const std::byte*, std::size_t>> pieces;
  std::vector<std::int64_t> sizes;  // bytes of each buffer
  std::int64_t total = 0;
};
template <class Cache>
layer_pieces pieces_of(Cache& cache, std::int64_t i) {
  layer_pieces out;
  for_each_buffer_of(cache, i, [&](auto& b) {
    const std::size_t n = buffer_bytes(b);
    out.pieces.emplace_back(reinterpret_cast<const std::byte*>(b.data()), n);
    out.sizes.push_back(static_cast<std::int64_t>(n));
    out.total += static_cast<std::int64_t>(n);
  });
  return out;
}

// Buffers for layer i shaped as `sizes` (bytes of each buffer, for_each_buffer order) says: null
// for an empty one, else make(std::type_identity<B>{}, elements), which returns a held buffer of
// type B (newly allocated, or from an engine's pool).
template <class Cache, class Make>
held_layer stage_layer(Cache& cache, std::int64_t i, const std::vector<std::int64_t>& sizes, Make&& make) {
  held_layer out;
  out.reserve(sizes.size());
  std::size_t k = 0;
  for_each_buffer_of(cache, i, [&](auto& b) {
    using B = std::remove_reference_t<decltype(b)>;
    const std::int64_t bytes = k < sizes.size() ? sizes[k] : 0;
    ++k;
    if (bytes == 0)
      out.emplace_back();
    else
      out.push_back(make(std::type_identity<B>{}, bytes / static_cast<std::int64_t>(sizeof(*b.data()))));
  });
  return out;
}

// Moves `held` (one entry per buffer of layer i, null for an empty one) into layer i's buffers,
// which must all be empty (an offloaded layer's). False, with nothing moved, when they do not fit:
// another number of buffers, a buffer of another type, or a layer that is not empty.
template <class Cache>
bool install_held(Cache& cache, std::int64_t i, held_layer& held) {
  bool fits = true;
  std::size_t k = 0;
  for_each_buffer_of(cache, i, [&](auto& b) {
    using B = std::remove_reference_t<decltype(b)>;
    if (k >= held.size() || (held[k] && held[k]->tag != &type_tag<B>) || b.size() != 0) fits = false;
    ++k;
  });
  if (!fits || k != held.size()) return false;
  k = 0;
  for_each_buffer_of(cache, i, [&](auto& b) {
    using B = std::remove_reference_t<decltype(b)>;
    if (auto& h = held[k++]) {
      std::swap(static_cast<held_buffer<B>&>(*h).buf, b);
      h.reset();
    }
  });
  return true;
}

// Calls f(bytes, size) for each non-empty held buffer, in order.
template <class F>
void for_each_held(const held_layer& held, F&& f) {
  for (const auto& h : held)
    if (h) f(h->bytes, h->size);
}

// An engine's per-cache state, created on first use: copies deep-copy it through Core::clone() (an
// engine's copy semantics), moves move the pointer.
template <class Core>
class cloned_core {
 public:
  cloned_core() noexcept = default;
  cloned_core(const cloned_core& other) : p_(other.p_ ? other.p_->clone() : nullptr) {}
  cloned_core(cloned_core&&) noexcept = default;
  cloned_core& operator=(const cloned_core& other) {
    if (this != &other) {
      cloned_core copy(other);
      p_.swap(copy.p_);
    }
    return *this;
  }
  cloned_core& operator=(cloned_core&&) noexcept = default;
  ~cloned_core() = default;

  // The state, created with `args` the first time.
  template <class... Args>
  Core& get(Args&&... args) {
    if (!p_) p_ = std::make_unique<Core>(std::forward<Args>(args)...);
    return *p_;
  }
  Core* operator->() const noexcept { return p_.get(); }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  std::unique_ptr<Core> p_;
};

}  // namespace kvc::detail::offload_buffers
