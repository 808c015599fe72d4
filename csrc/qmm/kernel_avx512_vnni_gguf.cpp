// GGUF block products on AVX-512 VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later): u8 weights times s8
// rounded x by vpdpbusd (gguf_impl.h). Chosen at run time (gguf_kernels_for), compiled for its own
// instruction set.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gguf_kernel.h"
#include "kernel.h"

namespace shardline_qmm {
namespace gguf_avx512_vnni {

struct S {
  using W = __m512i;
  using I = __m512i;
  using F = __m512;
  static constexpr bool SIGNED_Q8 = false;  // vpdpbusd takes unsigned weights: Q8_0 as q + 128
  // Accumulators per row of x (gguf_impl.h row_block): two fma chains; 8 rows' 16 fit the 32 registers.
  static constexpr int ROW_ACC = 2;

  static F zero_f() { return _mm512_setzero_ps(); }
  static F set1(float f) { return _mm512_set1_ps(f); }
  static W load_x(const int8_t* p) { return _mm512_loadu_si512(p); }
  static F load_f(const float* p) { return _mm512_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static float hsum(F a) { return _mm512_reduce_add_ps(a); }
  static float h2f(uint16_t h) { return _cvtsh_ss(h); }
  template <bool SIGNED>
  static I dot(W w, W x) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
  }
  template <bool SIGNED>
  static I dot_acc(I acc, W w, W x) {
    return _mm512_dpbusd_epi32(acc, w, x);
  }
  static F cvt(I i) { return _mm512_cvtepi32_ps(i); }
  static void k4_pair(W lo, W hi, W& p, W& q) {
    p = _mm512_shuffle_i64x2(lo, hi, 0x88);
    q = _mm512_shuffle_i64x2(lo, hi, 0xDD);
  }
  static F segs(F f, int c0, int c1, int c2, int c3) {
    const __m512i idx = _mm512_setr_epi32(c0, c0, c0, c0, c1, c1, c1, c1, c2, c2, c2, c2, c3, c3, c3, c3);
    return _mm512_permutexvar_ps(idx, f);
  }
  static __m128i ld16(const uint8_t* p, int at) {
    return p ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at)) : _mm_setzero_si128();
  }
  static W seg4(const uint8_t* const* p, int at, bool flip) {
    W w = _mm512_castsi128_si512(ld16(p[0], at));
    w = _mm512_inserti32x4(w, ld16(p[1], at), 1);
    w = _mm512_inserti32x4(w, ld16(p[2], at), 2);
    w = _mm512_inserti32x4(w, ld16(p[3], at), 3);
    return flip ? _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))) : w;
  }
  static void nib_split(W t, W& lo, W& hi) {
    lo = low4(t);
    hi = low4(_mm512_srli_epi16(t, 4));
  }
  static W low4(W w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  // 16 bytes -> [their low nibbles, their high nibbles] (not yet masked).
  static __m256i halves16(const uint8_t* p) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  }
  static void nib64(const uint8_t* p, W& lo, W& hi) {
    const W t = _mm512_loadu_si512(p);
    lo = low4(t);
    hi = low4(_mm512_srli_epi16(t, 4));
  }
  static W nib16x2(const uint8_t* p0, const uint8_t* p1) {
    const __m256i hi = p1 ? halves16(p1) : _mm256_setzero_si256();
    return low4(_mm512_inserti64x4(_mm512_castsi256_si512(halves16(p0)), hi, 1));
  }
  static W raw32x2(const uint8_t* p0, const uint8_t* p1, bool flip) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0));
    const __m256i hi = p1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)) : _mm256_setzero_si256();
    const W w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return flip ? _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))) : w;
  }
  static W add_bit16(W w, const uint8_t* qh, int b0, int b1) {
    const W h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)));
    const W bit = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << b0)), _mm256_set1_epi8(char(1 << b1)), 1);
    return _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(h, bit), w, _mm512_set1_epi8(16));
  }
  static W add_bits64(W w, uint64_t bits) {
    return _mm512_mask_add_epi8(w, _cvtu64_mask64(bits), w, _mm512_set1_epi8(16));
  }
  static void q6(const uint8_t* ql, const uint8_t* qh, W& w0, W& w1) {
    const W k30 = _mm512_set1_epi8(0x30);
    const W L = _mm512_loadu_si512(ql);
    const __m256i Q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    const W H = _mm512_inserti64x4(_mm512_castsi256_si512(Q), _mm256_srli_epi16(Q, 2), 1);
    w0 = _mm512_or_si512(low4(L), _mm512_and_si512(_mm512_slli_epi16(H, 4), k30));
    w1 = _mm512_or_si512(low4(_mm512_srli_epi16(L, 4)), _mm512_and_si512(H, k30));
  }
  static void store_w(W w, uint8_t* p) { _mm512_store_si512(p, w); }
  static void store_f(F f, float* p) { _mm512_store_ps(p, f); }
  template <bool SIGNED>
  static void dequant16(const uint8_t* q, float a, float b, float* out) {
    const __m512i i = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q)));
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(a), _mm512_set1_ps(b)));
  }
  static F join(__m256 a, __m256 b) {
    return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_castps_si256(a)), _mm256_castps_si256(b), 1));
  }
  static F pairs2(F f, int a, int b) {
    return _mm512_permutexvar_ps(_mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(a), _mm512_set1_epi32(b)), f);
  }
  static F offs_pairs(F f) {
    const __m512i idx = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    return _mm512_permutexvar_ps(idx, f);
  }
  static F quads(F f, int v) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * v),
                                         _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
    return _mm512_permutexvar_ps(idx, f);
  }
};

#include "gguf_impl.h"

void quantize(const float* x, int M, int K, int8_t* q, float* d, int16_t* s16) {
  for (size_t b = 0, nb = size_t(M) * (K / 32); b < nb; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float step = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(step != 0.0f ? 1.0f / step : 0.0f);
    d[b] = step;
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i a = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, inv), rn);
    const __m512i c = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, inv), rn);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), _mm512_cvtsepi32_epi8(a));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), _mm512_cvtsepi32_epi8(c));
    s16[2 * b] = int16_t(_mm512_reduce_add_epi32(a));
    s16[2 * b + 1] = int16_t(_mm512_reduce_add_epi32(c));
  }
}

}  // namespace gguf_avx512_vnni

const GgufKernels& gguf_kernels_avx512_vnni() {
  static const GgufKernels k{"avx512_vnni", &gguf_avx512_vnni::quantize, &gguf_avx512_vnni::GgufImpl<gguf_avx512_vnni::S>::rows,
                             &gguf_avx512_vnni::GgufImpl<gguf_avx512_vnni::S>::dequant};
  return k;
}

}  // namespace shardline_qmm
