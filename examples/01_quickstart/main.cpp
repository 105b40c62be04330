// The smallest useful kvc program: one layer of a DynamicCache, a prompt, one decoded token,
// a look at the stored keys through Eigen, and a rollback with crop. The regions between
// `// [snippet:...]` markers are quoted in README.md; docs.snippets checks that they match.
#include <kvc/kvc.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {
int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    std::printf("quickstart: FAILED: %s\n", what);
    ++failures;
  }
}
}  // namespace

int main() {
  // [snippet:prefill]
  kvc::DynamicCache<float> cache;  // a new DynamicLayer for every new layer index

  // K/V of a 5-token prompt: [batch, kv_heads, seq, head_dim]
  kvc::HostTensor<float> keys(1, 2, 5, 4), values(1, 2, 5, 4);
  keys.setRandom();
  values.setRandom();

  auto [k, v] = cache.update(keys, values, /*layer_idx=*/0);
  // k and v are zero-copy views of what layer 0 holds: [1, 2, 5, 4]
  // [/snippet]
  expect(k.extent(0) == 1 && k.extent(1) == 2 && k.extent(2) == 5 && k.extent(3) == 4, "prefill view shape");
  expect(v.extent(2) == 5, "prefill values length");

  // [snippet:head]
  // One (batch, head) block is a [seq, head_dim] Eigen matrix, read in place.
  Eigen::RowVectorXf query = Eigen::RowVectorXf::Random(4);
  Eigen::RowVectorXf scores = query * k.head(/*b=*/0, /*h=*/1).transpose();  // 5 scores
  Eigen::RowVectorXf weights = (scores.array() - scores.maxCoeff()).exp();
  Eigen::RowVectorXf context = (weights / weights.sum()) * v.head(0, 1);  // [1, head_dim]
  // [/snippet]
  expect(scores.size() == 5 && context.size() == 4, "attention over one head");
  expect(k.head(0, 1)(2, 3) == keys(0, 1, 2, 3), "head(b, h) reads the stored keys");

  // [snippet:decode]
  // Before the model runs a step, ask how long the keys will be and where they start.
  auto [kv_length, kv_offset] = cache.get_mask_sizes(/*query_length=*/1, /*layer_idx=*/0);  // 6, 0

  kvc::HostTensor<float> step_k(1, 2, 1, 4), step_v(1, 2, 1, 4);
  step_k.setRandom();
  step_v.setRandom();
  auto kv = cache.update(step_k, step_v, 0);  // kv.keys.extent(2) == kv_length == 6
  // [/snippet]
  expect(kv_length == 6 && kv_offset == 0, "get_mask_sizes before the decode step");
  expect(kv.keys.extent(2) == kv_length, "the update returns kv_length tokens");
  expect(kv.keys(0, 1, 5, 2) == step_k(0, 1, 0, 2), "the new token is last");
  expect(kv.keys(0, 0, 0, 0) == keys(0, 0, 0, 0), "the prompt is kept");

  // [snippet:crop]
  cache.crop(-2);                           // drop the last 2 tokens (e.g. rejected draft tokens)
  std::int64_t n = cache.get_seq_length();  // 4
  // [/snippet]
  expect(n == 4, "crop(-2) leaves 4 tokens");
  expect(cache.stored(0).keys.extent(2) == 4, "stored() follows the crop");

  std::printf("layer 0: %s, %lld tokens, kv_length for the next token %lld\n", std::string(cache.layer_name(0)).c_str(),
              static_cast<long long>(n), static_cast<long long>(cache.get_mask_sizes(1, 0).first));
  if (failures == 0) std::printf("quickstart: OK\n");
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
