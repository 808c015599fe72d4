// Quantized matrix-vector / small matrix-matrix kernels for MLX's affine quantization layout.
//
// y[m, n] = sum_k x[m, k] * (s[n, k / gs] * q[n, k] + b[n, k / gs])
//
// q holds `bits`-bit unsigned integers packed little-endian into uint32 words (for 4 bits: word w holds
// elements 8w..8w+7, element j at bits 4j..4j+3). The kernels see x already "prepared" (prepare_x): for
// 4 bits each 32-element chunk is stored as its 16 even elements then its 16 odd ones, which is the order
// in which the low and high nibbles of 16 packed bytes come out, so no kernel ever shuffles weights.
//
// This header is free of MLX so that the per-ISA translation units can be compiled with their own
// instruction-set flags without touching any inline code they share with MLX.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardline_qmm {

enum class ScaleType : int { F32 = 0, F16 = 1, BF16 = 2 };

struct Problem {
  const float* x = nullptr;  // M x K, prepared
  int M = 0, K = 0, N = 0;
  const uint8_t* w = nullptr;  // N rows of K * bits / 8 bytes
  const void* scales = nullptr;  // N x K / group_size
  const void* biases = nullptr;
  ScaleType stype = ScaleType::F32;
  int group_size = 32;
  int bits = 4;
  float* y = nullptr;  // y[m * ldy + n]
  size_t ldy = 0;
};

// y[:, n0:n1] for every row of x.
using RowsFn = void (*)(const Problem&, int n0, int n1);
// The dequantized float weights of rows [n0, n1) in prepared (permuted) column order, (n1 - n0) x K.
using DequantFn = void (*)(const Problem&, int n0, int n1, float* tile);

// x rounded to int16 per block of 32 (kernel_avx512_int16.h), for the integer-dot kernels.
struct QX {
  const int16_t* q = nullptr;  // M x K, in the kernel's order
  const float* dx = nullptr;  // M x K / 32: the step of each block (max |x| / 32767)
  const float* xsum = nullptr;  // M x K / group_size: sums of the rounded x per weight group (biases)
};
using QPrepareFn = void (*)(const float* x, int M, int K, int bits, int group_size, int16_t* q, float* dx,
                            float* xsum);
using QRowsFn = void (*)(const Problem&, const QX&, int n0, int n1);

// Decode attention over one KV head's `len` cached positions (rows `kl` / `vl` floats apart) for the `rep`
// query heads that share it (q: rep x D, contiguous).
// scores: s[r * len + l] = scale * q_r . k_l
using ScoresFn = void (*)(const float* q, int rep, int D, const float* k, int64_t kl, int len, float scale,
                          float* s);
// mix: out_r += sum_l p[r * len + l] * v_l (out: rep x D, contiguous)
using MixFn = void (*)(const float* p, int rep, int D, const float* v, int64_t vl, int len, float* out);

struct Kernels {
  const char* name;
  RowsFn rows;
  DequantFn dequant;
  ScoresFn scores;
  MixFn mix;
  QPrepareFn int_prepare = nullptr;  // null where the CPU has no fast integer dot product
  QRowsFn int_rows = nullptr;
};

// Asks for the bytes `ahead` of a block of `len` bytes that starts at `at`, up to `end`: the hardware
// prefetcher alone left a matrix streamed from DRAM at half the speed of a cached one.
constexpr size_t kPrefetchBytes = 12288;
inline void prefetch_ahead(const uint8_t* at, size_t len, const uint8_t* end) {
  const uint8_t* from = at + kPrefetchBytes;
  for (size_t off = 0; off < len && from + off < end; off += 64) __builtin_prefetch(from + off);
}

// Writes x (M x K, float32, row-major) in the order the kernels read it.
void prepare_x(const float* x, int M, int K, int bits, float* xp);

// The kernel set chosen now (set_isa), for ops outside the products.
const Kernels& current_kernels();

const Kernels& kernels_scalar();
#if defined(__x86_64__) || defined(_M_X64)
const Kernels& kernels_avx2();
const Kernels& kernels_avx512();
const Kernels& kernels_avx512_vnni();
#endif
#if defined(__aarch64__)
const Kernels& kernels_neon();
#endif

// The best kernel set this CPU runs, or the named one ("auto", "avx512_vnni", "avx512", "avx2", "neon", "scalar");
// nullptr for a name this build or CPU lacks.
const Kernels* select_kernels(const char* name);

bool supported_bits(int bits);

// Scalar conversions (also used by the per-ISA code for odd cases).
float half_to_float(uint16_t h);
inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

}  // namespace shardline_qmm
