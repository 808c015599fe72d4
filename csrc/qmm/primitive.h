// y = x @ dequantize(w, scales, biases).T as an MLX primitive that runs shardline's CPU kernels.
#pragma once

#include <string>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace shardline_qmm {

namespace mx = mlx::core;

// Inputs x, then (w, scales, biases) per weight set; one output per set, all from one preparation of x.
class QuantizedMatmulCPU : public mx::Primitive {
 public:
  QuantizedMatmulCPU(mx::Stream stream, int group_size, int bits, bool swiglu = false)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), swiglu_(swiglu) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ShardlineQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  bool swiglu_;  // two weight sets (gate, up) -> one output silu(x gate^T) * (x up^T)
};

// Same semantics as mx::quantized_matmul(x, w, scales, biases, transpose=true, group_size, bits) in affine
// mode, for bits 4 and 8; throws std::invalid_argument for anything else.
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits);
// x against several weight sets of one format at once (a fused q/k/v or gate/up projection): each output
// equals quantized_matmul(x, w_i, ...) bit for bit, and x is prepared once.
std::vector<mx::array> quantized_matmul_many(const mx::array& x, const std::vector<mx::array>& ws,
                                             const std::vector<mx::array>& scales,
                                             const std::vector<mx::array>& biases, int group_size, int bits);

// silu(x @ dequantize(gate).T) * (x @ dequantize(up).T) in one op (an MLP's gate and up projections).
mx::array quantized_swiglu(const mx::array& x, const mx::array& w_gate, const mx::array& s_gate,
                           const mx::array& b_gate, const mx::array& w_up, const mx::array& s_up,
                           const mx::array& b_up, int group_size, int bits);

// Which kernel set runs ("auto" picks the best this CPU has); false if the name is not available here.
bool set_isa(const std::string& name);
std::string isa();
// From how many rows of x a product dequantizes tiles of w and calls BLAS (0: never).
void set_gemm_rows(int rows);
int gemm_rows();
bool has_blas();
// Whether products below the BLAS threshold round x to int16 per block of 32 for integer dot products
// where the CPU has them (faster; x's rounding, at most max|x_block| / 65534, is the only difference from
// the float32 product) or stay in float32.
void set_integer(bool on);
bool integer();

}  // namespace shardline_qmm
