// kvc::concepts::StoragePolicy, supports_its_element_type and PagedStoragePolicy
// (concepts/kvc/concepts/storage_policy.hpp): the shipped policies and a minimal archetype model
// them; one near-miss per named requirement does not. Also the views the policies return
// (kvc::basic_tensor_view / basic_state_view over both memory spaces). Compile-only.
#include <kvc/concepts/storage_policy.hpp>
#include <kvc/policies/storage/host.hpp>
#include <kvc/tensor.hpp>

#include <array>
#include <cstdint>
#include <span>
#include <string>
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
// Without scatter_rows it is no paged storage policy; with it, it is.
static_assert(!has_scatter_rows<storage_archetype> && !PagedStoragePolicy<storage_archetype>);
struct paged_storage_archetype : storage_archetype {
  static void scatter_rows(std::span<const kvc::detail::scatter_job<float>> jobs, std::span<const std::int64_t> rows,
                           std::int64_t heads, std::int64_t width, std::int64_t dst_head_pitch);
};
static_assert(PagedStoragePolicy<paged_storage_archetype>);
static_assert(PagedStoragePolicy<kvc::HostStorage<float>> && PagedStoragePolicy<kvc::HostStorage<Eigen::bfloat16>>);
static_assert(!PagedStoragePolicy<float>);

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

// ---- the views a storage policy returns: one template per kind, over the memory space -------------
// TensorView / DeviceTensorView and StateView / DeviceStateView are aliases of basic_tensor_view and
// basic_state_view; host and device views of one T are different types.
static_assert(std::is_same_v<kvc::TensorView<float>, kvc::basic_tensor_view<float, kvc::memory_space::host>>);
static_assert(std::is_same_v<kvc::DeviceTensorView<float>, kvc::basic_tensor_view<float, kvc::memory_space::device>>);
static_assert(std::is_same_v<kvc::StateView<float>, kvc::basic_state_view<float, kvc::memory_space::host>>);
static_assert(std::is_same_v<kvc::DeviceStateView<float>, kvc::basic_state_view<float, kvc::memory_space::device>>);
static_assert(!std::is_same_v<kvc::TensorView<float>, kvc::DeviceTensorView<float>>);
static_assert(!std::is_same_v<kvc::StateView<float>, kvc::DeviceStateView<float>>);
static_assert(kvc::TensorView<float>::space == kvc::memory_space::host);
static_assert(kvc::DeviceStateView<float>::space == kvc::memory_space::device);
static_assert(std::is_same_v<kvc::HostStorage<float>::view_type, kvc::TensorView<float>>);
static_assert(std::is_same_v<kvc::HostStorage<float>::state_view_type, kvc::StateView<float>>);

// Trivially copyable aggregates (passed by value to kernels, built as {ptr, extents, strides} and
// {ptr, rank, extents}).
static_assert(std::is_trivially_copyable_v<kvc::TensorView<float>> && std::is_aggregate_v<kvc::TensorView<float>>);
static_assert(std::is_trivially_copyable_v<kvc::DeviceTensorView<float>> &&
              std::is_aggregate_v<kvc::DeviceTensorView<float>>);
static_assert(std::is_trivially_copyable_v<kvc::StateView<double>> && std::is_aggregate_v<kvc::StateView<double>>);
static_assert(std::is_trivially_copyable_v<kvc::DeviceStateView<double>> &&
              std::is_aggregate_v<kvc::DeviceStateView<double>>);
inline constexpr float view_data[8] = {0, 1, 2, 3, 4, 5, 6, 7};
constexpr kvc::TensorView<float> host_view{view_data, {1, 2, 2, 2}, {8, 4, 2, 1}};
constexpr kvc::DeviceTensorView<float> device_view{view_data, {1, 2, 2, 2}, {8, 4, 2, 1}};
constexpr kvc::StateView<float> host_state{view_data, 2, {2, 4}};
constexpr kvc::DeviceStateView<float> device_state{view_data, 2, {2, 4}};
static_assert(host_view.size() == 8 && host_view.stride(1) == 4 && host_view(0, 1, 1, 0) == 6.f);
static_assert(device_view.size() == 8 && device_view.extent(3) == 2 && device_view.data() == view_data);
static_assert(host_state.size() == 8 && host_state[5] == 5.f);
static_assert(device_state.size() == 8 && device_state.extent(1) == 4 && !device_state.empty());

// Host views read elements, map heads and copy themselves out; device views do none of that in
// host code (their operator(), operator[] and head are __device__, compiled by nvcc only).
template <class V>
concept reads_elements = requires(const V& v) { v(0, 0, 0, 0); };
template <class V>
concept maps_heads = requires(const V& v) { v.head(0, 0); };
template <class V>
concept copies_out = requires(const V& v) { v.to_tensor(); };
template <class V>
concept reads_states = requires(const V& v) { v[0]; };
template <class V>
concept copies_states_out = requires(const V& v) { v.template to_tensor<2>(); };
static_assert(reads_elements<kvc::TensorView<float>> && maps_heads<kvc::TensorView<float>> &&
              copies_out<kvc::TensorView<float>>);
static_assert(!reads_elements<kvc::DeviceTensorView<float>> && !maps_heads<kvc::DeviceTensorView<float>> &&
              !copies_out<kvc::DeviceTensorView<float>>);
static_assert(reads_states<kvc::StateView<float>> && copies_states_out<kvc::StateView<float>>);
static_assert(!reads_states<kvc::DeviceStateView<float>> && !copies_states_out<kvc::DeviceStateView<float>>);
static_assert(std::is_same_v<decltype(host_view.head(0, 0)), kvc::TensorView<float>::head_matrix>);

// One shape_string for state views of both spaces.
static_assert(std::is_same_v<decltype(kvc::shape_string(host_state)), std::string>);
static_assert(std::is_same_v<decltype(shape_string(device_state)), std::string>);  // found by ADL

}  // namespace kvc_test_storage_policy
