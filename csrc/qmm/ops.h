// Small CPU primitives for one decode position: on MLX's CPU backend rms_norm, rope and silu run as
// graphs of generic ops (its `fast` fallbacks), a dozen ops and tens of microseconds each for a vector
// of a few hundred floats. These compute the same functions in one op each, in float32.
#pragma once

#include <vector>

#include "mlx/array.h"

namespace shardline_qmm {

namespace mx = mlx::core;

// x * rsqrt(mean(x^2, -1) + eps) * w, over the last axis; x and w float32.
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps);

// mx.fast.rope for x laid out (B, T, heads...) (positions along axis 1, not 2), the trailing axes holding
// whole heads of head_dim: position offsets[b] + t (offsets int32, one per b or one for all), the first
// `dims` features of each head rotated, non-traditional (halves) or traditional (pairs). float32.
mx::array rope_bthd(const mx::array& x, const mx::array& offsets, int dims, bool traditional, float base,
                    float scale, int head_dim);

// One request's attention at one decode position: q holds its H heads (any shape of H * head_dim
// elements); keys and values are its cache in segments (a paged cache's blocks, or one contiguous array),
// each (1, kv_heads, length_i, head_dim), strided (views into a cache) or not. softmax(scale * q k^T) v per
// head over the segments' concatenation in order, grouped-query heads sharing their kv head, read where the
// segments lie: bit for bit what the concatenated array gives. -> (1, 1, H * head_dim).
// (One binding, lists only: with an overload for plain arrays nanobind took about 5 us to pick it.)
mx::array decode_attention(const mx::array& q, const std::vector<mx::array>& keys,
                           const std::vector<mx::array>& values, float scale);

// (a + b, rms_norm(a + b) * w): a residual sum and the next norm in one op. float32.
std::vector<mx::array> add_rms_norm(const mx::array& a, const mx::array& b, const mx::array& w, float eps);

// Greedy choice from 1-D float32 logits: (argmax as int32, its log-probability) in one pass.
std::vector<mx::array> greedy(const mx::array& logits);

// silu(gate) * up, elementwise; float32.
mx::array silu_mul(const mx::array& gate, const mx::array& up);

}  // namespace shardline_qmm
