// kvc::concepts::StoragePolicy and supports_its_element_type
// (concepts/kvc/concepts/storage_policy.hpp): the shipped policies and a minimal archetype model
// them; one near-miss per named requirement does not. Compile-only.
#include <kvc/concepts/storage_policy.hpp>
#include <kvc/policies/storage/host.hpp>

#include <array>
#include <cstdint>
#include <type_traits>

// A named namespace (not an anonymous one): clang warns about unused static members of
// internal-linkage archetypes.
namespace kvc_test_storage_policy {

using namespace kvc::concepts;  // the has_* parts

// ---- shipped policies ------------------------------------------------------------------------
static_assert(StoragePolicy<kvc::HostStorage<float>>);
static_assert(StoragePolicy<kvc::HostStorage<double>>);
static_assert(StoragePolicy<kvc::HostStorage<Eigen::half>>);
static_assert(StoragePolicy<kvc::HostStorage<Eigen::bfloat16>>);
static_assert(supports_its_element_type<kvc::HostStorage<float>>);
static_assert(supports_its_element_type<kvc::HostStorage<double>>);
static_assert(supports_its_element_type<kvc::HostStorage<Eigen::half>>);
static_assert(supports_its_element_type<kvc::HostStorage<Eigen::bfloat16>>);
// HostStorage<int> is well-formed, so the concept check stays SFINAE-friendly, but it says that it
// does not support int; kvc::Cache turns that into its own message.
static_assert(StoragePolicy<kvc::HostStorage<int>>);
static_assert(!supports_its_element_type<kvc::HostStorage<int>>);

// ---- minimal archetype: every required member, declared only --------------------------------
struct view_archetype {};
struct buffer_archetype {
  explicit buffer_archetype(std::int64_t n);
  float* data();
  std::int64_t size() const;
};
struct storage_archetype {
  using element_type = float;
  static constexpr kvc::memory_space space = kvc::memory_space::device;
  static constexpr bool element_supported = true;
  using buffer_type = buffer_archetype;
  using view_type = view_archetype;
  static void copy_2d(float* dst, std::int64_t dpitch, const float* src, std::int64_t spitch, std::int64_t width,
                      std::int64_t height);
  static void zero_2d(float* dst, std::int64_t dpitch, std::int64_t width, std::int64_t height);
  static view_type make_view(const float* ptr, std::array<std::int64_t, 4> extents,
                             std::array<std::int64_t, 4> strides);
  template <class X>
  static constexpr bool accepts_input = std::is_same_v<X, view_archetype>;
  static view_type input_view(const view_type& v);
};
static_assert(has_element_type<storage_archetype> && has_memory_space<storage_archetype> &&
              has_element_support_flag<storage_archetype> && has_buffer_type<storage_archetype> &&
              has_view_type<storage_archetype> && has_copy_kernels<storage_archetype> &&
              has_make_view<storage_archetype> && has_input_adapter<storage_archetype>);
static_assert(StoragePolicy<storage_archetype>);
static_assert(supports_its_element_type<storage_archetype>);

// ---- near-misses: the archetype with one member hidden by a wrong one ------------------------
// has_element_type: the standard library's name (value_type) instead of element_type.
struct value_type_instead {
  using value_type = float;
  static constexpr kvc::memory_space space = kvc::memory_space::host;
  static constexpr bool element_supported = true;
  using buffer_type = buffer_archetype;
  using view_type = view_archetype;
  template <class X>
  static constexpr bool accepts_input = false;
  static view_type input_view(const view_type& v);
};
static_assert(!has_element_type<value_type_instead>);
static_assert(has_memory_space<value_type_instead> && has_view_type<value_type_instead>);
static_assert(!StoragePolicy<value_type_instead>);

// has_memory_space: `space` is an int, not a kvc::memory_space.
struct space_is_an_int : storage_archetype {
  static constexpr int space = 1;
};
static_assert(!has_memory_space<space_is_an_int>);
static_assert(!StoragePolicy<space_is_an_int>);

// has_element_support_flag: a type (std::true_type) instead of a value.
struct support_flag_is_a_type : storage_archetype {
  using element_supported = std::true_type;
};
static_assert(!has_element_support_flag<support_flag_is_a_type>);
static_assert(!StoragePolicy<support_flag_is_a_type>);

// has_buffer_type: a read-only buffer (data() returns const float*).
struct const_buffer {
  explicit const_buffer(std::int64_t n);
  const float* data() const;
  std::int64_t size() const;
};
struct buffer_is_read_only : storage_archetype {
  using buffer_type = const_buffer;
};
static_assert(!has_buffer_type<buffer_is_read_only>);
static_assert(!StoragePolicy<buffer_is_read_only>);

// has_buffer_type: a buffer that cannot be sized at construction.
struct unsized_buffer {
  float* data();
  std::int64_t size() const;
};
struct buffer_not_sizable : storage_archetype {
  using buffer_type = unsized_buffer;
};
static_assert(!has_buffer_type<buffer_not_sizable>);
static_assert(!StoragePolicy<buffer_not_sizable>);

// has_view_type: view_type left as a template.
struct view_type_is_a_template : storage_archetype {
  template <class T>
  struct view_type {};
};
static_assert(!has_view_type<view_type_is_a_template>);
static_assert(!StoragePolicy<view_type_is_a_template>);

// has_copy_kernels: a memcpy-like copy_2d without pitches.
struct copy_without_pitches : storage_archetype {
  static void copy_2d(float* dst, const float* src, std::int64_t count);
};
static_assert(!has_copy_kernels<copy_without_pitches>);
static_assert(!StoragePolicy<copy_without_pitches>);

// has_copy_kernels: zero_2d missing its pitch.
struct zero_without_pitch : storage_archetype {
  static void zero_2d(float* dst, std::int64_t count);
};
static_assert(!has_copy_kernels<zero_without_pitch>);
static_assert(!StoragePolicy<zero_without_pitch>);

// has_make_view: make_view returns something other than view_type.
struct make_view_wrong_type : storage_archetype {
  static const float* make_view(const float* ptr, std::array<std::int64_t, 4> extents,
                                std::array<std::int64_t, 4> strides);
};
static_assert(!has_make_view<make_view_wrong_type>);
static_assert(!StoragePolicy<make_view_wrong_type>);

// has_input_adapter: accepts_input is a plain bool, not a variable template over the input type.
struct accepts_input_not_a_template : storage_archetype {
  static constexpr bool accepts_input = true;
};
static_assert(!has_input_adapter<accepts_input_not_a_template>);
static_assert(!StoragePolicy<accepts_input_not_a_template>);

// has_input_adapter: no input_view.
struct input_view_is_a_type : storage_archetype {
  using input_view = view_archetype;
};
static_assert(!has_input_adapter<input_view_is_a_type>);
static_assert(!StoragePolicy<input_view_is_a_type>);

// supports_its_element_type: a complete policy that declines its element type.
struct declines_its_element : storage_archetype {
  static constexpr bool element_supported = false;
};
static_assert(StoragePolicy<declines_its_element>);
static_assert(!supports_its_element_type<declines_its_element>);

// The element type where the policy belongs: kvc::Cache<L, float> instead of HostStorage<float>.
static_assert(!StoragePolicy<float>);
static_assert(!StoragePolicy<void>);

}  // namespace kvc_test_storage_policy
