#pragma once
// kvc::paged::UndoLog: what makes a multi-step change of the serving bookkeeping all or nothing.
// Between begin() and commit(), every change made through the log first records how to undo it;
// rollback() undoes them all, newest first, and allocates nothing. Recording is the only step
// that can fail (the log grows), and it comes before the change it records, so a std::bad_alloc
// anywhere in a transaction leaves the log describing exactly what was changed.
//
// Outside a transaction the log records nothing and set() is a plain assignment. The log keeps its
// memory between transactions: a steady-state step records without allocating.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

namespace kvc::paged {

// Makes a multi-step change of the serving bookkeeping all or nothing: between begin() and
// commit() every change made through the log records its undo first; rollback() undoes them all,
// newest first.
class UndoLog {
 public:
  // Undoes one change: `ctx` is what the change was made to, `data` a copy of what was recorded.
  using undo_fn = void (*)(void* ctx, const std::byte* data) noexcept;

  // Called with its context when a transaction ends, after the undos (see at_end()).
  using end_fn = void (*)(void* ctx) noexcept;

  // Returns true in a transaction (after begin(), before commit() or rollback()).
  bool active() const noexcept { return active_; }
  // Starts a transaction: from now on, changes made through the log record their undo.
  void begin() noexcept { active_ = true; }
  // Forgets the records: the changes stay.
  void commit() noexcept { end(); }
  // Undoes every recorded change, newest first.
  void rollback() noexcept {
    for (std::size_t i = records_.size(); i-- > 0;) records_[i].fn(records_[i].ctx, bytes_.data() + records_[i].at);
    end();
  }

  // Calls fn(ctx) when the transaction ends (committed or rolled back), after the undos: what
  // keeps memory for the undos (erased nodes, a saved list) lets it go there. In a transaction;
  // may throw std::bad_alloc, with nothing registered.
  void at_end(end_fn fn, void* ctx) {
    if (!active_) return;
    grow(ends_, ends_.size() + 1);
    ends_.push_back({fn, ctx});
  }

  // Sets `where` to `value`, recording its old value first (in a transaction).
  template <class T>
  void set(T& where, const T& value) {
    static_assert(std::is_trivially_copyable_v<T>, "kvc::paged::UndoLog::set: a trivially copyable value");
    if (active_) on_undo(&restore<T>, &where, where);
    where = value;
  }

  // Records `fn(ctx, copy of data)` as the undo of a change about to be made (in a transaction;
  // nothing otherwise). May throw std::bad_alloc, with nothing recorded.
  template <class D>
  void on_undo(undo_fn fn, void* ctx, const D& data) {
    static_assert(std::is_trivially_copyable_v<D>, "kvc::paged::UndoLog::on_undo: trivially copyable data");
    if (!active_) return;
    room(1, sizeof(D));
    const std::size_t at = bytes_.size();
    bytes_.resize(at + sizeof(D));  // within the room made: cannot fail
    std::memcpy(bytes_.data() + at, &data, sizeof(D));
    records_.push_back({fn, ctx, at});
  }

  // The same for an undo that needs nothing but its context.
  void on_undo(void (*fn)(void* ctx) noexcept, void* ctx) {
    on_undo([](void* f, const std::byte* data) noexcept { load<void (*)(void*) noexcept>(data)(f); }, ctx, fn);
  }

  // Room for n more records with `bytes` of data in all, so that a change that cannot be
  // recorded before it is made (an insertion whose position is known only after it) records
  // without failing. Grown geometrically.
  void room(std::size_t n, std::size_t bytes) {
    if (!active_) return;
    grow(records_, records_.size() + n);
    grow(bytes_, bytes_.size() + bytes);
  }

  // The data an undo function was given, as the type it was recorded with.
  template <class D>
  static D load(const std::byte* data) noexcept {
    D d;
    std::memcpy(&d, data, sizeof(D));
    return d;
  }

 private:
  struct record {
    undo_fn fn;
    void* ctx;
    std::size_t at;  // its data: bytes_[at, at + size of what was recorded)
  };

  template <class T>
  static void restore(void* where, const std::byte* old) noexcept {
    std::memcpy(where, old, sizeof(T));
  }
  template <class V>
  static void grow(V& v, std::size_t n) {
    if (n > v.capacity()) v.reserve(std::max(n, 2 * v.capacity()));
  }

  void end() noexcept {
    for (const auto& [fn, ctx] : ends_) fn(ctx);
    ends_.clear();
    records_.clear();
    bytes_.clear();
    active_ = false;
  }

  std::vector<record> records_;
  std::vector<std::byte> bytes_;
  std::vector<std::pair<end_fn, void*>> ends_;
  bool active_ = false;
};

// Nodes a transaction erased from a node-based map (std::map, std::unordered_map), kept with their
// memory so that undoing the erasure puts them back without allocating (an unordered_map must
// have room for them: it does, since undoing only brings its size back). A copy starts empty.
template <class Map>
class KeptNodes {
 public:
  // Keeps no nodes.
  KeptNodes() = default;
  // A copy starts empty: kept nodes belong to the transaction of the original's map.
  KeptNodes(const KeptNodes&) noexcept {}
  // Does nothing: this object keeps its own nodes and takes none of the other's.
  KeptNodes& operator=(const KeptNodes&) noexcept { return *this; }
  // Starts empty, as a copy does; the other object keeps its nodes.
  KeptNodes(KeptNodes&&) noexcept {}
  // Does nothing, as the copy assignment.
  KeptNodes& operator=(KeptNodes&&) noexcept { return *this; }

  // Erases *it from map; in a transaction of `log` the node is kept and its return recorded. May
  // throw std::bad_alloc before anything changes.
  void erase(UndoLog& log, Map& map, typename Map::iterator it) {
    if (!log.active()) {
      map.erase(it);
      return;
    }
    if (nodes_.empty()) log.at_end(&forget, this);
    nodes_.emplace_back();
    try {
      log.room(1, sizeof(where));
    } catch (...) {
      nodes_.pop_back();
      throw;
    }
    nodes_.back() = map.extract(it);
    log.on_undo(&put_back, this, where{&map, nodes_.size() - 1});
  }

 private:
  struct where {
    Map* map;
    std::size_t node;
  };
  static void put_back(void* self, const std::byte* data) noexcept {
    const auto w = UndoLog::load<where>(data);
    w.map->insert(std::move(static_cast<KeptNodes*>(self)->nodes_[w.node]));
  }
  static void forget(void* self) noexcept { static_cast<KeptNodes*>(self)->nodes_.clear(); }

  std::vector<typename Map::node_type> nodes_;
};

// The free ids of a pool of `capacity` ids (swap blocks, state slots): kept ascending, with room
// for every id, so that giving ids back never allocates. Before its first change in a transaction
// of the log the list is kept as it is (once per transaction); the rollback puts it back.
class FreeIds {
 public:
  // No ids.
  FreeIds() = default;
  // Ids 0 .. capacity - 1, all free.
  explicit FreeIds(std::int64_t capacity) : capacity_(capacity) {
    free_.reserve(static_cast<std::size_t>(capacity));
    for (std::int64_t i = 0; i < capacity; ++i) free_.push_back(i);
  }
  // Copies the free ids, with room for all of them (a transaction's saved list is not copied).
  FreeIds(const FreeIds& o) : capacity_(o.capacity_) {
    free_.reserve(static_cast<std::size_t>(capacity_));
    free_.assign(o.free_.begin(), o.free_.end());
  }
  // Takes over the other object's ids.
  FreeIds(FreeIds&&) noexcept = default;
  // Copies `o` (copy, then move): may throw std::bad_alloc, leaving this object unchanged.
  FreeIds& operator=(const FreeIds& o) { return *this = FreeIds(o); }
  // Takes over the other object's ids.
  FreeIds& operator=(FreeIds&&) noexcept = default;

  // Returns the number of ids, free or not.
  std::int64_t capacity() const noexcept { return capacity_; }
  // Returns the number of free ids.
  std::int64_t size() const noexcept { return static_cast<std::int64_t>(free_.size()); }
  // Returns the free ids, ascending.
  const std::vector<std::int64_t>& ids() const noexcept { return free_; }

  // Keeps the list for the undo of the log's transaction, once per transaction (nothing outside
  // one). May throw std::bad_alloc, changing nothing; after it, take and give_back cannot fail.
  void keep(UndoLog& log) {
    if (!log.active() || kept_) return;
    log.at_end([](void* self) noexcept { static_cast<FreeIds*>(self)->kept_ = false; }, this);
    saved_.reserve(static_cast<std::size_t>(capacity_));  // room for all, as free_ has
    saved_.assign(free_.begin(), free_.end());
    log.on_undo(
        [](void* self) noexcept { static_cast<FreeIds*>(self)->free_.swap(static_cast<FreeIds*>(self)->saved_); },
        this);
    kept_ = true;
  }
  // The n smallest free ids (there must be that many) stop being free; they are appended to
  // `out`, which must have room for them. Strong guarantee: may throw std::bad_alloc (keeping the
  // list in a transaction) before anything changes.
  void take(UndoLog& log, std::int64_t n, std::vector<std::int64_t>& out) {
    keep(log);
    const auto end = free_.begin() + static_cast<std::ptrdiff_t>(n);
    out.insert(out.end(), free_.begin(), end);
    free_.erase(free_.begin(), end);
  }
  // The smallest free id (there must be one) stops being free; returns it. Strong guarantee, as
  // take.
  std::int64_t take_one(UndoLog& log) {
    keep(log);
    const std::int64_t id = free_.front();
    free_.erase(free_.begin());
    return id;
  }
  // The ids are free again (kept ascending). Outside a transaction it allocates nothing; in one,
  // a std::bad_alloc comes before any change.
  void give_back(UndoLog& log, std::span<const std::int64_t> ids) {
    keep(log);
    free_.insert(free_.end(), ids.begin(), ids.end());  // within its room
    std::sort(free_.begin(), free_.end());
  }

 private:
  std::int64_t capacity_ = 0;
  std::vector<std::int64_t> free_;   // ascending, with room for all
  std::vector<std::int64_t> saved_;  // the list as a transaction found it
  bool kept_ = false;
};

// Records the undo of an insertion into a node-based map that made `element`: erasing it again.
// Make room in the log first (room(1, insert_undo_bytes)), so that recording after the insertion
// cannot fail.
inline constexpr std::size_t insert_undo_bytes = 2 * sizeof(void*);
// Records the undo of the insertion into `map` that made `element` (erasing it again). Nothing
// outside a transaction; may throw std::bad_alloc unless room(1, insert_undo_bytes) was made.
template <class Map>
void undo_insert(UndoLog& log, Map& map, typename Map::value_type& element) {
  struct what {
    Map* map;
    const typename Map::key_type* key;
  };
  log.on_undo(
      [](void*, const std::byte* data) noexcept {
        const auto w = UndoLog::load<what>(data);
        w.map->erase(w.map->find(*w.key));
      },
      nullptr, what{&map, &element.first});
}

// Records v[i] as it is now, for the undo to write back (v is found by its address: a vector in a
// node-based map keeps it).
template <class T>
void keep_entry(UndoLog& log, std::vector<T>& v, std::size_t i) {
  struct entry {
    std::vector<T>* v;
    std::size_t i;
    T old;
  };
  log.on_undo(
      [](void*, const std::byte* data) noexcept {
        const auto e = UndoLog::load<entry>(data);
        (*e.v)[e.i] = e.old;
      },
      nullptr, entry{&v, i, v[i]});
}

// Records v's size now, for the undo to resize v back. The undo of growth drops what was added;
// the undo of a cut brings the size back within v's capacity (no allocation), and keep_entry
// records made before the cut bring back its entries.
template <class T>
void keep_size(UndoLog& log, std::vector<T>& v) {
  struct size {
    std::vector<T>* v;
    std::size_t n;
  };
  log.on_undo(
      [](void*, const std::byte* data) noexcept {
        const auto s = UndoLog::load<size>(data);
        s.v->resize(s.n);
      },
      nullptr, size{&v, v.size()});
}

}  // namespace kvc::paged
