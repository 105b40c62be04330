#pragma once
// detail::staged_crop: a layer kind whose crop allocates (the quantized layers, linear-attention
// layers, hybrids) splits it in two, prepare_crop (const, may throw, changes nothing) and
// commit_crop (cannot throw), so that Cache::crop prepares every layer before changing any, and a
// composed layer prepares its parts before committing either. crop_plan<St>::type is the plan
// (std::monostate for kinds whose crop cannot fail once checked).
// detail::check_rollback: the refusal of a crop past what a layer can roll back exactly
// (docs/rollback.md).

#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include <kvc/errors.hpp>

namespace kvc::detail {

template <class St>
concept staged_crop = requires(St& l, const St& c, std::int64_t n) {
  typename St::crop_plan;
  { c.prepare_crop(n) } -> std::same_as<typename St::crop_plan>;
  l.commit_crop(std::declval<typename St::crop_plan&&>());
};

template <class St>
struct crop_plan {
  using type = std::monostate;
};
template <staged_crop St>
struct crop_plan<St> {
  using type = typename St::crop_plan;
};

// The number of tokens crop(tokens_to_remove) takes from a layer of `len` tokens: -n (at most len)
// for a negative count, len - n for a positive one below len (transformers' deprecated absolute
// length), 0 otherwise.
inline constexpr std::int64_t crop_count(std::int64_t tokens_to_remove, std::int64_t len) noexcept {
  if (tokens_to_remove > 0) return tokens_to_remove >= len ? 0 : len - tokens_to_remove;
  if (tokens_to_remove == 0) return 0;
  return tokens_to_remove < -len ? len : -tokens_to_remove;
}

// Throws kvc::RuntimeError when a crop would remove `removed` tokens from a layer of kind `kind`
// that can roll back only `depth` exactly; `why` says what bounds the depth.
inline void check_rollback(std::string_view kind, std::int64_t removed, std::int64_t depth, std::string_view why) {
  if (removed <= depth) return;
  throw RuntimeError(join_message({"`crop` would remove ", std::to_string(removed), " tokens, but this ", kind,
                                   " can roll back only ", std::to_string(depth), " exactly (", why, ")"}));
}

}  // namespace kvc::detail
