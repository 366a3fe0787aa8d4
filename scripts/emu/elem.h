// The part of kernels/src/gpu/elem.h that gemv_q4.cu uses (scripts/emulate_gemv_q4.sh).
#pragma once
#include "portable.h"
struct alignas(16) V16 {
    u32 w[4];
};
