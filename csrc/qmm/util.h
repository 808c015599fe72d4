// Helpers shared by the primitives.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mlx/array.h"

namespace shardline_qmm {

namespace mx = mlx::core;

// A's elements in row-major order, whatever its strides (a rare path: MLX hands over contiguous arrays
// almost always).
inline const uint8_t* contiguous_bytes(const mx::array& a, std::vector<uint8_t>& buf) {
  if (a.flags().row_contiguous) return a.data<uint8_t>();
  const size_t es = a.itemsize();
  buf.resize(a.size() * es);
  const uint8_t* src = a.data<uint8_t>();
  const int nd = int(a.ndim());
  std::vector<int64_t> idx(nd, 0);
  for (size_t e = 0; e < a.size(); ++e) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[d] * a.strides()[d];
    std::memcpy(buf.data() + e * es, src + off * int64_t(es), es);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) break;
      idx[d] = 0;
    }
  }
  return buf.data();
}

// e^x in float32 from arithmetic alone, so that loops over it vectorise (std::exp does not): 2^(x log2 e)
// as 2^whole (exponent bits) times a degree-6 polynomial of the fraction, within 2e-7 relative; the argument
// is clamped to [-87, 88] (silu needs neither 0 nor inf from it).
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // not fmin/fmax: their NaN rules block vectorising
  const float t = x * 1.44269504088896341f;
  int32_t whole = int32_t(t);  // truncates; floor without libm, which SSE2 lacks
  whole -= t < float(whole) ? 1 : 0;
  const float f = t - float(whole);  // [0, 1)
  float p = 2.154050929e-4f;  // a relative least-squares fit of 2^f on [0, 1): 1e-7 in float32
  p = p * f + 1.248288192e-3f;
  p = p * f + 9.674545855e-3f;
  p = p * f + 5.548532248e-2f;
  p = p * f + 2.402294002e-1f;
  p = p * f + 6.931470282e-1f;
  p = p * f + 1.0f;
  int32_t bits = (whole + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace shardline_qmm
