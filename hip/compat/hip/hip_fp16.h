// kvmulti HIP -> CUDA compat: <hip/hip_fp16.h>
#pragma once
#include "hip_runtime.h"
