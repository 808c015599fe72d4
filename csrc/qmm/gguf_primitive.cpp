#include "gguf_primitive.h"

#include <algorithm>
#include <atomic>
#include <sstream>
#include <stdexcept>
#include <string>

#include "gguf_kernel.h"
#include "mlx/ops.h"
#include "pool.h"
#include "primitive.h"
#include "product.h"
#include "small_op.h"
#include "util.h"

// As in primitive.cpp: MLX's own BLAS (or a preloaded OpenBLAS), weak so that a build without one still loads.
extern "C" __attribute__((weak)) void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                                                  float alpha, const float* a, int lda, const float* b,
                                                  int ldb, float beta, float* c, int ldc);

namespace shardline_qmm {

namespace {

constexpr int kTileRows = 64;  // rows of w dequantized per BLAS call, as the affine Gemm path does
std::atomic<int> g_gemm_rows{32};

bool float_dtype(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

std::string type_list() { return "Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14"; }

GgufBlock block_or_throw(const char* op, int qtype) {
  const GgufBlock b = gguf_block_of(qtype);
  if (!b.elements)
    throw std::invalid_argument(std::string(op) + ": GGUF type " + std::to_string(qtype) +
                                " is not supported (" + type_list() + ")");
  return b;
}

// K of w's rows, after checking w's shape for its type.
int weight_k(const char* op, const mx::array& w, int qtype) {
  const GgufBlock b = block_or_throw(op, qtype);
  std::ostringstream err;
  if (w.ndim() != 2 || w.dtype() != mx::uint8)
    err << "w must be a 2-D uint8 array of GGUF blocks (N rows, K / " << b.elements << " * " << b.bytes
        << " bytes each)";
  else if (w.shape(1) == 0 || w.shape(1) % b.bytes)
    err << "w's rows hold " << w.shape(1) << " bytes, not a whole number of " << b.bytes << "-byte blocks of type "
        << qtype;
  if (!err.str().empty()) throw std::invalid_argument(std::string(op) + ": " + err.str());
  return int(w.shape(1) / b.bytes * b.elements);
}

void check_x(const char* op, const mx::array& x, const mx::array& w, int qtype) {
  const int K = weight_k(op, w, qtype);
  std::ostringstream err;
  if (x.ndim() < 1 || !float_dtype(x.dtype()))
    err << "x must be a float32, float16 or bfloat16 array of at least 1 dimension";
  else if (x.shape(-1) != K)
    err << "x has " << x.shape(-1) << " columns, w's rows hold " << K << " elements";
  if (!err.str().empty()) throw std::invalid_argument(std::string(op) + ": " + err.str());
}

const GgufKernels& kernels() { return gguf_kernels_for(isa().c_str()); }

// x rounded for the integer kernels (thread-local buffers, valid until the next call on this thread).
GgufX round_x(const GgufKernels& k, const float* x, int M, int K) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int16_t> s16;
  q.resize(size_t(M) * K);
  d.resize(size_t(M) * (K / 32));
  s16.resize(size_t(M) * (K / 16));
  k.quantize(x, M, K, q.data(), d.data(), s16.data());
  return GgufX{q.data(), d.data(), s16.data()};
}

// x as rounded, back in float32: q * step per block of 32 (thread-local, valid until the next call).
const float* rounded_floats(const GgufX& xq, int M, int K) {
  thread_local std::vector<float> xr;
  xr.resize(size_t(M) * K);
  for (size_t i = 0, n = xr.size(); i < n; ++i) xr[i] = float(xq.q[i]) * xq.d[i / 32];
  return xr.data();
}

// y (M x N, row stride N) = x @ dequantize(w).T: on rounded x through the row kernels, or through BLAS over
// dequantized tiles (gemm; x there is the rounded x in float32).
void run(const GgufKernels& k, const float* xf, const GgufX& xq, bool gemm, int M, int K, const mx::array& w,
         int qtype, float* y) {
  const int N = w.shape(0);
  if (M == 0 || N == 0) return;
  thread_local std::vector<uint8_t> wb;
  GgufProblem p;
  p.x = xq;
  p.M = M;
  p.K = K;
  p.N = N;
  p.type = GgufType(qtype);
  p.w = contiguous_bytes(w, wb);
  p.row_bytes = size_t(w.shape(1));
  p.y = y;
  p.ldy = size_t(N);
  if (!gemm) {
    parallel_rows(N, 4, p.row_bytes, [&](int n0, int n1) { k.rows(p, n0, n1); });
    return;
  }
  parallel_rows(N, kTileRows, p.row_bytes * size_t(M), [&](int n0, int n1) {
    thread_local std::vector<float> tile;
    tile.resize(size_t(kTileRows) * K);
    for (int t0 = n0; t0 < n1; t0 += kTileRows) {
      const int t1 = std::min(n1, t0 + kTileRows);
      k.dequant(p, t0, t1, tile.data());
      cblas_sgemm(101 /* row major */, 111 /* no trans */, 112 /* trans */, M, t1 - t0, K, 1.0f, xf, K,
                  tile.data(), K, 0.0f, y + t0, N);
    }
  });
}

}  // namespace

std::pair<int, int> gguf_block(int qtype) {
  const GgufBlock b = block_or_throw("gguf_block", qtype);
  return {b.elements, b.bytes};
}

void set_gguf_gemm_rows(int rows) { g_gemm_rows.store(rows); }
int gguf_gemm_rows() { return g_gemm_rows.load(); }

bool gguf_supported(int qtype) { return gguf_block_of(qtype).elements != 0; }

void GgufMatmulCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  dispatch_cpu(stream(), inputs, outputs, [qtypes = qtypes_, swiglu = swiglu_](std::vector<mx::array>& ins,
                                                                               std::vector<mx::array>& outs) {
    const mx::array& x = ins[0];
    const int K = x.shape(-1);
    const int M = K ? int(x.size() / K) : 0;
    thread_local std::vector<float> xbuf;
    const float* xf = M ? float_rows(x, xbuf) : nullptr;
    const GgufKernels& k = kernels();
    const int from = g_gemm_rows.load(std::memory_order_relaxed);
    const bool gemm = from > 0 && M >= from && has_blas();
    // x is rounded once for every weight: a fused projection pays for it once. BLAS multiplies the rounded
    // values too, so that a row's product is the same function of x on either path (up to the order of
    // float sums): a prompt's rows then do not depend on how it was cut into chunks, or on a cached prefix.
    const GgufX xq = M ? round_x(k, xf, M, K) : GgufX{};
    if (gemm) xf = rounded_floats(xq, M, K);
    if (swiglu) {
      thread_local std::vector<float> up;
      up.resize(outs[0].size());
      float* y = outs[0].data<float>();
      run(k, xf, xq, gemm, M, K, ins[1], qtypes[0], y);
      run(k, xf, xq, gemm, M, K, ins[2], qtypes[1], up.data());
      for (size_t i = 0, n = up.size(); i < n; ++i) y[i] = y[i] / (1.0f + exp_approx(-y[i])) * up[i];
      return;
    }
    for (size_t i = 0; i < outs.size(); ++i) run(k, xf, xq, gemm, M, K, ins[1 + i], qtypes[i], outs[i].data<float>());
  });
}

void GgufMatmulCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("shardline's gguf_matmul runs on the CPU only");
}

bool GgufMatmulCPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GgufMatmulCPU&>(other);
  return qtypes_ == o.qtypes_ && swiglu_ == o.swiglu_;
}

std::vector<mx::Shape> GgufMatmulCPU::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  const size_t outs = swiglu_ ? 1 : inputs.size() - 1;
  for (size_t i = 0; i < outs; ++i) {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1 + i].shape(0);
    shapes.push_back(shape);
  }
  return shapes;
}

std::vector<mx::array> gguf_matmul_many(const mx::array& x, const std::vector<mx::array>& ws,
                                        const std::vector<int>& qtypes) {
  if (ws.empty() || ws.size() != qtypes.size())
    throw std::invalid_argument("gguf_matmul: one type per weight, at least one weight");
  std::vector<mx::array> inputs{x};
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < ws.size(); ++i) {
    check_x("gguf_matmul", x, ws[i], qtypes[i]);
    inputs.push_back(ws[i]);
    auto shape = x.shape();
    shape.back() = ws[i].shape(0);
    shapes.push_back(std::move(shape));
  }
  std::vector<mx::Dtype> dtypes(ws.size(), mx::float32);
  auto prim = std::make_shared<GgufMatmulCPU>(mx::default_stream(mx::Device::cpu), qtypes, false);
  return mx::array::make_arrays(std::move(shapes), dtypes, prim, inputs);
}

mx::array gguf_matmul(const mx::array& x, const mx::array& w, int qtype) { return gguf_matmul_many(x, {w}, {qtype})[0]; }

mx::array gguf_swiglu(const mx::array& x, const mx::array& w_gate, int t_gate, const mx::array& w_up, int t_up) {
  check_x("gguf_swiglu", x, w_gate, t_gate);
  check_x("gguf_swiglu", x, w_up, t_up);
  if (w_gate.shape(0) != w_up.shape(0))
    throw std::invalid_argument("gguf_swiglu: gate has " + std::to_string(w_gate.shape(0)) + " rows, up " +
                                std::to_string(w_up.shape(0)));
  auto shape = x.shape();
  shape.back() = w_gate.shape(0);
  auto prim = std::make_shared<GgufMatmulCPU>(mx::default_stream(mx::Device::cpu), std::vector<int>{t_gate, t_up}, true);
  return mx::array(std::move(shape), mx::float32, prim, {x, w_gate, w_up});
}

mx::array gguf_rows(const mx::array& w, const mx::array& ids, int qtype) {
  const int K = weight_k("gguf_rows", w, qtype);
  if (!mx::issubdtype(ids.dtype(), mx::integer))
    throw std::invalid_argument("gguf_rows: ids must be an integer array");
  auto shape = ids.shape();
  shape.push_back(K);
  const mx::array ids64 = mx::astype(ids, mx::int64);
  auto body = [qtype, K](const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    thread_local std::vector<uint8_t> wb;
    GgufProblem p;
    p.K = K;
    p.N = in[0].shape(0);
    p.type = GgufType(qtype);
    p.w = contiguous_bytes(in[0], wb);
    p.row_bytes = size_t(in[0].shape(1));
    const int64_t* id = dense<int64_t>(in, 1);
    float* out = outs[0].data<float>();
    const GgufKernels& scalar = gguf_kernels_scalar();  // the bit-equal dequantization
    for (size_t i = 0, n = in[1].size(); i < n; ++i) {
      float* o = out + i * size_t(K);
      if (id[i] < 0 || id[i] >= p.N)
        std::fill_n(o, K, 0.0f);
      else
        scalar.dequant(p, int(id[i]), int(id[i]) + 1, o);
    }
  };
  return one(shape, mx::float32, "ShardlineGgufRows", body, {w, ids64});
}

}  // namespace shardline_qmm
