// Helpers shared by the primitives.
#pragma once

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

}  // namespace shardline_qmm
