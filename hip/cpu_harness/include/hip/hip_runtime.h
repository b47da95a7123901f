// kvmulti HIP-on-CPU harness: <hip/hip_runtime.h> for g++ builds of the .hip sources.
#pragma once
#include "../../kvcpu.h"
