#include "ops.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "util.h"

namespace shardline_qmm {

namespace {

using Body = std::function<void(const std::vector<mx::array>&, mx::array&)>;

// A CPU-only primitive whose work is `body` on contiguous float32 inputs.
class SmallOp : public mx::UnaryPrimitive {
 public:
  SmallOp(mx::Stream s, const char* name, Body body) : mx::UnaryPrimitive(s), name_(name), body_(std::move(body)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> ins;
    for (const auto& in : inputs) {
      encoder.set_input_array(in);
      ins.push_back(mx::array::unsafe_weak_copy(in));
    }
    encoder.set_output_array(out);
    encoder.dispatch([ins = std::move(ins), out = mx::array::unsafe_weak_copy(out), body = body_]() mutable {
      body(ins, out);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string("shardline's ") + name_ + " runs on the CPU only");
  }
  const char* name() const override { return name_; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  const char* name_;
  Body body_;
};

mx::Stream cpu() { return mx::default_stream(mx::Device::cpu); }

// e^x in float32 from arithmetic alone, so that loops over it vectorise (std::exp does not): 2^(x log2 e)
// as 2^whole (exponent bits) times a degree-6 polynomial of the fraction, within 2e-7 relative; the argument
// is clamped to [-87, 88] (silu needs neither 0 nor inf from it).
inline float exp_approx(float x) {
  x = std::fmin(std::fmax(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f;
  const float whole = std::floor(t);
  const float f = t - whole;  // [0, 1)
  float p = 2.154050929e-4f;  // a relative least-squares fit of 2^f on [0, 1): 1e-7 in float32
  p = p * f + 1.248288192e-3f;
  p = p * f + 9.674545855e-3f;
  p = p * f + 5.548532248e-2f;
  p = p * f + 2.402294002e-1f;
  p = p * f + 6.931470282e-1f;
  p = p * f + 1.0f;
  int32_t bits = (int32_t(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Input i's elements in row-major order (copied only where it is a strided view).
template <typename T>
const T* dense(const std::vector<mx::array>& in, size_t i) {
  thread_local std::vector<uint8_t> bufs[3];
  return reinterpret_cast<const T*>(contiguous_bytes(in[i], bufs[i]));
}

void need_f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(what) + " must be float32");
}

}  // namespace

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  need_f32(x, "rms_norm: x");
  need_f32(w, "rms_norm: weight");
  if (x.ndim() < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm: weight must be 1-D with x's last dimension");
  const int D = x.shape(-1);
  auto body = [eps, D](const std::vector<mx::array>& in, mx::array& out) {
    const float* xs = dense<float>(in, 0);
    const float* ws = dense<float>(in, 1);
    float* ys = out.data<float>();
    const size_t rows = D ? in[0].size() / D : 0;
    for (size_t r = 0; r < rows; ++r) {
      const float* xr = xs + r * D;
      float* yr = ys + r * D;
      float ss = 0.0f;
      for (int i = 0; i < D; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / float(D) + eps);
      for (int i = 0; i < D; ++i) yr[i] = (xr[i] * inv) * ws[i];
    }
  };
  return mx::array(x.shape(), mx::float32, std::make_shared<SmallOp>(cpu(), "ShardlineRMSNorm", body),
                   {x, w});
}

mx::array rope_bthd(const mx::array& x, const mx::array& offsets, int dims, bool traditional, float base,
                    float scale) {
  need_f32(x, "rope: x");
  if (x.ndim() != 4) throw std::invalid_argument("rope: x must be (B, T, H, D)");
  if (dims <= 0 || dims % 2 || dims > x.shape(3)) throw std::invalid_argument("rope: bad dims");
  if (offsets.dtype() != mx::int32 || offsets.ndim() > 1 || (offsets.size() != 1 && int(offsets.size()) != x.shape(0)))
    throw std::invalid_argument("rope: offsets must be int32, one per batch row or one for all");
  const int B = x.shape(0), T = x.shape(1), H = x.shape(2), D = x.shape(3), half = dims / 2;
  // MLX's inverse frequencies: exp(-i * log(base) / half), in float32.
  std::vector<float> inv(half);
  const float step = std::log(base) / float(half);
  for (int i = 0; i < half; ++i) inv[i] = std::exp(-float(i) * step);
  auto body = [B, T, H, D, half, traditional, scale, inv](const std::vector<mx::array>& in, mx::array& out) {
    const float* xs = dense<float>(in, 0);
    const int32_t* off = dense<int32_t>(in, 1);
    const bool per_row = in[1].size() > 1;
    float* ys = out.data<float>();
    std::vector<float> c(half), s(half);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) {
        const float pos = float((per_row ? off[b] : off[0]) + t) * scale;
        for (int i = 0; i < half; ++i) {
          const float theta = pos * inv[i];
          c[i] = std::cos(theta);
          s[i] = std::sin(theta);
        }
        for (int h = 0; h < H; ++h) {
          const size_t base_idx = ((size_t(b) * T + t) * H + h) * D;
          const float* xr = xs + base_idx;
          float* yr = ys + base_idx;
          for (int i = 0; i < half; ++i) {
            const int a = traditional ? 2 * i : i, z = traditional ? 2 * i + 1 : i + half;
            const float x1 = xr[a], x2 = xr[z];
            yr[a] = x1 * c[i] - x2 * s[i];
            yr[z] = x1 * s[i] + x2 * c[i];
          }
          for (int i = 2 * half; i < D; ++i) yr[i] = xr[i];
        }
      }
  };
  return mx::array(x.shape(), mx::float32, std::make_shared<SmallOp>(cpu(), "ShardlineRoPE", body),
                   {x, offsets});
}

mx::array silu_mul(const mx::array& gate, const mx::array& up) {
  need_f32(gate, "silu_mul: gate");
  need_f32(up, "silu_mul: up");
  if (gate.shape() != up.shape()) throw std::invalid_argument("silu_mul: gate and up must have one shape");
  auto body = [](const std::vector<mx::array>& in, mx::array& out) {
    const float* g = dense<float>(in, 0);
    const float* u = dense<float>(in, 1);
    float* y = out.data<float>();
    for (size_t i = 0, n = out.size(); i < n; ++i) y[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
  };
  return mx::array(gate.shape(), mx::float32, std::make_shared<SmallOp>(cpu(), "ShardlineSiluMul", body),
                   {gate, up});
}

}  // namespace shardline_qmm
