#pragma once
// Indexed layer kinds (DSA models: GLM-MoE-DSA, DeepSeek-V3.2): a K/V layer plus the keys of the
// lightning indexer, [batch, seq, index_head_dim] (one head, seq on dim 1). Semantics:
// transformers' DynamicIndexedLayer and StaticIndexedLayer (src/transformers/cache_utils.py at
// a597f974); what kvc does differently: docs/indexed.md and docs/differences.md.
//
//  - DynamicIndexedLayer: a DynamicLayer and indexer keys that grow with every update_indexer.
//  - StaticIndexedLayer:  a StaticLayer and an indexer buffer of max_cache_len slots, written at
//    its own counter.
//
// Both are built by composition: the state holds the K/V layer's state and forwards every
// CacheLayer member to it; the indexer keys live next to it. The Cache reaches the indexer keys
// through Cache::update_indexer(x, layer_idx), which calls `update_indexer` below.
//
// Layout of the dynamic indexer keys. update_indexer returns a StateView, which is dense (no
// strides), so the returned [batch, len, dim] must be contiguous. The keys are therefore kept
// dense at the front of a buffer with room for `capacity` tokens per batch row:
//  - batch 1: an append writes after the last token; the buffer grows geometrically, so q new
//    tokens cost O(q) amortized, as for the K/V part;
//  - batch > 1: every row has to move when the rows get longer, so an append copies the whole
//    [batch, len + q, dim] into a second buffer of the same capacity and swaps the two. That is
//    O(len) per append, the same cost as transformers' torch.cat, with no allocation in the
//    steady state; the price is twice the memory. A StateView with a row stride would make this
//    O(q) too (docs/indexed.md).

#include <kvc/policies/layers/dynamic_indexed.hpp>
#include <kvc/policies/layers/static_indexed.hpp>
