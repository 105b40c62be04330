// The replaceable warning handler and warn_once semantics.

#include "../support/kvc_test.hpp"

TEST_CASE("warn always forwards, warn_once once per message") {
  kvc_test::captured_warnings w;
  kvc::warn("a");
  kvc::warn("a");
  kvc::warn_once("b");
  kvc::warn_once("b");
  kvc::warn_once("c");
  CHECK(w.messages == std::vector<std::string>{"a", "a", "b", "c"});
  kvc::reset_warnings_seen();
  kvc::warn_once("b");
  CHECK(w.messages.size() == 5);
}

TEST_CASE("set_warning_handler returns the previous handler; an empty one silences") {
  std::vector<std::string> first;
  auto original = kvc::set_warning_handler([&](std::string_view m) { first.emplace_back(m); });
  kvc::warn("x");
  auto mine = kvc::set_warning_handler({});
  kvc::warn("silenced");
  kvc::set_warning_handler(mine);
  kvc::warn("y");
  kvc::set_warning_handler(original);
  CHECK(first == std::vector<std::string>{"x", "y"});
}

TEST_CASE("the positive-crop deprecation goes through the handler once") {
  kvc_test::captured_warnings w;
  kvc::DynamicCache<float> cache;
  cache.update(kvc_test::seq({1, 2, 3}), kvc_test::seq({1, 2, 3}), 0);
  cache.crop(2);
  cache.crop(1);
  REQUIRE(w.messages.size() == 1);
  CHECK(w.messages[0] == kvc::positive_crop_deprecation);
}
