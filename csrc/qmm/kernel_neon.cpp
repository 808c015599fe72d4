// NEON (every aarch64 CPU). Written to mirror the x86 paths lane for lane; untested on hardware here.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstring>

#include <algorithm>
#include <vector>

#include "kernel.h"

namespace shardline_qmm {
namespace neon_isa {

struct S {
  using V = float32x4_t;
  static constexpr int L = 4;
  static constexpr int ACC = 16;
  static V zero() { return vdupq_n_f32(0.0f); }
  static V set1(float f) { return vdupq_n_f32(f); }
  static V load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, V v) { vst1q_f32(p, v); }
  static V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  static V add(V a, V b) { return vaddq_f32(a, b); }
  static float hsum(V v) { return vaddvq_f32(v); }
  static uint32x4_t widen4(const uint8_t* p) {
    uint32_t word;
    std::memcpy(&word, p, 4);
    const uint16x8_t h = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(word)));
    return vmovl_u16(vget_low_u16(h));
  }
  static void u4(const uint8_t* p, V& lo, V& hi) {
    const uint32x4_t v = widen4(p);
    lo = vcvtq_f32_u32(vandq_u32(v, vdupq_n_u32(15)));
    hi = vcvtq_f32_u32(vshrq_n_u32(v, 4));
  }
  static V u8(const uint8_t* p) { return vcvtq_f32_u32(widen4(p)); }
  static void cvt_f16(const uint16_t* src, float* dst, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(src + i))));
    for (; i < n; ++i) dst[i] = half_to_float(src[i]);
  }
};

#include "kernel_impl.h"

}  // namespace neon_isa

const Kernels& kernels_neon() {
  static const Kernels k{.name = "neon",
                         .rows = &neon_isa::Impl<neon_isa::S>::rows,
                         .dequant = &neon_isa::Impl<neon_isa::S>::dequant,
                         .scores = &neon_isa::Impl<neon_isa::S>::scores,
                         .mix = &neon_isa::Impl<neon_isa::S>::mix};
  return k;
}

}  // namespace shardline_qmm
#endif
