// AVX-512 with VNNI (Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4 and later): the int16-activation
// kernels on vpdpwssd; the float paths are kernel_avx512.cpp's. Chosen at run time.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernel.h"

namespace shardline_qmm {
namespace avx512_vnni_isa {

#define QMM_VNNI 1
#include "kernel_avx512_int16.h"
#undef QMM_VNNI

}  // namespace avx512_vnni_isa

const Kernels& kernels_avx512_vnni() {
  static const Kernels k{.name = "avx512_vnni",
                         .rows = kernels_avx512().rows,
                         .dequant = kernels_avx512().dequant,
                         .scores = kernels_avx512().scores,
                         .mix = kernels_avx512().mix,
                         .int_prepare = &avx512_vnni_isa::prepare,
                         .int_rows = &avx512_vnni_isa::int_rows};
  return k;
}

}  // namespace shardline_qmm
