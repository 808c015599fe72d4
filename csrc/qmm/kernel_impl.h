// The kernel bodies, written once over a small SIMD trait S and included by each per-ISA translation unit
// inside its own namespace (so that instantiations compiled with different flags never merge at link).
//
// S provides: V (a vector of L floats), zero(), set1(f), load(const float*), store(float*, V),
// fma(a, b, c) = a * b + c, add(a, b), hsum(V),
// u4(const uint8_t* p, V& lo, V& hi): L packed bytes -> their low and high nibbles as floats,
// u8(const uint8_t* p): L bytes -> floats, and cvt_f16(const uint16_t*, float*, int n).
// ACC is how many vector accumulators the register file holds comfortably.
//
// Per output row the weights are dequantized in registers, w = s * q + b (one fma per vector, shared by
// every row of x), then multiplied into each row of x: exact float32 arithmetic on the dequantized weights,
// with a different summation order than a plain dot product only.
// Each including file has already included <algorithm>, <vector> and kernel.h at global scope.

#ifndef QMM_PREFETCH_ROWS
#define QMM_PREFETCH_ROWS 32
#endif

template <class S>
struct Impl {
  using V = typename S::V;
  static constexpr int L = S::L;

  // Scales then biases of rows [n, n + R) as float: sb[r * 2G + g] = s, sb[r * 2G + G + g] = b.
  static void load_sb(const Problem& p, int n, int R, float* sb) {
    const int G = p.K / p.group_size;
    for (int r = 0; r < R; ++r) {
      const size_t off = size_t(n + r) * G;
      float* ds = sb + size_t(r) * 2 * G;
      float* db = ds + G;
      switch (p.stype) {
        case ScaleType::F32:
          std::copy_n(static_cast<const float*>(p.scales) + off, G, ds);
          std::copy_n(static_cast<const float*>(p.biases) + off, G, db);
          break;
        case ScaleType::F16:
          S::cvt_f16(static_cast<const uint16_t*>(p.scales) + off, ds, G);
          S::cvt_f16(static_cast<const uint16_t*>(p.biases) + off, db, G);
          break;
        case ScaleType::BF16: {
          const auto* s = static_cast<const uint16_t*>(p.scales) + off;
          const auto* b = static_cast<const uint16_t*>(p.biases) + off;
          for (int g = 0; g < G; ++g) {
            ds[g] = bf16_to_float(s[g]);
            db[g] = bf16_to_float(b[g]);
          }
          break;
        }
      }
    }
  }

  // MB rows of x against R rows of w; two accumulators per pair keep two independent fma chains.
  template <int BITS, int MB, int R>
  static void block(const Problem& p, int n, int m, const float* sb) {
    const int K = p.K, gs = p.group_size, G = K / gs;
    const size_t row_bytes = size_t(K) * BITS / 8;
    const uint8_t* wr[R];
    const float* sbr[R];
    for (int r = 0; r < R; ++r) {
      wr[r] = p.w + size_t(n + r) * row_bytes;
      sbr[r] = sb + size_t(r) * 2 * G;
    }
    const float* xm[MB];
    for (int i = 0; i < MB; ++i) xm[i] = p.x + size_t(m + i) * K;
    V acc0[MB][R], acc1[MB][R];
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < R; ++r) acc0[i][r] = acc1[i][r] = S::zero();

    for (int g = 0; g < G; ++g) {
      const int k0 = g * gs;
      if constexpr (BITS == 4) {
        for (int k = k0; k < k0 + gs; k += 32) {
          for (int j = 0; j < 16; j += L) {
            for (int r = 0; r < R; ++r) {
              const V s = S::set1(sbr[r][g]), b = S::set1(sbr[r][G + g]);
              V lo, hi;
              S::u4(wr[r] + k / 2 + j, lo, hi);
              const V wl = S::fma(lo, s, b), wh = S::fma(hi, s, b);
              for (int i = 0; i < MB; ++i) {
                acc0[i][r] = S::fma(wl, S::load(xm[i] + k + j), acc0[i][r]);
                acc1[i][r] = S::fma(wh, S::load(xm[i] + k + 16 + j), acc1[i][r]);
              }
            }
          }
        }
      } else {
        for (int k = k0; k < k0 + gs; k += 2 * L) {
          for (int r = 0; r < R; ++r) {
            const V s = S::set1(sbr[r][g]), b = S::set1(sbr[r][G + g]);
            const V w0 = S::fma(S::u8(wr[r] + k), s, b);
            const V w1 = S::fma(S::u8(wr[r] + k + L), s, b);
            for (int i = 0; i < MB; ++i) {
              acc0[i][r] = S::fma(w0, S::load(xm[i] + k), acc0[i][r]);
              acc1[i][r] = S::fma(w1, S::load(xm[i] + k + L), acc1[i][r]);
            }
          }
        }
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < R; ++r) p.y[size_t(m + i) * p.ldy + n + r] = S::hsum(S::add(acc0[i][r], acc1[i][r]));
  }

  // How many rows of w go with MB rows of x: as many as the accumulators allow, at most 4.
  static constexpr int rows_for(int MB) {
    const int r = S::ACC / (2 * MB);
    return r >= 4 ? 4 : (r >= 2 ? 2 : 1);
  }
  static constexpr int MB_MAX = S::ACC >= 16 ? 8 : 4;

  // Rows [n, n + RB) of w (RB = 4, or 1 at the tail) against every row of x.
  template <int BITS, int RB>
  static void n_block(const Problem& p, int n, const float* sb) {
    int m = 0;
    auto run = [&]<int MB>() {
      constexpr int R = RB < rows_for(MB) ? RB : rows_for(MB);
      for (int r = 0; r < RB; r += R) block<BITS, MB, R>(p, n + r, m, sb + size_t(r) * 2 * (p.K / p.group_size));
      m += MB;
    };
    while (p.M - m >= 8 && MB_MAX >= 8) run.template operator()<MB_MAX>();
    while (p.M - m >= 4) run.template operator()<4>();
    while (p.M - m >= 2) run.template operator()<2>();
    while (p.M - m >= 1) run.template operator()<1>();
  }

  template <int BITS>
  static void rows_bits(const Problem& p, int n0, int n1) {
    thread_local std::vector<float> sb;
    sb.resize(size_t(4) * 2 * (p.K / p.group_size));
    int n = n0;
    const size_t row_bytes = size_t(p.K) * BITS / 8;
    for (; n + 4 <= n1; n += 4) {
      prefetch_ahead(p.w + size_t(n) * row_bytes, 4 * row_bytes, p.w + size_t(n1) * row_bytes);
      load_sb(p, n, 4, sb.data());
      n_block<BITS, 4>(p, n, sb.data());
    }
    for (; n < n1; ++n) {
      load_sb(p, n, 1, sb.data());
      n_block<BITS, 1>(p, n, sb.data());
    }
  }

  static void rows(const Problem& p, int n0, int n1) {
    if (p.bits == 4)
      rows_bits<4>(p, n0, n1);
    else
      rows_bits<8>(p, n0, n1);
  }

  static void dequant(const Problem& p, int n0, int n1, float* tile) {
    const int K = p.K, gs = p.group_size, G = K / gs;
    const size_t row_bytes = size_t(K) * p.bits / 8;
    thread_local std::vector<float> sb;
    sb.resize(size_t(2) * G);
    for (int n = n0; n < n1; ++n) {
      load_sb(p, n, 1, sb.data());
      const uint8_t* wr = p.w + size_t(n) * row_bytes;
      float* t = tile + size_t(n - n0) * K;
      for (int g = 0; g < G; ++g) {
        const V s = S::set1(sb[g]), b = S::set1(sb[G + g]);
        const int k0 = g * gs;
        if (p.bits == 4) {
          for (int k = k0; k < k0 + gs; k += 32)
            for (int j = 0; j < 16; j += L) {
              V lo, hi;
              S::u4(wr + k / 2 + j, lo, hi);
              S::store(t + k + j, S::fma(lo, s, b));
              S::store(t + k + 16 + j, S::fma(hi, s, b));
            }
        } else {
          for (int k = k0; k < k0 + gs; k += L) S::store(t + k, S::fma(S::u8(wr + k), s, b));
        }
      }
    }
  }

  // Attention's two products (kernel.h: ScoresFn, MixFn). Two vector chains per dot where D allows, one
  // horizontal sum per score; each cached row is read once for all the query heads that share it.
  static void scores(const float* q, int rep, int D, const float* k, int64_t kl, int len, float scale, float* s) {
    for (int l = 0; l < len; ++l) {
      const float* kr = k + l * kl;
      for (int r = 0; r < rep; ++r) {
        const float* qr = q + size_t(r) * D;
        V a0 = S::zero(), a1 = S::zero();
        int d = 0;
        for (; d + 2 * L <= D; d += 2 * L) {
          a0 = S::fma(S::load(qr + d), S::load(kr + d), a0);
          a1 = S::fma(S::load(qr + d + L), S::load(kr + d + L), a1);
        }
        for (; d + L <= D; d += L) a0 = S::fma(S::load(qr + d), S::load(kr + d), a0);
        float dot = S::hsum(S::add(a0, a1));
        for (; d < D; ++d) dot += qr[d] * kr[d];
        s[size_t(r) * len + l] = dot * scale;
      }
    }
  }

  static void mix(const float* p, int rep, int D, const float* v, int64_t vl, int len, float* out) {
    for (int l = 0; l < len; ++l) {
      const float* vr = v + l * vl;
      for (int r = 0; r < rep; ++r) {
        float* o = out + size_t(r) * D;
        const float w = p[size_t(r) * len + l];
        const V wv = S::set1(w);
        int d = 0;
        for (; d + L <= D; d += L) S::store(o + d, S::fma(wv, S::load(vr + d), S::load(o + d)));
        for (; d < D; ++d) o[d] += w * vr[d];
      }
    }
  }
};
