#pragma once
// kvc::concepts::OffloadPolicy<O, S>: whether and how layers leave fast memory between uses.
//
// Required of an offload policy O for a storage policy S (docs/concepts/offload_policy.md):
//   O::template serves<S>            static constexpr bool: O can move S's buffers
//   typename O::template engine<S>   default-constructible per-cache state; the Cache calls
//                                    engine.before_update(cache, layer_idx) and
//                                    engine.after_update(cache, layer_idx) around each update
//                                    (transformers' wait/prefetch and offload steps)
// Optional (has_access_hook<E, Cache>):
//   engine.before_access(cache, layer_idx)   before a Cache method other than update reads or
//                                    changes layer layer_idx (-1: every layer); an engine that
//                                    moves buffers out brings them back here

#include <concepts>
#include <cstdint>

namespace kvc::concepts {

// A plain (non-template) `serves` member is ruled out first: g++ 12 treats `O::template serves<S>`
// on it as a hard error instead of an unsatisfied requirement.
template <class O>
concept has_plain_serves = requires { &O::serves; };

// `O::template serves<S>` converts to bool (a template, not a plain member).
template <class O, class S>
concept has_serves_flag = !has_plain_serves<O> && requires {
  { O::template serves<S> } -> std::convertible_to<bool>;
};

// `O::template engine<S>` names a default-constructible type, the per-cache engine.
template <class O, class S>
concept has_offload_engine =
    requires { typename O::template engine<S>; } && std::default_initializable<typename O::template engine<S>>;

// O is an offload policy for S: it has the serves flag and the engine.
template <class O, class S>
concept OffloadPolicy = has_serves_flag<O, S> && has_offload_engine<O, S>;

// O is an offload policy for S whose serves flag is true for S.
template <class O, class S>
concept serves_storage = OffloadPolicy<O, S> && static_cast<bool>(O::template serves<S>);

// The optional access hook, detected by kvc::Cache for its own type.
template <class E, class Cache>
concept has_access_hook =
    requires(E& engine, Cache& cache, std::int64_t layer_idx) { engine.before_access(cache, layer_idx); };

}  // namespace kvc::concepts
