#pragma once
// Traits of a cache type, shared by EncoderDecoderCache and AnyCache: whether a type is a kvc
// cache (a kvc::Cache instantiation, a class derived from one, or the type-erased kvc::AnyCache),
// transformers' isinstance(cache, DynamicCache), the Python class name it prints as; and
// kvc::cache_repr(cache), transformers' repr of a cache, `DynamicCache(layers=[...])`.

#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include <boost/mp11/algorithm.hpp>
#include <boost/mp11/list.hpp>

#include <kvc/cache.hpp>
#include <kvc/caches.hpp>

namespace kvc {

namespace detail {

// Whether C is a kvc::Cache instantiation or a class derived from one (deduction through a
// pointer conversion to the base; the ellipsis catches everything else).
template <class L, class S, class O>
std::true_type derives_from_cache(const Cache<L, S, O>*);
std::false_type derives_from_cache(...);
template <class T, class S, class O>
std::true_type derives_from_dynamic_cache(const DynamicCache<T, S, O>*);
std::false_type derives_from_dynamic_cache(...);
template <class T, class S, class O>
std::true_type derives_from_static_cache(const StaticCache<T, S, O>*);
std::false_type derives_from_static_cache(...);

template <class C, template <class> class Test>
inline constexpr bool class_test = [] {
  if constexpr (std::is_class_v<C> && !std::is_const_v<C> && !std::is_volatile_v<C>)
    return Test<C>::value;
  else
    return false;
}();
template <class C>
using derives_from_cache_t = decltype(derives_from_cache(static_cast<const C*>(nullptr)));
template <class C>
using derives_from_dynamic_cache_t = decltype(derives_from_dynamic_cache(static_cast<const C*>(nullptr)));
template <class C>
using derives_from_static_cache_t = decltype(derives_from_static_cache(static_cast<const C*>(nullptr)));

// A cache whose type is erased (kvc::AnyCache): what it holds is only known at run time, so the
// checks below are made when they are needed (is_dynamic_cache(), repr()).
template <class C>
concept type_erased_cache = requires(const C& c) {
  requires static_cast<bool>(C::is_type_erased_cache);
  { c.is_dynamic_cache() } -> std::convertible_to<bool>;
  { c.repr() } -> std::convertible_to<std::string>;
};

// A non-const, non-reference class type that is, or derives from, a kvc::Cache, or kvc::AnyCache.
template <class C>
inline constexpr bool is_cache_v = class_test<C, derives_from_cache_t> || type_erased_cache<C>;

// The element type of a cache; float stands in for a type-erased one (whose data constructor is
// disabled).
template <class C>
struct cache_element {
  using type = float;
};
template <class C>
  requires requires { typename C::element_type; }
struct cache_element<C> {
  using type = typename C::element_type;
};

// What the layer kinds of cache C can do: every kind can crop and change its batch ("dynamic"),
// or none can ("static").
template <class C>
struct cache_kind_traits {
  template <class K>
  using st = typename C::template state_of<K>;
  template <class K>
  using dynamic = std::bool_constant<concepts::supports_crop<st<K>> && concepts::supports_batch_ops<st<K>>>;
  template <class K>
  using fixed = std::bool_constant<!concepts::supports_crop<st<K>> && !concepts::supports_batch_ops<st<K>>>;
  static constexpr bool all_dynamic = boost::mp11::mp_all_of<typename C::kinds, dynamic>::value;
  static constexpr bool all_static = boost::mp11::mp_all_of<typename C::kinds, fixed>::value;
};

// transformers' isinstance(cache, DynamicCache): kvc::DynamicCache and the classes derived from
// it (MtpCache, DFlashCache), and any cache whose layer kinds are all dynamic (the cache
// make_dynamic_cache builds, transformers' DynamicCache(config=...)).
template <class C>
inline constexpr bool is_dynamic_cache_v = [] {
  if constexpr (type_erased_cache<C>)
    return true;  // possibly: EncoderDecoderCache asks is_dynamic_cache() at run time
  else if constexpr (is_cache_v<C>)
    return derives_from_dynamic_cache_t<C>::value ||
           (cache_kind_traits<C>::all_dynamic && !derives_from_static_cache_t<C>::value);
  else
    return false;
}();

// The Python class name a cache prints as: a `static constexpr std::string_view class_name`
// member if the class has one (MtpCache, DFlashCache, QuantizedCache, make_dynamic_cache's
// ConfiguredDynamicCache), else DynamicCache / StaticCache for those classes and the classes
// derived from them, else "Cache": a kvc::Cache<...> is transformers' Cache(layers=...), whatever
// its layer kinds.
template <class C>
constexpr std::string_view cache_class_name() {
  if constexpr (requires {
                  { C::class_name } -> std::convertible_to<std::string_view>;
                })
    return C::class_name;
  else if constexpr (derives_from_dynamic_cache_t<C>::value)
    return "DynamicCache";
  else if constexpr (derives_from_static_cache_t<C>::value)
    return "StaticCache";
  else
    return "Cache";
}

}  // namespace detail

// transformers' repr of a cache: `ClassName(layers=[LayerName, ...])`, e.g.
// `DynamicCache(layers=[DynamicLayer, DynamicLayer])` (detail::cache_class_name for the name).
template <class C>
  requires detail::is_cache_v<C>
std::string cache_repr(const C& cache) {
  if constexpr (detail::type_erased_cache<C>) {
    return cache.repr();
  } else {
    std::string out(detail::cache_class_name<C>());
    out.append("(layers=[");
    for (std::int64_t i = 0; i < cache.size(); ++i) {
      if (i) out.append(", ");
      out.append(cache.layer_name(i));
    }
    out.append("])");
    return out;
  }
}

}  // namespace kvc
