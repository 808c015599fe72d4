// Python bindings: nanobind in MLX's domain, so mx.array crosses without copies or conversions.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "mlx/version.h"
#include "gather.h"
#include "gguf_primitive.h"
#include "group_sum.h"
#include "ops.h"
#include "pool.h"
#include "primitive.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_qmm, m) {
  m.doc() = "shardline's CPU kernel for MLX affine-quantized matmul";
  m.def("quantized_matmul", &shardline_qmm::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "x @ dequantize(w, scales, biases, group_size, bits).T on the CPU (bits 4 or 8; group 32/64/128).");
  m.def("quantized_matmul_many", &shardline_qmm::quantized_matmul_many, "x"_a, "ws"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "x against several weight sets of one format in one op (x prepared once); one output per set.");
  m.def("gather_qmm", &shardline_qmm::gather_qmm, "x"_a, "w"_a, "scales"_a, "biases"_a, "indices"_a,
        "group_size"_a, "bits"_a, "sorted_indices"_a = false,
        "mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True) on the CPU (affine, bits 4 "
        "or 8; group 32/64/128): each expert's pairs run as one product, its weights read once.");
  m.def("quantized_swiglu", &shardline_qmm::quantized_swiglu, "x"_a, "w_gate"_a, "s_gate"_a, "b_gate"_a,
        "w_up"_a, "s_up"_a, "b_up"_a, "group_size"_a, "bits"_a,
        "silu(x @ dequantize(gate).T) * (x @ dequantize(up).T) in one op (float32 x).");
  m.def("gguf_matmul", &shardline_qmm::gguf_matmul, "x"_a, "w"_a, "qtype"_a,
        "x @ dequantize(w).T -> float32 on the CPU, w (N, K / block * block_bytes) uint8 holding each row's GGUF "
        "blocks as stored (types Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14); x rounded to int8 per 32 "
        "below gguf_gemm_rows rows.");
  m.def("gguf_matmul_many", &shardline_qmm::gguf_matmul_many, "x"_a, "ws"_a, "qtypes"_a,
        "x against several GGUF weights, each of its own type, in one op (x rounded once); one output each.");
  m.def("gguf_swiglu", &shardline_qmm::gguf_swiglu, "x"_a, "w_gate"_a, "t_gate"_a, "w_up"_a, "t_up"_a,
        "silu(x @ gate.T) * (x @ up.T) -> float32 in one op, on GGUF weights.");
  m.def("gguf_rows", &shardline_qmm::gguf_rows, "w"_a, "ids"_a, "qtype"_a,
        "Rows ids of dequantize(w) -> float32 ids.shape + (K,), bit-equal to gguf.quants.dequantize (zeros for an "
        "id out of range).");
  m.def("gguf_block", &shardline_qmm::gguf_block, "qtype"_a, "(block_elements, block_bytes) of a GGUF type.");
  m.def("set_gguf_gemm_rows", &shardline_qmm::set_gguf_gemm_rows, "rows"_a,
        "From this many rows of x on, GGUF products dequantize tiles and use BLAS with x unrounded (0: never).");
  m.def("gguf_gemm_rows", &shardline_qmm::gguf_gemm_rows);
  m.def("gguf_supported", &shardline_qmm::gguf_supported, "qtype"_a, "Whether gguf_matmul reads this GGUF type.");
  m.def("set_threads", &shardline_qmm::set_threads, "n"_a, "min_bytes"_a = 32768,
        "Threads per product, the caller included (output rows split between them; 1: none); a product is "
        "split only where each thread gets at least min_bytes of weights.");
  m.def("threads", &shardline_qmm::threads, "Threads per product.");
  m.def("rms_norm", &shardline_qmm::rms_norm, "x"_a, "weight"_a, "eps"_a,
        "x * rsqrt(mean(x^2) + eps) * weight over the last axis, as one CPU op (float32).");
  m.def("rope_bthd", &shardline_qmm::rope_bthd, "x"_a, "offsets"_a, "dims"_a, "traditional"_a, "base"_a,
        "scale"_a, "head_dim"_a,
        "mx.fast.rope for x laid out (B, T, heads...), position offsets[b] + t, as one CPU op (float32).");
  m.def("decode_attention", &shardline_qmm::decode_attention, "q"_a, "keys"_a, "values"_a, "scale"_a,
        "One request's attention at one decode position over its cache's key and value segments (lists of "
        "(1, kv_heads, length_i, head_dim), read in place), as one CPU op (float32) -> (1, 1, heads * dim).");
  m.def("add_rms_norm", &shardline_qmm::add_rms_norm, "a"_a, "b"_a, "weight"_a, "eps"_a,
        "(a + b, rms_norm(a + b) * weight) as one CPU op (float32).");
  m.def("greedy", &shardline_qmm::greedy, "logits"_a,
        "(argmax, its log-probability) of 1-D float32 logits as one CPU op.");
  m.def("silu_mul", &shardline_qmm::silu_mul, "gate"_a, "up"_a, "silu(gate) * up as one CPU op (float32).");
  nb::class_<shardline_qmm::SumLink>(m, "SumLink",
                                     "A tensor-parallel group's streams as the group_sum op uses them.")
      .def(nb::init<std::vector<int>, bool, bool, double>(), "fds"_a, "face"_a, "pair"_a, "spin_s"_a)
      .def("error", &shardline_qmm::SumLink::error, "(kind, peer index, message); kind 0: none.")
      .def("drain", &shardline_qmm::SumLink::drain, "[(decode step, microseconds)] of the sums since the last call.");
  m.def("group_sum", &shardline_qmm::group_sum, "x"_a, "link"_a, "seq"_a, "index"_a, "deadline"_a, "small"_a,
        "The group's total of float32 x through link: sum `index` of step `seq` by `deadline` (monotonic()).");
  m.def("monotonic", &shardline_qmm::monotonic, "The clock deadlines are read on (seconds).");
  m.def("set_isa", &shardline_qmm::set_isa, "name"_a,
        "Use the named kernel set (auto, avx512, avx2, neon, scalar); False if this CPU or build lacks it.");
  m.def("isa", &shardline_qmm::isa, "The kernel set in use.");
  m.def("set_gemm_rows", &shardline_qmm::set_gemm_rows, "rows"_a,
        "From this many rows of x on, dequantize tiles and use BLAS (0: never).");
  m.def("gemm_rows", &shardline_qmm::gemm_rows);
  m.def("has_blas", &shardline_qmm::has_blas);
  m.def("set_integer", &shardline_qmm::set_integer, "on"_a,
        "Round x to int16 per block of 32 for the integer-dot kernels (where the CPU has them).");
  m.def("integer", &shardline_qmm::integer, "Whether the integer-dot kernels are in use.");
  // The MLX this module was compiled against: its C++ ABI is only promised within one release.
  m.attr("MLX_VERSION") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
                          std::to_string(MLX_VERSION_PATCH);
}
