#include "primitive.h"

#include <atomic>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "kernel.h"
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
std::atomic<int> g_gemm_rows{8};
std::atomic<bool> g_integer{true};
constexpr int kTileRows = 64;  // rows of w dequantized per BLAS call: 64 x K floats stay in L2

// A's elements in row-major order, whatever its strides (a rare path: MLX hands over contiguous arrays
// almost always).
const uint8_t* contiguous_bytes(const mx::array& a, std::vector<uint8_t>& buf) {
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

template <typename T>
void to_float(const T* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void from_float(const float* src, T* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

ScaleType scale_type(mx::Dtype t) {
  if (t == mx::float32) return ScaleType::F32;
  if (t == mx::float16) return ScaleType::F16;
  return ScaleType::BF16;
}

void run(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
         mx::array& out, int group_size, int bits) {
  const int K = x.shape(-1), N = w.shape(0);
  const int M = K ? int(x.size() / K) : 0;
  if (M == 0 || N == 0) return;
  thread_local std::vector<uint8_t> xb, wb, sbuf, bbuf;
  thread_local std::vector<float> xf, xp, ys, tile;
  const size_t mk = size_t(M) * K;

  const uint8_t* xbytes = contiguous_bytes(x, xb);
  const float* xrows;
  if (x.dtype() == mx::float32) {
    xrows = reinterpret_cast<const float*>(xbytes);
  } else {
    xf.resize(mk);
    if (x.dtype() == mx::float16)
      to_float(reinterpret_cast<const mx::float16_t*>(xbytes), xf.data(), mk);
    else
      to_float(reinterpret_cast<const mx::bfloat16_t*>(xbytes), xf.data(), mk);
    xrows = xf.data();
  }

  const Kernels* k = g_kernels.load(std::memory_order_relaxed);
  const int gemm_from = g_gemm_rows.load(std::memory_order_relaxed);
  const bool gemm = gemm_from > 0 && M >= gemm_from && cblas_sgemm;
  const bool integer = !gemm && k->int_rows && g_integer.load(std::memory_order_relaxed);
  if (bits == 4 && !integer) {
    xp.resize(mk);
    prepare_x(xrows, M, K, bits, xp.data());
    xrows = xp.data();
  }

  Problem p;
  p.x = xrows;
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
  if (out.dtype() == mx::float32) {
    p.y = out.data<float>();
  } else {
    ys.resize(size_t(M) * N);
    p.y = ys.data();
  }

  if (integer) {
    thread_local std::vector<int16_t> q16;
    thread_local std::vector<float> dx, xsum;
    q16.resize(mk);
    dx.resize(size_t(M) * (K / 32));
    xsum.resize(size_t(M) * (K / group_size));
    k->int_prepare(xrows, M, K, bits, group_size, q16.data(), dx.data(), xsum.data());
    QX xq;
    xq.q = q16.data();
    xq.dx = dx.data();
    xq.xsum = xsum.data();
    k->int_rows(p, xq, 0, N);
  } else if (gemm) {
    // Many rows: dequantize a tile of w once and let BLAS reuse it across all of them.
    tile.resize(size_t(kTileRows) * K);
    for (int n0 = 0; n0 < N; n0 += kTileRows) {
      const int n1 = std::min(N, n0 + kTileRows);
      k->dequant(p, n0, n1, tile.data());
      cblas_sgemm(101 /* row major */, 111 /* no trans */, 112 /* trans */, M, n1 - n0, K, 1.0f, p.x, K,
                  tile.data(), K, 0.0f, p.y + n0, int(p.ldy));
    }
  } else {
    k->rows(p, 0, N);
  }

  const size_t mn = size_t(M) * N;
  if (out.dtype() == mx::float16)
    from_float(p.y, out.data<mx::float16_t>(), mn);
  else if (out.dtype() == mx::bfloat16)
    from_float(p.y, out.data<mx::bfloat16_t>(), mn);
}

bool float_dtype(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

}  // namespace

void QuantizedMatmulCPU::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), w = mx::array::unsafe_weak_copy(inputs[1]),
                    s = mx::array::unsafe_weak_copy(inputs[2]), b = mx::array::unsafe_weak_copy(inputs[3]),
                    out = mx::array::unsafe_weak_copy(out), gs = group_size_, bits = bits_]() mutable {
    run(x, w, s, b, out, gs, bits);
  });
}

void QuantizedMatmulCPU::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("shardline's quantized_matmul runs on the CPU only");
}

bool QuantizedMatmulCPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmulCPU&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

std::vector<mx::Shape> QuantizedMatmulCPU::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits) {
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
  auto shape = x.shape();
  shape.back() = w.shape(0);
  const auto dtype = mx::promote_types(x.dtype(), scales.dtype());
  return mx::array(std::move(shape), dtype,
                   std::make_shared<QuantizedMatmulCPU>(mx::default_stream(mx::Device::cpu), group_size, bits),
                   {x, w, scales, biases});
}

bool set_isa(const std::string& name) {
  const Kernels* k = select_kernels(name.c_str());
  if (!k) return false;
  g_kernels.store(k);
  return true;
}

std::string isa() { return g_kernels.load()->name; }

void set_gemm_rows(int rows) { g_gemm_rows.store(rows); }
int gemm_rows() { return g_gemm_rows.load(); }
bool has_blas() { return cblas_sgemm != nullptr; }
void set_integer(bool on) { g_integer.store(on); }
bool integer() { return g_integer.load() && g_kernels.load()->int_rows; }

}  // namespace shardline_qmm
