#pragma once
// The hash that names a complete block of a paged cache for prefix sharing: BLAKE2b (RFC 7693)
// with an 8-byte digest over (parent block's hash, the block's token ids, group index), read as a
// little-endian unsigned integer. It is the hash transformers' BlockManager.compute_hash uses when
// tensor parallelism is on (generation/continuous_batching/cache_manager.py at a597f974), chosen
// for every case here: it is stable across processes, builds and machines, which Python's hash()
// (used upstream without TP) is not. docs/paged.md gives the byte layout.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include <kvc/errors.hpp>

namespace kvc::paged {
namespace detail {

// BLAKE2b with an 8-byte digest and no key, fed incrementally.
class blake2b_64 {
 public:
  blake2b_64() noexcept {
    h_ = iv;
    h_[0] ^= 0x01010000ULL ^ 8ULL;  // parameter block: digest length 8, key length 0, fanout 1, depth 1
  }

  void update(std::span<const std::byte> in) noexcept {
    for (std::byte b : in) {
      if (fill_ == block_.size()) {  // a full block is compressed only once more input follows
        counter_ += block_.size();
        compress(false);
        fill_ = 0;
      }
      block_[fill_++] = static_cast<std::uint8_t>(b);
    }
  }
  void update_le(std::uint64_t v, int bytes) noexcept {
    std::array<std::byte, 8> le{};
    for (int i = 0; i < bytes; ++i) le[static_cast<std::size_t>(i)] = static_cast<std::byte>(v >> (8 * i));
    update(std::span<const std::byte>(le.data(), static_cast<std::size_t>(bytes)));
  }

  // The digest's 8 bytes read little-endian, which is the first state word.
  std::uint64_t finish() noexcept {
    counter_ += fill_;
    for (std::size_t i = fill_; i < block_.size(); ++i) block_[i] = 0;
    compress(true);
    return h_[0];
  }

 private:
  static constexpr std::array<std::uint64_t, 8> iv = {
      0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
      0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
  static constexpr std::uint8_t sigma[12][16] = {
      {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
      {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
      {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
      {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
      {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
      {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

  static constexpr std::uint64_t rotr(std::uint64_t x, int n) noexcept { return (x >> n) | (x << (64 - n)); }

  void compress(bool last) noexcept {
    std::array<std::uint64_t, 16> m{};
    for (std::size_t i = 0; i < 16; ++i)
      for (std::size_t j = 0; j < 8; ++j) m[i] |= static_cast<std::uint64_t>(block_[8 * i + j]) << (8 * j);
    std::array<std::uint64_t, 16> v{};
    for (std::size_t i = 0; i < 8; ++i) {
      v[i] = h_[i];
      v[i + 8] = iv[i];
    }
    v[12] ^= counter_;  // the high word of the 128-bit counter stays 0 (inputs are far below 2^64 bytes)
    if (last) v[14] = ~v[14];
    auto mix = [&](std::size_t a, std::size_t b, std::size_t c, std::size_t d, std::uint64_t x, std::uint64_t y) {
      v[a] = v[a] + v[b] + x;
      v[d] = rotr(v[d] ^ v[a], 32);
      v[c] = v[c] + v[d];
      v[b] = rotr(v[b] ^ v[c], 24);
      v[a] = v[a] + v[b] + y;
      v[d] = rotr(v[d] ^ v[a], 16);
      v[c] = v[c] + v[d];
      v[b] = rotr(v[b] ^ v[c], 63);
    };
    for (const auto& s : sigma) {
      mix(0, 4, 8, 12, m[s[0]], m[s[1]]);
      mix(1, 5, 9, 13, m[s[2]], m[s[3]]);
      mix(2, 6, 10, 14, m[s[4]], m[s[5]]);
      mix(3, 7, 11, 15, m[s[6]], m[s[7]]);
      mix(0, 5, 10, 15, m[s[8]], m[s[9]]);
      mix(1, 6, 11, 12, m[s[10]], m[s[11]]);
      mix(2, 7, 8, 13, m[s[12]], m[s[13]]);
      mix(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (std::size_t i = 0; i < 8; ++i) h_[i] ^= v[i] ^ v[i + 8];
  }

  std::array<std::uint64_t, 8> h_{};
  std::array<std::uint8_t, 128> block_{};
  std::size_t fill_ = 0;
  std::uint64_t counter_ = 0;
};

}  // namespace detail

// BLAKE2b-64 of raw bytes (exposed for tests and for users who hash their own keys the same way).
inline std::uint64_t blake2b_64(std::span<const std::byte> bytes) noexcept {
  detail::blake2b_64 h;
  h.update(bytes);
  return h.finish();
}

// ValueError for a token id that a block hash cannot pack (outside a 32-bit C int).
inline void check_block_tokens(std::span<const std::int64_t> tokens) {
  for (const std::int64_t t : tokens)
    if (t < INT32_MIN || t > INT32_MAX)
      throw ValueError("kvc::paged::compute_block_hash: token id " + std::to_string(t) +
                       " does not fit a 32-bit int (block hashes pack token ids as C ints)");
}

// The hash of a complete block: parent hash as 8 bytes little-endian (left out for the first block
// of a sequence), each token id as 4 bytes little-endian (a C int, as transformers packs them),
// the group index as 4 bytes little-endian. A token id or group that does not fit 32 bits is a
// ValueError.
inline std::uint64_t compute_block_hash(std::optional<std::uint64_t> parent_hash, std::span<const std::int64_t> tokens,
                                        std::int64_t group_id) {
  detail::blake2b_64 h;
  if (parent_hash) h.update_le(*parent_hash, 8);
  check_block_tokens(tokens);
  for (const std::int64_t t : tokens) {
    h.update_le(static_cast<std::uint32_t>(static_cast<std::int32_t>(t)), 4);
  }
  if (group_id < 0 || group_id > INT32_MAX)
    throw ValueError("kvc::paged::compute_block_hash: group " + std::to_string(group_id) +
                     " is outside 0 .. 2^31 - 1 (block hashes pack the group as a C int)");
  h.update_le(static_cast<std::uint32_t>(static_cast<std::int32_t>(group_id)), 4);
  return h.finish();
}

}  // namespace kvc::paged
