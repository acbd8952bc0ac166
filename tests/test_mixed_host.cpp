// Half of a program made of two kinds of translation unit: this one is compiled by the plain C++ compiler
// (host backend only, namespace lockstep::host_v0); test_mixed_cuda.cpp is compiled by nvcc (lockstep::cuda_v0).
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"

static_assert(!LOCKSTEP_HAS_CUDA, "this translation unit must be compiled without nvcc");

namespace mixed {

std::string host_tu_abi() { return typeid(lockstep::stream).name(); }

bool host_tu_has_cuda() { return lockstep::cuda_status().compiled_in; }

// Allocates on host:1 from this translation unit and leaves the buffer alive until release_host_tu_buffer.
static lockstep::device_buffer<float>* kept = nullptr;
void allocate_in_host_tu(std::size_t n) {
  kept = new lockstep::device_buffer<float>(n, lockstep::default_stream(lockstep::device{lockstep::device_kind::host, 1}));
}
void release_host_tu_buffer() {
  delete kept;
  kept = nullptr;
}

float host_tu_sum(const std::vector<float>& values) {
  const lockstep::device d{lockstep::device_kind::host, 0};
  lockstep::stream s(d);
  auto x = lockstep::to_device(values, s);
  lockstep::device_buffer<float> out(1, s);
  lockstep::sum<float>(x.span(), out.span(), s);
  return lockstep::to_vector(lockstep::device_span<const float>(out.span()), s)[0];
}

void host_tu_throw_device_error() { (void)lockstep::device_set::parse("host:9", lockstep::device_kind::host); }

}  // namespace mixed
