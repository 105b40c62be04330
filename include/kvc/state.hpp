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
// What a payload holds is each cache's own: Cache::transfer, EncoderDecoderCache::transfer and
// PagedCache::transfer_request write it or read it aside. This header is the file around it.
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
inline constexpr std::int64_t state_format_version = 6;

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
  detail::save_stream(os, [&](auto& ar) { cache.transfer(ar); });
}
// Writes the cache's state to the file `path` (through path.tmp, renamed over it). kvc::StateError
// when the file cannot be written (an existing file is then left as it was).
template <class C>
void save(const C& cache, const std::filesystem::path& path) {
  detail::save_file(path, [&](auto& ar) { cache.transfer(ar); });
}

// Replaces the cache's state by the saved one. The target must be of the same type: the same
// element type, the same layer kinds with the same parameters (a pre-built cache: layer for layer;
// a replicated one takes the file's layer count), and wherever a target layer is initialized, the
// same shape. Anything else, or a truncated, corrupted or foreign file: kvc::StateError, and the
// cache is unchanged.
template <class C>
void load(C& cache, std::istream& is) {
  detail::load_stream(is, [&](auto& ar) { return cache.transfer(ar); });
}
// Replaces the cache's state by the one in the file `path`. kvc::StateError when it is not a
// regular file, cannot be opened, or does not match (the cache is then unchanged).
template <class C>
void load(C& cache, const std::filesystem::path& path) {
  detail::load_file(path, [&](auto& ar) { return cache.transfer(ar); });
}

// The payload alone (no length, no checksum) into any Sink, layer after layer: what kvc::mpi sends.
template <class C, class Sink>
void write_state(const C& cache, Sink& sink) {
  detail::state_writer<Sink> ar(sink);
  cache.transfer(ar);
}

// Reads write_state's payload from a Source into a contiguous cache one layer at a time: a layer
// is in the cache (and usable) as soon as load_next has returned for it. Each layer keeps the
// strong guarantee; a failure leaves the layers loaded before it in place.
template <class C, class Source>
class StateLoader {
 public:
  // Reads the payload's header from `source` and checks it against `cache` (an empty state empties
  // the cache at once); kvc::StateError when it does not match or is malformed.
  StateLoader(C& cache, Source& source) : cache_(cache), ar_(source) {
    layers_ = cache_.transfer_header(ar_);
    if (layers_ == 0) cache_.transfer_end(0);  // an empty state empties the cache
  }

  // The number of layers the state holds.
  std::int64_t layers() const noexcept { return layers_; }
  // The number of layers loaded into the cache so far.
  std::int64_t loaded() const noexcept { return loaded_; }
  // Whether every layer of the state is loaded.
  bool done() const noexcept { return loaded_ == layers_; }

  // Loads the next layer into the cache (the last one also drops layers past the state's count).
  // kvc::StateError when every layer is loaded already or the layer does not match (the cache
  // keeps the layers loaded before it).
  void load_next() {
    if (done()) throw StateError("kvc::StateLoader: every layer is loaded already");
    cache_.transfer_layer(ar_, loaded_);
    ++loaded_;
    if (done()) cache_.transfer_end(layers_);
  }
  // Loads layers until `layer` is in the cache (nothing when it already is).
  void load_through(std::int64_t layer) {
    if (layer < 0 || layer >= layers_)
      throw IndexError("kvc::StateLoader: layer " + std::to_string(layer) + " is not one of the " +
                       std::to_string(layers_) + " layers of the state");
    while (loaded_ <= layer) load_next();
  }
  // Loads every layer not loaded yet; throws as load_next.
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
  detail::save_stream(os, [&](auto& ar) { cache.transfer_request(ar, request_id); });
}
// Writes the request's state to the file `path` (through path.tmp). ValueError for an offloaded
// request; kvc::StateError when the file cannot be written.
template <class S>
void save_request(const PagedCache<S>& cache, const std::string& request_id, const std::filesystem::path& path) {
  detail::save_file(path, [&](auto& ar) { cache.transfer_request(ar, request_id); });
}
// Allocates the request's blocks in `cache` (which must not hold request_id) and fills them. On any
// error, kvc::StateError and nothing allocated.
template <class S>
void load_request(PagedCache<S>& cache, const std::string& request_id, std::istream& is) {
  detail::load_stream(is, [&](auto& ar) { return cache.transfer_request(ar, request_id); });
}
// Loads a request saved by save_request from the file `path` under `request_id`. kvc::StateError
// for a file that cannot be read or does not match, and nothing allocated.
template <class S>
void load_request(PagedCache<S>& cache, const std::string& request_id, const std::filesystem::path& path) {
  detail::load_file(path, [&](auto& ar) { return cache.transfer_request(ar, request_id); });
}

// The payloads alone, for kvc::mpi.
template <class S, class Sink>
void write_request(const PagedCache<S>& cache, const std::string& request_id, Sink& sink) {
  detail::state_writer<Sink> ar(sink);
  cache.transfer_request(ar, request_id);
}
// Reads write_request's payload from `source` into `cache` under `request_id`. kvc::StateError
// when it does not match the cache, and nothing allocated.
template <class S, class Source>
void read_request(PagedCache<S>& cache, const std::string& request_id, Source& source) {
  detail::state_reader<Source> ar(source);
  cache.transfer_request(ar, request_id).commit();
}

}  // namespace kvc
