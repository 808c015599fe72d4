#include "primitive.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "kernel.h"
#include "pool.h"
#include "product.h"
#include "small_op.h"
#include "util.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/stream.h"
#include "mlx/types/half_types.h"

// Resolved from the BLAS that MLX itself links (or OpenBLAS when preloaded); weak so that a platform
// without one still loads the module and keeps to the row kernels.
extern "C" __attribute__((weak)) void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                                                  float alpha, const float* a, int lda, const float* b,
                                                  int ldb, float beta, float* c, int ldc);

namespace shardline_qmm {

namespace {

std::atomic<const Kernels*> g_kernels{select_kernels("auto")};
std::atomic<int> g_gemm_rows{16};
std::atomic<bool> g_integer{true};
constexpr int kTileRows = 64;  // rows of w dequantized per BLAS call: 64 x K floats stay in L2

template <typename T>
void to_float(const T* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void from_float(const float* src, T* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// x as the chosen kernel path reads it (thread-local buffers, valid until the next call on this thread).
struct PreparedX {
  int M = 0, K = 0;
  Path path = Path::Float;
  Prepared rows;
};

PreparedX prepare(const mx::array& x, int group_size, int bits) {
  PreparedX px;
  px.K = x.shape(-1);
  px.M = px.K ? int(x.size() / px.K) : 0;
  if (px.M == 0) return px;
  thread_local std::vector<float> xf, xp, dx, xsum;
  thread_local std::vector<int16_t> q16;
  px.path = path_for(px.M);
  px.rows = prepare_rows(float_rows(x, xf), px.M, px.K, group_size, bits, px.path, xp, q16, dx, xsum);
  return px;
}

// y (M x N floats, row stride N) = px @ dequantize(w, scales, biases).T, px from prepare() for the same
// group size and bits.
void run(const PreparedX& px, const mx::array& w, const mx::array& scales, const mx::array& biases, float* y,
         int group_size, int bits) {
  const int M = px.M, K = px.K, N = w.shape(0);
  if (M == 0 || N == 0) return;
  thread_local std::vector<uint8_t> wb, sbuf, bbuf;
  Problem p;
  p.x = px.rows.rows;
  p.M = M;
  p.K = K;
  p.N = N;
  p.w = contiguous_bytes(w, wb);
  p.scales = contiguous_bytes(scales, sbuf);
  p.biases = contiguous_bytes(biases, bbuf);
  p.stype = scale_type(scales.dtype());
  p.group_size = group_size;
  p.bits = bits;
  p.ldy = size_t(N);
  p.y = y;
  run_problem(p, px.rows.q, px.path);
}

// out = px @ dequantize(w, scales, biases).T in out's dtype.
void run(const PreparedX& px, const mx::array& w, const mx::array& scales, const mx::array& biases,
         mx::array& out, int group_size, int bits) {
  if (out.dtype() == mx::float32) {
    run(px, w, scales, biases, out.data<float>(), group_size, bits);
    return;
  }
  thread_local std::vector<float> ys;
  ys.resize(out.size());
  run(px, w, scales, biases, ys.data(), group_size, bits);
  store(ys.data(), out, 0, ys.size());
}

bool float_dtype(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

}  // namespace

Path path_for(int M) {
  const Kernels* k = g_kernels.load(std::memory_order_relaxed);
  const int gemm_from = g_gemm_rows.load(std::memory_order_relaxed);
  if (gemm_from > 0 && M >= gemm_from && cblas_sgemm) return Path::Gemm;
  return k->int_rows && g_integer.load(std::memory_order_relaxed) ? Path::Integer : Path::Float;
}

ScaleType scale_type(mx::Dtype t) {
  if (t == mx::float32) return ScaleType::F32;
  if (t == mx::float16) return ScaleType::F16;
  return ScaleType::BF16;
}

const float* float_rows(const mx::array& x, std::vector<float>& buf) {
  thread_local std::vector<uint8_t> xb;
  const uint8_t* bytes = contiguous_bytes(x, xb);
  if (x.dtype() == mx::float32) return reinterpret_cast<const float*>(bytes);
  buf.resize(x.size());
  if (x.dtype() == mx::float16)
    to_float(reinterpret_cast<const mx::float16_t*>(bytes), buf.data(), x.size());
  else
    to_float(reinterpret_cast<const mx::bfloat16_t*>(bytes), buf.data(), x.size());
  return buf.data();
}

Prepared prepare_rows(const float* x, int M, int K, int group_size, int bits, Path path, std::vector<float>& xp,
                      std::vector<int16_t>& q16, std::vector<float>& dx, std::vector<float>& xsum) {
  Prepared px;
  px.rows = x;
  const size_t mk = size_t(M) * K;
  if (path == Path::Integer) {
    q16.resize(mk);
    dx.resize(size_t(M) * (K / 32));
    xsum.resize(size_t(M) * (K / group_size));
    g_kernels.load(std::memory_order_relaxed)->int_prepare(x, M, K, bits, group_size, q16.data(), dx.data(),
                                                           xsum.data());
    px.q.q = q16.data();
    px.q.dx = dx.data();
    px.q.xsum = xsum.data();
  } else if (bits == 4) {
    xp.resize(mk);
    prepare_x(x, M, K, bits, xp.data());
    px.rows = xp.data();
  }
  return px;
}

void run_problem(const Problem& p, const QX& xq, Path path) {
  if (p.M == 0 || p.N == 0) return;
  const Kernels* k = g_kernels.load(std::memory_order_relaxed);
  const size_t row_bytes = size_t(p.K) * p.bits / 8;
  if (path == Path::Integer) {
    parallel_rows(p.N, 4, row_bytes, [&](int n0, int n1) { k->int_rows(p, xq, n0, n1); });
  } else if (path == Path::Gemm) {
    // Many rows: dequantize a tile of w once and let BLAS reuse it across all of them. Threads take whole
    // tiles, so that each output element comes from the same BLAS call whatever the thread count.
    parallel_rows(p.N, kTileRows, row_bytes * size_t(p.M), [&](int c0, int c1) {
      thread_local std::vector<float> tile;
      tile.resize(size_t(kTileRows) * p.K);
      for (int n0 = c0; n0 < c1; n0 += kTileRows) {
        const int n1 = std::min(c1, n0 + kTileRows);
        k->dequant(p, n0, n1, tile.data());
        cblas_sgemm(101 /* row major */, 111 /* no trans */, 112 /* trans */, p.M, n1 - n0, p.K, 1.0f, p.x, p.K,
                    tile.data(), p.K, 0.0f, p.y + n0, int(p.ldy));
      }
    });
  } else {
    parallel_rows(p.N, 4, row_bytes, [&](int n0, int n1) { k->rows(p, n0, n1); });
  }
}

void store(const float* y, mx::array& out, size_t at, size_t n) {
  if (out.dtype() == mx::float32)
    std::memcpy(out.data<float>() + at, y, n * sizeof(float));
  else if (out.dtype() == mx::float16)
    from_float(y, out.data<mx::float16_t>() + at, n);
  else
    from_float(y, out.data<mx::bfloat16_t>() + at, n);
}

void QuantizedMatmulCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  dispatch_cpu(stream(), inputs, outputs, [gs = group_size_, bits = bits_, swiglu = swiglu_](
                                               std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    // x is prepared once for every weight set: a fused projection pays for it once.
    const PreparedX px = prepare(ins[0], gs, bits);
    if (swiglu) {  // silu(x @ gate.T) * (x @ up.T), float32
      thread_local std::vector<float> up;
      up.resize(outs[0].size());
      float* y = outs[0].data<float>();
      run(px, ins[1], ins[2], ins[3], y, gs, bits);
      run(px, ins[4], ins[5], ins[6], up.data(), gs, bits);
      for (size_t i = 0, n = up.size(); i < n; ++i) y[i] = y[i] / (1.0f + exp_approx(-y[i])) * up[i];
      return;
    }
    for (size_t i = 0; i < outs.size(); ++i) run(px, ins[1 + 3 * i], ins[2 + 3 * i], ins[3 + 3 * i], outs[i], gs, bits);
  });
}

void QuantizedMatmulCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("shardline's quantized_matmul runs on the CPU only");
}

bool QuantizedMatmulCPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmulCPU&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && swiglu_ == o.swiglu_;
}

std::vector<mx::Shape> QuantizedMatmulCPU::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  if (swiglu_) {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
  for (size_t i = 1; i + 2 < inputs.size(); i += 3) {
    auto shape = inputs[0].shape();
    shape.back() = inputs[i].shape(0);
    shapes.push_back(shape);
  }
  return shapes;
}

namespace {

void check(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
           int group_size, int bits) {
  std::ostringstream err;
  if (!supported_bits(bits)) {
    err << "bits " << bits << " is not supported (4 or 8)";
  } else if (group_size != 32 && group_size != 64 && group_size != 128) {
    err << "group_size " << group_size << " is not supported (32, 64 or 128)";
  } else if (w.ndim() != 2 || w.dtype() != mx::uint32) {
    err << "w must be a 2-D uint32 array";
  } else if (x.ndim() < 1 || !float_dtype(x.dtype())) {
    err << "x must be a float32, float16 or bfloat16 array of at least 1 dimension";
  } else if (!float_dtype(scales.dtype()) || scales.dtype() != biases.dtype()) {
    err << "scales and biases must share one of float32, float16, bfloat16";
  } else {
    const int K = x.shape(-1), N = w.shape(0);
    const int64_t packed = int64_t(K) * bits / 32;
    if (K % group_size != 0 || w.shape(1) != packed)
      err << "x has " << K << " columns, w holds " << w.shape(1) * 32 / bits << " per row";
    else if (scales.ndim() != 2 || scales.shape(0) != N || scales.shape(1) != K / group_size ||
             biases.shape() != scales.shape())
      err << "scales and biases must be (" << N << ", " << K / group_size << ")";
  }
  if (!err.str().empty()) throw std::invalid_argument("quantized_matmul: " + err.str());
}

}  // namespace

std::vector<mx::array> quantized_matmul_many(const mx::array& x, const std::vector<mx::array>& ws,
                                             const std::vector<mx::array>& scales,
                                             const std::vector<mx::array>& biases, int group_size, int bits) {
  if (ws.empty() || ws.size() != scales.size() || ws.size() != biases.size())
    throw std::invalid_argument("quantized_matmul: as many scales and biases as weights, at least one");
  std::vector<mx::array> inputs{x};
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (size_t i = 0; i < ws.size(); ++i) {
    check(x, ws[i], scales[i], biases[i], group_size, bits);
    inputs.insert(inputs.end(), {ws[i], scales[i], biases[i]});
    auto shape = x.shape();
    shape.back() = ws[i].shape(0);
    shapes.push_back(std::move(shape));
    dtypes.push_back(mx::promote_types(x.dtype(), scales[i].dtype()));
  }
  auto prim = std::make_shared<QuantizedMatmulCPU>(mx::default_stream(mx::Device::cpu), group_size, bits);
  return mx::array::make_arrays(std::move(shapes), dtypes, prim, inputs);
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits) {
  return quantized_matmul_many(x, {w}, {scales}, {biases}, group_size, bits)[0];
}

mx::array quantized_swiglu(const mx::array& x, const mx::array& w_gate, const mx::array& s_gate,
                           const mx::array& b_gate, const mx::array& w_up, const mx::array& s_up,
                           const mx::array& b_up, int group_size, int bits) {
  check(x, w_gate, s_gate, b_gate, group_size, bits);
  check(x, w_up, s_up, b_up, group_size, bits);
  if (x.dtype() != mx::float32 || s_gate.dtype() != s_up.dtype() || w_gate.shape(0) != w_up.shape(0))
    throw std::invalid_argument("quantized_swiglu: float32 x, gate and up of one shape and scale dtype");
  auto shape = x.shape();
  shape.back() = w_gate.shape(0);
  auto prim = std::make_shared<QuantizedMatmulCPU>(mx::default_stream(mx::Device::cpu), group_size, bits, true);
  return mx::array(std::move(shape), mx::float32, prim, {x, w_gate, s_gate, b_gate, w_up, s_up, b_up});
}

bool set_isa(const std::string& name) {
  const Kernels* k = select_kernels(name.c_str());
  if (!k) return false;
  g_kernels.store(k);
  return true;
}

std::string isa() { return g_kernels.load()->name; }

const Kernels& current_kernels() { return *g_kernels.load(std::memory_order_relaxed); }

void set_gemm_rows(int rows) { g_gemm_rows.store(rows); }
int gemm_rows() { return g_gemm_rows.load(); }
bool has_blas() { return cblas_sgemm != nullptr; }
void set_integer(bool on) { g_integer.store(on); }
bool integer() { return g_integer.load() && g_kernels.load()->int_rows; }

}  // namespace shardline_qmm
