// AVX-512 VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later): integer dot products on int8 activations.
//
// x is quantized per block of 32 to int8 (step dx = max|x| / 127, round to nearest), as llama.cpp does
// for its Q8 activations, and each weight row contributes
//   sum_j s_j * dx_j * (q_j . xq_j) + sum_g b_g * sum(x_g)
// with the integer dots from vpdpbusd (unsigned weights x signed activations, exact in int32): the
// product of the dequantized weights with the rounded x (x's rounding, at most dx / 2 per element, is the
// only difference from the float product). Weights are unpacked without shuffles; x is laid out to match instead: for 4 bits, each
// 64-element pair of blocks (A, B) holds [A even | B even | A odd | B odd] elements, which is the order in
// which the low then high nibbles of A's and B's 32 packed bytes come out of one 512-bit vector.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernel.h"

namespace shardline_qmm {
namespace vnni_isa {

// Lane -> block of a 64-byte vector: 4 bits [A A A A B B B B A A A A B B B B], 8 bits [A x8, B x8].
inline __m512i lane_block(int bits) {
  return bits == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                   : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
}

// Two consecutive floats spread over the lanes of their blocks.
inline __m512 spread2(const float* pair, __m512i idx) {
  const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(pair)));
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
}

// Round to nearest, whatever MXCSR says.
inline __m512i round(__m512 v) { return _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

void prepare(const float* x, int M, int K, int bits, int group_size, int8_t* q, float* dx, float* xsum) {
  const int nb = K / 32, G = K / group_size;
  alignas(64) int8_t tmp[32];
  for (int m = 0; m < M; ++m) {
    const float* xr = x + size_t(m) * K;
    int8_t* qr = q + size_t(m) * K;
    float* dr = dx + size_t(m) * nb;
    // The biases meet the sums of the rounded x, so that each weight's error is w * (x's rounding) with w
    // itself, not its offset s * q from the group's minimum, which can be far larger than w.
    float* xs = xsum + size_t(m) * G;
    std::fill_n(xs, G, 0.0f);
    for (int j = 0; j < nb; ++j) {
      const __m512 a = _mm512_loadu_ps(xr + 32 * j), b = _mm512_loadu_ps(xr + 32 * j + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      dr[j] = amax / 127.0f;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), _mm512_cvtsepi32_epi8(round(_mm512_mul_ps(a, inv))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp + 16), _mm512_cvtsepi32_epi8(round(_mm512_mul_ps(b, inv))));
      int total = 0;
      for (int i = 0; i < 32; ++i) total += tmp[i];
      xs[j * 32 / group_size] += dr[j] * float(total);
      if (bits == 8) {
        std::memcpy(qr + 32 * j, tmp, 32);
      } else if (j == nb - 1 && nb % 2) {  // a last unpaired block: [even | odd]
        for (int i = 0; i < 16; ++i) {
          qr[32 * j + i] = tmp[2 * i];
          qr[32 * j + 16 + i] = tmp[2 * i + 1];
        }
      } else {
        int8_t* base = qr + 64 * (j / 2) + 16 * (j % 2);
        for (int i = 0; i < 16; ++i) {
          base[i] = tmp[2 * i];
          base[32 + i] = tmp[2 * i + 1];
        }
      }
    }
    // The biases meet the sums of the quantized x, so that each weight's error is w * (x rounding) with w
    // itself, not its offset from the group's minimum (s * q alone can be far larger than w).

  }
}

// n scales or biases from src + off as float.
inline void cvt_row(ScaleType t, const void* src, size_t off, int n, float* dst) {
  if (t == ScaleType::F32) {
    std::copy_n(static_cast<const float*>(src) + off, n, dst);
    return;
  }
  const auto* h = static_cast<const uint16_t*>(src) + off;
  for (int i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m256i v = _mm256_maskz_loadu_epi16(k, h + i);
    const __m512 f = t == ScaleType::F16 ? _mm512_cvtph_ps(v)
                                         : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    _mm512_mask_storeu_ps(dst + i, k, f);
  }
}

// Rows [n, n + R) of scales per block of 32 (ws, stride K / 32) and biases per group (wb, stride G). The
// rows are adjacent in memory, so each array is converted in one pass.
inline void load_rows(const Problem& p, int n, int R, float* ws, float* wb) {
  const int G = p.K / p.group_size, per = p.group_size / 32, nb = p.K / 32;
  cvt_row(p.stype, p.biases, size_t(n) * G, R * G, wb);
  cvt_row(p.stype, p.scales, size_t(n) * G, R * G, ws);
  if (per > 1)  // spread in place, from the end
    for (int j = R * nb - 1; j >= 0; --j) ws[j] = ws[(j / nb) * G + (j % nb) / per];
}

// Masks for the last n % 16 lanes of a loop over n floats.
inline __mmask16 tail_mask(int n) { return __mmask16((1u << (n & 15)) - 1); }

// a[0:n] * b[0:n] into d (n small: one row's blocks).
inline void mul_into(const float* a, const float* b, float* d, int n) {
  int j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(d + j, _mm512_mul_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j)));
  if (j < n) {
    const __mmask16 k = tail_mask(n);
    _mm512_mask_storeu_ps(d + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, a + j), _mm512_maskz_loadu_ps(k, b + j)));
  }
}

// The lanes of dot(a[0:n], b[0:n]), not yet summed.
inline __m512 dot_lanes(const float* a, const float* b, int n) {
  __m512 s = _mm512_setzero_ps();
  int j = 0;
  for (; j + 16 <= n; j += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), s);
  if (j < n) {
    const __mmask16 k = tail_mask(n);
    s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + j), _mm512_maskz_loadu_ps(k, b + j), s);
  }
  return s;
}

// The sums of four vectors, side by side.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  auto half = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(d)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The integer dot of one unpaired 32-block (the last one when K / 32 is odd).
template <int BITS>
inline int tail_dot(const uint8_t* wp, const int8_t* xp) {
  int dot = 0;
  if constexpr (BITS == 4) {
    for (int k = 0; k < 16; ++k) dot += (wp[k] & 15) * xp[k] + (wp[k] >> 4) * xp[16 + k];
  } else {
    for (int k = 0; k < 32; ++k) dot += wp[k] * xp[k];
  }
  return dot;
}

template <int BITS, int MB, int R>
void block(const Problem& p, const Q8X& xq, int n, int m, const float* ws, const float* wb, float* sdx) {
  const int K = p.K, nb = K / 32, G = K / p.group_size;
  const size_t row_bytes = size_t(K) * BITS / 8;
  const __m512i idx = lane_block(BITS);
  const __m512i shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);  // high nibbles in the upper half
  const __m512i low4 = _mm512_set1_epi8(15);
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = p.w + size_t(n + r) * row_bytes;
  // s_j * dx_j for every pair (x row, w row): the loop below then spends one shuffle per scale. The
  // accumulators start from the bias terms, so that each output needs one horizontal sum only.
  __m512 acc[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) {
      mul_into(ws + r * nb, xq.dx + size_t(m + i) * nb, sdx + (size_t(i) * R + r) * nb, nb);
      acc[i][r] = dot_lanes(wb + r * G, xq.xsum + size_t(m + i) * G, G);
    }

  for (int t = 0; t < nb / 2; ++t) {
    for (int r = 0; r < R; ++r) {
      __m512i wv;
      if constexpr (BITS == 4) {
        const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r] + 32 * t)));
        wv = _mm512_and_si512(_mm512_srlv_epi64(both, shift), low4);
      } else {
        wv = _mm512_loadu_si512(wr[r] + 64 * t);
      }
      for (int i = 0; i < MB; ++i) {
        const __m512i xv = _mm512_loadu_si512(xq.q + size_t(m + i) * K + 64 * t);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
        const __m512 d = spread2(sdx + (size_t(i) * R + r) * nb + 2 * t, idx);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    float y[R];
    if constexpr (R == 4) {
      _mm_storeu_ps(y, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    } else {
      for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[i][r]);
    }
    if (nb % 2) {
      const int j = nb - 1;
      for (int r = 0; r < R; ++r)
        y[r] += sdx[(size_t(i) * R + r) * nb + j] *
                float(tail_dot<BITS>(wr[r] + size_t(j) * 32 * BITS / 8, xq.q + size_t(m + i) * K + 32 * j));
    }
    std::copy_n(y, R, p.y + size_t(m + i) * p.ldy + n);
  }
}

constexpr int rows_for(int MB) { return MB == 1 || MB == 2 ? 4 : (MB == 4 ? 2 : 1); }

template <int BITS, int RB>
void n_block(const Problem& p, const Q8X& xq, int n, const float* ws, const float* wb, float* sdx) {
  const int nb = p.K / 32, G = p.K / p.group_size;
  int m = 0;
  auto run = [&]<int MB>() {
    constexpr int R = RB < rows_for(MB) ? RB : rows_for(MB);
    for (int r = 0; r < RB; r += R)
      block<BITS, MB, R>(p, xq, n + r, m, ws + r * nb, wb + r * G, sdx);
    m += MB;
  };
  while (p.M - m >= 8) run.template operator()<8>();
  while (p.M - m >= 4) run.template operator()<4>();
  while (p.M - m >= 2) run.template operator()<2>();
  while (p.M - m >= 1) run.template operator()<1>();
}

template <int BITS>
void rows_bits(const Problem& p, const Q8X& xq, int n0, int n1) {
  const size_t nb = size_t(p.K / 32), G = size_t(p.K / p.group_size);
  const size_t sb_bytes = G * (p.stype == ScaleType::F32 ? 4 : 2);
  thread_local std::vector<float> ws, wb, sdx;
  ws.resize(4 * nb);
  wb.resize(4 * nb);
  sdx.resize(8 * nb);  // MB * R <= 8
  const size_t row_bytes = size_t(p.K) * BITS / 8;
  const auto* sc = static_cast<const uint8_t*>(p.scales);
  const auto* bi = static_cast<const uint8_t*>(p.biases);
  int n = n0;
  for (; n + 4 <= n1; n += 4) {
    prefetch_ahead(p.w + size_t(n) * row_bytes, 4 * row_bytes, p.w + size_t(n1) * row_bytes);
    prefetch_ahead(sc + size_t(n) * sb_bytes, 4 * sb_bytes, sc + size_t(n1) * sb_bytes);
    prefetch_ahead(bi + size_t(n) * sb_bytes, 4 * sb_bytes, bi + size_t(n1) * sb_bytes);
    load_rows(p, n, 4, ws.data(), wb.data());
    n_block<BITS, 4>(p, xq, n, ws.data(), wb.data(), sdx.data());
  }
  for (; n < n1; ++n) {
    load_rows(p, n, 1, ws.data(), wb.data());
    n_block<BITS, 1>(p, xq, n, ws.data(), wb.data(), sdx.data());
  }
}

void rows(const Problem& p, const Q8X& xq, int n0, int n1) {
  if (p.bits == 4)
    rows_bits<4>(p, xq, n0, n1);
  else
    rows_bits<8>(p, xq, n0, n1);
}

}  // namespace vnni_isa

const Kernels& kernels_avx512_vnni() {
  static const Kernels k{"avx512_vnni", kernels_avx512().rows, kernels_avx512().dequant, &vnni_isa::prepare,
                         &vnni_isa::rows};
  return k;
}

}  // namespace shardline_qmm
