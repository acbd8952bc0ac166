// A user's program: finds the installed lockstep, picks the default devices (GPUs, or host devices when
// there is none), and runs one step of work on each: y += 0.5 * x, then the sum of y, read back.
#include <lockstep/lockstep.hpp>

#include <cstdio>
#include <vector>

int main() {
  try {
    const auto selection = lockstep::default_devices();
    std::printf("devices: %s (%s)\n", selection.devices.str().c_str(), selection.reason.c_str());
    for (const lockstep::device d : selection.devices) {
      lockstep::stream s(d);
      auto x = lockstep::to_device(std::vector<float>(1000, 2.0f), s);
      auto y = lockstep::to_device(std::vector<float>(1000, 1.0f), s);
      lockstep::axpy<float>(0.5f, x.span(), y.span(), s);
      lockstep::device_buffer<float> total(1, s);
      lockstep::sum<float>(y.span(), total.span(), s);
      const float result = lockstep::to_vector(lockstep::device_span<const float>(total.span()), s)[0];
      std::printf("%s: sum(y + 0.5 x) = %.1f (expected 2000.0)\n", d.str().c_str(), result);
      if (result != 2000.0f) return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
