// Products with weights in GGUF's own block formats (ggml-common.h), read as they are stored.
//
// A weight is N rows, each the row's K / block_elements blocks back to back exactly as in the GGUF file:
//   Q4_0 (18 B / 32): f16 d, 16 B nibbles (element i low, i + 16 high)            w = d * (q - 8)
//   Q4_1 (20 B / 32): f16 d, f16 m, 16 B nibbles                                   w = d * q + m
//   Q5_0 (22 B / 32): f16 d, 4 B fifth bits (element i: bit i), 16 B nibbles          w = d * (q - 16)
//   Q5_1 (24 B / 32): f16 d, f16 m, 4 B fifth bits, 16 B nibbles                    w = d * q + m
//   Q8_0 (34 B / 32): f16 d, 32 int8                                               w = d * q
//   Q4_K (144 B / 256): f16 d, f16 dmin, 12 B of 6-bit scales / mins, 128 B nibbles  w = d sc_j q - dmin m_j
//   Q5_K (176 B / 256): as Q4_K plus 32 B of fifth bits
//   Q6_K (210 B / 256): 128 B low nibbles, 64 B high 2 bits, 16 int8 scales, f16 d  w = d sc_h (q - 32)
//
// Rounding: as llama.cpp does, x is rounded to int8 per block of 32 (step dx = max|x_block| / 127, to the
// nearest, ties to even) so that every weight block meets x in exact integer dot products (VNNI, maddubs);
// the result is x_rounded @ dequantize(w).T up to float32 summation order. The error against float x is at
// most dx / 2 per element, sum_k |w_k| dx_k / 2 per output. The int8 sums of each 16 elements of x carry the
// offsets (-8, -16, -32, + 128 for Q8_0 on u8 x s8 dots) and the minimums (Q4_1, Q5_1, Q4_K, Q5_K).
// From gguf_gemm_rows rows on the products dequantize tiles of w to float32 and call BLAS with the rounded x
// in float32: the same function of x on both paths, up to the order of float sums.
//
// Free of MLX, like kernel.h, so that the per-ISA files compile with their own flags.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardline_qmm {

// GGML's type numbers.
enum class GgufType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct GgufBlock {
  int elements = 0;  // 0: not a supported type
  int bytes = 0;
};
GgufBlock gguf_block_of(int qtype);

// x rounded per block of 32: M rows of K int8, K / 32 steps, K / 16 sums of 16 rounded values.
struct GgufX {
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const int16_t* s16 = nullptr;
};

struct GgufProblem {
  GgufX x;
  int M = 0, K = 0, N = 0;
  GgufType type = GgufType::Q4_0;
  const uint8_t* w = nullptr;
  size_t row_bytes = 0;
  float* y = nullptr;  // y[m * ldy + n]
  size_t ldy = 0;
};

// Rounds x (M x K float32) into q (M x K), d (M x K / 32), s16 (M x K / 16); K a multiple of 32. Every ISA's
// version gives the same values as the scalar one.
using GgufQuantizeFn = void (*)(const float* x, int M, int K, int8_t* q, float* d, int16_t* s16);
// y[:, n0:n1] for every row of x; each output element's arithmetic does not depend on n0, n1.
using GgufRowsFn = void (*)(const GgufProblem& p, int n0, int n1);
// Rows [n0, n1) of w dequantized to float32, (n1 - n0) x K: bit-equal to gguf.quants.dequantize.
using GgufDequantFn = void (*)(const GgufProblem& p, int n0, int n1, float* out);

struct GgufKernels {
  const char* name;
  GgufQuantizeFn quantize;
  GgufRowsFn rows;
  GgufDequantFn dequant;
};

const GgufKernels& gguf_kernels_scalar();
#if defined(__x86_64__) || defined(_M_X64)
const GgufKernels& gguf_kernels_avx2();
const GgufKernels& gguf_kernels_avx512_vnni();
#endif
// The GGUF kernels that go with a kernel set of kernel.h (by its name).
const GgufKernels& gguf_kernels_for(const char* isa);

// One block's scalar pieces, shared by the scalar kernels and the per-ISA code's odd cases.
// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block's 12 scale bytes.
inline void gguf_scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

}  // namespace shardline_qmm
