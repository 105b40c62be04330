#pragma once
// Every layer kind with its state, and the ready-made layer policies. A layer policy is any type
// with exactly one of the member types `layers` (pre-built) or `layer_class_to_replicate` (appended
// lazily), named after transformers' two Cache constructor arguments (docs/policies/layers.md).
// The kinds alone, without their states, are in <kvc/policies/layers/kinds.hpp>.

#include <kvc/policies/layers/dynamic.hpp>
#include <kvc/policies/layers/dynamic_sliding.hpp>
#include <kvc/policies/layers/hybrid.hpp>
#include <kvc/policies/layers/indexed.hpp>
#include <kvc/policies/layers/kinds.hpp>
#include <kvc/policies/layers/linear.hpp>
#include <kvc/policies/layers/static.hpp>
#include <kvc/policies/layers/static_sliding.hpp>
