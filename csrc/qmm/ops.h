// Small CPU primitives for one decode position: on MLX's CPU backend rms_norm, rope and silu run as
// graphs of generic ops (its `fast` fallbacks), a dozen ops and tens of microseconds each for a vector
// of a few hundred floats. These compute the same functions in one op each, in float32.
#pragma once

#include "mlx/array.h"

namespace shardline_qmm {

namespace mx = mlx::core;

// x * rsqrt(mean(x^2, -1) + eps) * w, over the last axis; x and w float32.
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps);

// mx.fast.rope for x laid out (B, T, H, D) (positions along axis 1, not 2): position offsets[b] + t
// (offsets int32, one per b or one for all), the first `dims` features rotated, non-traditional (halves)
// or traditional (pairs). float32.
mx::array rope_bthd(const mx::array& x, const mx::array& offsets, int dims, bool traditional, float base,
                    float scale);

// silu(gate) * up, elementwise; float32.
mx::array silu_mul(const mx::array& gate, const mx::array& up);

}  // namespace shardline_qmm
