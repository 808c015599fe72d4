// AVX-512 integer-dot kernels on int16 activations, included by kernel_avx512.cpp (vpmaddwd + vpaddd) and
// kernel_avx512_vnni.cpp (vpdpwssd) inside their own namespaces, after <immintrin.h>, <algorithm>,
// <cstring>, <vector> and kernel.h, with QMM_VNNI set to 0 or 1.
//
// x is rounded per block of 32 to int16 (step dx = max|x| / 32767, to nearest), and each weight row gives
//   sum_j s_j * dx_j * (q_j . xq_j) + sum_g b_g * sum_{j in g} dx_j * sum(xq_j)
// with exact int32 dot products: the float product of the dequantized weights with the rounded x. x's
// rounding (at most dx / 2 = max|x_block| / 65534 per element) is the only difference from the float32
// product; int8 activations (llama.cpp's Q8) ran no faster here and moved the default model's logits
// by up to 1 and its greedy text within a dozen tokens, while this keeps them to a few thousandths.
// The biases meet the sums of the rounded x, so that each weight's error is w * (rounding) with w itself,
// not its offset s * q from the group's minimum, which can be far larger than w.
//
// Weights are widened without shuffles; x is laid out to match instead. Per 64-element pair of blocks
// (A, B), as two vectors of 32 int16: 4 bits [A even, B even], [A odd, B odd] (the low, then high nibbles
// of A's and B's 32 packed bytes, widened to 16 bits); 8 bits [A 0:16, B 0:16], [A 16:32, B 16:32]. Either
// way lanes 0-7 of the int32 dot belong to A and lanes 8-15 to B. An unpaired last block is [even | odd]
// (4 bits) or in order (8 bits).

// Two consecutive floats (A's, B's) spread over lanes [A x8, B x8].
inline __m512 spread2(const float* pair) {
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(pair)));
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
}

inline __m512i dot16(__m512i acc, __m512i a, __m512i b) {
#if QMM_VNNI
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// Round to nearest, whatever MXCSR says.
inline __m512i round_int(__m512 v) {
  return _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

void prepare(const float* x, int M, int K, int bits, int group_size, int16_t* q, float* dx, float* xsum) {
  const int nb = K / 32, G = K / group_size;
  alignas(64) int16_t t[32];
  for (int m = 0; m < M; ++m) {
    const float* xr = x + size_t(m) * K;
    int16_t* qr = q + size_t(m) * K;
    float* dr = dx + size_t(m) * nb;
    float* xs = xsum + size_t(m) * G;
    std::fill_n(xs, G, 0.0f);
    for (int j = 0; j < nb; ++j) {
      const __m512 a = _mm512_loadu_ps(xr + 32 * j), b = _mm512_loadu_ps(xr + 32 * j + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
      dr[j] = amax / 32767.0f;
      const __m512i ia = round_int(_mm512_mul_ps(a, inv)), ib = round_int(_mm512_mul_ps(b, inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t), _mm512_cvtsepi32_epi16(ia));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + 16), _mm512_cvtsepi32_epi16(ib));
      xs[j * 32 / group_size] += dr[j] * float(_mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib)));
      const bool paired = !(j == nb - 1 && nb % 2);
      if (!paired) {
        int16_t* d = qr + 32 * j;
        for (int i = 0; i < 16; ++i) {
          d[i] = bits == 4 ? t[2 * i] : t[i];
          d[16 + i] = bits == 4 ? t[2 * i + 1] : t[16 + i];
        }
        continue;
      }
      // Pair (j / 2): vector 0 at +0, vector 1 at +32; A fills words 0:16 of each, B words 16:32.
      int16_t* d = qr + 64 * (j / 2) + 16 * (j % 2);
      for (int i = 0; i < 16; ++i) {
        d[i] = bits == 4 ? t[2 * i] : t[i];
        d[32 + i] = bits == 4 ? t[2 * i + 1] : t[16 + i];
      }
    }
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

// The integer dot of an unpaired last block (K / 32 odd).
template <int BITS>
inline int64_t tail_dot(const uint8_t* wp, const int16_t* xp) {
  int64_t dot = 0;
  if constexpr (BITS == 4) {
    for (int k = 0; k < 16; ++k) dot += (wp[k] & 15) * xp[k] + (wp[k] >> 4) * xp[16 + k];
  } else {
    for (int k = 0; k < 32; ++k) dot += wp[k] * xp[k];
  }
  return dot;
}

// The two 32 x int16 weight vectors of pair t of a row.
template <int BITS>
inline void widen_pair(const uint8_t* row, int t, __m512i& w0, __m512i& w1) {
  if constexpr (BITS == 4) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * t)));
    w0 = _mm512_and_si512(v, _mm512_set1_epi16(15));
    w1 = _mm512_srli_epi16(v, 4);
  } else {
    const uint8_t* a = row + 64 * t;
    const __m128i* pa = reinterpret_cast<const __m128i*>(a);
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(pa)), _mm_loadu_si128(pa + 2), 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(pa + 1)), _mm_loadu_si128(pa + 3), 1);
    w0 = _mm512_cvtepu8_epi16(lo);
    w1 = _mm512_cvtepu8_epi16(hi);
  }
}

template <int BITS, int MB, int R>
void block(const Problem& p, const QX& xq, int n, int m, const float* ws, const float* wb, float* sdx) {
  const int K = p.K, nb = K / 32, G = K / p.group_size;
  const size_t row_bytes = size_t(K) * BITS / 8;
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
      __m512i w0, w1;
      widen_pair<BITS>(wr[r], t, w0, w1);
      for (int i = 0; i < MB; ++i) {
        const int16_t* xp = xq.q + size_t(m + i) * K + 64 * t;
        __m512i dot = dot16(_mm512_setzero_si512(), w0, _mm512_loadu_si512(xp));
        dot = dot16(dot, w1, _mm512_loadu_si512(xp + 32));
        const __m512 d = spread2(sdx + (size_t(i) * R + r) * nb + 2 * t);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    float y[R];
    // The same summation tree for any R: a row's result does not depend on the rows beside it (a fused
    // projection equals its parts bit for bit).
    if constexpr (R == 4) {
      _mm_storeu_ps(y, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    } else {
      for (int r = 0; r < R; ++r) y[r] = _mm_cvtss_f32(reduce4(acc[i][r], acc[i][r], acc[i][r], acc[i][r]));
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

constexpr int int_rows_for(int MB) { return MB == 1 || MB == 2 ? 4 : (MB == 4 ? 2 : 1); }

template <int BITS, int RB>
void n_block(const Problem& p, const QX& xq, int n, const float* ws, const float* wb, float* sdx) {
  const int nb = p.K / 32, G = p.K / p.group_size;
  int m = 0;
  auto run = [&]<int MB>() {
    constexpr int R = RB < int_rows_for(MB) ? RB : int_rows_for(MB);
    for (int r = 0; r < RB; r += R) block<BITS, MB, R>(p, xq, n + r, m, ws + r * nb, wb + r * G, sdx);
    m += MB;
  };
  while (p.M - m >= 8) run.template operator()<8>();
  while (p.M - m >= 4) run.template operator()<4>();
  while (p.M - m >= 2) run.template operator()<2>();
  while (p.M - m >= 1) run.template operator()<1>();
}

template <int BITS>
void int_rows_bits(const Problem& p, const QX& xq, int n0, int n1) {
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

void int_rows(const Problem& p, const QX& xq, int n0, int n1) {
  if (p.bits == 4)
    int_rows_bits<4>(p, xq, n0, n1);
  else
    int_rows_bits<8>(p, xq, n0, n1);
}
