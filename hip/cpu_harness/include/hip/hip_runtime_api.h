// kvmulti HIP-on-CPU harness: <hip/hip_runtime_api.h> for g++ builds of the .hip sources.
#pragma once
#include "../../kvcpu.h"
