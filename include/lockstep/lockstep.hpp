// lockstep/lockstep.hpp — the public surface of lockstep in one include.
#pragma once

#include "lockstep/config.hpp"

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/random.hpp"
#include "lockstep/core/units.hpp"

#include "lockstep/device/device.hpp"
#include "lockstep/device/device_guard.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/device/host_platform.hpp"
#include "lockstep/device/query.hpp"
#include "lockstep/device/visibility.hpp"

#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/memory.hpp"
#include "lockstep/runtime/pinned_buffer.hpp"
#include "lockstep/runtime/stream.hpp"

#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/kernels/reduce.hpp"
