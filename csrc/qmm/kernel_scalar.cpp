// The portable path: plain C++, for CPUs without the vector units the other files need.
#include <algorithm>
#include <vector>

#include "kernel.h"

namespace shardline_qmm {
namespace scalar_isa {

struct S {
  using V = float;
  static constexpr int L = 1;
  static constexpr int ACC = 8;
  static V zero() { return 0.0f; }
  static V set1(float f) { return f; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static float hsum(V v) { return v; }
  static void u4(const uint8_t* p, V& lo, V& hi) {
    lo = float(p[0] & 15);
    hi = float(p[0] >> 4);
  }
  static V u8(const uint8_t* p) { return float(p[0]); }
  static void cvt_f16(const uint16_t* src, float* dst, int n) {
    for (int i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
  }
};

#include "kernel_impl.h"

}  // namespace scalar_isa

const Kernels& kernels_scalar() {
  static const Kernels k{.name = "scalar",
                         .rows = &scalar_isa::Impl<scalar_isa::S>::rows,
                         .dequant = &scalar_isa::Impl<scalar_isa::S>::dequant,
                         .scores = &scalar_isa::Impl<scalar_isa::S>::scores,
                         .mix = &scalar_isa::Impl<scalar_isa::S>::mix};
  return k;
}

}  // namespace shardline_qmm
