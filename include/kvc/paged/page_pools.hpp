#pragma once
// kvc::paged::PagePools<S>: the pages of a paged cache, one of its three parts (with the block
// tables and the swap pool, docs/paged.md). `tensors` K and `tensors` V buffers of the storage
// policy S, each [kv_heads, blocks * block_size, width] flat (head-major, FlashInfer's HND; the
// width head_dim, or a kvc::kv_codes pool's own widths for K and V):
// the tokens of a block are one contiguous piece per head. It knows rows and blocks, nothing of
// requests: it scatters new tokens to rows, gathers rows, and copies blocks, between its own
// blocks or to and from another PagePools of the same geometry (the swap pool is one).

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <kvc/detail/traits.hpp>
#include <kvc/limits.hpp>

namespace kvc::paged {

// What a page is: block_size rows per block, kv_heads heads of head_dim elements per key row and
// value_width() per value row.
struct PageGeometry {
  // Tokens (rows) per block.
  std::int64_t block_size = 0;
  // Key/value heads per row.
  std::int64_t kv_heads = 0;
  // Elements per head in the K buffers.
  std::int64_t head_dim = 0;
  // Elements per head in the V buffers; 0: head_dim (only a kvc::kv_codes pool's differ).
  std::int64_t value_dim = 0;
  // Returns the elements per head in the V buffers.
  std::int64_t value_width() const noexcept { return value_dim > 0 ? value_dim : head_dim; }
  // Returns the elements of one token's key row over every head: kv_heads * head_dim.
  std::int64_t row_elems() const noexcept { return kv_heads * head_dim; }
  // Returns the elements of one token's value row over every head: kv_heads * value_width().
  std::int64_t value_row_elems() const noexcept { return kv_heads * value_width(); }
};

// The pages of a paged cache or of its swap pool: `tensors` K and V buffers of the storage policy
// S, each [kv_heads, blocks * block_size, head_dim] flat (head-major). It scatters new tokens to
// rows, gathers rows and copies blocks; it knows nothing of requests.
template <class S>
class PagePools {
 public:
  // The element type of the pages (S's element_type).
  using T = typename S::element_type;
  // S's tensor view: how new tokens are handed in.
  using view_type = typename S::view_type;
  // S's buffer: one K or V buffer of the pages.
  using buffer_type = typename S::buffer_type;

  // No buffers (a swap pool before its space is reserved).
  explicit PagePools(const PageGeometry& geo) : geo_(geo) {}
  // `tensors` K and V buffers of `blocks` blocks each, zeroed whole when asked (a cache's pools:
  // the read-trash block must read as zeros, and no path then reads uninitialized memory).
  PagePools(const PageGeometry& geo, std::int64_t blocks, std::int64_t tensors, bool zeroed) : geo_(geo) {
    const std::int64_t k_elems =
        kvc::detail::checked_elements({blocks, geo.block_size, geo.kv_heads, geo.head_dim}, sizeof(T));
    const std::int64_t v_elems =
        kvc::detail::checked_elements({blocks, geo.block_size, geo.kv_heads, geo.value_width()}, sizeof(T));
    keys_.reserve(static_cast<std::size_t>(tensors));
    values_.reserve(static_cast<std::size_t>(tensors));
    for (std::int64_t j = 0; j < tensors; ++j) {
      keys_.emplace_back(k_elems);
      values_.emplace_back(v_elems);
      if (zeroed) {
        S::zero_2d(keys_.back().data(), k_elems, k_elems, 1);
        S::zero_2d(values_.back().data(), v_elems, v_elems, 1);
      }
    }
  }

  // Returns the geometry of a page.
  const PageGeometry& geometry() const noexcept { return geo_; }
  // Returns the number of K buffers (as many as V buffers); 0 without buffers.
  std::int64_t tensors() const noexcept { return static_cast<std::int64_t>(keys_.size()); }
  // Returns the number of blocks in each buffer; 0 without buffers.
  std::int64_t blocks() const noexcept {
    return keys_.empty() ? 0 : static_cast<std::int64_t>(keys_.front().size()) / (geo_.block_size * geo_.row_elems());
  }
  // Returns the number of rows in each buffer: blocks() * block_size.
  std::int64_t rows() const noexcept { return blocks() * geo_.block_size; }
  // Bytes of one block in every K and V buffer, and of all of them.
  std::int64_t bytes_per_block() const noexcept {
    return tensors() * geo_.block_size * (geo_.row_elems() + geo_.value_row_elems()) *
           static_cast<std::int64_t>(sizeof(T));
  }
  // Returns the bytes of all the buffers: blocks() * bytes_per_block().
  std::int64_t bytes() const noexcept { return blocks() * bytes_per_block(); }
  // Returns the data of K buffer j; throws std::out_of_range for j outside [0, tensors()).
  const T* keys(std::int64_t j) const { return keys_.at(static_cast<std::size_t>(j)).data(); }
  // Returns the data of V buffer j; throws std::out_of_range for j outside [0, tensors()).
  const T* values(std::int64_t j) const { return values_.at(static_cast<std::size_t>(j)).data(); }

  // The write of x's tokens ([1, kv_heads, tokens, head_dim]) to K buffer j's rows first_row to
  // first_row + tokens - 1 of a rows list (one per token), keys or values.
  kvc::detail::scatter_job<T> key_job(std::size_t j, const view_type& x, std::size_t first_row, std::size_t tokens) {
    return job(keys_[j].data(), x, first_row, tokens);
  }
  // The same write to V buffer j (see key_job()): x is [1, kv_heads, tokens, value_width()].
  kvc::detail::scatter_job<T> value_job(std::size_t j, const view_type& x, std::size_t first_row, std::size_t tokens) {
    return job(values_[j].data(), x, first_row, tokens);
  }
  // Runs the jobs over `rows`: the first `key_jobs` are K buffers' (key_job), the rest V buffers'
  // (value_job). One storage call (on a CUDA device, one kernel launch), two when K and V rows
  // differ in width.
  void scatter(std::span<const kvc::detail::scatter_job<T>> jobs, std::size_t key_jobs,
               std::span<const std::int64_t> rows) {
    if (geo_.value_width() == geo_.head_dim) {
      S::scatter_rows(jobs, rows, geo_.kv_heads, geo_.head_dim, pitch(geo_.head_dim));
    } else {
      S::scatter_rows(jobs.first(key_jobs), rows, geo_.kv_heads, geo_.head_dim, pitch(geo_.head_dim));
      S::scatter_rows(jobs.subspan(key_jobs), rows, geo_.kv_heads, geo_.value_width(), pitch(geo_.value_width()));
    }
  }
  // Writes the tokens of k and v (one per entry of `rows`) to those rows of K and V buffer j, in
  // one storage call.
  void scatter(std::size_t j, const view_type& k, const view_type& v, std::span<const std::int64_t> rows) {
    const kvc::detail::scatter_job<T> jobs[2] = {key_job(j, k, 0, rows.size()), value_job(j, v, 0, rows.size())};
    scatter(jobs, 1, rows);
  }
  // out_k[h, i, :] = keys[j][h, rows[i], :] (and V); where rows[i] is `sentinel`, the next new
  // token of k (or v) instead, when they are given.
  void gather(std::size_t j, std::span<const std::int64_t> rows, T* out_k, T* out_v, const view_type* k = nullptr,
              const view_type* v = nullptr, std::int64_t sentinel = -1) const {
    gather(out_k, keys_[j].data(), geo_.head_dim, rows, k, sentinel);
    gather(out_v, values_[j].data(), geo_.value_width(), rows, v, sentinel);
  }

  // Block src_ids[i] of `from` to block dst_ids[i] of `to`, in every buffer (the same geometry).
  static void copy_blocks(const PagePools& from, std::span<const std::int64_t> src_ids, PagePools& to,
                          std::span<const std::int64_t> dst_ids) {
    const PageGeometry& g = to.geo_;
    // One head's part of a block, in the K and in the V buffers.
    const std::int64_t kblock = g.block_size * g.head_dim, vblock = g.block_size * g.value_width();
    for (std::size_t j = 0; j < to.keys_.size(); ++j)
      for (std::size_t i = 0; i < src_ids.size(); ++i) {
        S::copy_2d(to.keys_[j].data() + dst_ids[i] * kblock, to.pitch(g.head_dim),
                   from.keys_[j].data() + src_ids[i] * kblock, from.pitch(g.head_dim), kblock, g.kv_heads);
        S::copy_2d(to.values_[j].data() + dst_ids[i] * vblock, to.pitch(g.value_width()),
                   from.values_[j].data() + src_ids[i] * vblock, from.pitch(g.value_width()), vblock, g.kv_heads);
      }
  }

  // f(pointer, elements) for every piece of the blocks, buffer after buffer (K then V), each block
  // head after head: what a saved request holds, in its order.
  template <class F>
  void for_each_piece(std::span<const std::int64_t> blocks, F&& f) const {
    for (const bool keys : {true, false}) {
      const std::int64_t d = keys ? geo_.head_dim : geo_.value_width(), piece = geo_.block_size * d;
      for (const buffer_type& b : keys ? keys_ : values_)
        for (const std::int64_t id : blocks)
          for (std::int64_t h = 0; h < geo_.kv_heads; ++h)
            f(const_cast<T*>(b.data()) + h * pitch(d) + id * piece, piece);
    }
  }

 private:
  // Elements from one head to the next in a buffer of rows d wide (K: head_dim, V: value_width()).
  std::int64_t pitch(std::int64_t d) const noexcept { return rows() * d; }

  static kvc::detail::scatter_job<T> job(T* pool, const view_type& x, std::size_t first_row, std::size_t tokens) {
    return {pool,
            x.data(),
            x.stride(2),
            x.stride(1),
            static_cast<std::int64_t>(first_row),
            static_cast<std::int64_t>(tokens)};
  }
  // out[h, i, :] = pool[h, rows[i], :]; the i-th sentinel row takes the next token of `fresh`. A run
  // of consecutive rows (the tokens of one block) is one contiguous piece per head: one copy per
  // run and head instead of one per token and head.
  void gather(T* out, const T* pool, std::int64_t d, std::span<const std::int64_t> rows, const view_type* fresh,
              std::int64_t sentinel) const {
    const auto r = static_cast<std::int64_t>(rows.size());
    const std::int64_t out_pitch = r * d, pool_pitch = pitch(d);
    std::int64_t next_fresh = 0;
    for (std::int64_t i = 0; i < r;) {
      const std::int64_t row = rows[static_cast<std::size_t>(i)];
      if (fresh && row == sentinel) {
        S::copy_2d(out + i * d, out_pitch, fresh->data() + next_fresh++ * fresh->stride(2), fresh->stride(1), d,
                   geo_.kv_heads);
        ++i;
        continue;
      }
      std::int64_t n = 1;
      while (i + n < r && rows[static_cast<std::size_t>(i + n)] == row + n && !(fresh && row + n == sentinel)) ++n;
      S::copy_2d(out + i * d, out_pitch, pool + row * d, pool_pitch, n * d, geo_.kv_heads);
      i += n;
    }
  }

  PageGeometry geo_;
  std::vector<buffer_type> keys_, values_;
};

}  // namespace kvc::paged
