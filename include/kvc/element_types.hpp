#pragma once
// The one list of the element types kvc handles by name at run time: AnyCache's typed interface,
// the dtype of a cache description, the names in AnyCache's messages, torch's dtype of an exported
// buffer, and the instantiations of the kvc::runtime library all come from KVC_ELEMENT_TYPES.
// Each entry: the C++ type, kvc's name for it, torch's dtype name. Adding an element type is one
// entry (and its name in cmake/kvcRuntimeTarget.cmake, which compiles one object per type).

#include <array>
#include <string_view>
#include <type_traits>

#include <boost/mp11/algorithm.hpp>
#include <boost/mp11/list.hpp>

#include <kvc/detail/fixed_name.hpp>
#include <kvc/tensor.hpp>

#define KVC_ELEMENT_TYPES(X)        \
  X(float, "float", "float32")      \
  X(double, "double", "float64")    \
  X(Eigen::half, "half", "float16") \
  X(Eigen::bfloat16, "bfloat16", "bfloat16")

namespace kvc {

// One row of the element-type table: a C++ element type, kvc's name for it and torch's dtype name.
template <class T, detail::fixed_name Name, detail::fixed_name TorchDtype>
struct element_type_row {
  // The C++ element type.
  using type = T;
  // kvc's name for it ("float", "half", ...).
  static constexpr std::string_view name = Name.view();
  // torch's dtype name for it ("float32", "float16", ...).
  static constexpr std::string_view torch_dtype = TorchDtype.view();
};

#define KVC_DETAIL_ELEMENT_ROW(T, NAME, TORCH) , element_type_row<T, NAME, TORCH>
// The table: one element_type_row per element type, in KVC_ELEMENT_TYPES' order.
using element_type_table =
    boost::mp11::mp_pop_front<boost::mp11::mp_list<void KVC_ELEMENT_TYPES(KVC_DETAIL_ELEMENT_ROW)>>;
#undef KVC_DETAIL_ELEMENT_ROW

namespace detail {
template <class Row>
using element_type_of = typename Row::type;
}  // namespace detail

// float, double, Eigen::half, Eigen::bfloat16.
using host_element_types = boost::mp11::mp_transform<detail::element_type_of, element_type_table>;
// Their names, in the table's order: ("float", "double", "half", "bfloat16").
inline constexpr auto element_type_names = detail::row_names(element_type_table{});

namespace detail {
template <class T>
using element_row_of =
    boost::mp11::mp_at<element_type_table, boost::mp11::mp_find<host_element_types, std::remove_cv_t<T>>>;

// kvc's name of T ("unknown" for a type outside the table).
template <class T>
constexpr std::string_view element_name() {
  if constexpr (boost::mp11::mp_contains<host_element_types, std::remove_cv_t<T>>::value)
    return element_row_of<T>::name;
  else
    return "unknown";
}

// torch's dtype name of T.
template <class T>
constexpr std::string_view torch_dtype() {
  return element_row_of<T>::torch_dtype;
}

// Calls f(std::type_identity<T>{}) for the element type named `name`; false when none is.
template <class F>
bool with_element_type(std::string_view name, F&& f) {
  bool found = false;
  boost::mp11::mp_for_each<element_type_table>([&](auto row) {
    if (!found && decltype(row)::name == name) {
      found = true;
      f(std::type_identity<typename decltype(row)::type>{});
    }
  });
  return found;
}
}  // namespace detail

}  // namespace kvc
