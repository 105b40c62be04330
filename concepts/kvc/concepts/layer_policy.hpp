#pragma once
// kvc::concepts::LayerPolicy: how a Cache's list of layers comes to be.
//
// A layer policy L has exactly one of (docs/concepts/layer_policy.md):
//   typename L::layers                    a Boost.Mp11 list of layer kinds; the layers are given
//                                         at construction ("pre-built")
//   typename L::layer_class_to_replicate  one layer kind; the Cache appends a new layer of this
//                                         kind for every `update` with an index it does not have

#include <boost/mp11/algorithm.hpp>
#include <boost/mp11/list.hpp>

namespace kvc::concepts {

// L names a Boost.Mp11 list of layer kinds, `L::layers`.
template <class L>
concept has_layers_list = requires { typename L::layers; } && boost::mp11::mp_is_list<typename L::layers>::value;

// L names the one layer kind the cache replicates, `L::layer_class_to_replicate`.
template <class L>
concept has_layer_class_to_replicate = requires { typename L::layer_class_to_replicate; };

// L is a layer policy: it has exactly one of those two member types.
template <class L>
concept LayerPolicy = has_layers_list<L> != has_layer_class_to_replicate<L>;

}  // namespace kvc::concepts

namespace kvc::detail {

template <class L>
struct layer_kinds_of {
  using type = boost::mp11::mp_list<>;
};
template <concepts::has_layers_list L>
  requires(!concepts::has_layer_class_to_replicate<L>)
struct layer_kinds_of<L> {
  using type = typename L::layers;
};
template <concepts::has_layer_class_to_replicate L>
  requires(!concepts::has_layers_list<L>)
struct layer_kinds_of<L> {
  using type = boost::mp11::mp_list<typename L::layer_class_to_replicate>;
};

// The layer kinds a policy names, as an mp_list (empty when the policy is malformed).
template <class L>
using layer_kinds = typename layer_kinds_of<L>::type;

}  // namespace kvc::detail
