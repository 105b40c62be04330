#pragma once
// Saved cache state (docs/state.md): kvc::save / kvc::load for every contiguous cache (any layer
// kinds: dynamic, sliding, static, quantized, linear-attention and hybrid, indexed) and for
// EncoderDecoderCache, kvc::save_request / kvc::load_request for one request of a PagedCache, and
// the streaming pieces under them (write_state, StateLoader, write_request, read_request) that
// kvc::mpi sends between ranks (<kvc/mpi.hpp>).
//
// A file: "KVCSTATE", the format version, the payload's length, the payload, and the XXH64 of the
// payload. The payload starts with a fingerprint of the cache type (what it is, the element type,
// the layer count) and then has every layer: its kind's name, its kind's parameters, its counters
// and the tokens it holds. Loading checks each of these against the target cache as it comes,
// builds the new layers aside, checks the checksum, and only then swaps them in: a load that
// throws (kvc::StateError, naming what differs) leaves the cache as it was.
//
// Host storages only: a device cache is saved by copying it to a host cache of the same kinds.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <kvc/cache.hpp>
#include <kvc/detail/state_io.hpp>
#include <kvc/element_types.hpp>
#include <kvc/encoder_decoder_cache.hpp>
#include <kvc/errors.hpp>
#include <kvc/float8.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/paged_cache.hpp>

namespace kvc {

namespace detail {

inline constexpr std::array<char, 8> state_magic{'K', 'V', 'C', 'S', 'T', 'A', 'T', 'E'};
inline constexpr std::int64_t state_format_version = 1;

template <class T>
constexpr std::string_view state_element_name() {
  if constexpr (std::is_same_v<T, float8_e4m3>)
    return "float8_e4m3";
  else if constexpr (std::is_same_v<T, float8_e5m2>)
    return "float8_e5m2";
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

// The private parts of Cache, EncoderDecoderCache and PagedCache that saving and loading reach.
struct state_access {
  // ---- Cache -----------------------------------------------------------------------------------

  template <class L, class S, class O>
  static const auto& layers(const Cache<L, S, O>& c) {
    c.before_access(-1);  // every layer resident (an offload engine keeps nothing away afterwards)
    return c.layers_;
  }

  // What a payload starts with, both directions: its type and the storage's element type.
  template <class S, class A>
  static void type_header(A& ar, std::string_view type) {
    check_host_storage<S>();
    ar.set_context("");
    same_text(ar, "the cache type", type);
    same_text(ar, "the element type", state_element_name<typename S::element_type>());
    ar.param("element_size", static_cast<std::int64_t>(sizeof(typename S::element_type)));
  }

  template <class L, class S, class O, class A>
  static void write_cache(const Cache<L, S, O>& c, A& ar) {
    const auto& ls = layers(c);
    type_header<S>(ar, "Cache");
    ar.value(static_cast<std::int64_t>(ls.size()));
    for (std::size_t i = 0; i < ls.size(); ++i) write_layer(c, static_cast<std::int64_t>(i), ar);
  }
  template <class L, class S, class O, class A>
  static void write_layer(const Cache<L, S, O>& c, std::int64_t i, A& ar) {
    std::visit(
        [&](const auto& l) {
          ar.text(l.name);
          transfer(ar, l);
        },
        c.layers_[static_cast<std::size_t>(i)]);
  }

  // Reads the header; returns the number of layers that follow (checked against the cache).
  template <class L, class S, class O, class A>
  static std::int64_t read_cache_header(const Cache<L, S, O>& c, A& ar) {
    type_header<S>(ar, "Cache");
    const std::int64_t n = ar.size("the layer count");
    if (n > max_layers)
      ar.fail("the file has " + std::to_string(n) + " layers, above kvc's limit of " + std::to_string(max_layers));
    if (!Cache<L, S, O>::replicated && n != c.size())
      ar.fail("the file has " + std::to_string(n) + " layers and the cache " + std::to_string(c.size()));
    return n;
  }

  // Layer i of the stream, built aside as the cache's layer i (or its prototype's copy) would be.
  template <class L, class S, class O, class A>
  static typename Cache<L, S, O>::layer_variant read_layer(const Cache<L, S, O>& c, std::int64_t i, A& ar) {
    using C = Cache<L, S, O>;
    const auto idx = static_cast<std::size_t>(i);
    ar.set_context("layer " + std::to_string(i));
    const std::string name = ar.text();
    const auto build = [&](const auto& target) -> typename C::layer_variant {
      using St = std::decay_t<decltype(target)>;
      if (name != St::name) ar.fail(join_message({"the file holds a ", name, " and the cache a ", St::name}));
      ar.set_context(join_message({"layer ", std::to_string(i), " (", St::name, ")"}));
      St fresh(target.kind());
      try {
        fresh.transfer(ar);
      } catch (const ValueError& e) {  // a layer kind's own size checks: the file is at fault
        ar.fail(e.what());
      }
      if constexpr (requires { target.shape(); }) {
        if (target.is_initialized() && fresh.is_initialized() && !(target.shape() == fresh.shape()))
          ar.fail(join_message(
              {"the file holds ", shape_words(fresh.shape()), ", and the cache ", shape_words(target.shape())}));
      }
      return typename C::layer_variant(std::in_place_type<St>, std::move(fresh));
    };
    if constexpr (C::replicated) {
      using St = typename C::template state_of<boost::mp11::mp_front<typename C::kinds>>;
      if (idx < c.layers_.size()) return std::visit(build, c.layers_[idx]);
      return build(St(c.prototype_));
    } else {
      return std::visit(build, c.layers_[idx]);
    }
  }

  static std::string shape_words(const LayerShape& s) {
    return join_message({"batch ", std::to_string(s.batch), ", ", std::to_string(s.heads), " heads, key head_dim ",
                         std::to_string(s.key_head_dim), " and value head_dim ", std::to_string(s.value_head_dim)});
  }

  // Replaces layer i (appending it, and the prototype's copies before it, in a replicated cache).
  // Only the reserve can throw, before anything changes.
  template <class L, class S, class O>
  static void install(Cache<L, S, O>& c, std::int64_t i, typename Cache<L, S, O>::layer_variant& layer) {
    c.before_access(-1);
    const auto idx = static_cast<std::size_t>(i);
    if (idx >= c.layers_.size()) {
      if constexpr (Cache<L, S, O>::replicated) {
        if (c.layers_.capacity() <= idx) c.layers_.reserve(std::max(idx + 1, 2 * c.layers_.capacity()));
        while (c.layers_.size() < idx) c.layers_.emplace_back(std::in_place_index<0>, c.prototype_);
        c.layers_.push_back(std::move(layer));
        return;
      }
    }
    c.layers_[idx].swap(layer);
  }
  // Keeps the first n layers (a replicated cache loaded from a file with fewer layers).
  template <class L, class S, class O>
  static void truncate(Cache<L, S, O>& c, std::int64_t n) noexcept {
    if (static_cast<std::size_t>(n) < c.layers_.size())
      c.layers_.erase(c.layers_.begin() + static_cast<std::ptrdiff_t>(n), c.layers_.end());
  }

  template <class L, class S, class O, class A>
  static auto read_cache(Cache<L, S, O>& c, A& ar) {
    using C = Cache<L, S, O>;
    c.before_access(-1);  // before the swap: the offload engine then holds nothing away
    const std::int64_t n = read_cache_header(c, ar);
    std::vector<typename C::layer_variant> next;  // grows as layers arrive: n is the file's word
    for (std::int64_t i = 0; i < n; ++i) next.push_back(read_layer(c, i, ar));
    return pending_layers<C>{&c, std::move(next)};
  }
  // A whole cache read aside; commit() swaps it in and cannot throw.
  template <class C>
  struct pending_layers {
    C* target;
    std::vector<typename C::layer_variant> layers;
    void commit() noexcept { target->layers_.swap(layers); }
  };

  // ---- EncoderDecoderCache ---------------------------------------------------------------------

  template <class SC, class CC, class A>
  static void write_cache(const EncoderDecoderCache<SC, CC>& c, A& ar) {
    same_text(ar, "the cache type", "EncoderDecoderCache");
    write_cache(c.self_, ar);
    write_cache(c.cross_, ar);
    ar.value(static_cast<std::int64_t>(c.is_updated_.size()));
    for (const auto& [layer, updated] : c.is_updated_) {
      ar.value(layer);
      ar.value(updated);
    }
  }
  template <class SC, class CC, class A>
  static auto read_cache(EncoderDecoderCache<SC, CC>& c, A& ar) {
    ar.set_context("");
    same_text(ar, "the cache type", "EncoderDecoderCache");
    auto self = read_cache(c.self_, ar);
    auto cross = read_cache(c.cross_, ar);
    ar.set_context("is_updated");
    const std::int64_t n = ar.size("the is_updated count");
    if (n > max_layers) ar.fail("more entries than kvc's limit of layers");
    std::map<std::int64_t, bool> updated;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t layer = ar.size("a layer index");
      bool u = false;
      ar.value(u);
      updated[layer] = u;
    }
    struct pending {
      decltype(self) s;
      decltype(cross) x;
      EncoderDecoderCache<SC, CC>* target;
      std::map<std::int64_t, bool> updated;
      void commit() noexcept {
        s.commit();
        x.commit();
        target->is_updated_.swap(updated);
      }
    };
    return pending{std::move(self), std::move(cross), &c, std::move(updated)};
  }

  // ---- PagedCache requests ---------------------------------------------------------------------

  template <class S, class A>
  static void paged_header(const PagedCache<S>& c, const std::string& id, A& ar) {
    type_header<S>(ar, "PagedRequest");
    ar.set_context("request " + id);
    ar.param("block_size", c.block_size_);
    ar.param("kv_heads", c.kv_heads_);
    ar.param("head_dim", c.head_dim_);
    ar.param("layers_per_group", static_cast<std::int64_t>(c.keys_.size()));
    ar.param("groups", static_cast<std::int64_t>(c.groups_.types.size()));
    for (std::size_t g = 0; g < c.groups_.types.size(); ++g)
      same_text(ar, "group " + std::to_string(g) + "'s attention type", c.groups_.types[g]);
  }

  // Every block of the request, pool after pool (K then V), each block head after head.
  template <class S, class A, class Blocks>
  static void paged_blocks(const PagedCache<S>& c, A& ar, const Blocks& blocks) {
    using T = typename S::element_type;
    const std::int64_t piece = c.block_size_ * c.head_dim_, pitch = c.pool_rows() * c.head_dim_;
    for (auto* pools : {&c.keys_, &c.values_})
      for (const auto& pool : *pools)
        for (const std::int64_t b : blocks)
          for (std::int64_t h = 0; h < c.kv_heads_; ++h)
            ar.raw(const_cast<T*>(pool.data()) + h * pitch + b * piece, static_cast<std::size_t>(piece) * sizeof(T));
  }
  template <class S>
  static std::vector<std::int64_t> request_blocks(const PagedCache<S>& c, const std::string& id,
                                                  std::vector<std::int64_t>* counts) {
    std::vector<std::int64_t> blocks;
    for (const auto& a : c.allocators_)
      std::visit(
          [&](const auto& al) {
            const std::int64_t n = al.has_request(id) ? std::ssize(al.table(id)) : 0;
            if (counts) counts->push_back(n);
            if (n > 0) blocks.insert(blocks.end(), al.table(id).begin(), al.table(id).end());
          },
          a);
    return blocks;
  }

  template <class S, class A>
  static void write_request(const PagedCache<S>& c, const std::string& id, A& ar) {
    if (c.is_offloaded(id))
      throw ValueError("kvc::save_request: request " + id + " is offloaded: restore_request it first");
    paged_header(c, id, ar);
    std::vector<std::int64_t> counts;
    const std::vector<std::int64_t> blocks = request_blocks(c, id, &counts);
    for (const std::int64_t n : counts) ar.value(n);
    paged_blocks(c, ar, blocks);
  }

  // The request's blocks, allocated and filled; commit() keeps them, and destruction without a
  // commit frees them again (the cache as it was: the request held none).
  template <class S>
  struct pending_request {
    PagedCache<S>* target = nullptr;
    std::string id;
    pending_request(PagedCache<S>* t, std::string i) : target(t), id(std::move(i)) {}
    pending_request(pending_request&& o) noexcept : target(std::exchange(o.target, nullptr)), id(std::move(o.id)) {}
    pending_request& operator=(pending_request&&) = delete;
    ~pending_request() {
      if (target) target->free_blocks(id);
    }
    void commit() noexcept { target = nullptr; }
  };
  template <class S, class A>
  static pending_request<S> read_request(PagedCache<S>& c, const std::string& id, A& ar) {
    ar.set_context("request " + id);
    if (c.is_offloaded(id) || c.blocks_in_use(id) > 0)
      ar.fail("the cache already holds this request; free_blocks it first");
    paged_header(c, id, ar);
    std::vector<std::int64_t> counts(c.allocators_.size());
    std::int64_t most = 0, total = 0;
    for (std::int64_t& n : counts) {
      n = ar.size("a group's block count");
      most = std::max(most, n);
      total += n;
    }
    ar.check(total <= c.num_blocks(), "more blocks than the cache has");
    ar.reserve(static_cast<std::uint64_t>(total) * static_cast<std::uint64_t>(c.bytes_per_block()),
               "the request's blocks");
    pending_request<S> out(nullptr, id);
    if (most > 0) {
      if (!c.allocate_blocks(most, id, 0))
        ar.fail("the request needs " + std::to_string(total) + " free blocks and the cache has " +
                std::to_string(c.get_num_free_blocks()));
      out.target = &c;
    }
    std::vector<std::int64_t> got;
    const std::vector<std::int64_t> blocks = request_blocks(c, id, &got);
    if (got != counts) ar.fail("the cache's groups would give the request other block counts than the file's");
    paged_blocks(c, ar, blocks);
    return out;
  }
};

inline std::string hex(std::uint64_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s = "0x0000000000000000";
  for (int i = 17; i >= 2; --i, v >>= 4) s[static_cast<std::size_t>(i)] = digits[v & 15];
  return s;
}

// The file around a payload: magic, version, length, payload, checksum.
struct ostream_sink {
  std::ostream& os;
  void put(const void* p, std::size_t n) {
    os.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
    if (!os) throw StateError("kvc::save: writing the state failed");
  }
};
// The payload of a stream. A stream of unknown length (a pipe, a FIFO, standard input) can announce
// more than it holds; for it, prefetch reads a buffer's bytes ahead before the reader allocates the
// buffer, into a read-ahead that grows only as bytes arrive.
struct istream_source {
  std::istream& is;
  std::uint64_t left;       // announced and not yet taken
  bool measured = true;     // the stream's length was checked against `left`
  std::vector<char> ahead;  // read ahead, from `next` on
  std::size_t next = 0;

  istream_source(std::istream& stream, std::uint64_t announced, bool length_checked)
      : is(stream), left(announced), measured(length_checked) {}

  void get(void* p, std::size_t n) {
    if (n > left) throw StateError("kvc::load: the state is truncated: its contents run past the announced length");
    const std::size_t from_ahead = std::min(n, ahead.size() - next);
    if (from_ahead > 0) std::memcpy(p, ahead.data() + next, from_ahead);
    next += from_ahead;
    read(static_cast<char*>(p) + from_ahead, n - from_ahead);
    left -= n;
  }
  std::uint64_t available() const noexcept { return left; }
  void prefetch(std::uint64_t bytes) {
    if (measured) return;
    std::size_t have = ahead.size() - next;
    if (have >= bytes) return;
    ahead.erase(ahead.begin(), ahead.begin() + static_cast<std::ptrdiff_t>(next));
    next = 0;
    // Doubles at most what has arrived (64 KiB to start): the read-ahead never holds more than
    // twice the bytes the stream really delivered.
    while (have < bytes) {
      const std::uint64_t step = std::min<std::uint64_t>(bytes - have, std::max<std::size_t>(have, 65536));
      ahead.resize(have + static_cast<std::size_t>(step));
      read(ahead.data() + have, static_cast<std::size_t>(step));
      have += static_cast<std::size_t>(step);
    }
  }

 private:
  void read(char* p, std::size_t n) {
    if (n == 0) return;
    is.read(p, static_cast<std::streamsize>(n));
    if (static_cast<std::size_t>(is.gcount()) != n) throw StateError("kvc::load: the file is truncated");
  }
};

template <class Write>
void save_stream(std::ostream& os, Write&& write) {
  counting_sink counter;
  {
    state_writer<counting_sink> ar(counter);
    write(ar);
  }
  ostream_sink out{os};
  out.put(state_magic.data(), state_magic.size());
  const std::int64_t head[2] = {state_format_version, static_cast<std::int64_t>(counter.bytes)};
  out.put(head, sizeof head);
  hashing_sink<ostream_sink> hashed{out};
  {
    state_writer<hashing_sink<ostream_sink>> ar(hashed);
    write(ar);
  }
  out.put(&hashed.hash, sizeof hashed.hash);
  os.flush();
  if (!os) throw StateError("kvc::save: writing the state failed");
}

// The bytes left in a seekable stream, or nullopt.
inline std::optional<std::uint64_t> bytes_left(std::istream& is) {
  const auto here = is.tellg();
  if (here < 0) return std::nullopt;
  is.seekg(0, std::ios::end);
  const auto end = is.tellg();
  is.seekg(here);
  if (end < 0 || !is) {
    is.clear();
    return std::nullopt;
  }
  return static_cast<std::uint64_t>(end - here);
}

// Reads a file's payload with read(ar) -> pending, checks the checksum, and commits.
template <class Read>
void load_stream(std::istream& is, Read&& read) {
  std::array<char, 8> magic{};
  is.read(magic.data(), magic.size());
  if (static_cast<std::size_t>(is.gcount()) != magic.size() || magic != state_magic)
    throw StateError("kvc::load: not a kvc state (it does not start with KVCSTATE)");
  std::int64_t head[2] = {0, 0};
  is.read(reinterpret_cast<char*>(head), sizeof head);
  if (static_cast<std::size_t>(is.gcount()) != sizeof head) throw StateError("kvc::load: the file is truncated");
  if (head[0] != state_format_version)
    throw StateError("kvc::load: the state has format version " + std::to_string(head[0]) +
                     ", and this kvc reads version " + std::to_string(state_format_version));
  const auto payload = static_cast<std::uint64_t>(head[1]);
  if (head[1] < 0) throw StateError("kvc::load: the state announces a negative length");
  const auto left = bytes_left(is);
  if (left && *left < payload + sizeof(std::uint64_t))
    throw StateError("kvc::load: the file is truncated: it announces " + std::to_string(payload) +
                     " bytes of state and a checksum, and " + std::to_string(*left) + " bytes follow");
  istream_source in(is, payload, left.has_value());
  hashing_source<istream_source> hashed{in};
  state_reader<hashing_source<istream_source>> ar(hashed);
  auto pending = read(ar);
  if (in.left != 0)
    throw StateError("kvc::load: the state announces " + std::to_string(payload) + " bytes and its contents end " +
                     std::to_string(in.left) + " bytes earlier");
  std::uint64_t stored = 0;
  in.left = sizeof stored;
  in.get(&stored, sizeof stored);
  if (stored != hashed.hash)
    throw StateError("kvc::load: the checksum does not match: the state is corrupted (stored " + hex(stored) +
                     ", computed " + hex(hashed.hash) + ")");
  pending.commit();
}

// Writes to path.tmp and renames it over path: a failed save leaves an existing file as it was.
template <class Write>
void save_file(const std::filesystem::path& path, Write&& write) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream os(tmp, std::ios::binary | std::ios::trunc);
    if (!os) throw StateError("kvc::save: cannot open " + tmp.string() + " for writing");
    try {
      save_stream(os, write);
    } catch (...) {
      os.close();
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      throw;
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw StateError("kvc::save: cannot rename " + tmp.string() + " to " + path.string() + ": " + ec.message());
}
template <class Read>
void load_file(const std::filesystem::path& path, Read&& read) {
  // Not a FIFO or a device: opening one can wait for a writer forever, and its length is unknown.
  std::error_code ec;
  const auto type = std::filesystem::status(path, ec).type();
  if (!ec && type != std::filesystem::file_type::regular)
    throw StateError("kvc::load: " + path.string() + " is not a regular file");
  std::ifstream is(path, std::ios::binary);
  if (!is) throw StateError("kvc::load: cannot open " + path.string());
  load_stream(is, read);
}

}  // namespace detail

// ---- contiguous caches and EncoderDecoderCache --------------------------------------------------

// Writes the cache's state to a stream or a file (a file is written whole to path.tmp first and
// renamed over path).
template <class C>
void save(const C& cache, std::ostream& os) {
  detail::save_stream(os, [&](auto& ar) { detail::state_access::write_cache(cache, ar); });
}
template <class C>
void save(const C& cache, const std::filesystem::path& path) {
  detail::save_file(path, [&](auto& ar) { detail::state_access::write_cache(cache, ar); });
}

// Replaces the cache's state by the saved one. The target must be of the same type: the same
// element type, the same layer kinds with the same parameters (a pre-built cache: layer for layer;
// a replicated one takes the file's layer count), and wherever a target layer is initialized, the
// same shape. Anything else, or a truncated, corrupted or foreign file: kvc::StateError, and the
// cache is unchanged.
template <class C>
void load(C& cache, std::istream& is) {
  detail::load_stream(is, [&](auto& ar) { return detail::state_access::read_cache(cache, ar); });
}
template <class C>
void load(C& cache, const std::filesystem::path& path) {
  detail::load_file(path, [&](auto& ar) { return detail::state_access::read_cache(cache, ar); });
}

// The payload alone (no length, no checksum) into any Sink, layer after layer: what kvc::mpi sends.
template <class C, class Sink>
void write_state(const C& cache, Sink& sink) {
  detail::state_writer<Sink> ar(sink);
  detail::state_access::write_cache(cache, ar);
}

// Reads write_state's payload from a Source into a contiguous cache one layer at a time: a layer
// is in the cache (and usable) as soon as load_next has returned for it. Each layer keeps the
// strong guarantee; a failure leaves the layers loaded before it in place.
template <class C, class Source>
class StateLoader {
 public:
  StateLoader(C& cache, Source& source) : cache_(cache), ar_(source) {
    layers_ = detail::state_access::read_cache_header(cache_, ar_);
    if (layers_ == 0) detail::state_access::truncate(cache_, 0);  // an empty state empties the cache
  }

  std::int64_t layers() const noexcept { return layers_; }
  std::int64_t loaded() const noexcept { return loaded_; }
  bool done() const noexcept { return loaded_ == layers_; }

  void load_next() {
    if (done()) throw StateError("kvc::StateLoader: every layer is loaded already");
    auto layer = detail::state_access::read_layer(cache_, loaded_, ar_);
    detail::state_access::install(cache_, loaded_, layer);
    ++loaded_;
    if (done()) detail::state_access::truncate(cache_, layers_);
  }
  // Loads layers until `layer` is in the cache (nothing when it already is).
  void load_through(std::int64_t layer) {
    if (layer < 0 || layer >= layers_)
      throw IndexError("kvc::StateLoader: layer " + std::to_string(layer) + " is not one of the " +
                       std::to_string(layers_) + " layers of the state");
    while (loaded_ <= layer) load_next();
  }
  void load_all() {
    while (!done()) load_next();
  }

 private:
  C& cache_;
  detail::state_reader<Source> ar_;
  std::int64_t layers_ = 0;
  std::int64_t loaded_ = 0;
};

// ---- one request of a PagedCache ----------------------------------------------------------------

// The request's blocks, every layer: saved, it can be loaded into another PagedCache of the same
// configuration (block size, heads, head_dim, layer groups, element type), under any request id.
// The tokens' positions are the caller's (the scheduler's) to keep, as with offload_request.
template <class S>
void save_request(const PagedCache<S>& cache, const std::string& request_id, std::ostream& os) {
  detail::save_stream(os, [&](auto& ar) { detail::state_access::write_request(cache, request_id, ar); });
}
template <class S>
void save_request(const PagedCache<S>& cache, const std::string& request_id, const std::filesystem::path& path) {
  detail::save_file(path, [&](auto& ar) { detail::state_access::write_request(cache, request_id, ar); });
}
// Allocates the request's blocks in `cache` (which must not hold request_id) and fills them. On any
// error, kvc::StateError and nothing allocated.
template <class S>
void load_request(PagedCache<S>& cache, const std::string& request_id, std::istream& is) {
  detail::load_stream(is, [&](auto& ar) { return detail::state_access::read_request(cache, request_id, ar); });
}
template <class S>
void load_request(PagedCache<S>& cache, const std::string& request_id, const std::filesystem::path& path) {
  detail::load_file(path, [&](auto& ar) { return detail::state_access::read_request(cache, request_id, ar); });
}

// The payloads alone, for kvc::mpi.
template <class S, class Sink>
void write_request(const PagedCache<S>& cache, const std::string& request_id, Sink& sink) {
  detail::state_writer<Sink> ar(sink);
  detail::state_access::write_request(cache, request_id, ar);
}
template <class S, class Source>
void read_request(PagedCache<S>& cache, const std::string& request_id, Source& source) {
  detail::state_reader<Source> ar(source);
  detail::state_access::read_request(cache, request_id, ar).commit();
}

}  // namespace kvc
