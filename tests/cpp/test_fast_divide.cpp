// FastDivisor (common/fast_divide.h) against the hardware division: divisors and dividends at the
// edges of the method's proof (powers of two and their neighbours, 1, 2^32 - 1) and at random.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "common/fast_divide.h"

namespace fp8amp {
namespace {

std::vector<uint32_t> edge_values() {
  std::vector<uint32_t> v = {1, 2, 3, 5, 7, 10, 100, 127, 129, 1000, 65535, 65537, 1000003, 0xFFFFFFFFu};
  for (int k = 1; k < 32; ++k) {
    const uint32_t p = uint32_t{1} << k;
    v.insert(v.end(), {p - 1, p, p + 1});
  }
  return v;
}

TEST(FastDivisor, EqualsDivisionAtTheEdgesAndAtRandom) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> any(0, 0xFFFFFFFFu);
  const std::vector<uint32_t> edges = edge_values();
  std::vector<uint32_t> divisors = edges;
  for (int i = 0; i < 200; ++i) divisors.push_back(std::max<uint32_t>(1, any(rng) >> (i % 32)));
  for (const uint32_t d : divisors) {
    const FastDivisor div = FastDivisor::of(d);
    ASSERT_EQ(div.divisor, d);
    std::vector<uint32_t> dividends = edges;
    dividends.push_back(0);
    for (const uint64_t k : {uint64_t{1}, uint64_t{2}, uint64_t{0xFFFFFFFFu} / d}) {
      const uint64_t multiple = k * d;  // q * d and its neighbours: where a quotient steps
      for (const uint64_t n : {multiple - 1, multiple, multiple + 1}) {
        if (n <= 0xFFFFFFFFu) dividends.push_back(static_cast<uint32_t>(n));
      }
    }
    for (int i = 0; i < 500; ++i) dividends.push_back(any(rng));
    for (const uint32_t n : dividends) ASSERT_EQ(div.divide(n), n / d) << n << " / " << d;
  }
}

}  // namespace
}  // namespace fp8amp
