// Products and row lookups on weights in GGUF's block formats (gguf_kernel.h) as MLX primitives on the CPU.
#pragma once

#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace shardline_qmm {

namespace mx = mlx::core;

// Inputs x, then one weight per output (its GGUF type in qtypes); swiglu: two weights (gate, up), one output.
class GgufMatmulCPU : public mx::Primitive {
 public:
  GgufMatmulCPU(mx::Stream stream, std::vector<int> qtypes, bool swiglu)
      : mx::Primitive(stream), qtypes_(std::move(qtypes)), swiglu_(swiglu) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ShardlineGgufMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  std::vector<int> qtypes_;
  bool swiglu_;
};

// From how many rows of x the GGUF products dequantize tiles of w and call BLAS (0: never; default 32:
// below that the integer row kernels, which unpack each block once per 8 rows of x, measured faster).
void set_gguf_gemm_rows(int rows);
int gguf_gemm_rows();

// (elements, bytes) of one block of GGUF type qtype; throws std::invalid_argument for a type not supported.
std::pair<int, int> gguf_block(int qtype);
bool gguf_supported(int qtype);

// x (..., K) float32 / float16 / bfloat16 @ dequantize(w).T -> (..., N) float32, w (N, K / block * bytes) uint8.
mx::array gguf_matmul(const mx::array& x, const mx::array& w, int qtype);
// x against several weights, each of its own type, x prepared once; each output as gguf_matmul gives it.
std::vector<mx::array> gguf_matmul_many(const mx::array& x, const std::vector<mx::array>& ws,
                                        const std::vector<int>& qtypes);
// silu(x @ gate.T) * (x @ up.T), float32.
mx::array gguf_swiglu(const mx::array& x, const mx::array& w_gate, int t_gate, const mx::array& w_up, int t_up);
// Rows ids of dequantize(w) -> float32 ids.shape + (K,), bit-equal to gguf.quants.dequantize (an embedding
// lookup); an id out of range gives a row of zeros.
mx::array gguf_rows(const mx::array& w, const mx::array& ids, int qtype);

}  // namespace shardline_qmm
