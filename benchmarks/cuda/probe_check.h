// What the cuBLASLt probes in this folder share: a status check that stops the probe with the
// failing call and its line, and the workspace they give cuBLASLt (fp8amp's kGemmWorkspaceBytes
// on Hopper, so the heuristic answers as it does for the library).
#pragma once

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                             \
  do {                                                                    \
    const int s_ = static_cast<int>(x);                                   \
    if (s_ != 0) {                                                        \
      std::printf("%s:%d: %s returned %d\n", __FILE__, __LINE__, #x, s_); \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)

constexpr size_t kWorkspace = 32u << 20;
