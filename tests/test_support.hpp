// Helpers shared by lockstep's GoogleTest programs: error-message checks, a gate for queued host work,
// conversions between f32 and the floating storage types, and the fixtures that run a test once per backend.
#pragma once

#include <gtest/gtest.h>

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/device/device.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/device/query.hpp"

/// Expects `needle` in the string `haystack` (an error message), showing both on failure.
#define EXPECT_CONTAINS(haystack, needle)                          \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "expected to find \"" << (needle) << "\" in \"" << (haystack) << '"'

namespace lockstep_test {

/// Runs `f`, expecting an exception of type E; returns its message ("" and a test failure otherwise).
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw the wrong exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "did not throw";
  return {};
}

/// A gate that queued host work can wait on: the test decides when the stream may go on.
struct gate {
  std::mutex m;
  std::condition_variable cv;
  bool open = false;
  void release() {
    {
      std::lock_guard l(m);
      open = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock l(m);
    cv.wait(l, [&] { return open; });
  }
};

/// Calls f.template operator()<T>() for the C++ type of a floating dtype. (`lockstep::half` is spelled out:
/// compiled by nvcc, cuda_fp16.h also declares `::half`.)
template <class F>
void with_float_type(lockstep::dtype t, F&& f) {
  switch (t) {
    case lockstep::dtype::f32: return f.template operator()<float>();
    case lockstep::dtype::f16: return f.template operator()<lockstep::half>();
    case lockstep::dtype::bf16: return f.template operator()<lockstep::bfloat16>();
    default: FAIL() << "not a floating dtype";
  }
}

/// v converted (rounded to nearest even) to T.
template <class T>
std::vector<T> from_floats(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = lockstep::convert<T>(v[i]);
  return out;
}

/// v widened to f32 (exact).
template <class T>
std::vector<float> to_floats(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = lockstep::to_float(v[i]);
  return out;
}

/// The backend of a test parameter: the parameter itself, or the first element of a tuple.
inline lockstep::device_kind backend_of(lockstep::device_kind k) { return k; }
template <class... Rest>
lockstep::device_kind backend_of(const std::tuple<lockstep::device_kind, Rest...>& param) {
  return std::get<0>(param);
}

/// Both backends, host first: what a backend test is instantiated over (alone, or in ::testing::Combine).
inline auto all_backends() { return ::testing::Values(lockstep::device_kind::host, lockstep::device_kind::cuda); }

/// A test run once per backend. Param is a device_kind, or a tuple whose first element is one (the backend
/// added to a test's other parameters). kind() is the backend, dev(i) its device i, devices(k) its first k.
/// The CUDA instances skip without a GPU ("no GPU: " and the CUDA runtime's reason); a test that needs several
/// devices says so first with `if (!require_devices(n)) return;`.
template <class Param>
class on_backend : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (kind() == lockstep::device_kind::cuda && !lockstep::cuda_available()) {
      GTEST_SKIP() << "no GPU: " << lockstep::cuda_status().reason();
    }
  }

  lockstep::device_kind kind() const { return backend_of(this->GetParam()); }
  lockstep::device dev(int i = 0) const { return lockstep::device{kind(), i}; }
  /// Devices 0..k-1 of the backend.
  lockstep::device_set devices(int k) const {
    std::vector<lockstep::device> d;
    for (int i = 0; i < k; ++i) d.push_back(dev(i));
    return lockstep::device_set(std::move(d));
  }

  /// True when the backend has at least n devices. Otherwise returns false after marking the test: skipped
  /// on CUDA ("needs 2 GPUs, found 1": the machine has what it has), failed on the host backend (the test
  /// program's environment configures its host devices, so too few of them is a mistake to report).
  [[nodiscard]] bool require_devices(int n) const {
    const int found = lockstep::device_count(kind());
    if (found >= n) return true;
    if (kind() == lockstep::device_kind::cuda) {
      [&] { GTEST_SKIP() << "needs " << n << " GPUs, found " << found; }();
    } else {
      ADD_FAILURE() << "needs " << n << " host devices, found " << found << ": run with LOCKSTEP_HOST_DEVICES=" << n
                    << " or more";
    }
    return false;
  }
};

/// A test over the backend alone. Name the instances with `backend_name`.
using backend_test = on_backend<lockstep::device_kind>;

/// "host", "cuda": the instance names of a backend_test.
inline std::string backend_name(const ::testing::TestParamInfo<lockstep::device_kind>& info) {
  return std::string(lockstep::name_of(info.param));
}

/// A test over (backend, floating dtype): kind(), type() and dev() (device 0 of the kind); the CUDA instances
/// skip when there is no GPU. Name the instances with `param_name`.
class backend_and_dtype : public on_backend<std::tuple<lockstep::device_kind, lockstep::dtype>> {
 protected:
  lockstep::dtype type() const { return std::get<1>(GetParam()); }
};

/// "host_f32", "cuda_bf16": the instance names of a backend_and_dtype test.
inline std::string param_name(const ::testing::TestParamInfo<backend_and_dtype::ParamType>& info) {
  return std::string(lockstep::name_of(std::get<0>(info.param))) + "_" +
         std::string(lockstep::name_of(std::get<1>(info.param)));
}

}  // namespace lockstep_test
