#pragma once
// The machinery under kvc's saved state (include/kvc/state.hpp, docs/state.md): the checksum, the
// channels the bytes travel through, and the two archives every layer kind's `transfer` member
// is written against.
//
// A layer kind describes its state once, in `template <class A> void transfer(A& ar)`, as a
// sequence of archive calls (a parameter, a few scalars, its K/V rows). state_writer runs that
// sequence reading the state and putting bytes into a Sink; state_reader runs the same sequence
// getting bytes from a Source and writing them into a fresh state, checking each value as it
// comes. So the two directions cannot drift apart, and the reader's gets mirror the writer's
// puts exactly, in size and order (kvc::mpi relies on that to batch the small ones).
//
//   Sink:   void put(const void* data, std::size_t bytes);
//   Source: void get(void* data, std::size_t bytes);   throws StateError if it cannot
//           std::uint64_t available() const;            an upper bound on the bytes still to come
//           void prefetch(std::uint64_t bytes);         optional: makes sure `bytes` more can be
//                                                       read (reading them ahead), or throws
//
// The reader never allocates more than the source can still deliver, so a hostile file cannot
// make it allocate more than the file's own size. A source that cannot know its length (a pipe)
// offers prefetch: the reader reads a buffer's bytes ahead before allocating it, so what it
// allocates is bounded by the bytes that really arrived.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <kvc/element_types.hpp>
#include <kvc/errors.hpp>
#include <kvc/float8.hpp>
#include <kvc/limits.hpp>
#include <kvc/detail/row_code_types.hpp>
#include <kvc/tensor.hpp>

namespace kvc::detail {

static_assert(std::endian::native == std::endian::little,
              "kvc's state format is little-endian, and this platform is not: kvc::save/load need a byte swap here");

// ---- checksum ------------------------------------------------------------------------------------

// XXH64 (Yann Collet's xxHash, 64-bit variant, as its specification defines it): fast enough
// (several GB/s) that checking a loaded file costs little next to reading it.
namespace xxh {
inline constexpr std::uint64_t p1 = 0x9E3779B185EBCA87ULL, p2 = 0xC2B2AE3D27D4EB4FULL, p3 = 0x165667B19E3779F9ULL,
                               p4 = 0x85EBCA77C2B2AE63ULL, p5 = 0x27D4EB2F165667C5ULL;
inline std::uint64_t read64(const unsigned char* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline std::uint32_t read32(const unsigned char* p) noexcept {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline std::uint64_t round(std::uint64_t acc, std::uint64_t lane) noexcept {
  return std::rotl(acc + lane * p2, 31) * p1;
}
inline std::uint64_t merge(std::uint64_t acc, std::uint64_t v) noexcept { return (acc ^ round(0, v)) * p1 + p4; }
}  // namespace xxh

inline std::uint64_t xxh64(const void* data, std::size_t len, std::uint64_t seed) noexcept {
  using namespace xxh;
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + len;
  std::uint64_t h;
  if (len >= 32) {
    std::uint64_t v1 = seed + p1 + p2, v2 = seed + p2, v3 = seed, v4 = seed - p1;
    for (; end - p >= 32; p += 32) {
      v1 = round(v1, read64(p));
      v2 = round(v2, read64(p + 8));
      v3 = round(v3, read64(p + 16));
      v4 = round(v4, read64(p + 24));
    }
    h = std::rotl(v1, 1) + std::rotl(v2, 7) + std::rotl(v3, 12) + std::rotl(v4, 18);
    h = merge(merge(merge(merge(h, v1), v2), v3), v4);
  } else {
    h = seed + p5;
  }
  h += static_cast<std::uint64_t>(len);
  for (; end - p >= 8; p += 8) h = std::rotl(h ^ round(0, read64(p)), 27) * p1 + p4;
  if (end - p >= 4) {
    h = std::rotl(h ^ (static_cast<std::uint64_t>(read32(p)) * p1), 23) * p2 + p3;
    p += 4;
  }
  for (; p < end; ++p) h = std::rotl(h ^ (static_cast<std::uint64_t>(*p) * p5), 11) * p1;
  h ^= h >> 33;
  h *= p2;
  h ^= h >> 29;
  h *= p3;
  h ^= h >> 32;
  return h;
}

// ---- channels ------------------------------------------------------------------------------------

// Counts what a writer would put (the payload length a file's header announces).
struct counting_sink {
  std::uint64_t bytes = 0;
  void put(const void*, std::size_t n) noexcept { bytes += n; }
};

// Chains every put (get) into a running XXH64: h = xxh64(piece, h). Writer and reader see the same
// pieces, so they reach the same value.
template <class Sink>
struct hashing_sink {
  Sink& inner;
  std::uint64_t hash = 0;
  void put(const void* p, std::size_t n) {
    hash = xxh64(p, n, hash);
    inner.put(p, n);
  }
};
template <class Source>
struct hashing_source {
  Source& inner;
  std::uint64_t hash = 0;
  void get(void* p, std::size_t n) {
    inner.get(p, n);
    hash = xxh64(p, n, hash);
  }
  std::uint64_t available() const { return inner.available(); }
  void prefetch(std::uint64_t bytes)
    requires requires(Source& s, std::uint64_t n) { s.prefetch(n); }
  {
    inner.prefetch(bytes);
  }
};

// ---- archives ------------------------------------------------------------------------------------

// What both archives share: the context a reader's messages name ("layer 3 (StaticLayer)").
class archive_context {
 public:
  void set_context(std::string c) { context_ = std::move(c); }
  const std::string& context() const noexcept { return context_; }

 protected:
  std::string where() const { return context_.empty() ? std::string("the state") : context_; }
  std::string context_;
};

template <class Sink>
class state_writer : public archive_context {
 public:
  static constexpr bool loading = false;
  explicit state_writer(Sink& sink) noexcept : sink_(sink) {}
  Sink& sink() noexcept { return sink_; }

  // Empty pieces never reach the sink (their pointer may be null), nor the source below.
  void raw(const void* p, std::size_t n) {
    if (n > 0) sink_.put(p, n);
  }
  // An integer, bool or enum, as 8 bytes.
  template <class V>
  void value(const V& v) {
    std::int64_t x;
    if constexpr (std::is_enum_v<V>)
      x = static_cast<std::int64_t>(static_cast<std::underlying_type_t<V>>(v));
    else
      x = static_cast<std::int64_t>(v);
    raw(&x, sizeof x);
  }
  void text(std::string_view s) {
    value(static_cast<std::int64_t>(s.size()));
    raw(s.data(), s.size());
  }
  // A configuration value the reader compares with its own: name and value.
  void param(std::string_view name, std::int64_t v) {
    text(name);
    value(v);
  }
  // An invariant the reader checks; nothing to write.
  void check(bool, std::string_view) const noexcept {}

  // K and V of the store's slots [from, from + len): the shape, then every (batch, head) row.
  template <class Store>
  void kv(Store& store, std::int64_t from, std::int64_t len, std::int64_t /*capacity on load*/) {
    const LayerShape s = store.shape();
    value(s.batch);
    value(s.heads);
    value(s.key_head_dim);
    value(s.value_head_dim);
    if (len == 0) return;
    const auto kb = store.key_blocks(), vb = store.value_blocks();
    rows(kb.data, s, kb.stride_h, s.key_head_dim, from, len);
    rows(vb.data, s, vb.stride_h, s.value_head_dim, from, len);
  }
  // A buffer of `count` elements: the count, then the elements.
  template <class Buffer>
  void buffer(Buffer& b, std::int64_t count) {
    value(count);
    if (count > 0) raw(b.data(), static_cast<std::size_t>(count) * sizeof(*b.data()));
  }
  template <class T>
  void array(std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    value(static_cast<std::int64_t>(v.size()));
    if (!v.empty()) raw(v.data(), v.size() * sizeof(T));
  }

 private:
  // One piece per (batch, head) row, whatever the capacities: the reader's pieces must be the same.
  template <class T>
  void rows(const T* data, const LayerShape& s, std::int64_t stride_h, std::int64_t d, std::int64_t from,
            std::int64_t len) {
    const auto row = static_cast<std::size_t>(len * d) * sizeof(T);
    if (row == 0) return;
    for (std::int64_t i = 0; i < s.batch * s.heads; ++i) raw(data + i * stride_h + from * d, row);
  }

  Sink& sink_;
};

template <class Source>
class state_reader : public archive_context {
 public:
  static constexpr bool loading = true;
  explicit state_reader(Source& source) noexcept : source_(source) {}
  Source& source() noexcept { return source_; }

  [[noreturn]] void fail(std::string_view what) const {
    throw StateError(join_message({"kvc::load: ", where(), ": ", what}));
  }

  void raw(void* p, std::size_t n) {
    if (n > 0) source_.get(p, n);
  }
  template <class V>
  void value(V& v) {
    std::int64_t x;
    raw(&x, sizeof x);
    if constexpr (std::is_same_v<V, bool>) {
      if (x != 0 && x != 1) fail("a flag is " + std::to_string(x) + ", not 0 or 1");
      v = x == 1;
    } else if constexpr (std::is_enum_v<V>) {
      v = static_cast<V>(static_cast<std::underlying_type_t<V>>(x));
    } else {
      if (x < static_cast<std::int64_t>(std::numeric_limits<V>::min()) ||
          x > static_cast<std::int64_t>(std::numeric_limits<V>::max()))
        fail("the value " + std::to_string(x) + " is out of range");
      v = static_cast<V>(x);
    }
  }
  // A size: 0 <= x <= max_extent.
  std::int64_t size(std::string_view what) {
    std::int64_t x;
    value(x);
    if (x < 0 || x > max_extent)
      fail(join_message({what, " is ", std::to_string(x), ", outside [0, ", std::to_string(max_extent), "]"}));
    return x;
  }
  std::string text() {
    const std::int64_t n = size("a name's length");
    if (n > 4096) fail("a name of " + std::to_string(n) + " bytes is longer than any kvc writes");
    std::string s(static_cast<std::size_t>(n), '\0');
    raw(s.data(), s.size());
    return s;
  }
  void param(std::string_view name, std::int64_t v) {
    const std::string got = text();
    if (got != name) fail(join_message({"the file has a parameter '", got, "' where kvc expects '", name, "'"}));
    std::int64_t x;
    value(x);
    if (x != v)
      fail(join_message({name, " is ", std::to_string(x), " in the file and ", std::to_string(v), " in the cache"}));
  }
  void check(bool ok, std::string_view what) const {
    if (!ok) fail(join_message({"the saved state is inconsistent (", what, ")"}));
  }
  // Refuses an allocation of `bytes` that the rest of the source cannot fill (a source of unknown
  // length reads them ahead first).
  void reserve(std::uint64_t bytes, std::string_view what) const {
    if (bytes > source_.available())
      fail(join_message({what, " would need ", std::to_string(bytes), " bytes, and only ",
                         std::to_string(source_.available()), " remain"}));
    if constexpr (requires { source_.prefetch(bytes); }) source_.prefetch(bytes);
  }

  // A new store of `capacity` slots whose slots [0, len) come from the source.
  template <class Store>
  void kv(Store& store, std::int64_t /*from*/, std::int64_t len, std::int64_t capacity) {
    LayerShape s;
    s.batch = size("the batch size");
    s.heads = size("the head count");
    s.key_head_dim = size("the key head_dim");
    s.value_head_dim = size("the value head_dim");
    // The layer's capacity on load is at most twice what the file holds (a static sliding layer's
    // window in its buffer of 2W), so the allocation stays within twice the file's bytes.
    check(len >= 0 && len <= max_extent && len <= capacity && capacity <= 2 * len,
          "more tokens than the layer has room for");
    using T = typename Store::T;
    // The buffers the store allocates (capacity tokens of both head_dims) within the allocation limit.
    std::int64_t elements = 0, bytes = 0;
    if (!products_fit({s.batch, s.heads, capacity, s.key_head_dim, s.value_head_dim}) ||
        !mul_fits(s.batch * s.heads * capacity, s.key_head_dim + s.value_head_dim, elements) ||
        !mul_fits(elements, static_cast<std::int64_t>(sizeof(T)), bytes) || bytes > allocation_limit())
      fail(join_message({"a layer of batch ", std::to_string(s.batch), ", ", std::to_string(s.heads), " heads, ",
                         std::to_string(capacity), " tokens, key head_dim ", std::to_string(s.key_head_dim),
                         " and value head_dim ", std::to_string(s.value_head_dim),
                         " is larger than kvc's allocation limit of ", std::to_string(allocation_limit()), " bytes"}));
    reserve(static_cast<std::uint64_t>(s.batch * s.heads * len * (s.key_head_dim + s.value_head_dim)) * sizeof(T),
            "the layer's keys and values");
    Store fresh(s, capacity, len < capacity);
    if (len > 0) {
      auto kb = fresh.key_blocks(), vb = fresh.value_blocks();
      rows(kb.data, s, kb.stride_h, s.key_head_dim, len);
      rows(vb.data, s, vb.stride_h, s.value_head_dim, len);
    }
    store = std::move(fresh);
  }
  template <class Buffer>
  void buffer(Buffer& b, std::int64_t count) {
    const std::int64_t n = size("a buffer's length");
    if (n != count)
      fail("a buffer holds " + std::to_string(n) + " elements where its shape needs " + std::to_string(count));
    using T = std::remove_cvref_t<decltype(*b.data())>;
    reserve(static_cast<std::uint64_t>(n) * sizeof(T), "a buffer");
    Buffer fresh(checked_elements({n}, sizeof(T)));
    if (n > 0) raw(fresh.data(), static_cast<std::size_t>(n) * sizeof(T));
    b = std::move(fresh);
  }
  template <class T>
  void array(std::vector<T>& v) {
    const std::int64_t n = size("an array's length");
    reserve(static_cast<std::uint64_t>(n) * sizeof(T), "an array");
    std::vector<T> fresh(static_cast<std::size_t>(n));
    if (n > 0) raw(fresh.data(), fresh.size() * sizeof(T));
    v = std::move(fresh);
  }

 private:
  template <class T>
  void rows(T* data, const LayerShape& s, std::int64_t stride_h, std::int64_t d, std::int64_t len) {
    const auto row = static_cast<std::size_t>(len * d) * sizeof(T);
    if (row == 0) return;  // (else the reserve above bounds batch * heads by the bytes left)
    for (std::int64_t i = 0; i < s.batch * s.heads; ++i) raw(data + i * stride_h, row);
  }

  Source& source_;
};

// Calls `state.transfer(ar)` on a state the writer only reads (transfer is one non-const member
// for both directions; the writer's archive calls never modify it).
template <class Archive, class State>
void transfer(Archive& ar, const State& state) {
  static_assert(!Archive::loading);
  const_cast<State&>(state).transfer(ar);
}

// ---- what every payload shares (the caches' transfer members) ----------------------------------

template <class T>
constexpr std::string_view state_element_name() {
  if constexpr (std::is_same_v<T, float8_e4m3>)
    return "float8_e4m3";
  else if constexpr (std::is_same_v<T, float8_e5m2>)
    return "float8_e5m2";
  else if constexpr (is_row_code_v<T>)
    return T::name;
  else
    return element_name<T>();
}

// The fingerprint entries both directions share: the writer writes v, the reader reads a text and
// compares it with v ("<what> is '<file>' in the file and '<v>' in the cache").
template <class A>
void same_text(A& ar, std::string_view what, std::string_view v) {
  if constexpr (A::loading) {
    const std::string got = ar.text();
    if (got != v) ar.fail(join_message({what, " is '", got, "' in the file and '", v, "' in the cache"}));
  } else {
    ar.text(v);
  }
}

template <class S>
void check_host_storage() {
  static_assert(S::space == memory_space::host,
                "kvc::save/kvc::load: only caches in host memory are saved; copy a device cache to a host cache "
                "of the same layer kinds first (docs/state.md)");
}

// What a payload starts with, both directions: its type and the storage's element type.
template <class S, class A>
void state_header(A& ar, std::string_view type) {
  check_host_storage<S>();
  ar.set_context("");
  same_text(ar, "the cache type", type);
  same_text(ar, "the element type", state_element_name<typename S::element_type>());
  ar.param("element_size", static_cast<std::int64_t>(sizeof(typename S::element_type)));
}

inline std::string shape_words(const LayerShape& s) {
  return join_message({"batch ", std::to_string(s.batch), ", ", std::to_string(s.heads), " heads, key head_dim ",
                       std::to_string(s.key_head_dim), " and value head_dim ", std::to_string(s.value_head_dim)});
}

}  // namespace kvc::detail
