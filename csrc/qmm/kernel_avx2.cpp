// AVX2 + FMA + F16C (x86-64 since Haswell / Zen 1): the float paths and the int16-activation kernels.
// Compiled with those flags only; chosen at run time.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernel.h"

namespace shardline_qmm {
namespace avx2_isa {

struct S {
  using V = __m256;
  static constexpr int L = 8;
  static constexpr int ACC = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void u4(const uint8_t* p, V& lo, V& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  static V u8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void cvt_f16(const uint16_t* src, float* dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = half_to_float(src[i]);
  }
};

#include "kernel_impl.h"
#include "kernel_avx2_int16.h"

}  // namespace avx2_isa

const Kernels& kernels_avx2() {
  static const Kernels k{.name = "avx2",
                         .rows = &avx2_isa::Impl<avx2_isa::S>::rows,
                         .dequant = &avx2_isa::Impl<avx2_isa::S>::dequant,
                         .scores = &avx2_isa::Impl<avx2_isa::S>::scores,
                         .mix = &avx2_isa::Impl<avx2_isa::S>::mix,
                         .int_prepare = &avx2_isa::int16_avx2::prepare,
                         .int_rows = &avx2_isa::int16_avx2::int_rows};
  return k;
}

}  // namespace shardline_qmm
