// GGUF block formats in plain C++: the block table, x's rounding, dequantization (bit-equal to
// gguf.quants.dequantize: compiled with -ffp-contract=off, each product and sum rounded as numpy rounds it),
// and the reference row kernel that the per-ISA ones must agree with.
#include <cmath>
#include <cstring>
#include <vector>

#include "gguf_kernel.h"
#include "kernel.h"

namespace shardline_qmm {

GgufBlock gguf_block_of(int qtype) {
  switch (GgufType(qtype)) {
    case GgufType::Q4_0:
      return {32, 18};
    case GgufType::Q4_1:
      return {32, 20};
    case GgufType::Q5_0:
      return {32, 22};
    case GgufType::Q5_1:
      return {32, 24};
    case GgufType::Q8_0:
      return {32, 34};
    case GgufType::Q4_K:
      return {256, 144};
    case GgufType::Q5_K:
      return {256, 176};
    case GgufType::Q6_K:
      return {256, 210};
  }
  return {};
}

namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

void quantize(const float* x, int M, int K, int8_t* q, float* d, int16_t* s16) {
  for (size_t b = 0, nb = size_t(M) * (K / 32); b < nb; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float step = amax / 127.0f;
    const float inv = step != 0.0f ? 1.0f / step : 0.0f;
    d[b] = step;
    for (int h = 0; h < 2; ++h) {
      int sum = 0;
      for (int i = 16 * h; i < 16 * h + 16; ++i) {
        const int v = int(std::nearbyint(xb[i] * inv));
        q[32 * b + i] = int8_t(v);
        sum += v;
      }
      s16[2 * b + h] = int16_t(sum);
    }
  }
}

// One block as signed int8 weights, an integer scale per 16 and, per 32, the float factor A and offset B:
// the block's share of a dot with rounded x is sum_j dx_j (A_j sum_h sc_h (w8 . x8)_h + B_j sum32(x8)_j).
struct Unpacked {
  int8_t w8[256];
  int sc16[16];
  float A[8], B[8];
};

int unpack(GgufType t, const uint8_t* b, Unpacked& u) {
  for (int h = 0; h < 16; ++h) u.sc16[h] = 1;
  for (int j = 0; j < 8; ++j) u.B[j] = 0.0f;
  switch (t) {
    case GgufType::Q4_0:
    case GgufType::Q4_1: {
      const bool q41 = t == GgufType::Q4_1;
      const uint8_t* qs = b + (q41 ? 4 : 2);
      for (int i = 0; i < 16; ++i) {
        u.w8[i] = int8_t((qs[i] & 15) - (q41 ? 0 : 8));
        u.w8[i + 16] = int8_t((qs[i] >> 4) - (q41 ? 0 : 8));
      }
      u.A[0] = f16(b);
      if (q41) u.B[0] = f16(b + 2);
      return 32;
    }
    case GgufType::Q5_0:
    case GgufType::Q5_1: {
      const bool q51 = t == GgufType::Q5_1;
      uint32_t qh;
      std::memcpy(&qh, b + (q51 ? 4 : 2), 4);
      const uint8_t* qs = b + (q51 ? 8 : 6);
      for (int i = 0; i < 16; ++i) {
        u.w8[i] = int8_t(((qs[i] & 15) | (((qh >> i) & 1) << 4)) - (q51 ? 0 : 16));
        u.w8[i + 16] = int8_t(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - (q51 ? 0 : 16));
      }
      u.A[0] = f16(b);
      if (q51) u.B[0] = f16(b + 2);
      return 32;
    }
    case GgufType::Q8_0:
      std::memcpy(u.w8, b + 2, 32);
      u.A[0] = f16(b);
      return 32;
    case GgufType::Q4_K:
    case GgufType::Q5_K: {
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t* sc = b + 4;
      const bool q5 = t == GgufType::Q5_K;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (q5 ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        uint8_t s, m;
        gguf_scale_min_k4(j, sc, s, m);
        u.A[j] = d * float(s);
        u.B[j] = -(dmin * float(m));
        const uint8_t* src = qs + 32 * (j / 2);
        for (int l = 0; l < 32; ++l) {
          int v = j % 2 ? src[l] >> 4 : src[l] & 15;
          if (q5) v |= ((qh[l] >> j) & 1) << 4;
          u.w8[32 * j + l] = int8_t(v);
        }
      }
      return 256;
    }
    case GgufType::Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const uint8_t* L = ql + 64 * h;
          const uint8_t H = qh[32 * h + l];
          int8_t* w = u.w8 + 128 * h;
          w[l] = int8_t(((L[l] & 15) | ((H & 3) << 4)) - 32);
          w[l + 32] = int8_t(((L[l + 32] & 15) | (((H >> 2) & 3) << 4)) - 32);
          w[l + 64] = int8_t(((L[l] >> 4) | (((H >> 4) & 3) << 4)) - 32);
          w[l + 96] = int8_t(((L[l + 32] >> 4) | (((H >> 6) & 3) << 4)) - 32);
        }
      for (int h = 0; h < 16; ++h) u.sc16[h] = sc[h];
      for (int j = 0; j < 8; ++j) u.A[j] = d;
      return 256;
    }
  }
  return 0;
}

void rows(const GgufProblem& p, int n0, int n1) {
  const GgufBlock blk = gguf_block_of(int(p.type));
  const int nb = p.K / blk.elements;
  thread_local std::vector<float> acc;
  acc.resize(p.M);
  Unpacked u;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = p.w + size_t(n) * p.row_bytes;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int b = 0; b < nb; ++b) {
      const int E = unpack(p.type, wr + size_t(b) * blk.bytes, u);
      const int k0 = b * E;
      for (int m = 0; m < p.M; ++m) {
        const int8_t* xq = p.x.q + size_t(m) * p.K + k0;
        const float* dx = p.x.d + size_t(m) * (p.K / 32) + k0 / 32;
        const int16_t* xs = p.x.s16 + size_t(m) * (p.K / 16) + k0 / 16;
        float a = acc[m];
        for (int j = 0; j < E / 32; ++j) {
          int dot = 0;
          for (int h = 0; h < 2; ++h) {
            int part = 0;
            for (int l = 16 * h; l < 16 * h + 16; ++l) part += int(u.w8[32 * j + l]) * int(xq[32 * j + l]);
            dot += u.sc16[2 * j + h] * part;
          }
          const int sum = int(xs[2 * j]) + int(xs[2 * j + 1]);
          a += dx[j] * (u.A[j] * float(dot) + u.B[j] * float(sum));
        }
        acc[m] = a;
      }
    }
    for (int m = 0; m < p.M; ++m) p.y[size_t(m) * p.ldy + n] = acc[m];
  }
}

// As gguf.quants.dequantize computes it: the same float32 operations in the same order.
void dequant_block(GgufType t, const uint8_t* b, float* out) {
  switch (t) {
    case GgufType::Q4_0: {
      const float d = f16(b);
      for (int i = 0; i < 16; ++i) {
        out[i] = d * float((b[2 + i] & 15) - 8);
        out[i + 16] = d * float((b[2 + i] >> 4) - 8);
      }
      return;
    }
    case GgufType::Q4_1: {
      const float d = f16(b), m = f16(b + 2);
      for (int i = 0; i < 16; ++i) {
        out[i] = d * float(b[4 + i] & 15) + m;
        out[i + 16] = d * float(b[4 + i] >> 4) + m;
      }
      return;
    }
    case GgufType::Q5_0:
    case GgufType::Q5_1: {
      Unpacked u;
      unpack(t, b, u);
      const float d = f16(b);
      if (t == GgufType::Q5_0) {
        for (int i = 0; i < 32; ++i) out[i] = d * float(u.w8[i]);
      } else {
        const float m = f16(b + 2);
        for (int i = 0; i < 32; ++i) out[i] = d * float(u.w8[i]) + m;
      }
      return;
    }
    case GgufType::Q8_0: {
      const float d = f16(b);
      for (int i = 0; i < 32; ++i) out[i] = d * float(int8_t(b[2 + i]));
      return;
    }
    case GgufType::Q4_K:
    case GgufType::Q5_K:
    case GgufType::Q6_K: {
      Unpacked u;
      unpack(t, b, u);
      if (t == GgufType::Q6_K) {
        const float d = f16(b + 208);
        for (int i = 0; i < 256; ++i) out[i] = (d * float(u.sc16[i / 16])) * float(u.w8[i]);
      } else {
        for (int i = 0; i < 256; ++i) out[i] = u.A[i / 32] * float(u.w8[i]) + u.B[i / 32];
      }
      return;
    }
  }
}

void dequant(const GgufProblem& p, int n0, int n1, float* out) {
  const GgufBlock blk = gguf_block_of(int(p.type));
  const int nb = p.K / blk.elements;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = p.w + size_t(n) * p.row_bytes;
    float* o = out + size_t(n - n0) * p.K;
    for (int b = 0; b < nb; ++b) dequant_block(p.type, wr + size_t(b) * blk.bytes, o + size_t(b) * blk.elements);
  }
}

}  // namespace

const GgufKernels& gguf_kernels_scalar() {
  static const GgufKernels k{"scalar", &quantize, &rows, &dequant};
  return k;
}

const GgufKernels& gguf_kernels_for(const char* isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (std::strcmp(isa, "avx512_vnni") == 0) return gguf_kernels_avx512_vnni();
  if (std::strcmp(isa, "avx512") == 0 || std::strcmp(isa, "avx2") == 0) return gguf_kernels_avx2();
#endif
  (void)isa;
  return gguf_kernels_scalar();
}

}  // namespace shardline_qmm
