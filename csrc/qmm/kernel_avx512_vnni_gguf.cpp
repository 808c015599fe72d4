// GGUF block products on AVX-512 VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later): u8 weights times s8
// rounded x by vpdpbusd. Chosen at run time (gguf_kernels_for), compiled for its own instruction set.
//
// Every format is read 256 elements at a time (one K-quant block, or 8 blocks of 32) as four vectors of 64
// unsigned weights in element order, so that one x layout serves all formats; each vector's 16 int32 lanes
// (4 products each) belong to its two sub-blocks of 32 (8 lanes each). A lane's dot is converted to float and
// multiplied by its factor (weight scale times x's step), and each 16 elements' offset or minimum meets the
// sum of x's rounded values there: per output element the same operations in the same order whatever the
// row range, so that threads never change a bit.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gguf_kernel.h"
#include "kernel.h"

namespace shardline_qmm {
namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

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

// x as the row kernels read it, per 256 elements (zero past K): the int8 values, each 64-vector's steps
// spread over its lanes ([step of its first 32] x 8, [second] x 8), and each 16's step times its sum.
struct XRows {
  int M = 0, S = 0;  // rows, 256-element super blocks
  std::vector<int8_t> q;  // M x 256 S
  std::vector<float> dxv;  // M x 64 S
  std::vector<float> xs16;  // M x 16 S
  const int8_t* qm(int m) const { return q.data() + size_t(m) * 256 * S; }
  const float* dm(int m) const { return dxv.data() + size_t(m) * 64 * S; }
  const float* sm(int m) const { return xs16.data() + size_t(m) * 16 * S; }
};

void lay_out(const GgufProblem& p, XRows& x) {
  const int K = p.K, S = (K + 255) / 256, nb = K / 32;
  x.M = p.M;
  x.S = S;
  x.q.assign(size_t(p.M) * 256 * S, 0);
  x.dxv.assign(size_t(p.M) * 64 * S, 0.0f);
  x.xs16.assign(size_t(p.M) * 16 * S, 0.0f);
  for (int m = 0; m < p.M; ++m) {
    std::memcpy(x.q.data() + size_t(m) * 256 * S, p.x.q + size_t(m) * K, size_t(K));
    const float* d = p.x.d + size_t(m) * nb;
    const int16_t* s = p.x.s16 + size_t(m) * 2 * nb;
    float* dv = x.dxv.data() + size_t(m) * 64 * S;
    float* xs = x.xs16.data() + size_t(m) * 16 * S;
    for (int j = 0; j < nb; ++j) {
      std::fill_n(dv + 8 * j, 8, d[j]);
      xs[2 * j] = d[j] * float(s[2 * j]);
      xs[2 * j + 1] = d[j] * float(s[2 * j + 1]);
    }
  }
}

// 256 elements of one weight row: four vectors of u8 weights, their lanes' scale factors, and the offset per
// 16 elements (what multiplies the sum of x there).
struct Super {
  __m512i w[4];
  __m512 a[4];
  __m512 b;
};

// Not a namespace-scope constant: its initializer would run AVX-512 code on load, on any CPU.
inline __m512i low4() { return _mm512_set1_epi8(0x0F); }

// F holds 8 scales then 8 offsets, one per sub-block of 32: lane i of vector v takes scale 2v + i / 8, lane h
// of the offsets offset h / 2.
inline void spread_pairs(__m512 F, Super& s) {
  for (int v = 0; v < 4; ++v) {
    const __m512i idx = _mm512_setr_epi32(2 * v, 2 * v, 2 * v, 2 * v, 2 * v, 2 * v, 2 * v, 2 * v, 2 * v + 1,
                                          2 * v + 1, 2 * v + 1, 2 * v + 1, 2 * v + 1, 2 * v + 1, 2 * v + 1, 2 * v + 1);
    s.a[v] = _mm512_permutexvar_ps(idx, F);
  }
  s.b = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), F);
}

// 16 bytes of nibbles -> 32 bytes: the low nibbles then the high ones (GGUF's order within a block of 32).
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
}

// Blocks of 32 (Q4_0, Q4_1, Q8_0): blocks [8 sb, 8 sb + 8) of the row, as many as it has.
template <GgufType T>
inline void unpack32(const uint8_t* row, int sb, int nb, Super& s) {
  constexpr int bytes = T == GgufType::Q8_0 ? 34 : (T == GgufType::Q4_1 ? 20 : 18);
  alignas(64) float F[16] = {};
  const int j0 = 8 * sb, n = std::min(8, nb - j0);
  __m256i half[8];
  for (int j = 0; j < 8; ++j) {
    if (j >= n) {
      half[j] = _mm256_setzero_si256();
      continue;
    }
    const uint8_t* b = row + size_t(j0 + j) * bytes;
    const float d = f16(b);
    F[j] = d;
    if constexpr (T == GgufType::Q4_0) {
      F[8 + j] = -8.0f * d;
      half[j] = nibbles32(b + 2);
    } else if constexpr (T == GgufType::Q4_1) {
      F[8 + j] = f16(b + 2);
      half[j] = nibbles32(b + 4);
    } else {
      F[8 + j] = -128.0f * d;  // int8 weights read as unsigned q + 128
      half[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), _mm256_set1_epi8(-128));
    }
  }
  for (int v = 0; v < 4; ++v) {
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(half[2 * v]), half[2 * v + 1], 1);
    s.w[v] = T == GgufType::Q8_0 ? w : _mm512_and_si512(w, low4());
  }
  spread_pairs(_mm512_load_ps(F), s);
}

// Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth bits,) 128 bytes of nibbles.
template <GgufType T>
inline void unpack_k45(const uint8_t* b, Super& s) {
  constexpr bool q5 = T == GgufType::Q5_K;
  // llama.cpp's unpacking of the 12 bytes: words 0-1 the 8 scales, words 2-3 the 8 mins.
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t m0 = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = m0;
  u[0] &= k1;
  const __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u))));
  const __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16(b)), _mm512_set1_ps(-f16(b + 2)));
  spread_pairs(_mm512_mul_ps(sm, dd), s);
  const uint8_t* qs = b + (q5 ? 48 : 16);
  __m512i hb;
  if constexpr (q5) hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
  for (int v = 0; v < 4; ++v) {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * v));
    __m512i w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1), low4());
    if constexpr (q5) {
      // Sub-block 2v's fifth bits are bit 2v of the 32 bytes, sub-block 2v + 1's bit 2v + 1.
      const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (2 * v))), _mm256_set1_epi8(char(1 << (2 * v + 1))), 1);
      w = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(hb, bit), w, _mm512_set1_epi8(16));
    }
    s.w[v] = w;
  }
}

// Q6_K: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales (one per 16), d.
inline void unpack_k6(const uint8_t* b, Super& s) {
  const __m512 a16 = _mm512_mul_ps(
      _mm512_set1_ps(f16(b + 208)),
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
  for (int v = 0; v < 4; ++v) {
    const __m512i idx = _mm512_setr_epi32(4 * v, 4 * v, 4 * v, 4 * v, 4 * v + 1, 4 * v + 1, 4 * v + 1, 4 * v + 1,
                                          4 * v + 2, 4 * v + 2, 4 * v + 2, 4 * v + 2, 4 * v + 3, 4 * v + 3, 4 * v + 3,
                                          4 * v + 3);
    s.a[v] = _mm512_permutexvar_ps(idx, a16);
  }
  s.b = _mm512_mul_ps(a16, _mm512_set1_ps(-32.0f));
  const __m512i k30 = _mm512_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m512i L = _mm512_loadu_si512(b + 64 * h);
    const __m256i Q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m512i H = _mm512_inserti64x4(_mm512_castsi256_si512(Q), _mm256_srli_epi16(Q, 2), 1);
    s.w[2 * h] = _mm512_or_si512(_mm512_and_si512(L, low4()), _mm512_and_si512(_mm512_slli_epi16(H, 4), k30));
    s.w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), low4()), _mm512_and_si512(H, k30));
  }
}

template <GgufType T>
inline void unpack(const uint8_t* row, int sb, int nb32, Super& s) {
  if constexpr (T == GgufType::Q4_K || T == GgufType::Q5_K)
    unpack_k45<T>(row + size_t(sb) * (T == GgufType::Q4_K ? 144 : 176), s);
  else if constexpr (T == GgufType::Q6_K)
    unpack_k6(row + size_t(sb) * 210, s);
  else
    unpack32<T>(row, sb, nb32, s);
}

// Rows [m0, m0 + MB) of x against weight row n.
template <GgufType T, int MB>
inline void row_block(const GgufProblem& p, const XRows& x, int n, int m0) {
  const uint8_t* row = p.w + size_t(n) * p.row_bytes;
  const int nb32 = p.K / 32;
  __m512 acc[MB], accb[MB];
  for (int i = 0; i < MB; ++i) acc[i] = accb[i] = _mm512_setzero_ps();
  const int8_t* xq[MB];
  const float *dv[MB], *xs[MB];
  for (int i = 0; i < MB; ++i) {
    xq[i] = x.qm(m0 + i);
    dv[i] = x.dm(m0 + i);
    xs[i] = x.sm(m0 + i);
  }
  Super s;
  for (int sb = 0; sb < x.S; ++sb) {
    unpack<T>(row, sb, nb32, s);
    for (int i = 0; i < MB; ++i) {
      const int8_t* q = xq[i] + 256 * sb;
      const float* d = dv[i] + 64 * sb;
      for (int v = 0; v < 4; ++v) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), s.w[v], _mm512_loadu_si512(q + 64 * v));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s.a[v], _mm512_loadu_ps(d + 16 * v)), acc[i]);
      }
      accb[i] = _mm512_fmadd_ps(s.b, _mm512_loadu_ps(xs[i] + 16 * sb), accb[i]);
    }
  }
  for (int i = 0; i < MB; ++i) p.y[size_t(m0 + i) * p.ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], accb[i]));
}

template <GgufType T>
void rows_t(const GgufProblem& p, const XRows& x, int n0, int n1) {
  const uint8_t* end = p.w + size_t(n1) * p.row_bytes;
  for (int n = n0; n < n1; ++n) {
    prefetch_ahead(p.w + size_t(n) * p.row_bytes, p.row_bytes, end);
    int m = 0;
    for (; p.M - m >= 8; m += 8) row_block<T, 8>(p, x, n, m);
    if (p.M - m >= 4) {
      row_block<T, 4>(p, x, n, m);
      m += 4;
    }
    if (p.M - m >= 2) {
      row_block<T, 2>(p, x, n, m);
      m += 2;
    }
    if (p.M - m >= 1) row_block<T, 1>(p, x, n, m);
  }
}

void rows(const GgufProblem& p, int n0, int n1) {
  thread_local XRows x;
  lay_out(p, x);
  switch (p.type) {
    case GgufType::Q4_0:
      return rows_t<GgufType::Q4_0>(p, x, n0, n1);
    case GgufType::Q4_1:
      return rows_t<GgufType::Q4_1>(p, x, n0, n1);
    case GgufType::Q8_0:
      return rows_t<GgufType::Q8_0>(p, x, n0, n1);
    case GgufType::Q4_K:
      return rows_t<GgufType::Q4_K>(p, x, n0, n1);
    case GgufType::Q5_K:
      return rows_t<GgufType::Q5_K>(p, x, n0, n1);
    case GgufType::Q6_K:
      return rows_t<GgufType::Q6_K>(p, x, n0, n1);
  }
}

}  // namespace

const GgufKernels& gguf_kernels_avx512_vnni() {
  static const GgufKernels k{"avx512_vnni", &quantize, &rows, gguf_kernels_scalar().dequant};
  return k;
}

}  // namespace shardline_qmm
