// The instruction-set level this CPU and OS run (common.h's cpu_level: CPUID, XGETBV, AMX's
// permission), for runtime/native/__init__.py to pick which build of the kernels to load before
// loading any: a plain shared library (no torch headers: it builds in a second), read through ctypes.
#include "common.h"

extern "C" int lowbit_cpu_level() { return cpu_level(); }
