#pragma once
// The host umbrella header: everything kvc offers without CUDA.

#include <kvc/cache.hpp>
#include <kvc/any_cache.hpp>
#include <kvc/attention.hpp>
#include <kvc/caches.hpp>
#include <kvc/config.hpp>
#include <kvc/errors.hpp>
#include <kvc/tensor.hpp>
#include <kvc/warnings.hpp>
