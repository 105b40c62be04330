#pragma once
// detail::staged_crop: a layer kind whose crop allocates (the quantized layers, linear-attention
// layers, hybrids) splits it in two, prepare_crop (const, may throw, changes nothing) and
// commit_crop (cannot throw), so that Cache::crop prepares every layer before changing any, and a
// composed layer prepares its parts before committing either. crop_plan<St>::type is the plan
// (std::monostate for kinds whose crop cannot fail once checked).

#include <concepts>
#include <cstdint>
#include <utility>
#include <variant>

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

}  // namespace kvc::detail
