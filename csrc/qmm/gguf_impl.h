// The GGUF row kernels, written once over a SIMD trait S and included by each per-ISA translation unit
// inside its own namespace (kernel_avx512_vnni_gguf.cpp, kernel_avx2_gguf.cpp), after <immintrin.h>,
// <algorithm>, <cstring>, <vector>, gguf_kernel.h and kernel.h.
//
// Every format is read 256 elements at a time (one K-quant block, or 8 blocks of 32) as four vectors of 64
// unsigned weights in element order, so that one x layout serves all formats; each vector's dot with x gives
// 16 int32 lanes (4 products each), lanes 0-7 its first sub-block of 32, lanes 8-15 its second. A lane's dot
// is converted to float and multiplied by its factor (the weight's scale times x's step), and each 16
// elements' offset or minimum meets x's step times the sum of its rounded values there: per output element
// the same operations in the same order whatever the row range, so that threads never change a bit.
//
// S provides: W (64 bytes), I (16 int32), F (16 floats); zero_f(), load_x(const int8_t*), load_f(const float*),
// set1(f), fma(a, b, c), mul(a, b), add(a, b), hsum(F), h2f(half bits);
// dot<SIGNED>(W w, W x): the 16 lane dots of w (u8, or s8 where SIGNED) with x (s8), cvt(I) -> F;
// dot_acc<SIGNED>(I acc, W w, W x): acc plus those dots; k4_pair(lo, hi, P, Q): 16-byte segments
// [lo0 lo2 hi0 hi2], [lo1 lo3 hi1 hi3]; segs(f, c0..c3): lanes 4k..4k+3 = f[ck]; seg4(p[4], at, flip): 16
// bytes from each p[k] + at (nullptr: zeros), ^ 0x80 where flip; nib_split(t, lo, hi): t's low, high nibbles;
// nib64(p, lo, hi): 64 bytes -> their low nibbles, their high ones; nib16x2(p0, p1): two 16-byte runs (nullptr:
// zeros) -> [low p0, high p0 | low p1, high p1]; raw32x2(p0, p1, xor_hi): two 32-byte runs, each byte ^ 0x80
// where xor_hi; add_bit16(w, qh32, b0, b1): 16 added to byte l < 32 where bit b0 of qh32[l] is set, to byte
// 32 + l where bit b1 is; add_bits64(w, bits): 16 added to byte i where bit i is set; q6(ql64, qh32, w0, w1): Q6_K's two vectors of one half;
// join(a8, b8): two __m256 as one F; pairs2(f, a, b): lanes 0-7 f[a], 8-15 f[b]; offs_pairs(f): lane h =
// f[8 + h / 2]; quads(f, v): lane i = f[4v + i / 4]; SIGNED_Q8: whether Q8_0 is read signed (else as q + 128).

struct XRows {
  int M = 0, S = 0;  // rows, 256-element super blocks
  std::vector<int8_t> q;  // M x 256 S, zero past K
  std::vector<float> dxv;  // M x 64 S: per 64, [step of its first 32] x 8, [second] x 8
  std::vector<float> xs16;  // M x 16 S: per 16, its step times its sum
  const int8_t* qm(int m) const { return q.data() + size_t(m) * 256 * S; }
  const float* dm(int m) const { return dxv.data() + size_t(m) * 64 * S; }
  const float* sm(int m) const { return xs16.data() + size_t(m) * 16 * S; }
};

// Which sub-block of 32 the half `h` of vector v holds: in element order, except for Q4_K and Q5_K, whose
// 64-byte runs of nibbles hold sub-blocks (4j, 4j + 2) in their low nibbles and (4j + 1, 4j + 3) in their
// high ones (used by the dequantization, which reads the runs as they are).
constexpr bool k4_order(GgufType t) { return t == GgufType::Q4_K || t == GgufType::Q5_K; }
inline int sub_of(bool k4, int v, int h) {
  if (!k4) return 2 * v + h;
  return 4 * (v / 2) + (v % 2) + 2 * h;
}

// The products read every format but Q6_K (whose scales are per 16) as vectors P_j, Q_j (j = 0, 1 per 256)
// whose 16-byte segment k both hold sub-block seg_of(j, k) (P its elements 0-15, Q 16-31): the two dots
// then add up in int32 before one conversion. Q4_K / Q5_K's run j of nibbles gives sub-blocks (0, 2, 1, 3).
constexpr bool chained(GgufType t) { return t != GgufType::Q6_K; }
inline int seg_of(bool k4, int j, int k) {
  static constexpr int order[4] = {0, 2, 1, 3};
  return 4 * j + (k4 ? order[k] : k);
}

inline void lay_out(const GgufProblem& p, XRows& x) {
  const int K = p.K, S = (K + 255) / 256, nb = K / 32;
  const bool k4 = k4_order(p.type);
  x.M = p.M;
  x.S = S;
  x.q.assign(size_t(p.M) * 256 * S, 0);
  x.dxv.assign(size_t(p.M) * 64 * S, 0.0f);
  x.xs16.assign(size_t(p.M) * 16 * S, 0.0f);
  for (int m = 0; m < p.M; ++m) {
    const int8_t* src = p.x.q + size_t(m) * K;
    int8_t* dst = x.q.data() + size_t(m) * 256 * S;
    const float* d = p.x.d + size_t(m) * nb;
    const int16_t* s = p.x.s16 + size_t(m) * 2 * nb;
    float* dv = x.dxv.data() + size_t(m) * 64 * S;
    float* xs = x.xs16.data() + size_t(m) * 16 * S;
    for (int j = 0; j < 2 * nb; ++j) xs[j] = d[j / 2] * float(s[j]);  // offsets stay in element order
    if (chained(p.type)) {  // per super block, x vectors P0 Q0 P1 Q1, steps of P0 then of P1; zeros past K
      for (int sb = 0; sb < S; ++sb)
        for (int j = 0; j < 2; ++j)
          for (int k = 0; k < 4; ++k) {
            const int from = 8 * sb + seg_of(k4, j, k);
            if (from >= nb) continue;
            for (int h = 0; h < 2; ++h)
              std::memcpy(dst + 256 * sb + 64 * (2 * j + h) + 16 * k, src + 32 * from + 16 * h, 16);
            std::fill_n(dv + 64 * sb + 16 * j + 4 * k, 4, d[from]);
          }
      continue;
    }
    for (int j = 0; j < nb; ++j) {  // slot j of the layout holds sub-block j
      std::memcpy(dst + 32 * j, src + 32 * j, 32);
      std::fill_n(dv + 8 * j, 8, d[j]);
    }
  }
}

template <class S>
struct GgufImpl {
  using W = typename S::W;
  using F = typename S::F;

  static float f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return S::h2f(h);
  }

  // 256 elements of one weight row: nv vectors of weights (the rest of a row's last 8 blocks of 32 are
  // absent), their lanes' factors, and the offset per 16 elements.
  struct Super {
    W w[4];
    F a[4];
    F b;
    int nv = 4;
  };

  static uint32_t load32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }

  static uint16_t half_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return h;
  }

  // Blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): blocks [8 sb, 8 sb + 8) of the row, as many as it has (a whole 8
  // unrolled, without the checks a row's last few need).
  template <GgufType T, bool CHAIN>
  static void unpack32(const uint8_t* row, int sb, int nb, Super& s) {
    const int n = std::min(8, nb - 8 * sb);
    if (n == 8)
      unpack32_n<T, true, CHAIN>(row + size_t(8 * sb) * bytes32<T>(), 8, s);
    else
      unpack32_n<T, false, CHAIN>(row + size_t(8 * sb) * bytes32<T>(), n, s);
  }

  template <GgufType T>
  static constexpr int bytes32() {
    switch (T) {
      case GgufType::Q4_1:
        return 20;
      case GgufType::Q5_0:
        return 22;
      case GgufType::Q5_1:
        return 24;
      case GgufType::Q8_0:
        return 34;
      default:
        return 18;
    }
  }

  template <GgufType T, bool FULL, bool CHAIN>
  static void unpack32_n(const uint8_t* b0, int n, Super& s) {
    constexpr int bytes = bytes32<T>();
    constexpr bool q5 = T == GgufType::Q5_0 || T == GgufType::Q5_1;
    constexpr int hoff = T == GgufType::Q5_1 ? 4 : 2;  // Q5's fifth bits
    constexpr int off = T == GgufType::Q4_1 ? 4 : (q5 ? hoff + 4 : 2);
    if constexpr (FULL) n = 8;
    const auto blk = [&](int j) -> const uint8_t* { return FULL || j < n ? b0 + j * bytes : nullptr; };
    const auto dh = [&](int j, int at) -> short { return FULL || j < n ? short(half_at(b0 + j * bytes + at)) : 0; };
    // Built in registers (no store of 8 halves reloaded as one vector: that stalls store forwarding).
    const __m256 d8 = _mm256_cvtph_ps(_mm_setr_epi16(dh(0, 0), dh(1, 0), dh(2, 0), dh(3, 0), dh(4, 0), dh(5, 0),
                                                     dh(6, 0), dh(7, 0)));
    __m256 o8;
    if constexpr (T == GgufType::Q4_0)
      o8 = _mm256_mul_ps(d8, _mm256_set1_ps(-8.0f));
    else if constexpr (T == GgufType::Q5_0)
      o8 = _mm256_mul_ps(d8, _mm256_set1_ps(-16.0f));
    else if constexpr (T == GgufType::Q4_1 || T == GgufType::Q5_1)
      o8 = _mm256_cvtph_ps(_mm_setr_epi16(dh(0, 2), dh(1, 2), dh(2, 2), dh(3, 2), dh(4, 2), dh(5, 2), dh(6, 2),
                                          dh(7, 2)));
    else if constexpr (!S::SIGNED_Q8)
      o8 = _mm256_mul_ps(d8, _mm256_set1_ps(-128.0f));  // int8 weights read as unsigned q + 128
    else
      o8 = _mm256_setzero_ps();
    const F f = S::join(d8, o8);
    if constexpr (CHAIN) {  // the products' layout (seg_of): blocks absent past the row's end read as zeros, d 0
      for (int j = 0; j < 2; ++j) {
        const uint8_t* p[4];
        for (int k = 0; k < 4; ++k) p[k] = blk(4 * j + k) ? blk(4 * j + k) + off : nullptr;
        if constexpr (T == GgufType::Q8_0) {
          s.w[2 * j] = S::seg4(p, 0, !S::SIGNED_Q8);
          s.w[2 * j + 1] = S::seg4(p, 16, !S::SIGNED_Q8);
        } else {
          S::nib_split(S::seg4(p, 0, false), s.w[2 * j], s.w[2 * j + 1]);
        }
        if constexpr (q5) {
          uint64_t lo = 0, hi = 0;
          for (int k = 0; k < 4; ++k) {
            uint32_t h = 0;
            if (const uint8_t* b = blk(4 * j + k)) std::memcpy(&h, b + hoff, 4);
            lo |= uint64_t(h & 0xFFFF) << (16 * k);
            hi |= uint64_t(h >> 16) << (16 * k);
          }
          s.w[2 * j] = S::add_bits64(s.w[2 * j], lo);
          s.w[2 * j + 1] = S::add_bits64(s.w[2 * j + 1], hi);
        }
        s.a[j] = S::segs(f, 4 * j, 4 * j + 1, 4 * j + 2, 4 * j + 3);
      }
      s.nv = 4;
      s.b = S::offs_pairs(f);
      return;
    }
    s.nv = FULL ? 4 : (n + 1) / 2;
    for (int v = 0; v < (FULL ? 4 : s.nv); ++v) {
      const uint8_t* p0 = blk(2 * v);
      const uint8_t* p1 = blk(2 * v + 1);
      if constexpr (T == GgufType::Q8_0)
        s.w[v] = S::raw32x2(p0 + off, p1 ? p1 + off : nullptr, !S::SIGNED_Q8);
      else
        s.w[v] = S::nib16x2(p0 + off, p1 ? p1 + off : nullptr);
      if constexpr (q5) {
        uint32_t h0, h1 = 0;
        std::memcpy(&h0, p0 + hoff, 4);
        if (p1) std::memcpy(&h1, p1 + hoff, 4);
        s.w[v] = S::add_bits64(s.w[v], uint64_t(h0) | uint64_t(h1) << 32);
      }
      s.a[v] = S::pairs2(f, 2 * v, 2 * v + 1);
    }
    s.b = S::offs_pairs(f);
  }

  // Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth bits,) 128 of nibbles.
  template <GgufType T, bool CHAIN>
  static void unpack_k45(const uint8_t* b, Super& s) {
    constexpr bool q5 = T == GgufType::Q5_K;
    // llama.cpp's unpacking of the 12 bytes: words 0-1 the 8 scales, words 2-3 the 8 mins.
    uint32_t u[4] = {load32(b + 4), load32(b + 8), load32(b + 12), 0};  // registers, no copy through the stack
    constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t m0 = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = m0;
    u[0] &= k1;
    const __m128i scm = _mm_setr_epi32(int(u[0]), int(u[1]), int(u[2]), int(u[3]));
    const __m256 sc8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scm));
    const __m256 m8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scm, 8)));
    const F f = S::join(_mm256_mul_ps(sc8, _mm256_set1_ps(f16(b))), _mm256_mul_ps(m8, _mm256_set1_ps(-f16(b + 2))));
    s.nv = 4;
    const uint8_t* qs = b + (q5 ? 48 : 16);
    if constexpr (CHAIN) {  // the products' layout (seg_of): w = P0 Q0 P1 Q1, a[j] the factors of P_j's lanes
      for (int j = 0; j < 2; ++j) {
        W lo, hi;
        S::nib64(qs + 64 * j, lo, hi);
        if constexpr (q5) {
          lo = S::add_bit16(lo, b + 16, 4 * j, 4 * j + 2);
          hi = S::add_bit16(hi, b + 16, 4 * j + 1, 4 * j + 3);
        }
        S::k4_pair(lo, hi, s.w[2 * j], s.w[2 * j + 1]);
        s.a[j] = S::segs(f, 4 * j, 4 * j + 2, 4 * j + 1, 4 * j + 3);
      }
      s.b = S::offs_pairs(f);
      return;
    }
    for (int j = 0; j < 2; ++j) {
      S::nib64(qs + 64 * j, s.w[2 * j], s.w[2 * j + 1]);
      for (int v = 2 * j; v < 2 * j + 2; ++v) {
        const int lo = sub_of(true, v, 0), hi = sub_of(true, v, 1);
        if constexpr (q5) s.w[v] = S::add_bit16(s.w[v], b + 16, lo, hi);
        s.a[v] = S::pairs2(f, lo, hi);
      }
    }
    s.b = S::offs_pairs(f);
  }

  // Q6_K: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales (one per 16), d.
  static void unpack_k6(const uint8_t* b, Super& s) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256 d = _mm256_set1_ps(f16(b + 208));
    const F a16 = S::join(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
                          _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    s.nv = 4;
    for (int v = 0; v < 4; ++v) s.a[v] = S::quads(a16, v);
    s.b = S::mul(a16, S::set1(-32.0f));
    for (int h = 0; h < 2; ++h) S::q6(b + 64 * h, b + 128 + 32 * h, s.w[2 * h], s.w[2 * h + 1]);
  }

  template <GgufType T, bool CHAIN = false>
  static void unpack(const uint8_t* row, int sb, int nb32, Super& s) {
    if constexpr (T == GgufType::Q4_K || T == GgufType::Q5_K)
      unpack_k45<T, CHAIN>(row + size_t(sb) * (T == GgufType::Q4_K ? 144 : 176), s);
    else if constexpr (T == GgufType::Q6_K)
      unpack_k6(row + size_t(sb) * 210, s);
    else
      unpack32<T, CHAIN>(row, sb, nb32, s);
  }

  // Rows [m0, m0 + MB) of x against weight row n. The same accumulators per row whatever MB (S::ROW_ACC),
  // so that a row's result does not depend on how many rows share the call: a decode row batched with
  // others must give the bits it gives alone (replays and concurrent requests rely on it).
  template <GgufType T, int MB>
  static void row_block(const GgufProblem& p, const XRows& x, int n, int m0) {
    constexpr bool sgn = T == GgufType::Q8_0 && S::SIGNED_Q8;
    constexpr int NA = S::ROW_ACC;
    const uint8_t* row = p.w + size_t(n) * p.row_bytes;
    const int nb32 = p.K / 32;
    F acc[MB][NA];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NA; ++j) acc[i][j] = S::zero_f();
    Super s;
    for (int sb = 0; sb < x.S; ++sb) {
      unpack<T, true>(row, sb, nb32, s);
      for (int i = 0; i < MB; ++i) {
        const int8_t* q = x.qm(m0 + i) + 256 * sb;
        const float* d = x.dm(m0 + i) + 64 * sb;
        if constexpr (chained(T)) {  // P_j and Q_j share their lanes' factors: one conversion per 128
          for (int j = 0; j < 2; ++j) {
            const auto dot = S::template dot_acc<sgn>(S::template dot<sgn>(s.w[2 * j], S::load_x(q + 128 * j)),
                                                      s.w[2 * j + 1], S::load_x(q + 128 * j + 64));
            F& a = acc[i][j % NA];
            a = S::fma(S::cvt(dot), S::mul(s.a[j], S::load_f(d + 16 * j)), a);
          }
        } else {
          for (int v = 0; v < s.nv; ++v) {
            const F dot = S::cvt(S::template dot<sgn>(s.w[v], S::load_x(q + 64 * v)));
            acc[i][v % NA] = S::fma(dot, S::mul(s.a[v], S::load_f(d + 16 * v)), acc[i][v % NA]);
          }
        }
        acc[i][NA - 1] = S::fma(s.b, S::load_f(x.sm(m0 + i) + 16 * sb), acc[i][NA - 1]);
      }
    }
    for (int i = 0; i < MB; ++i) {
      F a = acc[i][0];
      for (int j = 1; j < NA; ++j) a = S::add(a, acc[i][j]);
      p.y[size_t(m0 + i) * p.ldy + n] = S::hsum(a);
    }
  }

  template <GgufType T>
  static void rows_t(const GgufProblem& p, const XRows& x, int n0, int n1) {
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

  // Rows [n0, n1) dequantized for BLAS: per 16 elements q * scale + offset in float32 (not bit-equal to
  // gguf.quants, whose Q4_0 and Q6_K subtract the offset before scaling; gguf_rows keeps to the scalar code).
  template <GgufType T>
  static void dequant_t(const GgufProblem& p, int n0, int n1, float* out) {
    constexpr bool sgn = T == GgufType::Q8_0 && S::SIGNED_Q8;
    const int nb32 = p.K / 32, nsb = (p.K + 255) / 256;
    alignas(64) uint8_t wb[64];
    alignas(64) float a[16], b[16];
    Super s;
    for (int n = n0; n < n1; ++n) {
      const uint8_t* row = p.w + size_t(n) * p.row_bytes;
      float* o = out + size_t(n - n0) * p.K;
      for (int sb = 0; sb < nsb; ++sb) {
        unpack<T>(row, sb, nb32, s);
        S::store_f(s.b, b);
        for (int v = 0; v < s.nv; ++v) {
          S::store_w(s.w[v], wb);
          S::store_f(s.a[v], a);
          for (int c = 0; c < 4; ++c) {
            const int sub = sub_of(k4_order(T), v, c / 2), h16 = 2 * sub + c % 2;
            const int e = 256 * sb + 16 * h16;
            if (e >= p.K) continue;
            S::template dequant16<sgn>(wb + 16 * c, a[4 * c], b[h16], o + e);
          }
        }
      }
    }
  }

  static void dequant(const GgufProblem& p, int n0, int n1, float* out) {
    switch (p.type) {
      case GgufType::Q4_0:
        return dequant_t<GgufType::Q4_0>(p, n0, n1, out);
      case GgufType::Q4_1:
        return dequant_t<GgufType::Q4_1>(p, n0, n1, out);
      case GgufType::Q5_0:
        return dequant_t<GgufType::Q5_0>(p, n0, n1, out);
      case GgufType::Q5_1:
        return dequant_t<GgufType::Q5_1>(p, n0, n1, out);
      case GgufType::Q8_0:
        return dequant_t<GgufType::Q8_0>(p, n0, n1, out);
      case GgufType::Q4_K:
        return dequant_t<GgufType::Q4_K>(p, n0, n1, out);
      case GgufType::Q5_K:
        return dequant_t<GgufType::Q5_K>(p, n0, n1, out);
      case GgufType::Q6_K:
        return dequant_t<GgufType::Q6_K>(p, n0, n1, out);
    }
  }

  static void rows(const GgufProblem& p, int n0, int n1) {
    thread_local XRows x;
    lay_out(p, x);
    switch (p.type) {
      case GgufType::Q4_0:
        return rows_t<GgufType::Q4_0>(p, x, n0, n1);
      case GgufType::Q4_1:
        return rows_t<GgufType::Q4_1>(p, x, n0, n1);
      case GgufType::Q5_0:
        return rows_t<GgufType::Q5_0>(p, x, n0, n1);
      case GgufType::Q5_1:
        return rows_t<GgufType::Q5_1>(p, x, n0, n1);
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
};
