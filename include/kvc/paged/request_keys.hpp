#pragma once
// kvc::paged::RequestKey and RequestNames: how a paged cache names its requests. Its block tables
// and its swap pool are indexed by a dense integer key; the request's string id is kept once, in
// RequestNames, for messages and for callers that name requests by id. A caller that makes many
// calls for one request (the scheduler) opens it once and uses the key; the calls that take an id
// look it up at the call.
//
// A key names its request until the request is closed (an opened key) or holds nothing in the
// cache any more (a key the cache made for an id: the cache forgets the id then). Keys are used
// again after that under the next generation, so a key kept past its request's end is refused,
// never taken for another request. Changes go through an UndoLog, so that a transaction undoes
// them with the rest.

#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <kvc/errors.hpp>
#include <kvc/paged/undo_log.hpp>

namespace kvc::paged {

// A request of a paged cache (PagedCache::open_request returns it). Trivially copyable.
struct RequestKey {
  // The request's index in the cache's tables; the default names no request.
  std::uint32_t index = std::numeric_limits<std::uint32_t>::max();
  // Which use of the index: a key kept past its request's end has an older one and is refused.
  std::uint32_t generation = 0;
  // Returns true when index and generation are both equal.
  friend constexpr bool operator==(RequestKey, RequestKey) noexcept = default;
};

// A request named by its id or by its key: what every PagedCache call on one request takes. (It
// keeps a view of the id: a call's argument outlives the call.)
class RequestRef {
 public:
  // Names a request by its id (a view of it: `id` must outlive the reference).
  RequestRef(const std::string& id) noexcept : id_(id) {}  // NOLINT: implicit, as a string argument
  // Names a request by its id (a view of it: `id` must outlive the reference).
  RequestRef(const char* id) noexcept : id_(id) {}  // NOLINT
  // Names a request by its key.
  RequestRef(RequestKey key) noexcept : key_(key), by_key_(true) {}  // NOLINT

  // Returns true when the request is named by its key, false when by its id.
  bool by_key() const noexcept { return by_key_; }
  // Returns the key (a default RequestKey when the request is named by its id).
  RequestKey key() const noexcept { return key_; }
  // Returns the id (empty when the request is named by its key).
  std::string_view id() const noexcept { return id_; }

 private:
  std::string_view id_;
  RequestKey key_;
  bool by_key_ = false;
};

// The names of a paged cache's requests: the id of each key and the key of each id. Keys are dense
// indices, used again under a new generation once freed; changes go through an UndoLog.
class RequestNames {
 public:
  // Names no request.
  RequestNames() = default;
  // A copy names the same requests under the same keys.
  RequestNames(const RequestNames& o) : keys_(o.keys_), free_(o.free_) {
    free_.reserve(o.free_.capacity());
    for (const entry& e : o.entries_)
      entries_.push_back({e.name ? &keys_.find(*e.name)->first : nullptr, e.generation, e.opened});
  }
  // Copies `o` (copy, then move): may throw std::bad_alloc, leaving this object unchanged.
  RequestNames& operator=(const RequestNames& o) {
    if (this != &o) *this = RequestNames(o);
    return *this;
  }
  // Takes over the other object's requests and keys.
  RequestNames(RequestNames&&) noexcept = default;
  // Takes over the other object's requests and keys.
  RequestNames& operator=(RequestNames&&) noexcept = default;

  // Returns the number of named requests.
  std::size_t size() const noexcept { return keys_.size(); }
  // The key of a named request; nullopt for an id the cache does not know.
  std::optional<RequestKey> find(std::string_view id) const {
    const auto it = keys_.find(id);
    if (it == keys_.end()) return std::nullopt;
    return RequestKey{it->second, entries_[it->second].generation};
  }
  // Returns true when `k` names a request now (its index is in use, under k's generation).
  bool contains(RequestKey k) const noexcept {
    return k.index < entries_.size() && entries_[k.index].name && entries_[k.index].generation == k.generation;
  }
  // The key, checked: a KeyError for one that names no request (closed, forgotten, or never made).
  RequestKey check(RequestKey k) const {
    if (!contains(k))
      throw KeyError("kvc::PagedCache: no request with key " + std::to_string(k.index) + "." +
                     std::to_string(k.generation) + " (it was closed, or never opened)");
    return k;
  }
  // The id of a key's request ("#unknown" for an index that names none: a message never fails).
  const std::string& name(std::uint32_t index) const noexcept {
    static const std::string none = "#unknown";
    return index < entries_.size() && entries_[index].name ? *entries_[index].name : none;
  }
  // The key at an index (of the generation that uses it now, or would use it next).
  RequestKey key_at(std::uint32_t index) const noexcept {
    return {index, index < entries_.size() ? entries_[index].generation : 0};
  }
  // Returns true when `k` names a request that is marked opened (set_opened()).
  bool opened(RequestKey k) const noexcept { return contains(k) && entries_[k.index].opened; }
  // Every key in use, ascending.
  std::vector<RequestKey> keys() const {
    std::vector<RequestKey> out;
    out.reserve(keys_.size());
    for (std::uint32_t i = 0; i < entries_.size(); ++i)
      if (entries_[i].name) out.push_back({i, entries_[i].generation});
    return out;
  }

  // The key of `id`, made (a free index, the most recently freed first) when the id is new.
  // Strong guarantee: growing the pool of indices is no change (an index more is free).
  RequestKey add(UndoLog& log, std::string_view id) {
    if (const auto k = find(id)) return *k;
    if (free_.empty()) {  // (2^32 ids would need hundreds of GiB: memory runs out first)
      if (free_.capacity() < entries_.size() + 1) free_.reserve(2 * entries_.size() + 8);  // room for every index
      entries_.emplace_back();  // (a deque: recorded addresses of entries stay valid)
      free_.push_back(static_cast<std::uint32_t>(entries_.size() - 1));
    }
    // The insertion's undo can only be recorded after it: its room first (the other records come
    // before their changes).
    log.room(1, insert_undo_bytes);
    const auto made = keys_.try_emplace(std::string(id)).first;
    undo_insert(log, keys_, *made);
    const std::uint32_t index = free_.back();
    log.on_undo(
        [](void* self, const std::byte* data) noexcept {
          static_cast<RequestNames*>(self)->free_.push_back(UndoLog::load<std::uint32_t>(data));
        },
        this, index);
    free_.pop_back();
    made->second = index;
    entry& e = entries_[index];
    log.set(e, entry{&made->first, e.generation, false});
    return {index, e.generation};
  }
  // Marks the key opened (its request stays known until close) or not.
  void set_opened(UndoLog& log, RequestKey k, bool opened) { log.set(entries_[k.index].opened, opened); }
  // Forgets the key's request: its index is free again, under the next generation. Outside a
  // transaction it allocates nothing.
  void remove(UndoLog& log, RequestKey k) {
    if (!contains(k)) return;
    entry& e = entries_[k.index];
    const auto it = keys_.find(*e.name);
    kept_.erase(log, keys_, it);  // (in a transaction the node, and so the name, stay until it ends)
    keep_size(log, free_);
    log.set(e, entry{nullptr, e.generation + 1, false});
    free_.push_back(k.index);  // within its room
  }

 private:
  struct entry {
    const std::string* name = nullptr;  // its key in keys_; null while the index is free
    std::uint32_t generation = 0;
    bool opened = false;
  };
  std::map<std::string, std::uint32_t, std::less<>> keys_;  // id -> index
  std::deque<entry> entries_;                               // by index
  std::vector<std::uint32_t> free_;                         // free indices, with room for all
  KeptNodes<std::map<std::string, std::uint32_t, std::less<>>> kept_;
};

}  // namespace kvc::paged
