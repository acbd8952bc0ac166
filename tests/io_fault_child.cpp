// The child process of test_io's file-system fault tests: trains one step and saves it (step 1) under the
// directory given, trains another and saves again (step 2) into the fault named by the first argument:
//   kill      SIGKILL once the files are written and synced, before the rename that publishes them
//   fsize     a file-size limit (RLIMIT_FSIZE) far below the checkpoint's size: writes fail part-way
//   readonly  the directory made read-only (and, as root, the process turned into nobody, whom it binds)
// Prints the error of the second save and exits 3; exits 0 if it did not fail, 2 on a usage error.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "io_common.hpp"

int main(int argc, char** argv) {
  using namespace io_test;
  if (argc != 3) {
    std::fprintf(stderr, "usage: io_fault_child kill|fsize|readonly DIR\n");
    return 2;
  }
  const std::string fault = argv[1];
  const std::filesystem::path dir = argv[2];
  try {
    run r(device{device_kind::host, 0}, dtype::f32, false);
    r.train(1);
    {
      checkpointer saver(dir);
      auto st = r.state();
      saver.save(st, r.s);
    }
    r.train(1);
    checkpoint_options o;
    if (fault == "kill") {
      o.before_publish = [](const std::filesystem::path&) { ::raise(SIGKILL); };
    } else if (fault == "fsize") {
      ::signal(SIGXFSZ, SIG_IGN);  // EFBIG from write() instead of a signal
      const rlimit limit{2000, 2000};
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 2;
    } else if (fault == "readonly") {
      if (::chmod(dir.c_str(), 0555) != 0) return 2;
      if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 2;  // root ignores modes
    } else {
      return 2;
    }
    checkpointer saver(dir, o);
    auto st = r.state();
    saver.save(st, r.s);
    std::printf("the second save did not fail\n");
    return 0;
  } catch (const std::exception& e) {
    std::printf("%s\n", e.what());
    return 3;
  }
}
