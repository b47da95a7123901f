// kvmulti HIP-on-CPU harness: <hip/hip_bfloat16.h> for g++ builds of the .hip sources.
#pragma once
#include "../../kvcpu.h"
