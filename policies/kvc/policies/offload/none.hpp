#pragma once
// kvc::NoOffload: every layer stays where its storage put it. The engine's hooks are where an
// offloading policy waits for its prefetch, prefetches the next layer and offloads the current one
// (transformers' Cache.update with offloading=True); here they do nothing.

#include <cstdint>

namespace kvc {

// The offload policy that moves nothing, and the Cache's default: every layer stays where its
// storage allocated it.
struct NoOffload {
  // True: it serves every storage.
  template <class Storage>
  static constexpr bool serves = true;

  // The per-cache state: hooks that do nothing.
  template <class Storage>
  struct engine {
    // Before an update: does nothing.
    template <class Cache>
    void before_update(Cache&, std::int64_t) noexcept {}
    // After an update: does nothing.
    template <class Cache>
    void after_update(Cache&, std::int64_t) noexcept {}
    // Before a Cache method reads or changes layer `layer_idx` (-1: all) outside update.
    template <class Cache>
    void before_access(Cache&, std::int64_t) noexcept {}
  };
};

}  // namespace kvc
