// Shared by the C++ tests: f must throw fp8amp::Error of `kind` whose message contains `needle`
// (the argument's name, the accepted values).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "fp8amp/error.h"

namespace fp8amp {

inline void expect_error(ErrorKind kind, const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

inline void expect_value_error(const std::function<void()>& f, const std::string& needle) {
  expect_error(ErrorKind::kValue, f, needle);
}

}  // namespace fp8amp
