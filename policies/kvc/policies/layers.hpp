#pragma once
// The ready-made layer policies and every layer kind. A layer policy is any type with exactly one
// of the member types `layers` (pre-built) or `layer_class_to_replicate` (appended lazily), named
// after transformers' two Cache constructor arguments (docs/policies/layers.md).

#include <boost/mp11/list.hpp>

#include <kvc/policies/layers/dynamic.hpp>
#include <kvc/policies/layers/indexed.hpp>
#include <kvc/policies/layers/linear.hpp>
#include <kvc/policies/layers/static.hpp>

namespace kvc {

// Pre-built layers: the cache is constructed from a list of layers whose kinds are among Kinds.
template <class... Kinds>
struct Layers {
  using layers = boost::mp11::mp_list<Kinds...>;
};

// Replicated layers: `update` with an index the cache does not have yet appends layers of Kind
// (copies of the prototype given at construction) until it does.
template <class Kind>
struct Replicate {
  using layer_class_to_replicate = Kind;
};

}  // namespace kvc
