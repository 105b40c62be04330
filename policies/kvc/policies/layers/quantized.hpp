#pragma once
// kvc::QuantizedLayer<Codec>: a dynamic layer that keeps most of its tokens quantized
// (transformers' QuantizedLayer, QuantoQuantizedLayer and HQQQuantizedLayer in
// src/transformers/cache_utils.py at a597f974).
// Codecs, the meaning of `axis` and the packing: <kvc/policies/quantization/codecs.hpp> and
// docs/quantized.md; what kvc does differently from transformers: docs/differences.md. Over
// CudaStorage the codes live on the device and the codecs run as kernels
// (<kvc/policies/quantization/cuda_codecs.cuh>, docs/cuda.md).
//
// What the layer holds:
//   - the quantized history of K and V (packed codes, and a scale and offset per group);
//   - the residual: the tokens added since the last quantization, in full precision;
//   - a dequantized workspace, [batch, heads, capacity, head_dim] per K and V in the element type
//     (a detail::kv_store, like the residual), which the views returned by `update` point into. It
//     must outlive the call (the views stay valid until the next call that changes the layer), so
//     the layer keeps it, and reuses it: between two quantizations its front holds
//     dequant(history) + residual, and an update only appends the new tokens (amortized O(q));
//     after a quantization (every residual_length decode steps) the next update dequantizes the
//     history again (O(sequence)). Its capacity is the sequence plus
//     max(min(residual_length, sequence), sequence / 16) tokens. `release_workspace()` frees it
//     when the caller no longer needs the views (the next update rebuilds it).
// bytes() counts all three; quantized_bytes(), residual_bytes() and workspace_bytes() split it.
// for_each_buffer walks nothing: offload engines leave a quantized layer where it is (its codes,
// residual and workspace alike).
//
// The options (transformers' nbits, axis_key, axis_value, q_group_size, residual_length; kvc's
// append_only, rotate_keys, rotate_values and value_nbits) are the members of the layer kind,
// declared once: kvc::QuantizedOptions, QuantizedCache's argument, is
// QuantizedLayer<void> (the same members and defaults, no codec). One function,
// detail::validate_quantized_options, checks them for the layer's constructor and QuantizedCache's.
//
// `update`: the first call quantizes all of k and v and returns the inputs themselves (copied);
// later calls return dequant(history) + residual + new, and when the residual already holds
// residual_length - 1 tokens or more (and is not empty), everything returned is quantized again
// and the residual is emptied; otherwise the new tokens join the residual.
//
// `append_only` (a kvc option, off by default; docs/differences.md): at those same moments only
// the residual and the new tokens are quantized, as a chunk of their own appended to the history,
// which is never quantized again (KIVI's scheme). The history is then a list of chunks, each
// quantized on its own (detail::quantized_history); without the option it is always one chunk.
// kvc::kivi_options() are KIVI's settings: keys grouped along seq (one scale per channel and
// chunk of tokens), values along head_dim (per token), append-only.
//
// `rotate_keys` / `rotate_values` (kvc options, off by default; docs/quantized.md): the history's
// codes are those of the rows rotated by kvc::hadamard_rotate (quantized from a float copy), which
// spreads a few large channels over the whole row. Nothing else is rotated: the residual, what
// `stored` returns and the views `update` returns hold the rows as given (the workspace's history is
// rotated back after it is dequantized). The layer also keeps the residual's rows rotated, in
// float (rotated_residual(): each token rotated once, as it arrives; counted in residual_bytes()),
// so that kvc::attend_quantized reads codes and residual alike with rotated queries, rotating its
// output back once when the values are rotated; a flush of the fused path (append) quantizes the
// history again in rotated space, from its codes and that copy. Host storage only: over
// CudaStorage the constructor throws.

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers/dynamic.hpp>
#include <kvc/policies/layers/kv_store.hpp>
#include <kvc/policies/quantization/codecs.hpp>
#include <kvc/rotation.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

template <class Codec>
struct QuantizedLayer;

// transformers' QuantizedCache keyword arguments: QuantizedLayer's options before a codec is chosen
// (QuantizedCache picks it from its backend). The same class template as the layer kinds, so that
// the options and their defaults are written once, below.
using QuantizedOptions = QuantizedLayer<void>;

namespace detail {

// The same options, as the layer kind of `Codec` (QuantizedCache: QuantizedOptions to the kind of
// its backend).
template <class Codec, class From>
constexpr QuantizedLayer<Codec> with_codec(const QuantizedLayer<From>& o) noexcept {
  return {o.nbits,       o.axis_key,    o.axis_value,    o.q_group_size, o.residual_length,
          o.append_only, o.rotate_keys, o.rotate_values, o.value_nbits};
}

// The quantized history of one K or V tensor: chunks of consecutive tokens, each a quantized tensor
// QT of its own (quantized_tensor on the host, device_quantized_tensor on CUDA). Without
// append_only it holds one chunk, replaced whenever the layer quantizes; with it, every quantization
// appends a chunk.
template <class QT>
class quantized_history {
 public:
  quantized_history() = default;
  explicit quantized_history(QT&& first) {
    chunks_.push_back(std::move(first));
    tokens_ = chunks_.back().tokens();
  }

  std::int64_t tokens() const noexcept { return tokens_; }
  std::size_t chunks() const noexcept { return chunks_.size(); }
  const QT& chunk(std::size_t i) const noexcept { return chunks_[i]; }
  // Codes and metadata of every chunk.
  std::int64_t bytes() const noexcept {
    std::int64_t n = 0;
    for (const QT& c : chunks_) n += c.bytes();
    return n;
  }

  // Room for one more chunk: then push cannot throw.
  void reserve_one() { chunks_.reserve(chunks_.size() + 1); }
  void push(QT&& c) noexcept {
    tokens_ += c.tokens();
    chunks_.push_back(std::move(c));
  }

  // Writes every token dequantized: token t of block (b, h) to dst + b * stride_b + h * stride_h +
  // t * dim.
  template <class T>
  void decode(T* dst, std::int64_t stride_b, std::int64_t stride_h, std::int64_t dim) const {
    std::int64_t start = 0;
    for (const QT& c : chunks_) {
      c.decode(dst + start * dim, stride_b, stride_h);
      start += c.tokens();
    }
  }

  // Saved state (docs/state.md): the chunks one after the other.
  template <class A>
  void transfer(A& ar) {
    auto n = static_cast<std::int64_t>(chunks_.size());
    ar.value(n);
    if constexpr (A::loading) {
      ar.check(n >= 0 && n <= max_extent, "the chunk count");
      ar.reserve(static_cast<std::uint64_t>(n) * 80, "the quantized chunks");  // a chunk takes >= 80 bytes
      chunks_.assign(static_cast<std::size_t>(n), QT{});
    }
    for (QT& c : chunks_) c.transfer(ar);
    if constexpr (A::loading) {
      tokens_ = 0;
      for (const QT& c : chunks_) tokens_ += c.tokens();
    }
  }
  // Whether every chunk has this batch, head count and head_dim.
  bool fits(std::int64_t batch, std::int64_t heads, std::int64_t dim) const noexcept {
    return std::all_of(chunks_.begin(), chunks_.end(), [&](const QT& c) {
      return c.layout().batch == batch && c.layout().heads == heads && c.layout().dim == dim;
    });
  }
  // Whether every chunk is coded as the layer codes: this width, grouping and group size.
  bool coded_as(int nbits, quant_grouping grouping, std::int64_t group_size) const noexcept {
    return std::all_of(chunks_.begin(), chunks_.end(), [&](const QT& c) {
      return c.layout().nbits == nbits && c.layout().grouping == grouping && c.layout().group_size == group_size;
    });
  }
  // Whether o's chunks hold the same numbers of tokens as this history's, one for one (the keys' and
  // values' histories of a layer are cut alike: attention walks their chunks in step).
  bool cut_as(const quantized_history& o) const noexcept {
    return std::equal(chunks_.begin(), chunks_.end(), o.chunks_.begin(), o.chunks_.end(),
                      [](const QT& a, const QT& b) { return a.tokens() == b.tokens(); });
  }

  // Batch entry i of the copy is entry indices[i] of this history (packed bytes copied as they are).
  quantized_history gathered(std::span<const std::int64_t> indices) const {
    quantized_history out;
    out.chunks_.reserve(chunks_.size());
    for (const QT& c : chunks_) out.chunks_.push_back(c.gathered(indices));
    out.tokens_ = tokens_;
    return out;
  }

 private:
  std::vector<QT> chunks_;
  std::int64_t tokens_ = 0;
};

// The checks of transformers' QuantoQuantizedLayer.__init__ and HQQQuantizedLayer.__init__: the
// codec's, in its order (nbits, axis_key, axis_value), then kvc's value_nbits (0 or a width the
// codec takes), then q_group_size and residual_length (positive, and at most kvc::max_extent).
// The layer's constructor and QuantizedCache's both run this one.
template <class Codec>
void validate_quantized_options(const QuantizedLayer<Codec>& o) {
  Codec::validate(o.nbits, o.axis_key, o.axis_value);
  if (o.value_nbits != 0 && !Codec::valid_nbits(o.value_nbits))
    throw ValueError(join_message({Codec::layer_name, ": `value_nbits` has to be 0 (the keys' nbits) or one of ",
                                   Codec::nbits_choices, ", got ", std::to_string(o.value_nbits)}));
  check_size(join_message({Codec::layer_name, ": `q_group_size`"}), o.q_group_size, 1, max_extent);
  check_size(join_message({Codec::layer_name, ": `residual_length`"}), o.residual_length, 1, max_extent);
}

}  // namespace detail

// Keeps the tokens quantized with Codec (QuantoCodec or HqqCodec) and the last few in full
// precision. The options are transformers' constructor arguments, with its defaults.
// QuantizedLayer<void> (QuantizedOptions) has the same options and is no layer kind.
template <class Codec>
struct QuantizedLayer {
  // Bits per code: 2 or 4 with QuantoCodec; 1, 2, 3, 4 or 8 with HqqCodec.
  std::int64_t nbits = 4;
  // How K's groups run: along head_dim (quanto 0, HQQ 1) or along seq (quanto -1, HQQ 0).
  std::int64_t axis_key = 0;
  // How V's groups run: along head_dim (quanto 0, HQQ 1) or along seq (quanto -1, HQQ 0).
  std::int64_t axis_value = 0;
  // Elements per quantization group (positive).
  std::int64_t q_group_size = 64;
  // How many recent tokens stay in full precision: an update quantizes them once the residual
  // holds residual_length - 1 or more (positive).
  std::int64_t residual_length = 128;
  // kvc's option: quantize only what leaves the residual, as a chunk appended to the history.
  bool append_only = false;
  // kvc's options: quantize keys (values) rotated by kvc::hadamard_rotate, which spreads outlier
  // channels over the row; what the layer returns and stores in full precision is not rotated
  // (see the top of this header). Host storage only.
  bool rotate_keys = false;
  // See rotate_keys.
  bool rotate_values = false;
  // kvc's option: bits per code of the values, where they differ from the keys' (8-bit keys with
  // 2-bit values, ...): 0 (the default) quantizes values with nbits, as transformers' layers do.
  // Checked as nbits is.
  std::int64_t value_nbits = 0;

  // The bits per code of the values: value_nbits, or nbits where it is 0.
  constexpr std::int64_t value_bits() const noexcept { return value_nbits != 0 ? value_nbits : nbits; }

  // Any storage with a quantized tensor type (detail::quantized_tensor_for): HostStorage, where
  // the codecs run on the CPU, and CudaStorage, where they run as kernels.
  template <class S>
  class state {
    static_assert(!std::is_void_v<Codec>,
                  "kvc::QuantizedOptions is not a layer kind: use QuantoQuantizedLayer or HQQQuantizedLayer");

   public:
    // The layer kind this state belongs to.
    using kind_type = QuantizedLayer;
    // The view type `update` and `stored` return (S::view_type).
    using view = typename S::view_type;
    // The element type of K/V (S::element_type).
    using element_type = typename S::element_type;
    // The type of the scales and offsets: the element type for 16-bit floats, float otherwise.
    using meta_type = detail::quant_meta_t<element_type>;
    // False: the layer keeps every token.
    static constexpr bool is_sliding = false;
    // False: the buffers move as they grow (transformers' is_compileable).
    static constexpr bool is_compileable = false;
    // True: lazy_initialization may give the layer its shape before the first update.
    static constexpr bool supports_early_init = true;
    // True: the Cache's batch_repeat_interleave and batch_select_indices apply to the layer.
    static constexpr bool supports_batch_ops = true;
    // The kind's name, Codec::layer_name: QuantoQuantizedLayer or HQQQuantizedLayer.
    static constexpr std::string_view name = Codec::layer_name;

    // Checks the options (detail::validate_quantized_options).
    explicit state(const QuantizedLayer& kind) : opts_(kind) {
      detail::validate_quantized_options(kind);
      if constexpr (S::space != memory_space::host)
        if (kind.rotate_keys || kind.rotate_values)
          throw ValueError(
              detail::join_message({Codec::layer_name, ": rotate_keys and rotate_values need host storage"}));
    }

    // Returns the layer's options.
    const QuantizedLayer& options() const noexcept { return opts_; }
    // Whether the layer has a shape (from lazy_initialization or its first update).
    bool is_initialized() const noexcept { return initialized_; }
    // Returns the layer's batch, heads and K/V head_dims (all 0 before it has a shape).
    LayerShape shape() const noexcept { return shape_; }

    // Everything held: quantized history, residual and workspace.
    std::int64_t bytes() const noexcept { return quantized_bytes() + residual_bytes() + workspace_bytes(); }
    // The quantized history of K and V: packed codes plus scales and offsets.
    std::int64_t quantized_bytes() const noexcept { return qk_.bytes() + qv_.bytes(); }
    // The full-precision residual (its allocated capacity), and with rotation its rotated copy.
    std::int64_t residual_bytes() const noexcept {
      return residual_.bytes() + static_cast<std::int64_t>((rot_.k.size() + rot_.v.size()) * sizeof(float));
    }
    // The dequantized workspace the returned views point into (its allocated capacity).
    std::int64_t workspace_bytes() const noexcept { return ws_.bytes(); }
    // No buffer for offload engines to move (docs/offload.md): the walk is empty, on purpose.
    template <class F>
    void for_each_buffer(F&&) noexcept {}

    // Returns the number of tokens in the quantized history.
    std::int64_t quantized_tokens() const noexcept { return qk_.tokens(); }
    // Returns the number of tokens in the full-precision residual.
    std::int64_t residual_tokens() const noexcept { return rlen_; }

    // Frees the workspace: the views returned so far become invalid, and the next update
    // dequantizes the history again.
    void release_workspace() noexcept {
      ws_ = detail::kv_store<S>();
      ws_fresh_ = false;
    }

    // Records the shape; allocates nothing.
    void lazy_initialization(LayerShape shape) {
      detail::kv_store<S> residual(shape, 0, false);
      clear();
      shape_ = shape;
      residual_ = std::move(residual);
      initialized_ = true;
    }

    // Appends k and v ([batch, heads, q, head_dim]) and returns every token, K and V: the history
    // dequantized, then the residual and the new tokens (see the top of this header). On the host,
    // an allocation that fails (kvc::MemoryError, kvc::ValueError) leaves the layer as it was.
    KV<view> update(const view& k, const view& v) {
      if (!initialized_ || cumulative_ == 0) return first_update(k, v);
      const std::int64_t q = k.extent(2);
      const std::int64_t qlen = qk_.tokens();
      const std::int64_t held = qlen + rlen_;
      const std::int64_t total = held + q;
      // An empty residual never triggers (transformers tests `keys.dim() == 4`, false for its
      // 1-D empty residual).
      const bool flush = rlen_ > 0 && rlen_ + 1 >= opts_.residual_length;

      // Everything that can throw on the host happens first, aside; the commit below cannot throw
      // there (on a device its writes can, and they come before its moves).
      std::optional<detail::kv_store<S>> grown_residual;
      std::optional<rotated_store> grown_rotated;
      if (!flush && rlen_ + q > residual_.capacity()) {
        grown_residual = residual_.relocated(residual_capacity_for(q), 0, rlen_);
        grown_rotated = rotated_copy(grown_residual->capacity(), rlen_);
      }
      const bool rebuild_in_place = !ws_fresh_ && !flush && ws_.capacity() >= total;
      std::optional<detail::kv_store<S>> grown_ws;
      if (ws_.capacity() < total || (!ws_fresh_ && !rebuild_in_place)) {
        if (ws_fresh_) {
          grown_ws = ws_.relocated(workspace_capacity(total), 0, held);
        } else {
          grown_ws.emplace(shape_, workspace_capacity(total), false);
          fill_from_store(*grown_ws);
        }
      }
      detail::kv_store<S>& w = grown_ws ? *grown_ws : ws_;

      if (flush) {
        // The new tokens go after the held prefix (in place, this leaves the prefix the previous
        // views show untouched), then all `total` tokens are quantized, or with append_only the
        // residual and the new ones (w holds the residual exactly after the history).
        w.write(held, k, v);
        if (opts_.append_only) {
          qtensor nk = encode(w.keys(qlen, total - qlen), kv_part::keys);
          qtensor nv = encode(w.values(qlen, total - qlen), kv_part::values);
          qk_.reserve_one();
          qv_.reserve_one();
          if (grown_ws) ws_ = std::move(*grown_ws);
          qk_.push(std::move(nk));
          qv_.push(std::move(nv));
        } else {
          // A rotated part from its codes and the residual's rotated copy, as append does (the same
          // codes and scales; w holds the history rotated back).
          const rotated_rows rot = rotated_residual();
          history nk(opts_.rotate_keys ? requantized(qk_, rot.keys, shape_.key_head_dim, k, kv_part::keys)
                                       : encode(w.keys(0, total), kv_part::keys));
          history nv(opts_.rotate_values ? requantized(qv_, rot.values, shape_.value_head_dim, v, kv_part::values)
                                         : encode(w.values(0, total), kv_part::values));
          if (grown_ws) ws_ = std::move(*grown_ws);
          qk_ = std::move(nk);
          qv_ = std::move(nv);
        }
        rlen_ = 0;
        cumulative_ += q;
        ws_fresh_ = false;  // it holds what was returned, not dequant of the new history
        return ws_.kv(0, total);
      }

      // Every write before any move: on a device a write can throw (a CUDA error), and then the
      // layer keeps its buffers (writes past held / rlen_ are invisible).
      if (rebuild_in_place) fill_from_store(ws_);
      w.write(held, k, v);
      detail::kv_store<S>& r = grown_residual ? *grown_residual : residual_;
      r.write(rlen_, k, v);
      write_rotated(grown_rotated ? *grown_rotated : rot_, rlen_, k, v);
      if (grown_ws) ws_ = std::move(*grown_ws);
      if (grown_residual) residual_ = std::move(*grown_residual);
      if (grown_rotated) rot_ = std::move(*grown_rotated);
      rlen_ += q;
      cumulative_ += q;
      ws_fresh_ = true;
      return ws_.kv(0, total);
    }

    // The fused path's store (kvc::attend_quantized, <kvc/quantized_attention.hpp>): k and v are
    // kept exactly as update keeps them (quantized at the same moments, so the codes are the same)
    // but no dequantized workspace is made, and any is released: the layer then holds its codes
    // and its residual only. A flush quantizes from a temporary of the whole sequence, freed at
    // once. Strong guarantee: what allocates comes before anything changes.
    void append(const view& k, const view& v) {
      const std::int64_t q = k.extent(2);
      if (!initialized_ || cumulative_ == 0) {
        const LayerShape shape = detail::shape_of(k, v);
        history nk(encode(k, kv_part::keys));
        history nv(encode(v, kv_part::values));
        detail::kv_store<S> residual(shape, 0, false);
        shape_ = shape;
        qk_ = std::move(nk);
        qv_ = std::move(nv);
        residual_ = std::move(residual);
        rot_ = rotated_store();
        rlen_ = 0;
        cumulative_ = q;
        initialized_ = true;
        release_workspace();
        return;
      }
      const std::int64_t held = qk_.tokens() + rlen_, total = held + q;
      if (rlen_ > 0 && rlen_ + 1 >= opts_.residual_length && opts_.append_only) {  // update's flush
        detail::kv_store<S> chunk(shape_, rlen_ + q, false);
        const KV<view> r = residual_.kv(0, rlen_);
        chunk.write(0, r.keys, r.values);
        chunk.write(rlen_, k, v);
        qtensor nk = encode(chunk.keys(0, rlen_ + q), kv_part::keys);
        qtensor nv = encode(chunk.values(0, rlen_ + q), kv_part::values);
        qk_.reserve_one();
        qv_.reserve_one();
        qk_.push(std::move(nk));
        qv_.push(std::move(nv));
        rlen_ = 0;
      } else if (rlen_ > 0 && rlen_ + 1 >= opts_.residual_length) {
        // A rotated part is quantized again where it is stored, in rotated space (requantized);
        // a part that is not, from the sequence dequantized.
        const rotated_rows rot = rotated_residual();
        std::optional<detail::kv_store<S>> all;
        if (!opts_.rotate_keys || !opts_.rotate_values) {
          all.emplace(shape_, total, false);
          fill_from_store(*all);
          all->write(held, k, v);
        }
        history nk(opts_.rotate_keys ? requantized(qk_, rot.keys, shape_.key_head_dim, k, kv_part::keys)
                                     : encode(all->keys(0, total), kv_part::keys));
        history nv(opts_.rotate_values ? requantized(qv_, rot.values, shape_.value_head_dim, v, kv_part::values)
                                       : encode(all->values(0, total), kv_part::values));
        qk_ = std::move(nk);
        qv_ = std::move(nv);
        rlen_ = 0;
      } else {
        if (rlen_ + q > residual_.capacity()) {
          detail::kv_store<S> grown = residual_.relocated(residual_capacity_for(q), 0, rlen_);
          rotated_store grown_rotated = rotated_copy(grown.capacity(), rlen_);
          grown.write(rlen_, k, v);
          write_rotated(grown_rotated, rlen_, k, v);
          residual_ = std::move(grown);
          rot_ = std::move(grown_rotated);
        } else {
          residual_.write(rlen_, k, v);
          write_rotated(rot_, rlen_, k, v);
        }
        rlen_ += q;
      }
      cumulative_ += q;
      release_workspace();
    }
    // What the fused path reads: the quantized history (detail::quantized_history: its chunks) and
    // the residual's tokens.
    const auto& quantized_keys() const noexcept { return qk_; }
    // The quantized history of V (detail::quantized_history: its chunks).
    const auto& quantized_values() const noexcept { return qv_; }
    // Returns the residual's tokens, K and V.
    KV<view> residual_kv() const noexcept { return residual_.kv(0, rlen_); }

    // The residual's rows rotated, in float (what the rotated codes are read against), kept with the
    // residual while the layer rotates: rows of block (batch b, head h) from keys + (b * heads + h) *
    // capacity * key_head_dim (values likewise); null for a part the layer does not rotate.
    struct rotated_rows {
      // The keys' rows, or null when the keys are not rotated.
      const float* keys;
      // The values' rows, or null when the values are not rotated.
      const float* values;
      // Rows per (batch, head) block.
      std::int64_t capacity;
    };
    // Returns the residual's rotated rows (rows [0, residual_tokens()) of each block).
    rotated_rows rotated_residual() const noexcept {
      return {rot_.k.empty() ? nullptr : rot_.k.data(), rot_.v.empty() ? nullptr : rot_.v.data(), rot_.cap};
    }

    // Returns the number of tokens held: quantized plus residual.
    std::int64_t get_seq_length() const noexcept { return cumulative_; }
    // Returns (kv_length, kv_offset) for a query of q tokens: (tokens held + q, 0).
    std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t q) const noexcept { return {cumulative_ + q, 0}; }
    // Returns -1: the layer has no maximum length.
    std::int64_t get_max_length() const noexcept { return -1; }

    // How many of its last tokens the layer can drop exactly (docs/rollback.md): those of its
    // full-precision residual, or every token while nothing is quantized (kvc::unbounded_rollback).
    // A cut into the quantized history cannot be exact: the codes of a group depend on every value in
    // it, so a chunk cut short and quantized again differs from the chunk a cache that never saw the
    // cut tokens would hold.
    std::int64_t rollback_depth() const noexcept { return qk_.tokens() == 0 ? unbounded_rollback : rlen_; }
    // Checks that crop(tokens_to_remove) can run, changing nothing: throws kvc::RuntimeError when it
    // would remove more than rollback_depth() tokens; a positive count gives the deprecation warning.
    void check_crop(std::int64_t tokens_to_remove) const {
      if (!initialized_) return;
      detail::check_rollback(Codec::layer_name, detail::crop_count(tokens_to_remove, cumulative_), rollback_depth(),
                             "the tokens of its full-precision residual; the quantized history cannot be cut exactly");
      if (tokens_to_remove > 0) warn_once(positive_crop_deprecation);
    }
    // Negative: removes the last -tokens_to_remove tokens from the residual. Positive: the deprecated
    // absolute length (with DynamicLayer's warning). Throws kvc::RuntimeError as check_crop does,
    // changing nothing.
    void crop(std::int64_t tokens_to_remove) {
      check_crop(tokens_to_remove);
      if (!initialized_) return;
      const std::int64_t count = detail::dynamic_crop_count(tokens_to_remove, cumulative_);
      cumulative_ -= count;
      rlen_ -= count;  // the workspace's prefix stays what it was
    }

    // Drops everything: the next update starts afresh and may have another shape.
    void reset() noexcept {
      clear();
      shape_ = LayerShape{};
      residual_ = detail::kv_store<S>();
      initialized_ = false;
    }

    // transformers' layer.keys / layer.values: the full-precision residual.
    KV<view> stored() const noexcept { return residual_.kv(0, rlen_); }

    // Batch entry i of the copy is entry batch_indices[i] of this layer; the quantized history is
    // copied as packed bytes (exact, nothing is quantized again).
    state gathered(std::span<const std::int64_t> batch_indices) const {
      state out(*this, 0);
      if (!initialized_) return out;
      out.shape_.batch = static_cast<std::int64_t>(batch_indices.size());
      out.qk_ = qk_.gathered(batch_indices);
      out.qv_ = qv_.gathered(batch_indices);
      out.residual_ = residual_.gathered(batch_indices);
      out.rot_ = out.rotated_copy(out.residual_.capacity());
      out.write_rotated(out.rot_, 0, out.residual_.keys(0, rlen_), out.residual_.values(0, rlen_));
      if (ws_fresh_) out.ws_ = ws_.gathered(batch_indices, qk_.tokens() + rlen_);
      out.ws_fresh_ = ws_fresh_;
      return out;
    }

    // Saved state (docs/state.md): the options, the counters, the quantized history and the
    // residual. The workspace is not saved: a loaded layer dequantizes its history again at its
    // next update, which gives what the workspace held.
    QuantizedLayer kind() const noexcept { return opts_; }
    // Writes the layer into a saved state, or reads it back (kvc::save, kvc::load); loading throws
    // kvc::StateError when the options differ or the saved counters and tensors disagree.
    template <class A>
    void transfer(A& ar) {
      ar.param("nbits", opts_.nbits);
      ar.param("axis_key", opts_.axis_key);
      ar.param("axis_value", opts_.axis_value);
      ar.param("q_group_size", opts_.q_group_size);
      ar.param("residual_length", opts_.residual_length);
      ar.param("append_only", opts_.append_only);
      ar.param("rotate_keys", opts_.rotate_keys);
      ar.param("rotate_values", opts_.rotate_values);
      ar.param("value_nbits", opts_.value_bits());  // the width: 0 and nbits mean the same
      ar.value(initialized_);
      ar.value(shape_.batch);
      ar.value(shape_.heads);
      ar.value(shape_.key_head_dim);
      ar.value(shape_.value_head_dim);
      ar.value(rlen_);
      ar.value(cumulative_);
      qk_.transfer(ar);
      qv_.transfer(ar);
      ar.kv(residual_, 0, rlen_, rlen_);
      if constexpr (A::loading) {
        const LayerShape s = shape_;
        const auto in_range = [](std::int64_t x) { return x >= 0 && x <= max_extent; };
        ar.check(in_range(s.batch) && in_range(s.heads) && in_range(s.key_head_dim) && in_range(s.value_head_dim) &&
                     in_range(rlen_) && (initialized_ || cumulative_ == 0),
                 "the layer's shape and counters");
        ar.check(qk_.tokens() == qv_.tokens() && cumulative_ == qk_.tokens() + rlen_, "the token counts");
        ar.check(qk_.fits(s.batch, s.heads, s.key_head_dim) && qv_.fits(s.batch, s.heads, s.value_head_dim) &&
                     (!initialized_ || residual_.shape() == s),
                 "the quantized tensors' shapes");
        // The chunks as the layer writes them: K's and V's cut alike (attention reads them in step),
        // one chunk unless append_only, each at its part's width, grouping and group size.
        ar.check(qk_.cut_as(qv_) && (opts_.append_only || qk_.chunks() <= 1), "the quantized chunks' token counts");
        ar.check(qk_.coded_as(bits_of(kv_part::keys), Codec::grouping(opts_.axis_key), opts_.q_group_size) &&
                     qv_.coded_as(bits_of(kv_part::values), Codec::grouping(opts_.axis_value), opts_.q_group_size),
                 "the quantized chunks' widths and groups");
        ws_ = detail::kv_store<S>();
        ws_fresh_ = false;
        rot_ = rotated_store();
        if (initialized_ && (opts_.rotate_keys || opts_.rotate_values)) {
          try {
            rot_ = rotated_copy(residual_.capacity());
          } catch (const ValueError&) {  // above kvc's limits: the file's residual is too large
            ar.check(false, "the residual's size");
          }
          write_rotated(rot_, 0, residual_.keys(0, rlen_), residual_.values(0, rlen_));
        }
      }
    }

   private:
    using qtensor = detail::quantized_tensor_t<S, meta_type>;
    using history = detail::quantized_history<qtensor>;

    state(const state& o, int)
        : opts_(o.opts_), shape_(o.shape_), rlen_(o.rlen_), cumulative_(o.cumulative_), initialized_(o.initialized_) {}

    void clear() noexcept {
      qk_ = history();
      qv_ = history();
      ws_ = detail::kv_store<S>();
      rlen_ = cumulative_ = 0;
      rot_ = rotated_store();
      ws_fresh_ = false;
    }

    // The residual's capacity when q more tokens do not fit: doubling, at least 16 (or the residual
    // length, if shorter).
    std::int64_t residual_capacity_for(std::int64_t q) const noexcept {
      return std::max({rlen_ + q, 2 * residual_.capacity(), std::min<std::int64_t>(opts_.residual_length, 16)});
    }

    // Room for `total` tokens and the ones the next few updates add: residual_length more (a
    // single-token decode quantizes, and so rebuilds the workspace anyway, within that many steps),
    // but never more than `total` more (a residual_length far above the sequence would otherwise
    // reserve room for tokens that may never come; doubling keeps appends amortized O(1)), or a
    // sixteenth more for long multi-token appends (amortized O(1) copies per token).
    std::int64_t workspace_capacity(std::int64_t total) const noexcept {
      const std::int64_t extra = std::max(std::min(opts_.residual_length, total), total / 16);
      return std::max(total + extra, detail::min_dynamic_capacity);
    }

    // Which of K and V a quantization is for: the options give each its bits, grouping and rotation.
    enum class kv_part { keys, values };
    int bits_of(kv_part p) const noexcept {
      return static_cast<int>(p == kv_part::keys ? opts_.nbits : opts_.value_bits());
    }
    std::int64_t axis_of(kv_part p) const noexcept { return p == kv_part::keys ? opts_.axis_key : opts_.axis_value; }

    // x ([batch, heads, tokens, head_dim], each token's head_dim elements contiguous) quantized as
    // the options say for part p (nbits or value_bits(), grouped as axis_key or axis_value says);
    // with rotate_keys (rotate_values), its rows rotated first, in a float copy of x.
    qtensor encode(const view& x, kv_part p) const {
      const int bits = bits_of(p);
      const std::int64_t axis = axis_of(p);
      const bool rotate = p == kv_part::keys ? opts_.rotate_keys : opts_.rotate_values;
      const std::int64_t B = x.extent(0), H = x.extent(1), n = x.extent(2), d = x.extent(3);
      if constexpr (S::space == memory_space::host) {
        if (rotate && B * H * n * d > 0) {  // (an empty view may have no data to offset)
          std::vector<float> rows(static_cast<std::size_t>(detail::checked_elements({B, H, n, d}, sizeof(float))));
          for (std::int64_t blk = 0; blk < B * H; ++blk) rotated_rows_of(x, blk, rows.data() + blk * n * d);
          return qtensor::template encode<Codec>(bits, Codec::grouping(axis), opts_.q_group_size, rows.data(), B, H, n,
                                                 d, H * n * d, n * d);
        }
      }
      return qtensor::template encode<Codec>(bits, Codec::grouping(axis), opts_.q_group_size, x.data(), B, H, n, d,
                                             x.stride(0), x.stride(1));
    }

    // The residual's rows rotated, for the parts the layer rotates: [batch * heads, cap, head_dim]
    // floats each (empty for a part it does not rotate), rows [0, rlen_) written.
    struct rotated_store {
      std::vector<float> k, v;
      std::int64_t cap = 0;
    };
    // A store of `cap` rows per block for the layer's shape, holding rows [0, keep) of rot_.
    rotated_store rotated_copy(std::int64_t cap, std::int64_t keep = 0) const {
      rotated_store out;
      if constexpr (S::space == memory_space::host) {
        const std::int64_t blocks = shape_.batch * shape_.heads;
        for (auto [part, from, dim, on] : {std::tuple{&out.k, &rot_.k, shape_.key_head_dim, opts_.rotate_keys},
                                           std::tuple{&out.v, &rot_.v, shape_.value_head_dim, opts_.rotate_values}}) {
          if (!on) continue;
          part->resize(static_cast<std::size_t>(
              detail::checked_elements({shape_.batch, shape_.heads, cap, dim}, sizeof(float))));
          for (std::int64_t blk = 0; blk < blocks && keep > 0; ++blk)
            std::copy_n(from->data() + blk * rot_.cap * dim, keep * dim, part->data() + blk * cap * dim);
        }
        out.cap = cap;
      }
      return out;
    }
    // The rows of block `blk` (batch blk / heads, head blk % heads) of x, as floats, rotated, to
    // dst (x's extent(2) rows of extent(3) values). x must hold at least one row.
    static void rotated_rows_of(const view& x, std::int64_t blk, float* dst) noexcept {
      const std::int64_t H = x.extent(1), q = x.extent(2), dim = x.extent(3);
      const element_type* src = x.data() + blk / H * x.stride(0) + blk % H * x.stride(1);
      for (std::int64_t t = 0; t < q; ++t)
        for (std::int64_t d = 0; d < dim; ++d) dst[t * dim + d] = detail::to_float(src[t * x.stride(2) + d]);
      hadamard_rotate(dst, q, dim);
    }
    // Writes k's and v's rows, rotated, to rows [at, at + q) of `to`'s blocks. Allocates nothing.
    void write_rotated(rotated_store& to, std::int64_t at, const view& k, const view& v) const noexcept {
      if constexpr (S::space == memory_space::host) {
        const std::int64_t H = shape_.heads, blocks = shape_.batch * H, q = k.extent(2);
        if (q == 0) return;  // (an empty view may have no data to offset)
        assert(at + q <= to.cap);
        for (auto [part, x, dim] :
             {std::tuple{&to.k, &k, shape_.key_head_dim}, std::tuple{&to.v, &v, shape_.value_head_dim}}) {
          if (part->empty()) continue;
          for (std::int64_t blk = 0; blk < blocks; ++blk)
            rotated_rows_of(*x, blk, part->data() + (blk * to.cap + at) * dim);
        }
      }
    }

    // The whole sequence quantized again in rotated space, for a part whose codes are rotated: the
    // history `h` decoded as it is stored (rotated) into float, the residual's rotated copy
    // (`rotated`, rot_'s part), then x's rows rotated. Nothing of the history is rotated.
    qtensor requantized(const history& h, const float* rotated, std::int64_t dim, const view& x, kv_part p) const {
      const std::int64_t B = shape_.batch, H = shape_.heads, q = x.extent(2), past = h.tokens(),
                         total = past + rlen_ + q;
      std::vector<float> rows(static_cast<std::size_t>(detail::checked_elements({B, H, total, dim}, sizeof(float))));
      h.decode(rows.data(), H * total * dim, total * dim, dim);
      for (std::int64_t blk = 0; blk < B * H; ++blk) {
        float* dst = rows.data() + blk * total * dim;
        std::copy_n(rotated + blk * rot_.cap * dim, rlen_ * dim, dst + past * dim);
        if (q > 0) rotated_rows_of(x, blk, dst + (past + rlen_) * dim);  // (an empty view may have no data)
      }
      return qtensor::template encode<Codec>(bits_of(p), Codec::grouping(axis_of(p)), opts_.q_group_size, rows.data(),
                                             B, H, total, dim, H * total * dim, total * dim);
    }

    // Rotates rows [0, tokens) of every (batch, head) block of a workspace back (a rotation is its
    // own inverse): the history decode() wrote there rotated.
    void unrotate(const typename detail::kv_store<S>::blocks& w, std::int64_t tokens, std::int64_t dim) const noexcept {
      if constexpr (S::space == memory_space::host)
        for (std::int64_t b = 0; b < shape_.batch; ++b)
          for (std::int64_t h = 0; h < shape_.heads; ++h)
            detail::hadamard_rotate_any(w.data + b * w.stride_b + h * w.stride_h, tokens, dim);
    }

    // Writes dequant(history) + residual to the front of `w`. Cannot throw on the host (a device
    // throws only when CUDA fails).
    void fill_from_store(detail::kv_store<S>& w) const {
      const auto wk = w.key_blocks(), wv = w.value_blocks();
      qk_.decode(wk.data, wk.stride_b, wk.stride_h, shape_.key_head_dim);
      qv_.decode(wv.data, wv.stride_b, wv.stride_h, shape_.value_head_dim);
      if (opts_.rotate_keys) unrotate(wk, qk_.tokens(), shape_.key_head_dim);
      if (opts_.rotate_values) unrotate(wv, qv_.tokens(), shape_.value_head_dim);
      const KV<view> r = residual_.kv(0, rlen_);
      w.write(qk_.tokens(), r.keys, r.values);
    }

    KV<view> first_update(const view& k, const view& v) {
      const LayerShape shape = detail::shape_of(k, v);
      const std::int64_t q = k.extent(2);
      history nk(encode(k, kv_part::keys));
      history nv(encode(v, kv_part::values));
      detail::kv_store<S> w(shape, std::max(q, detail::min_dynamic_capacity), false);
      w.write(0, k, v);
      detail::kv_store<S> residual(shape, 0, false);
      shape_ = shape;
      qk_ = std::move(nk);
      qv_ = std::move(nv);
      ws_ = std::move(w);
      residual_ = std::move(residual);
      rot_ = rotated_store();
      rlen_ = 0;
      cumulative_ = q;
      ws_fresh_ = false;  // it holds the inputs, not dequant of what was quantized
      initialized_ = true;
      return ws_.kv(0, q);
    }

    QuantizedLayer opts_;
    LayerShape shape_{};
    history qk_, qv_;               // quantized history (the same chunks of tokens)
    detail::kv_store<S> residual_;  // full-precision tokens [0, rlen_)
    detail::kv_store<S> ws_;        // the workspace: what the last update returned
    std::int64_t rlen_ = 0;
    std::int64_t cumulative_ = 0;  // tokens held: quantized + residual
    rotated_store rot_;            // the residual's rows rotated (rotated_residual()), as its capacity
    bool ws_fresh_ = false;        // ws_[0, quantized + residual) == dequant(history) + residual
    bool initialized_ = false;
  };
};

// KIVI's settings (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
// 2024), spelled for the quanto backend: keys grouped along seq (one scale per channel and 32
// tokens), values along head_dim (one scale per token and 32 channels), the last 128 tokens in full
// precision, append_only. QuantizedCache<T>("quanto", config, kvc::kivi_options()).
constexpr QuantizedOptions kivi_options(std::int64_t nbits = 2) noexcept {
  return {
      .nbits = nbits, .axis_key = -1, .axis_value = 0, .q_group_size = 32, .residual_length = 128, .append_only = true};
}

// transformers' QuantoQuantizedLayer: a QuantizedLayer with kvc::QuantoCodec.
using QuantoQuantizedLayer = QuantizedLayer<QuantoCodec>;
// transformers' HQQQuantizedLayer: a QuantizedLayer with kvc::HqqCodec.
using HQQQuantizedLayer = QuantizedLayer<HqqCodec>;

}  // namespace kvc
