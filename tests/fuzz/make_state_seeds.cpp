// Writes the seeds of the fuzz target's saved-state modes to a directory (tests/fuzz/corpus_state):
// 'S', 'F' and 'N' (the three modes that load a contiguous cache's state) + the cache kind byte +
// a saved state of that kind, and 'P' + a saved paged request.
//   c++ -std=c++20 -O1 -Iinclude -Iconcepts -Ipolicies -isystem /usr/include/eigen3 \
//       tests/fuzz/make_state_seeds.cpp -o /tmp/make_state_seeds && /tmp/make_state_seeds tests/fuzz/corpus_state
#include <fstream>
#include <iostream>
#include <sstream>

#include "state_targets.hpp"

namespace {

void write(const std::string& dir, const std::string& name, const std::string& prefix, const std::string& bytes) {
  std::ofstream(dir + "/" + name, std::ios::binary) << prefix << bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_state_seeds <directory>\n";
    return 2;
  }
  const std::string dir = argv[1];
  std::mt19937 rng(1);
  const char* names[] = {"dynamic", "mixed", "quantized", "linear", "indexed", "encoder_decoder"};
  for (int which = 0; which < 6; ++which)
    kvc_fuzz::with_cache(which, [&](auto& c) {
      if constexpr (requires { c.self_attention_cache(); }) {
        kvc_fuzz::fill(c.self_attention_cache(), 3, rng);
        kvc_fuzz::fill(c.cross_attention_cache(), 5, rng);
        c.set_is_updated(0);
      } else {
        kvc_fuzz::fill(c, 6, rng);
        kvc_fuzz::fill(c, 1, rng);
        if (which == 3) {
          Eigen::Tensor<float, 3, Eigen::RowMajor> conv(1, 2, 3);
          conv.setConstant(0.25f);
          for (std::int64_t l = 0; l < c.size(); ++l)
            if (c.is_linear()[static_cast<std::size_t>(l)] || l == 2) c.update_conv_state(conv, l, 0, 3);
          // Layer 0 keeps a ring of 2 steps: a recurrent state and a second step fill it.
          Eigen::Tensor<float, 3, Eigen::RowMajor> rec(1, 2, 2);
          rec.setConstant(0.5f);
          c.update_recurrent_state(rec, 0, 0);
          c.update_conv_state(conv, 0, 0, 3);
        }
        if (which == 4) {
          Eigen::Tensor<float, 3, Eigen::RowMajor> keys(1, 7, 3);
          keys.setConstant(0.5f);
          c.update_indexer(keys, 0);
          c.update_indexer(keys, 1);
        }
      }
      std::ostringstream os(std::ios::binary);
      kvc::save(c, os);
      for (const auto& [mode, name] : {std::pair{'S', "state_"}, {'F', "filled_state_"}, {'N', "pipe_state_"}})
        write(dir, name + std::string(names[which]), std::string(1, mode) + static_cast<char>(which), os.str());
    });
  kvc_fuzz::Paged p = kvc_fuzz::paged();
  p.allocate_blocks(2, "r", 0);
  Eigen::Tensor<float, 3, Eigen::RowMajor> conv(1, 3, 2);
  Eigen::Tensor<float, 2, Eigen::RowMajor> rec(1, 5);
  for (Eigen::Index i = 0; i < conv.size(); ++i) conv.data()[i] = static_cast<float>(i);
  for (Eigen::Index i = 0; i < rec.size(); ++i) rec.data()[i] = static_cast<float>(i) / 2;
  (void)p.update_conv_state(conv, "r", 2, 0, 3);
  (void)p.update_recurrent_state(rec, "r", 2);
  std::ostringstream os(std::ios::binary);
  kvc::save_request(p, "r", os);
  write(dir, "request_paged", "P", os.str());
  return 0;
}
