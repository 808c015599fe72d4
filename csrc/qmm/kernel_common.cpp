#include <cstring>

#include "kernel.h"

namespace shardline_qmm {

bool supported_bits(int bits) { return bits == 4 || bits == 8; }

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000 | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(mant & 0x400)) {
      mant <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void prepare_x(const float* x, int M, int K, int bits, float* xp) {
  if (bits != 4) {
    std::memcpy(xp, x, sizeof(float) * size_t(M) * K);
    return;
  }
  // Byte i of a 16-byte chunk holds elements 2i (low nibble) and 2i + 1 (high nibble).
  for (size_t m = 0; m < size_t(M); ++m) {
    const float* src = x + m * K;
    float* dst = xp + m * K;
    for (int k = 0; k < K; k += 32)
      for (int i = 0; i < 16; ++i) {
        dst[k + i] = src[k + 2 * i];
        dst[k + 16 + i] = src[k + 2 * i + 1];
      }
  }
}

const Kernels* select_kernels(const char* name) {
  const bool any = std::strcmp(name, "auto") == 0;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  const bool vnni = avx512 && __builtin_cpu_supports("avx512vnni");
  if ((any || std::strcmp(name, "avx512_vnni") == 0) && vnni) return &kernels_avx512_vnni();
  if ((any || std::strcmp(name, "avx512") == 0) && avx512) return &kernels_avx512();
  if ((any || std::strcmp(name, "avx2") == 0) && avx2) return &kernels_avx2();
#endif
#if defined(__aarch64__)
  if (any || std::strcmp(name, "neon") == 0) return &kernels_neon();
#endif
  if (any || std::strcmp(name, "scalar") == 0) return &kernels_scalar();
  return nullptr;
}

}  // namespace shardline_qmm
