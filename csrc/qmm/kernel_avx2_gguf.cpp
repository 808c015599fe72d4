// GGUF block products on AVX2 (also the AVX-512 CPUs without VNNI): u8 weights times s8 rounded x by
// vpmaddubsw + vpmaddwd (gguf_impl.h); Q8_0 signed, its signs moved onto x, as vpmaddubsw's int16 pairs
// would overflow on q + 128. Chosen at run time, compiled for its own instruction set.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gguf_kernel.h"
#include "kernel.h"

namespace shardline_qmm {
namespace gguf_avx2 {

struct S {
  struct W {
    __m256i lo, hi;
  };
  using I = W;
  struct F {
    __m256 lo, hi;
  };
  static constexpr bool SIGNED_Q8 = true;
  static constexpr int ROW_ACC = 1;  // F is already two registers: two chains per row

  static F zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F set1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
  static __m256i ld(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static W load_x(const int8_t* p) { return {ld(p), ld(p + 32)}; }
  static F load_f(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static F fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static F mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static F add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static float hsum(F a) {
    const __m256 s = _mm256_add_ps(a.lo, a.hi);
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
  }
  static float h2f(uint16_t h) { return _cvtsh_ss(h); }
  template <bool SIGNED>
  static __m256i dot8(__m256i w, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (SIGNED) return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  }
  template <bool SIGNED>
  static I dot(W w, W x) {
    return {dot8<SIGNED>(w.lo, x.lo), dot8<SIGNED>(w.hi, x.hi)};
  }
  template <bool SIGNED>
  static I dot_acc(I acc, W w, W x) {
    const I d = dot<SIGNED>(w, x);
    return {_mm256_add_epi32(acc.lo, d.lo), _mm256_add_epi32(acc.hi, d.hi)};
  }
  static F cvt(I i) { return {_mm256_cvtepi32_ps(i.lo), _mm256_cvtepi32_ps(i.hi)}; }
  static void k4_pair(W lo, W hi, W& p, W& q) {
    p = {_mm256_permute2x128_si256(lo.lo, lo.hi, 0x20), _mm256_permute2x128_si256(hi.lo, hi.hi, 0x20)};
    q = {_mm256_permute2x128_si256(lo.lo, lo.hi, 0x31), _mm256_permute2x128_si256(hi.lo, hi.hi, 0x31)};
  }
  static F segs(F f, int c0, int c1, int c2, int c3) {
    return {_mm256_permutevar8x32_ps(f.lo, _mm256_setr_epi32(c0, c0, c0, c0, c1, c1, c1, c1)),
            _mm256_permutevar8x32_ps(f.lo, _mm256_setr_epi32(c2, c2, c2, c2, c3, c3, c3, c3))};
  }
  static __m128i ld16(const uint8_t* p, int at) {
    return p ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at)) : _mm_setzero_si128();
  }
  static W seg4(const uint8_t* const* p, int at, bool flip) {
    W w{_mm256_inserti128_si256(_mm256_castsi128_si256(ld16(p[0], at)), ld16(p[1], at), 1),
        _mm256_inserti128_si256(_mm256_castsi128_si256(ld16(p[2], at)), ld16(p[3], at), 1)};
    if (flip) {
      w.lo = _mm256_xor_si256(w.lo, _mm256_set1_epi8(char(0x80)));
      w.hi = _mm256_xor_si256(w.hi, _mm256_set1_epi8(char(0x80)));
    }
    return w;
  }
  static void nib_split(W t, W& lo, W& hi) {
    lo = {low4(t.lo), low4(t.hi)};
    hi = {low4(_mm256_srli_epi16(t.lo, 4)), low4(_mm256_srli_epi16(t.hi, 4))};
  }
  static __m256i low4(__m256i w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
  static __m256i halves16(const uint8_t* p) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return low4(_mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1));
  }
  static void nib64(const uint8_t* p, W& lo, W& hi) {
    const __m256i t0 = ld(p), t1 = ld(p + 32);
    lo = {low4(t0), low4(t1)};
    hi = {low4(_mm256_srli_epi16(t0, 4)), low4(_mm256_srli_epi16(t1, 4))};
  }
  static W nib16x2(const uint8_t* p0, const uint8_t* p1) {
    return {halves16(p0), p1 ? halves16(p1) : _mm256_setzero_si256()};
  }
  static W raw32x2(const uint8_t* p0, const uint8_t* p1, bool flip) {
    W w{ld(p0), p1 ? ld(p1) : _mm256_setzero_si256()};
    if (flip) {
      w.lo = _mm256_xor_si256(w.lo, _mm256_set1_epi8(char(0x80)));
      w.hi = _mm256_xor_si256(w.hi, _mm256_set1_epi8(char(0x80)));
    }
    return w;
  }
  static __m256i bit16(__m256i h, int b) {
    const __m256i bit = _mm256_set1_epi8(char(1 << b));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(16));
  }
  static W add_bit16(W w, const uint8_t* qh, int b0, int b1) {
    const __m256i h = ld(qh);
    return {_mm256_add_epi8(w.lo, bit16(h, b0)), _mm256_add_epi8(w.hi, bit16(h, b1))};
  }
  // 32 bits -> 16 in byte i where bit i is set.
  static __m256i bits32(uint32_t b) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int(b)),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
  }
  static W add_bits64(W w, uint64_t bits) {
    return {_mm256_add_epi8(w.lo, bits32(uint32_t(bits))), _mm256_add_epi8(w.hi, bits32(uint32_t(bits >> 32)))};
  }
  static void q6(const uint8_t* ql, const uint8_t* qh, W& w0, W& w1) {
    const __m256i k30 = _mm256_set1_epi8(0x30);
    const __m256i L0 = ld(ql), L1 = ld(ql + 32), Q = ld(qh);
    w0.lo = _mm256_or_si256(low4(L0), _mm256_and_si256(_mm256_slli_epi16(Q, 4), k30));
    w0.hi = _mm256_or_si256(low4(L1), _mm256_and_si256(_mm256_slli_epi16(Q, 2), k30));
    w1.lo = _mm256_or_si256(low4(_mm256_srli_epi16(L0, 4)), _mm256_and_si256(Q, k30));
    w1.hi = _mm256_or_si256(low4(_mm256_srli_epi16(L1, 4)), _mm256_and_si256(_mm256_srli_epi16(Q, 2), k30));
  }
  static void store_w(W w, uint8_t* p) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(p), w.lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(p + 32), w.hi);
  }
  static void store_f(F f, float* p) {
    _mm256_store_ps(p, f.lo);
    _mm256_store_ps(p + 8, f.hi);
  }
  template <bool SIGNED>
  static void dequant16(const uint8_t* q, float a, float b, float* out) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    for (int h = 0; h < 2; ++h) {
      const __m128i t = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h));
      const __m256i i = SIGNED ? _mm256_cvtepi8_epi32(t) : _mm256_cvtepu8_epi32(t);
      _mm256_storeu_ps(out + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), va, vb));
    }
  }
  static F join(__m256 a, __m256 b) { return {a, b}; }
  static F pairs2(F f, int a, int b) {
    return {_mm256_permutevar8x32_ps(f.lo, _mm256_set1_epi32(a)), _mm256_permutevar8x32_ps(f.lo, _mm256_set1_epi32(b))};
  }
  static F offs_pairs(F f) {
    return {_mm256_permutevar8x32_ps(f.hi, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
            _mm256_permutevar8x32_ps(f.hi, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))};
  }
  static F quads(F f, int v) {
    const __m256 a = v < 2 ? f.lo : f.hi;
    const int b = 4 * (v % 2);
    return {_mm256_permutevar8x32_ps(a, _mm256_setr_epi32(b, b, b, b, b + 1, b + 1, b + 1, b + 1)),
            _mm256_permutevar8x32_ps(a, _mm256_setr_epi32(b + 2, b + 2, b + 2, b + 2, b + 3, b + 3, b + 3, b + 3))};
  }
};

#include "gguf_impl.h"

}  // namespace gguf_avx2

const GgufKernels& gguf_kernels_avx2() {
  static const GgufKernels k{"avx2", gguf_kernels_scalar().quantize, &gguf_avx2::GgufImpl<gguf_avx2::S>::rows,
                             &gguf_avx2::GgufImpl<gguf_avx2::S>::dequant};
  return k;
}

}  // namespace shardline_qmm
