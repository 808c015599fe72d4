// AVX-512 F/BW/VL + FMA + F16C (Skylake-SP and later, Zen 4 and later): the float paths, and the
// int16-activation kernels on vpmaddwd for CPUs without VNNI. Chosen at run time.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernel.h"

namespace shardline_qmm {
namespace avx512_isa {

struct S {
  using V = __m512;
  static constexpr int L = 16;
  static constexpr int ACC = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static void u4(const uint8_t* p, V& lo, V& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  static V u8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void cvt_f16(const uint16_t* src, float* dst, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    for (; i < n; ++i) dst[i] = half_to_float(src[i]);
  }
};

#include "kernel_impl.h"

#define QMM_VNNI 0
#include "kernel_avx512_int16.h"
#undef QMM_VNNI

}  // namespace avx512_isa

const Kernels& kernels_avx512() {
  static const Kernels k{.name = "avx512",
                         .rows = &avx512_isa::Impl<avx512_isa::S>::rows,
                         .dequant = &avx512_isa::Impl<avx512_isa::S>::dequant,
                         .scores = &avx512_isa::Impl<avx512_isa::S>::scores,
                         .mix = &avx512_isa::Impl<avx512_isa::S>::mix,
                         .int_prepare = &avx512_isa::prepare,
                         .int_rows = &avx512_isa::int_rows};
  return k;
}

}  // namespace shardline_qmm
