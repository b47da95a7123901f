// kvmulti HIP-on-CPU harness: <hip/hip_fp16.h> for g++ builds of the .hip sources.
#pragma once
#include "../../kvcpu.h"
