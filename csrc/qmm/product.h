// The pieces of a quantized product that the dense primitive (primitive.cpp) and the gathered one
// (gather.cpp) share: which kernel path a number of rows takes, x prepared for that path, one product run
// on it, and the conversions at either end.
#pragma once

#include <cstdint>
#include <vector>

#include "kernel.h"
#include "mlx/array.h"

namespace shardline_qmm {

namespace mx = mlx::core;

// Integer: x rounded to int16 for the integer-dot row kernels; Float: the float32 row kernels; Gemm:
// tiles of w dequantized and multiplied by BLAS.
enum class Path { Float, Integer, Gemm };

// The path a product of M rows of x takes under the current settings (set_isa, set_gemm_rows, set_integer).
Path path_for(int M);

ScaleType scale_type(mx::Dtype t);

// x (M x K, row-major, any float dtype) as float32 rows: x's own memory where it already is (then
// `buf` is untouched), else converted into buf.
const float* float_rows(const mx::array& x, std::vector<float>& buf);

// x's rows (M x K float32) as `path` reads them: permuted for the 4-bit float kernels (into xp; 8-bit
// rows stay as they are), or rounded into q16 / dx / xsum for the integer ones. Row i of any of these
// depends on row i of x alone.
struct Prepared {
  const float* rows = nullptr;  // for Float and Gemm
  QX q;  // for Integer
};
Prepared prepare_rows(const float* x, int M, int K, int group_size, int bits, Path path, std::vector<float>& xp,
                      std::vector<int16_t>& q16, std::vector<float>& dx, std::vector<float>& xsum);

// p.y[m * p.ldy + n] for every row of p.x and every row of w: p.x prepared for `path` (xq for Integer).
void run_problem(const Problem& p, const QX& xq, Path path);

// out's n elements from float32 y, in out's dtype (float32, float16 or bfloat16), starting at element at.
void store(const float* y, mx::array& out, size_t at, size_t n);

}  // namespace shardline_qmm
