#pragma once
// How kvc reads JSON (config.json, generation_config.json, cache descriptions): one parser for
// every reader, with the bounds docs/limits.md documents.
//  - parse_json<J>(text, who): nlohmann's SAX parser feeding kvc's own document builder, which
//    refuses documents nested deeper than max_json_depth (kvc's messages and copies recurse over
//    the document) and builds objects in linear time also for nlohmann::ordered_json, whose own
//    builder looks every key up in a vector (quadratic in the keys of an object). Duplicate keys
//    keep the last value at the first key's place, as Python's json.load does.
//  - read_json_file(path, who): the text of a regular file of at most max_json_file_bytes.
//  - json_integer(v): an integer that fits in int64, or nothing (an unsigned above 2^63 - 1, a
//    float, anything else), so that no reader wraps 18446744073709551615 around to -1.
//  - json_excerpt(v): a value as messages quote it, at most 64 bytes.

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <kvc/errors.hpp>

namespace kvc {

// The deepest nesting of arrays and objects kvc reads.
inline constexpr std::size_t max_json_depth = 128;
// The largest JSON file from_file reads (16 MiB: real config files are well under 1 MiB, and the
// parsed document of a 16 MiB file can take about 250 MiB, docs/limits.md).
inline constexpr std::int64_t max_json_file_bytes = std::int64_t{16} << 20;

namespace detail {

// Builds a J from nlohmann's SAX events (see the header comment).
template <class J>
class json_builder {
 public:
  explicit json_builder(std::string_view who) : who_(who) {}

  J take() { return std::move(root_); }

  bool null() { return value(J(nullptr)); }
  bool boolean(bool b) { return value(J(b)); }
  bool number_integer(typename J::number_integer_t v) { return value(J(v)); }
  bool number_unsigned(typename J::number_unsigned_t v) { return value(J(v)); }
  bool number_float(typename J::number_float_t v, const typename J::string_t&) { return value(J(v)); }
  bool string(typename J::string_t& v) { return value(J(std::move(v))); }
  bool binary(typename J::binary_t&) { return value(J()); }  // only binary formats (CBOR, ...) have them
  bool start_object(std::size_t) { return open(J::object()); }
  bool start_array(std::size_t) { return open(J::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(typename J::string_t& k) {
    frame& f = stack_.back();
    auto& object = f.node->template get_ref<typename J::object_t&>();
    if constexpr (std::is_same_v<J, nlohmann::ordered_json>) {
      // ordered_map is a vector of pairs: find a duplicate through an index once the object has
      // more than a few keys, then append.
      // (ordered_map's operator[] takes a key: entries are reached through iterators.)
      const auto entry = [&](std::size_t i) -> auto& { return *(object.begin() + static_cast<std::ptrdiff_t>(i)); };
      std::size_t at = object.size();
      if (f.index.empty() && object.size() >= 16)
        for (std::size_t i = 0; i < object.size(); ++i) f.index.emplace(entry(i).first, i);
      if (!f.index.empty()) {
        const auto it = f.index.find(k);
        if (it != f.index.end()) at = it->second;
      } else {
        for (std::size_t i = 0; i < object.size() && at == object.size(); ++i)
          if (entry(i).first == k) at = i;
      }
      if (at == object.size()) {
        if (!f.index.empty()) f.index.emplace(k, at);
        object.emplace_back(std::move(k), J());
      }
      f.slot = &entry(at).second;
    } else {
      f.slot = &object[std::move(k)];
    }
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    // Rethrown as the type nlohmann's own parser throws (parse_error, out_of_range for a number
    // too large for a double), so the readers' messages stay the parser's.
    if (e.id >= 400 && e.id < 500) throw static_cast<const nlohmann::detail::out_of_range&>(e);
    throw static_cast<const nlohmann::detail::parse_error&>(e);
  }

 private:
  struct frame {
    J* node = nullptr;
    J* slot = nullptr;  // objects: the value of the last key
    std::unordered_map<std::string, std::size_t> index;
  };

  // Where the next value goes.
  J& place() {
    if (stack_.empty()) return root_;
    frame& f = stack_.back();
    if (f.node->is_array()) {
      f.node->push_back(J());
      return f.node->back();
    }
    return *f.slot;
  }
  bool value(J&& v) {
    place() = std::move(v);
    return true;
  }
  bool open(J&& container) {
    if (stack_.size() >= max_json_depth)
      throw ValueError(join_message({who_, ": the JSON nests arrays and objects deeper than kvc's limit of ",
                                     std::to_string(max_json_depth), " levels"}));
    J& at = place();
    at = std::move(container);
    stack_.push_back(frame{&at, nullptr, {}});
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }

  std::string_view who_;
  J root_;
  std::vector<frame> stack_;
};

// Parses `text` as J (nlohmann::json or nlohmann::ordered_json). Malformed JSON throws the parser's
// nlohmann exception; nesting deeper than max_json_depth throws ValueError("{who}: ...").
template <class J>
J parse_json(std::string_view text, std::string_view who) {
  json_builder<J> builder(who);
  J::sax_parse(text.begin(), text.end(), &builder);
  return builder.take();
}

// The text of a JSON file: RuntimeError("{who}: cannot open '{path}'") when it cannot be opened,
// RuntimeError for something that is not a regular file (a FIFO or a device would block or never
// end) and for a read error, ValueError for a file above max_json_file_bytes. The file is opened
// without blocking and checked through its descriptor, so it cannot be swapped for a FIFO between
// the check and the read.
inline std::string read_json_file(const std::filesystem::path& path, std::string_view who) {
  const std::string name = path.string();
  const auto fail = [&](std::string_view what) {
    return RuntimeError(join_message({who, ": ", what, " '", name, "'"}));
  };
  const int fd = ::open(name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw fail("cannot open");
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } guard{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw fail("cannot read");
  if (!S_ISREG(st.st_mode)) throw RuntimeError(join_message({who, ": '", name, "' is not a regular file"}));
  const auto too_large = [&](std::string_view size) {
    return ValueError(join_message({who, ": '", name, "' holds ", size, " bytes, above kvc's limit of ",
                                    std::to_string(max_json_file_bytes), " bytes for a JSON file"}));
  };
  if (st.st_size > max_json_file_bytes) throw too_large(std::to_string(st.st_size));
  // Read until the end, and stop one byte past the limit: a file that grew since it was measured is
  // refused too, and nothing is allocated beyond what the file holds.
  std::string text;
  text.reserve(static_cast<std::size_t>(st.st_size));
  char chunk[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw fail("cannot read");
    if (n == 0) return text;
    text.append(chunk, static_cast<std::size_t>(n));
    if (static_cast<std::int64_t>(text.size()) > max_json_file_bytes)
      throw too_large("more than " + std::to_string(max_json_file_bytes));
  }
}

// An integer that fits in int64 (see the header comment).
template <class J>
std::optional<std::int64_t> json_integer(const J& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.template get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
    return static_cast<std::int64_t>(u);
  }
  if (v.is_number_integer()) return v.template get<std::int64_t>();
  return std::nullopt;
}

// A JSON value as messages quote it: at most 64 bytes, cut on a UTF-8 boundary.
template <class J>
std::string json_excerpt(const J& v) {
  std::string s = v.dump(-1, ' ', false, J::error_handler_t::replace);
  if (s.size() <= 64) return s;
  std::size_t cut = 61;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  s.resize(cut);
  return s + "...";
}

}  // namespace detail
}  // namespace kvc
