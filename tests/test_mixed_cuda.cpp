// The nvcc half of a two-configuration program (see test_mixed_host.cpp): both halves include the same
// headers, link into one executable without ODR clashes, and share the host platform (devices, memory).
#include <gtest/gtest.h>

#include <string>
#include <typeinfo>
#include <vector>

#include "lockstep/lockstep.hpp"

static_assert(LOCKSTEP_HAS_CUDA, "this translation unit must be compiled by nvcc");

namespace mixed {
std::string host_tu_abi();
bool host_tu_has_cuda();
void allocate_in_host_tu(std::size_t n);
void release_host_tu_buffer();
float host_tu_sum(const std::vector<float>& values);
void host_tu_throw_device_error();
}  // namespace mixed

TEST(mixed_program, each_configuration_has_its_own_abi_namespace) {
  EXPECT_NE(mixed::host_tu_abi(), std::string(typeid(lockstep::stream).name()));
  EXPECT_NE(mixed::host_tu_abi().find("host_v0"), std::string::npos);
  EXPECT_NE(std::string(typeid(lockstep::stream).name()).find("cuda_v0"), std::string::npos);
  EXPECT_FALSE(mixed::host_tu_has_cuda());
  EXPECT_TRUE(lockstep::cuda_status().compiled_in);
}

TEST(mixed_program, both_halves_share_the_host_devices_and_their_memory) {
  const lockstep::device d{lockstep::device_kind::host, 1};
  const auto before = lockstep::get_memory_stats(d);
  mixed::allocate_in_host_tu(1 << 20);
  const auto during = lockstep::get_memory_stats(d);  // read through the cuda_v0 functions
  EXPECT_EQ(during.live_allocations, before.live_allocations + 1);
  EXPECT_GE(during.bytes_in_use, before.bytes_in_use + (4u << 20));
  mixed::release_host_tu_buffer();
  lockstep::synchronize(d);
  EXPECT_EQ(lockstep::get_memory_stats(d).live_allocations, before.live_allocations);
  EXPECT_EQ(lockstep::host_device_count(), 2);
}

TEST(mixed_program, kernels_and_errors_work_from_both_halves) {
  EXPECT_EQ(mixed::host_tu_sum(std::vector<float>(1001, 2.0f)), 2002.0f);
  EXPECT_THROW(mixed::host_tu_throw_device_error(), lockstep::device_error);  // one error type for both
}
