#pragma once
// kvc::paged_attention: attention for one step of a continuous batch, reading the cached keys and
// values straight from a kvc::PagedCache's pools through each request's block table (no gather of
// a request's history into a contiguous copy).
//
// The step packs R requests one after another: request r has q_r = cu_seqlens_q[r + 1] -
// cu_seqlens_q[r] new tokens (its query rows in `queries`, its new keys and values at the same
// rows of `keys` and `values`) after past[r] cached tokens. A query at absolute position qp of
// request r sees that request's keys at positions kp <= qp (causal, within the request: no
// request sees another), and in a sliding layer of window W only kp > qp - W. Cached keys
// (kp < past[r]) come from the pools; the step's own keys from `keys`/`values`, as
// flash_attn_with_kvcache takes k_new. Nothing is written: store the step with the cache's update
// (a write-only update when nothing else needs the gathered keys) after this call: a sliding
// group writes a new token into the ring slot of a key the step's earlier queries still see.
//
// A full-attention group keeps position p at block table[p / block_size], row p % block_size; a
// sliding group keeps it in ring slot p % W (docs/paged.md). The pools are head-major, so the
// keys of one head in one block are one contiguous [rows, head_dim] piece, read in place (widened
// to float first for half and bfloat16). A decode step scores each key row against the few query
// rows with plain dot products while the row is in cache, takes an exact softmax, then adds each
// value row the same way; a prefill chunk multiplies whole blocks with an online softmax (running
// maximum and sum). Scores accumulate in float (double for double). Grouped-query and multi-query
// attention: query head h reads KV head h / (Hq / Hkv), and the query heads of one KV head share
// each block read.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include <Eigen/Core>

#include <kvc/attention.hpp>
#include <kvc/detail/attention_rows.hpp>
#include <kvc/errors.hpp>
#include <kvc/float8.hpp>
#include <kvc/fp8_attention.hpp>
#include <kvc/paged/attention_step.hpp>
#include <kvc/paged/paged_cache.hpp>
#include <kvc/rotation.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {

// A run of consecutive key positions whose rows in one head's pool are consecutive too.
struct pool_run {
  std::int64_t position;  // absolute position of the first key
  std::int64_t row;       // its pool row
  std::int64_t count;
};

// fn(run) for the runs covering positions [lo, hi) of a request's cached keys in a group, in
// position order: cut at block boundaries, and for a sliding group (window > 0) at the ring's wrap.
template <class Fn>
void visit_cached_runs(const std::vector<std::int64_t>& table, std::int64_t block_size, std::int64_t window,
                       std::int64_t lo, std::int64_t hi, const std::string& request, Fn&& fn) {
  for (std::int64_t p = lo; p < hi;) {
    const std::int64_t slot = window > 0 ? p % window : p;
    const std::int64_t block = slot / block_size, offset = slot % block_size;
    if (block >= static_cast<std::int64_t>(table.size()))
      throw ValueError("kvc::paged_attention: request " + request + " has " + std::to_string(table.size()) +
                       " blocks, too few for its cached position " + std::to_string(p));
    std::int64_t n = std::min(block_size - offset, hi - p);
    if (window > 0) n = std::min(n, window - slot);  // the ring wraps to slot 0
    fn(pool_run{p, table[static_cast<std::size_t>(block)] * block_size + offset, n});
    p += n;
  }
}

// The same runs collected in `out`.
inline void cached_runs(const std::vector<std::int64_t>& table, std::int64_t block_size, std::int64_t window,
                        std::int64_t lo, std::int64_t hi, const std::string& request, std::vector<pool_run>& out) {
  out.clear();
  visit_cached_runs(table, block_size, window, lo, hi, request, [&](const pool_run& run) { out.push_back(run); });
}

// The checked geometry of one paged_attention call (host or device views): the layer's group and
// pool tensor, sizes, and the group's window (0: full attention).
struct paged_call {
  std::int64_t group, pool, Hkv, D, block_size, Hq, T, R, window, pool_rows;
  std::int64_t W;   // elements of a head's key row in the pools and in the step's keys (D, or row codes' bytes)
  std::int64_t Wv;  // the same for values (W, except in a kvc::kv_codes pool)
};

// Every check of paged_attention on shapes and the step's layout: ValueError.
template <class S, class QView, class KVView>
paged_call check_paged_attention(const PagedCache<S>& cache, std::int64_t layer_idx, const PagedAttentionStep& step,
                                 const QView& queries, const KVView& keys, const KVView& values) {
  const auto [group, pool] = cache.layer_group(layer_idx);
  const std::int64_t Hkv = cache.num_key_value_heads(), D = cache.head_dim(), bs = cache.block_size();
  const std::int64_t W = cache.row_width(), Wv = cache.value_row_width();
  const std::int64_t Hq = queries.extent(1), T_ = queries.extent(2);
  const auto R = static_cast<std::int64_t>(step.requests.size());
  if (queries.extent(0) != 1 || queries.extent(3) != D || Hq < 1 || Hq % Hkv != 0)
    throw ValueError("kvc::paged_attention: queries must be [1, a multiple of " + std::to_string(Hkv) +
                     " heads, tokens, " + std::to_string(D) + "], got " + shape_string(queries.extents));
  for (const KVView* x : {&keys, &values})
    if (x->extents != std::array<std::int64_t, 4>{1, Hkv, T_, x == &keys ? W : Wv})
      throw ValueError("kvc::paged_attention: " + std::string(x == &keys ? "keys" : "values") + " must be [1, " +
                       std::to_string(Hkv) + ", " + std::to_string(T_) + ", " + std::to_string(x == &keys ? W : Wv) +
                       "] like the queries' tokens, got " + shape_string(x->extents));
  if (queries.stride(3) != 1 || keys.stride(3) != 1 || values.stride(3) != 1)
    throw ValueError("kvc::paged_attention: tensors must have contiguous head_dim rows");
  const auto cu = step.cu_seqlens_q;
  bool layout_ok = static_cast<std::int64_t>(cu.size()) == R + 1 && static_cast<std::int64_t>(step.past.size()) == R &&
                   !cu.empty() && cu.front() == 0 && cu.back() == T_;
  for (std::int64_t r = 0; layout_ok && r < R; ++r)
    layout_ok = cu[static_cast<std::size_t>(r + 1)] >= cu[static_cast<std::size_t>(r)] &&
                step.past[static_cast<std::size_t>(r)] >= 0;
  if (!layout_ok)
    throw ValueError("kvc::paged_attention: a step of " + std::to_string(R) + " requests needs " +
                     std::to_string(R + 1) + " non-decreasing cu_seqlens_q from 0 to the " + std::to_string(T_) +
                     " query tokens, and " + std::to_string(R) + " cached lengths >= 0");
  if (!step.keys.empty() && static_cast<std::int64_t>(step.keys.size()) != R)
    throw ValueError("kvc::paged_attention: a step of " + std::to_string(R) + " requests has " +
                     std::to_string(step.keys.size()) + " keys (give none, or one per request)");
  const bool sliding = cache.is_sliding_group(group);
  return {group, pool, Hkv, D, bs, Hq, T_, R, sliding ? cache.sliding_window() : 0, (cache.num_blocks() + 2) * bs,
          W,     Wv};
}

// Request i's block table in `group`, by its key where the step has keys.
template <class S>
const std::vector<std::int64_t>& step_table(const PagedCache<S>& cache, std::int64_t group,
                                            const PagedAttentionStep& step, std::size_t i) {
  if (step.keys.empty()) return cache.block_table(group, step.requests[i]);
  return cache.block_table(group, step.keys[i]);
}

// The block tables of a step's requests for a kernel: [R, width] (row r: request r's table, padded
// with block 0), checked to cover every cached key a query sees (cached_runs' error otherwise).
// Requests without query tokens get a padding row only.
template <class S>
std::vector<std::int64_t> paged_tables(const PagedCache<S>& cache, const paged_call& call,
                                       const PagedAttentionStep& step, std::int64_t& width) {
  std::vector<const std::vector<std::int64_t>*> tables(static_cast<std::size_t>(call.R), nullptr);
  std::vector<pool_run> runs;
  width = 1;
  for (std::int64_t r = 0; r < call.R; ++r) {
    const auto i = static_cast<std::size_t>(r);
    if (step.cu_seqlens_q[i + 1] == step.cu_seqlens_q[i]) continue;
    const std::int64_t past = step.past[i];
    const auto& table = step_table(cache, call.group, step, i);
    cached_runs(table, call.block_size, call.window,
                call.window > 0 ? std::max<std::int64_t>(past - call.window + 1, 0) : 0, past, step.requests[i], runs);
    tables[i] = &table;
    width = std::max(width, static_cast<std::int64_t>(table.size()));
  }
  std::vector<std::int64_t> out(static_cast<std::size_t>(call.R * width), 0);
  for (std::int64_t r = 0; r < call.R; ++r)
    if (tables[static_cast<std::size_t>(r)])
      std::copy(tables[static_cast<std::size_t>(r)]->begin(), tables[static_cast<std::size_t>(r)]->end(),
                out.begin() + r * width);
  return out;
}

// The device kernels' problem for a checked call: q, k, v the step's views, out a dense
// [1, Hq, T, D]; cu, past and tables (paged_tables, `width` wide) in the memory the kernels read.
template <class S, class QView, class KVView, class T = typename QView::element_type,
          class KV = typename KVView::element_type>
paged_problem<std::remove_const_t<T>, std::remove_const_t<KV>> make_paged_problem(
    const PagedCache<S>& cache, const paged_call& call, const QView& q, const KVView& k, const KVView& v,
    std::remove_const_t<T>* out, const std::int64_t* cu, const std::int64_t* past, const std::int64_t* tables,
    std::int64_t width, std::optional<double> scale, head_scales key_scales, head_scales value_scales) {
  paged_problem<std::remove_const_t<T>, std::remove_const_t<KV>> p{};
  static_cast<problem_base&>(p) = problem_base::of(call.Hq, call.Hkv, call.D, call.D, scale, key_scales, value_scales);
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.out = out;
  p.kpool = cache.key_pool(call.pool);
  p.vpool = cache.value_pool(call.pool);
  p.Tq = call.T;
  p.R = call.R;
  p.pool_rows = call.pool_rows;
  p.block_size = call.block_size;
  p.window = call.window;
  p.W = call.W;
  p.Wv = call.Wv;
  p.qs[0] = q.stride(1);
  p.qs[1] = q.stride(2);
  p.ks[0] = k.stride(1);
  p.ks[1] = k.stride(2);
  p.vs[0] = v.stride(1);
  p.vs[1] = v.stride(2);
  p.cu = cu;
  p.past = past;
  p.tables = tables;
  p.table_width = width;
  return p;
}
}  // namespace detail

namespace detail {

// The rotation an fp8 pool's scales name (kvc::Fp8Scales::rotation); none for other scales.
template <class Scales>
Fp8Rotation rotation_of(const Scales& scales) noexcept {
  if constexpr (requires { Fp8Rotation(scales.rotation); })
    return scales.rotation;
  else
    return {};
}

// paged_attention into `out` (resized to [1, Hq, T, D]) with queries of type T over a pool of
// S::element_type (T, fp8 codes, or row codes widened a row at a time: <kvc/row_codes.hpp>) whose
// KV head hk's keys and values stand for
// scales.key_scale(hk) and value_scale(hk) times their values (detail::unit_scales: themselves).
// Work items are (KV head, request, tile, split) as tile_plan cuts them (attention.hpp); a tile
// reads its request's cached keys run by run from the pools and its own keys from the step's.
template <class S, class T, class Scales>
void paged_attention_into(HostTensor<T>& out, const PagedCache<S>& cache, std::int64_t layer_idx,
                          const PagedAttentionStep& step, const TensorView<T>& queries,
                          const TensorView<typename S::element_type>& keys,
                          const TensorView<typename S::element_type>& values, std::optional<double> scale,
                          const Scales& scales, const AttentionContext& context) {
  using KV = typename S::element_type;
  using A = accum_t<T>;
  using plan = tile_plan;
  // Rows rotated before they were encoded (kvc::rotated, or an fp8 pool's Fp8Scales::rotation):
  // with rotated keys, queries are rotated the same way; with rotated values, each tile's output
  // rows are rotated back before they are finished or stored (a linear step, so the partials of a
  // split row merge as before). A kvc::kv_codes pool's keys and values are each widened from their
  // own format.
  const Fp8Rotation rotation = rotation_of(scales);
  const bool rotated_keys = rotates_keys<KV> || rotation.keys, rotated_values = rotates_values<KV> || rotation.values;
  using KF = key_format_t<KV>;
  using VF = value_format_t<KV>;
  const paged_call call = check_paged_attention(cache, layer_idx, step, queries, keys, values);
  const std::int64_t Hkv = call.Hkv, D = call.D, bs = call.block_size, Hq = call.Hq, R = call.R, T_ = call.T;
  const std::int64_t W = call.W, Wv = call.Wv;  // a row's elements in the pools (D, or the bytes of row codes)
  const std::int64_t window = call.window, head_pitch = call.pool_rows * W, value_head_pitch = call.pool_rows * Wv;
  const std::int64_t group = Hq / Hkv, pitch = 2 + D;
  const auto cu = step.cu_seqlens_q;
  const auto past_of = [&](std::int64_t r) { return step.past[static_cast<std::size_t>(r)]; };
  const auto queries_of = [&](std::int64_t r) {
    return cu[static_cast<std::size_t>(r + 1)] - cu[static_cast<std::size_t>(r)];
  };
  std::int64_t active = 0;  // requests with query tokens
  for (std::int64_t r = 0; r < R; ++r) active += queries_of(r) > 0;
  // Request r's tiles: whether they decode, their query positions each, their count and splits.
  struct tiling {
    bool decode;
    std::int64_t per_tile, tiles, splits, split_length;
  };
  const auto tiling_of = [&](std::int64_t r) {
    const std::int64_t q = queries_of(r), past = past_of(r);
    const bool decode = group * q <= plan::decode_rows;
    const std::int64_t per_tile = decode ? q : plan::tile_rows;
    const std::int64_t lo = window > 0 ? std::max<std::int64_t>(past - window + 1, 0) : 0;
    const std::int64_t splits = plan::splits(decode, past + q - lo, Hkv * active);
    return tiling{decode, per_tile, q > 0 ? (q + per_tile - 1) / per_tile : 0, splits,
                  plan::split_length(past + q - lo, splits)};
  };

  // A table too short is refused before anything is computed; then the items are counted.
  std::int64_t items_per_head = 0, partial_values = 0, rows_max = 1, keys_max = 1;
  bool any_prefill = false;
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t q = queries_of(r), past = past_of(r);
    if (q == 0) continue;
    visit_cached_runs(step_table(cache, call.group, step, static_cast<std::size_t>(r)), bs, window,
                      window > 0 ? std::max<std::int64_t>(past - window + 1, 0) : 0, past,
                      step.requests[static_cast<std::size_t>(r)], [](const pool_run&) {});
    const tiling t = tiling_of(r);
    items_per_head += t.tiles * t.splits;
    if (t.splits > 1) partial_values += Hkv * t.splits * group * q * pitch;
    rows_max = std::max(rows_max, group * std::min(t.per_tile, q));
    any_prefill = any_prefill || !t.decode;
    keys_max = std::max(keys_max, past + q);
  }
  // Blocks of the plan's size, or of every key a request has when that is fewer.
  const std::int64_t block = std::min(plan::block_keys, keys_max);
  out.resize(1, Hq, T_, D);  // every row is written below: each token belongs to a request
  const std::int64_t items = Hkv * items_per_head;
  if (items == 0) return;
  // The shared area: each request's tiling (R), first item (R + 1) and partials' offset (R), then
  // the partials.
  const std::size_t index_bytes = static_cast<std::size_t>(R) * sizeof(tiling) +
                                  static_cast<std::size_t>(2 * R + 1) * sizeof(std::int64_t),
                    index_values = (index_bytes + sizeof(A) - 1) / sizeof(A);
  AttentionWorkspace local;
  // Decode tiles read pool blocks of A in place when the blocks are long; otherwise (short blocks,
  // whose many small folds would cost more than a copy, other element types, prefill tiles) the
  // keys are gathered (and widened) into blocks of the plan's size.
  const auto in_place = [&](bool decode) { return std::is_same_v<A, KV> && decode && bs >= plan::block_keys / 4; };
  const auto copies_of = [&](bool decode) { return in_place(decode) ? 0 : block; };
  AttentionWorkspace& ws = reserve_workspace<A>(context, local, items, rows_max, D, D, block, copies_of(!any_prefill),
                                                any_prefill, index_values + static_cast<std::size_t>(partial_values));
  auto* tilings = reinterpret_cast<tiling*>(ws.shared());
  auto* first_item = reinterpret_cast<std::int64_t*>(tilings + R);
  std::int64_t* partial_at = first_item + R + 1;
  A* partials = reinterpret_cast<A*>(ws.shared()) + index_values;
  first_item[0] = 0;
  for (std::int64_t r = 0, at = 0; r < R; ++r) {
    const tiling t = tilings[r] = tiling_of(r);
    first_item[r + 1] = first_item[r] + t.tiles * t.splits;
    partial_at[r] = at;
    if (t.splits > 1) at += Hkv * t.splits * group * queries_of(r) * pitch;
  }
  const A s = static_cast<A>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(D)));
  const KV* kpool = cache.key_pool(call.pool);
  const KV* vpool = cache.value_pool(call.pool);

  context.executor.parallel_for(items, [&](std::int64_t item, int worker) {
    const std::int64_t hk = item / items_per_head, local_item = item % items_per_head;
    const std::int64_t r = std::upper_bound(first_item, first_item + R + 1, local_item) - first_item - 1;
    const tiling& tl = tilings[r];
    const std::int64_t split = (local_item - first_item[r]) % tl.splits,
                       tile = (local_item - first_item[r]) / tl.splits;
    const std::int64_t t0 = cu[static_cast<std::size_t>(r)], q = queries_of(r), past = past_of(r);
    const std::int64_t i0 = tile * tl.per_tile, per_head = std::min(tl.per_tile, q - i0), rows = group * per_head;
    const tile_scratch<A> t =
        tile_scratch<A>::carve(ws.worker(worker), rows, D, D, block, copies_of(tl.decode), !tl.decode);
    const A sk = s * static_cast<A>(scales.key_scale(hk)), sv = static_cast<A>(scales.value_scale(hk));
    for (std::int64_t g = 0; g < group; ++g) {
      const T* qp = queries.data() + (hk * group + g) * queries.stride(1) + (t0 + i0) * queries.stride(2);
      for (std::int64_t i = 0; i < per_head; ++i)
        for (std::int64_t d = 0; d < D; ++d)
          t.q[(g * per_head + i) * D + d] = static_cast<A>(qp[i * queries.stride(2) + d]);
    }
    if (rotated_keys) hadamard_rotate(t.q, rows, D);
    t.start(rows, D);
    // Keys are numbered by absolute position.
    const auto vis = [&](std::int64_t row) {
      const std::int64_t qpos = past + i0 + row % per_head;
      return std::pair<std::int64_t, std::int64_t>{window > 0 ? std::max<std::int64_t>(qpos - window + 1, 0) : 0,
                                                   qpos + 1};
    };
    const std::int64_t first_q = past + i0;
    std::int64_t lo = window > 0 ? std::max<std::int64_t>(first_q - window + 1, 0) : 0, hi = first_q + per_head;
    lo = std::min(hi, lo + split * tl.split_length);
    if (tl.splits > 1) hi = std::min(hi, lo + tl.split_length);
    // The keys [lo, hi) as pieces of rows consecutive in memory: fn(k, kpitch, v, vpitch, p0, n).
    const auto for_each_piece = [&](auto&& fn) {
      if (lo < std::min(hi, past))
        visit_cached_runs(step_table(cache, call.group, step, static_cast<std::size_t>(r)), bs, window, lo,
                          std::min(hi, past), step.requests[static_cast<std::size_t>(r)], [&](const pool_run& run) {
                            fn(kpool + hk * head_pitch + run.row * W, W, vpool + hk * value_head_pitch + run.row * Wv,
                               Wv, run.position, run.count);
                          });
      const std::int64_t f0 = std::max(lo, past);
      if (f0 < hi)
        fn(keys.data() + hk * keys.stride(1) + (t0 + f0 - past) * keys.stride(2), keys.stride(2),
           values.data() + hk * values.stride(1) + (t0 + f0 - past) * values.stride(2), values.stride(2), f0, hi - f0);
    };
    if (in_place(tl.decode)) {  // each piece read in place, a block at a time (pools of A only)
      if constexpr (std::is_same_v<A, KV>)
        for_each_piece(
            [&](const KV* kp, std::int64_t kpitch, const KV* vp, std::int64_t vpitch, std::int64_t p0, std::int64_t n) {
              for (std::int64_t j = 0; j < n; j += block)
                fold_keys(t, rows, D, D, true, kp + j * kpitch, kpitch, vp + j * vpitch, vpitch, p0 + j,
                          std::min(block, n - j), sk, vis, nullptr);
            });
    } else {  // pieces gathered (widened) into blocks of `block` keys
      std::int64_t filled = 0, start = lo;
      for_each_piece(
          [&](const KV* kp, std::int64_t kpitch, const KV* vp, std::int64_t vpitch, std::int64_t p0, std::int64_t n) {
            for (std::int64_t j = 0; j < n;) {
              const std::int64_t m = std::min(block - filled, n - j);
              widen_rows(reinterpret_cast<const KF*>(kp + j * kpitch), m, D, kpitch, t.k + filled * D);
              widen_rows(reinterpret_cast<const VF*>(vp + j * vpitch), m, D, vpitch, t.v + filled * D);
              if (filled == 0) start = p0 + j;
              filled += m;
              j += m;
              if (filled == block) {
                fold_keys<A, A>(t, rows, D, D, tl.decode, t.k, D, t.v, D, start, filled, sk, vis, nullptr);
                filled = 0;
              }
            }
          });
      if (filled > 0) fold_keys<A, A>(t, rows, D, D, tl.decode, t.k, D, t.v, D, start, filled, sk, vis, nullptr);
    }
    if (rotated_values) hadamard_rotate(t.acc, rows, D);
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::int64_t h = hk * group + row / per_head, i = t0 + i0 + row % per_head;
      if (tl.splits == 1)
        finish_row(t, row, D, sv, &out(0, h, i, 0));
      else
        store_partial(t.m[row], t.l[row], t.acc + row * D, D,
                      partials + partial_at[r] + ((hk * tl.splits + split) * group * q + tile * rows + row) * pitch);
    }
  });
  // Requests cut into splits: each (KV head, request)'s rows merged over its splits, in order.
  context.executor.parallel_for(Hkv * R, [&](std::int64_t i, int) {
    const std::int64_t hk = i / R, r = i % R;
    const tiling& tl = tilings[r];
    if (tl.splits == 1 || tl.tiles == 0) return;
    const std::int64_t q = queries_of(r), t0 = cu[static_cast<std::size_t>(r)];
    const A sv = static_cast<A>(scales.value_scale(hk));
    for (std::int64_t row = 0; row < group * q; ++row)
      merge_partials(partials + partial_at[r] + (hk * tl.splits * group * q + row) * pitch, tl.splits,
                     group * q * pitch, D, sv, &out(0, hk * group + row / q, t0 + row % q, 0));
  });
}

}  // namespace detail

namespace detail {

// Whether a pool of KV reads its values through a scale list: fp8 codes, and row codes with an
// NVFP4 side; not the other row formats, whose scales are in the rows.
template <class KV>
inline constexpr bool takes_scale_lists = !is_row_code_v<KV> || key_tensor_scaled<KV> || value_tensor_scaled<KV>;

// The tensor scales of a pool of row codes with one NVFP4 side (a kvc::kv_codes pool): a side
// whose rows keep their scales must be given 1 (ValueError), and reads 1.
template <class KV, class Scales>
struct row_code_scales {
  const Scales& given;
  row_code_scales(const Scales& s, std::int64_t heads) : given(s) {
    for (std::int64_t h = 0; h < heads; ++h)
      for (const bool keys : {true, false})
        if (!(keys ? key_tensor_scaled<KV> : value_tensor_scaled<KV>)) {
          const float v = keys ? s.key_scale(h) : s.value_scale(h);
          if (v == 1.0f) continue;
          char digits[32];
          const auto end = std::to_chars(digits, digits + sizeof digits, v).ptr;
          throw ValueError("kvc::paged_attention: the " + std::string(keys ? "keys" : "values") + " are " +
                           std::string(keys ? key_format_t<KV>::name : value_format_t<KV>::name) +
                           " rows, which keep their scales in the rows: their tensor scale must be 1, got " +
                           std::string(digits, end));
        }
  }
  float key_scale(std::int64_t h) const { return key_tensor_scaled<KV> ? given.key_scale(h) : 1.0f; }
  float value_scale(std::int64_t h) const { return value_tensor_scaled<KV> ? given.value_scale(h) : 1.0f; }
};

// The scale lists of an fp8 pool's attention (kvc::Fp8Scales, detail::unit_scales).
template <class Scales>
concept fp8_scale_lists = requires(const Scales& sc) {
  { sc.key_scale(std::int64_t{0}) } -> std::convertible_to<float>;
  { sc.value_scale(std::int64_t{0}) } -> std::convertible_to<float>;
};

// What paged_attention takes: queries any tensor_input of Q in the pool's memory space; keys and
// values tensor_inputs of the pool's element type there. Row codes are widened to float: their
// queries are float, half or bfloat16.
template <class S, class Q, class QT, class KT, class VT>
constexpr bool check_paged_inputs() {
  using KV = typename S::element_type;
  if constexpr (is_row_code_v<KV> && std::is_same_v<Q, double>) {
    static_assert(!std::is_same_v<Q, double>,
                  "kvc::paged_attention: pools of row codes are read in float: the queries must be float, "
                  "Eigen::half or Eigen::bfloat16");
    return false;
  } else {
    constexpr bool accepted = input_of<QT, Q, S::space> && !is_float8_v<Q> && !is_row_code_v<Q> &&
                              input_of<KT, KV, S::space> && input_of<VT, KV, S::space>;
    return require_inputs<accepted, QT, KT, VT>();
  }
}

}  // namespace detail

// Attention of layer `layer_idx` for the step: queries [1, Hq, T, head_dim], keys and values
// [1, Hkv, T, head_dim] (the step's new tokens, packed as the queries), Hkv the cache's KV heads
// and Hq a multiple of it; each any kvc::tensor_input of the pool's element type on the host.
// Returns [1, Hq, T, head_dim]. `scale` defaults to 1 / sqrt(head_dim). Throws kvc::ValueError for
// a step or shapes that do not fit the cache.
template <class S, class QT, class KT, class VT>
  requires((S::space == memory_space::host || !detail::device_call<QT, KT, VT>) &&
           !is_row_code_v<typename S::element_type>)
HostTensor<typename S::element_type> paged_attention(const PagedCache<S>& cache, std::int64_t layer_idx,
                                                     const PagedAttentionStep& step, const QT& queries, const KT& keys,
                                                     const VT& values, std::optional<double> scale = std::nullopt) {
  HostTensor<typename S::element_type> out;
  paged_attention(cache, layer_idx, step, queries, keys, values, out, {}, scale);
  return out;
}

// The same into `out`, resized to [1, Hq, T, head_dim] (no allocation when it holds that many
// elements already), run by `context` (executor and workspace, as scaled_dot_product_attention's):
// with a workspace that has served a step of the same shape, the call allocates nothing. The
// results are the same on any executor and any number of threads.
template <class S, class QT, class KT, class VT>
  requires((S::space == memory_space::host || !detail::device_call<QT, KT, VT>) &&
           !is_row_code_v<typename S::element_type>)
void paged_attention(const PagedCache<S>& cache, std::int64_t layer_idx, const PagedAttentionStep& step,
                     const QT& queries, const KT& keys, const VT& values, HostTensor<typename S::element_type>& out,
                     const AttentionContext& context = {}, std::optional<double> scale = std::nullopt) {
  using T = typename S::element_type;
  if constexpr (detail::check_paged_inputs<S, T, QT, KT, VT>())
    detail::paged_attention_into(out, cache, layer_idx, step, input_view(queries), input_view(keys), input_view(values),
                                 scale, detail::unit_scales{}, context);
}

// The same over a pool of row codes (`PagedCache<HostStorage<kvc::int4_row>>`, int8_row, fp8_row,
// kvc::rotated ones, kvc::kv_codes pairs: <kvc/row_codes.hpp>; a pool with an NVFP4 side takes its
// tensor scales, as the fp8 pools below): queries of the model's type T (float, half or bfloat16);
// keys and values the step's tokens as the rows kvc::to_row_codes (to_kv_codes) made,
// [1, Hkv, T, cache.row_width()] and [..., cache.value_row_width()]. Each block of rows is widened
// to float as it is read. Returns [1, Hq, T, head_dim] in T.
template <class S, class QT, class KT, class VT>
  requires(S::space == memory_space::host && is_row_code_v<typename S::element_type>)
HostTensor<detail::input_element_or_t<QT>> paged_attention(const PagedCache<S>& cache, std::int64_t layer_idx,
                                                           const PagedAttentionStep& step, const QT& queries,
                                                           const KT& keys, const VT& values,
                                                           std::optional<double> scale = std::nullopt) {
  HostTensor<detail::input_element_or_t<QT>> out;
  paged_attention(cache, layer_idx, step, queries, keys, values, out, {}, scale);
  return out;
}

// The row codes' attention into `out`, run by `context`.
template <class S, class QT, class KT, class VT, class T>
  requires(S::space == memory_space::host && is_row_code_v<typename S::element_type>)
void paged_attention(const PagedCache<S>& cache, std::int64_t layer_idx, const PagedAttentionStep& step,
                     const QT& queries, const KT& keys, const VT& values, HostTensor<T>& out,
                     const AttentionContext& context = {}, std::optional<double> scale = std::nullopt) {
  static_assert(!detail::takes_scale_lists<typename S::element_type>,
                "kvc::paged_attention: an NVFP4 pool needs its tensor scales: pass kvc::Nvfp4TensorScales");
  if constexpr (!detail::takes_scale_lists<typename S::element_type>) {  // (nested: one misuse, one error)
    if constexpr (detail::check_paged_inputs<S, T, QT, KT, VT>())
      detail::paged_attention_into(out, cache, layer_idx, step, input_view(queries), input_view(keys),
                                   input_view(values), scale, detail::unit_scales{}, context);
  }
}

// The same over a pool of fp8 codes (`PagedCache<HostStorage<float8_e4m3>>` or `<float8_e5m2>`,
// <kvc/fp8_attention.hpp>): queries of the model's type T; keys and values the step's tokens as
// the codes kvc::to_fp8_keys / to_fp8_values made with `scales` (kvc::Fp8Scales: per tensor or per
// KV head, rows rotated or not), which the pool's codes share. Returns [1, Hq, T, head_dim] in T.
// The same for an NVFP4 pool (nvfp4_row) with its tensor scales (kvc::Nvfp4TensorScales).
template <class S, class QT, class KT, class VT, detail::fp8_scale_lists Scales>
  requires(S::space == memory_space::host || !detail::device_call<QT, KT, VT>)
HostTensor<detail::input_element_or_t<QT>> paged_attention(const PagedCache<S>& cache, std::int64_t layer_idx,
                                                           const PagedAttentionStep& step, const QT& queries,
                                                           const KT& keys, const VT& values, const Scales& scales,
                                                           std::optional<double> scale = std::nullopt) {
  HostTensor<detail::input_element_or_t<QT>> out;
  paged_attention(cache, layer_idx, step, queries, keys, values, scales, out, {}, scale);
  return out;
}

// The fp8 pool's attention into `out`, run by `context`.
template <class S, class QT, class KT, class VT, detail::fp8_scale_lists Scales, class T>
  requires(S::space == memory_space::host || !detail::device_call<QT, KT, VT>)
void paged_attention(const PagedCache<S>& cache, std::int64_t layer_idx, const PagedAttentionStep& step,
                     const QT& queries, const KT& keys, const VT& values, const Scales& scales, HostTensor<T>& out,
                     const AttentionContext& context = {}, std::optional<double> scale = std::nullopt) {
  using KV = typename S::element_type;
  static_assert(detail::takes_scale_lists<KV>,
                "kvc::paged_attention: row codes other than NVFP4 keep their scales in the rows: call it without "
                "scales");
  if constexpr (detail::takes_scale_lists<KV>) {  // (nested: one misuse, one error)
    if constexpr (detail::check_paged_inputs<S, T, QT, KT, VT>()) {
      if constexpr (requires { std::span<const float>(scales.keys); }) {  // lists (kvc::Fp8Scales): their length
        detail::check_fp8_scales(scales.keys, cache.num_key_value_heads(), "key");
        detail::check_fp8_scales(scales.values, cache.num_key_value_heads(), "value");
      }
      if constexpr (is_row_code_v<KV>) {  // rotation of row codes is their format's (kvc::rotated)
        const Fp8Rotation rotation = detail::rotation_of(scales);
        if (rotation.keys || rotation.values)
          throw ValueError(
              "kvc::paged_attention: Fp8Scales::rotation is for pools of fp8 codes; rotate row codes with "
              "kvc::rotated<C>");
      }
      if constexpr (detail::is_kv_codes<KV>)
        detail::paged_attention_into(out, cache, layer_idx, step, input_view(queries), input_view(keys),
                                     input_view(values), scale,
                                     detail::row_code_scales<KV, Scales>(scales, cache.num_key_value_heads()), context);
      else
        detail::paged_attention_into(out, cache, layer_idx, step, input_view(queries), input_view(keys),
                                     input_view(values), scale, scales, context);
    }
  }
}

}  // namespace kvc
