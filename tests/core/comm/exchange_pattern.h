#pragma once
// The expected all_to_allv / all_gather exchanges, computed independently of
// any communicator: element i of the block rank `src` sends to rank `dst` in
// round `round` has a value that encodes (src, dst, i, round), so a block in
// the wrong place or order is caught.
#include <cstdint>
#include <cstring>
#include <vector>

namespace muond::testing {

// Uneven counts with zeros: 0..3 elements, varying by pair and round.
inline int64_t UnevenCount(int src, int dst, int round) {
  return (src * 3 + dst * 5 + round * 7 + 1) % 4;
}

// Rank 1 neither sends nor receives anything (an idle rank).
inline int64_t IdleRankOneCount(int src, int dst, int round) {
  return (src == 1 || dst == 1) ? 0 : src + dst + round + 1;
}

template <typename T>
T Encode(int src, int dst, int64_t i, int round);

template <>
inline float Encode<float>(int src, int dst, int64_t i, int round) {
  return static_cast<float>(src * 100000 + dst * 1000 + i * 10 + round) + 0.5f;
}

// bf16 payloads are opaque 2-byte words to a communicator: any bit pattern
// must arrive unchanged, so encode directly in the bits.
template <>
inline uint16_t Encode<uint16_t>(int src, int dst, int64_t i, int round) {
  return static_cast<uint16_t>((src << 13) | (dst << 10) | (i << 3) | round);
}

template <typename T, typename CountFn>
std::vector<T> SendBuffer(int rank, int size, int round, CountFn count,
                          std::vector<int64_t>* counts) {
  std::vector<T> out;
  counts->clear();
  for (int dst = 0; dst < size; ++dst) {
    counts->push_back(count(rank, dst, round));
    for (int64_t i = 0; i < counts->back(); ++i) {
      out.push_back(Encode<T>(rank, dst, i, round));
    }
  }
  return out;
}

template <typename T, typename CountFn>
std::vector<T> ExpectedRecv(int rank, int size, int round, CountFn count,
                            std::vector<int64_t>* counts) {
  std::vector<T> out;
  counts->clear();
  for (int src = 0; src < size; ++src) {
    counts->push_back(count(src, rank, round));
    for (int64_t i = 0; i < counts->back(); ++i) {
      out.push_back(Encode<T>(src, rank, i, round));
    }
  }
  return out;
}

template <typename T>
bool SameBytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() ||
          std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

}  // namespace muond::testing
