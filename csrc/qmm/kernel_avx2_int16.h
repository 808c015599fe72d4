// AVX2 integer-dot kernels on int16 activations (vpmaddwd), included by kernel_avx2.cpp inside its
// namespace after <immintrin.h>, <algorithm>, <cstring>, <vector> and kernel.h. The same arithmetic as
// kernel_avx512_int16.h (see there: x rounded to int16 per block of 32, exact int32 dots, biases against
// the sums of the rounded x), one block of 32 per step: x's block is stored as two vectors of 16 int16,
// 4 bits [even, odd] (the low, then high nibbles of its 16 packed bytes widened to 16 bits), 8 bits in order.

namespace int16_avx2 {

inline __m256i round_int(__m256 v) {
  return _mm256_cvttps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

void prepare(const float* x, int M, int K, int bits, int group_size, int16_t* q, float* dx, float* xsum) {
  const int nb = K / 32, G = K / group_size;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  alignas(32) int32_t t[32];
  for (int m = 0; m < M; ++m) {
    const float* xr = x + size_t(m) * K;
    int16_t* qr = q + size_t(m) * K;
    float* dr = dx + size_t(m) * nb;
    float* xs = xsum + size_t(m) * G;
    std::fill_n(xs, G, 0.0f);
    for (int j = 0; j < nb; ++j) {
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xr + 32 * j + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      }
      const float mx = hmax(amax);
      const __m256 inv = _mm256_set1_ps(mx > 0.0f ? 32767.0f / mx : 0.0f);
      dr[j] = mx / 32767.0f;
      int total = 0;
      for (int i = 0; i < 4; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + 8 * i), round_int(_mm256_mul_ps(v[i], inv)));
      for (int i = 0; i < 32; ++i) total += t[i];
      xs[j * 32 / group_size] += dr[j] * float(total);
      int16_t* d = qr + 32 * j;
      for (int i = 0; i < 16; ++i) {
        d[i] = int16_t(bits == 4 ? t[2 * i] : t[i]);
        d[16 + i] = int16_t(bits == 4 ? t[2 * i + 1] : t[16 + i]);
      }
    }
  }
}

inline void cvt_row(ScaleType t, const void* src, size_t off, int n, float* dst) {
  if (t == ScaleType::F32) {
    std::copy_n(static_cast<const float*>(src) + off, n, dst);
    return;
  }
  const auto* h = static_cast<const uint16_t*>(src) + off;
  int i = 0;
  if (t == ScaleType::F16) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    for (; i < n; ++i) dst[i] = half_to_float(h[i]);
  } else {
    for (; i < n; ++i) dst[i] = bf16_to_float(h[i]);
  }
}

inline void load_rows(const Problem& p, int n, int R, float* ws, float* wb) {
  const int G = p.K / p.group_size, per = p.group_size / 32, nb = p.K / 32;
  cvt_row(p.stype, p.biases, size_t(n) * G, R * G, wb);
  cvt_row(p.stype, p.scales, size_t(n) * G, R * G, ws);
  if (per > 1)
    for (int j = R * nb - 1; j >= 0; --j) ws[j] = ws[(j / nb) * G + (j % nb) / per];
}

inline __m256i tail_mask(int n) {  // lanes [0, n) of 8 on
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline void mul_into(const float* a, const float* b, float* d, int n) {
  int j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(d + j, _mm256_mul_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j)));
  for (; j < n; ++j) d[j] = a[j] * b[j];
}

inline __m256 dot_lanes(const float* a, const float* b, int n) {
  __m256 s = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s);
  if (j < n) {
    const __m256i k = tail_mask(n - j);
    s = _mm256_fmadd_ps(_mm256_maskload_ps(a + j, k), _mm256_maskload_ps(b + j, k), s);
  }
  return s;
}

// The sums of four vectors, side by side; the same tree for one (a = b = c = d).
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Block j of a row as two vectors of 16 int16 weights (the order x's block is stored in).
template <int BITS>
inline void widen_block(const uint8_t* row, int j, __m256i& w0, __m256i& w1) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j)));
    w0 = _mm256_and_si256(v, _mm256_set1_epi16(15));
    w1 = _mm256_srli_epi16(v, 4);
  } else {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + 32 * j);
    w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p));
    w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p + 1));
  }
}

template <int BITS, int MB, int R>
void block(const Problem& p, const QX& xq, int n, int m, const float* ws, const float* wb, float* sdx) {
  const int K = p.K, nb = K / 32, G = K / p.group_size;
  const size_t row_bytes = size_t(K) * BITS / 8;
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = p.w + size_t(n + r) * row_bytes;
  __m256 acc[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) {
      mul_into(ws + r * nb, xq.dx + size_t(m + i) * nb, sdx + (size_t(i) * R + r) * nb, nb);
      acc[i][r] = dot_lanes(wb + r * G, xq.xsum + size_t(m + i) * G, G);
    }
  for (int j = 0; j < nb; ++j) {
    for (int r = 0; r < R; ++r) {
      __m256i w0, w1;
      widen_block<BITS>(wr[r], j, w0, w1);
      for (int i = 0; i < MB; ++i) {
        const int16_t* xp = xq.q + size_t(m + i) * K + 32 * j;
        const __m256i dot = _mm256_add_epi32(
            _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp))),
            _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 16))));
        const __m256 d = _mm256_broadcast_ss(sdx + (size_t(i) * R + r) * nb + j);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    float y[R];
    if constexpr (R == 4) {
      _mm_storeu_ps(y, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    } else {
      for (int r = 0; r < R; ++r) y[r] = _mm_cvtss_f32(reduce4(acc[i][r], acc[i][r], acc[i][r], acc[i][r]));
    }
    std::copy_n(y, R, p.y + size_t(m + i) * p.ldy + n);
  }
}

constexpr int rows_for(int MB) { return MB == 1 ? 4 : (MB == 2 ? 2 : 1); }

template <int BITS, int RB>
void n_block(const Problem& p, const QX& xq, int n, const float* ws, const float* wb, float* sdx) {
  const int nb = p.K / 32, G = p.K / p.group_size;
  int m = 0;
  auto run = [&]<int MB>() {
    constexpr int R = RB < rows_for(MB) ? RB : rows_for(MB);
    for (int r = 0; r < RB; r += R) block<BITS, MB, R>(p, xq, n + r, m, ws + r * nb, wb + r * G, sdx);
    m += MB;
  };
  while (p.M - m >= 4) run.template operator()<4>();
  while (p.M - m >= 2) run.template operator()<2>();
  while (p.M - m >= 1) run.template operator()<1>();
}

template <int BITS>
void rows_bits(const Problem& p, const QX& xq, int n0, int n1) {
  const size_t nb = size_t(p.K / 32), G = size_t(p.K / p.group_size);
  const size_t sb_bytes = G * (p.stype == ScaleType::F32 ? 4 : 2);
  thread_local std::vector<float> ws, wb, sdx;
  ws.resize(4 * nb);
  wb.resize(4 * nb);
  sdx.resize(4 * nb);  // MB * R <= 4
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
    rows_bits<4>(p, xq, n0, n1);
  else
    rows_bits<8>(p, xq, n0, n1);
}

}  // namespace int16_avx2
