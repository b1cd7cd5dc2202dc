// Unsigned 32-bit division by a divisor fixed for a whole kernel, as a multiply-high, an add and a
// shift: what a kernel uses where a per-element index needs n / d and a hardware division (a
// ~20-instruction sequence on the GPU) would cost more than the element's own math. The host
// computes the same quotient (tests compare it with `/` over the edge cases).
//
// Method: Granlund and Montgomery's round-up multiplier ("Division by invariant integers using
// multiplication", 1994): with l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1,
// floor(n / d) = (mulhi(m, n) + n) >> l for every n < 2^32, the sum taken in 64 bits.
#pragma once

#include <cstdint>

#include "common/numerics.h"

namespace fp8amp {

struct FastDivisor {
  uint32_t divisor;
  uint32_t multiplier;
  uint32_t shift;

  // d >= 1 (the caller checks).
  FP8AMP_HD static FastDivisor of(uint32_t d) {
    uint32_t l = 0;
    while (l < 32 && (uint64_t{1} << l) < d) ++l;
    const uint64_t m = ((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1;
    return {d, static_cast<uint32_t>(m), l};
  }

  FP8AMP_HD uint32_t divide(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t high = __umulhi(n, multiplier);
#else
    const uint32_t high = static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32);
#endif
    return static_cast<uint32_t>((uint64_t{high} + n) >> shift);
  }
};

}  // namespace fp8amp
