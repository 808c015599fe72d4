// The gathered quantized product of a mixture-of-experts layer, mx.gather_qmm as mlx-lm's
// QuantizedSwitchLinear calls it, as an MLX primitive that runs shardline's CPU kernels.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace shardline_qmm {

namespace mx = mlx::core;

// Inputs x, w, scales, biases, indices (uint32 or int32); one output.
class GatherQuantizedMatmulCPU : public mx::Primitive {
 public:
  GatherQuantizedMatmulCPU(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ShardlineGatherQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
};

// Same semantics as mx::gather_qmm(x, w, scales, biases, lhs_indices=None, rhs_indices=indices,
// transpose=true, group_size, bits) in affine mode: x (..., M, K), w (E, N, K * bits / 32) uint32, scales
// and biases (E, N, K / group_size); x's batch axes and indices broadcast to the output's batch shape B,
// and out[b] = x[b] @ dequantize(w[indices[b]]).T, (B..., M, N). The pairs that share an expert run as
// one product of all their rows, so each expert's weights are read once per call whatever the order of
// indices (`sorted_indices` is accepted for the signature and changes nothing). An index outside
// [0, E) gives zeros. Bits 4 and 8, groups of 32, 64 or 128; throws std::invalid_argument otherwise.
mx::array gather_qmm(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     const mx::array& indices, int group_size, int bits, bool sorted_indices);

}  // namespace shardline_qmm
