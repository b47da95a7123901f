// kvmulti HIP -> CUDA compat: <hip/hip_bfloat16.h> (hip_bfloat16 is __nv_bfloat16: float conversions both ways)
#pragma once
#include "hip_runtime.h"
typedef __nv_bfloat16 hip_bfloat16;
