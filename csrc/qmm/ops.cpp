#include "ops.h"

#include <cmath>
#include <cstring>
#include <algorithm>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "kernel.h"
#include "small_op.h"
#include "util.h"

namespace shardline_qmm {

namespace {

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
  auto body = [eps, D](const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    mx::array& out = outs[0];
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
  return one(x.shape(), mx::float32, "ShardlineRMSNorm", body, {x, w});
}

mx::array rope_bthd(const mx::array& x, const mx::array& offsets, int dims, bool traditional, float base,
                    float scale, int head_dim) {
  need_f32(x, "rope: x");
  if (x.ndim() < 3) throw std::invalid_argument("rope: x must be (B, T, ...) with heads in the trailing axes");
  const int B = x.shape(0), T = x.shape(1), D = head_dim;
  const int64_t F = B && T ? int64_t(x.size()) / (int64_t(B) * T) : 0;
  if (D <= 0 || F % D) throw std::invalid_argument("rope: the trailing axes must hold whole heads of head_dim");
  if (dims <= 0 || dims % 2 || dims > D) throw std::invalid_argument("rope: bad dims");
  if (offsets.dtype() != mx::int32 || offsets.ndim() > 1 || (offsets.size() != 1 && int(offsets.size()) != B))
    throw std::invalid_argument("rope: offsets must be int32, one per batch row or one for all");
  const int H = int(F / D), half = dims / 2;
  // MLX's inverse frequencies: exp(-i * log(base) / half), in float32.
  std::vector<float> inv(half);
  const float step = std::log(base) / float(half);
  for (int i = 0; i < half; ++i) inv[i] = std::exp(-float(i) * step);
  auto body = [B, T, H, D, half, traditional, scale, inv](const std::vector<mx::array>& in,
                                                          std::vector<mx::array>& outs) {
    mx::array& out = outs[0];
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
  return one(x.shape(), mx::float32, "ShardlineRoPE", body, {x, offsets});
}

mx::array decode_attention(const mx::array& q, const std::vector<mx::array>& keys,
                           const std::vector<mx::array>& values, float scale) {
  need_f32(q, "attention: q");
  if (keys.empty() || keys.size() != values.size())
    throw std::invalid_argument("attention: keys and values must be as many segments, at least one");
  const int Hkv = keys[0].ndim() == 4 ? keys[0].shape(1) : 0, D = keys[0].ndim() == 4 ? keys[0].shape(3) : 0;
  for (size_t s = 0; s < keys.size(); ++s) {
    need_f32(keys[s], "attention: keys");
    need_f32(values[s], "attention: values");
    const auto& k = keys[s];
    if (k.ndim() != 4 || k.shape(0) != 1 || k.shape(1) != Hkv || k.shape(3) != D || values[s].shape() != k.shape())
      throw std::invalid_argument(
          "attention: keys and values must be segments (1, kv_heads, length, head_dim) of one kv_heads and head_dim");
  }
  if (q.size() % D || (q.size() / D) % Hkv) throw std::invalid_argument("attention: q must hold whole heads");
  const int H = int(q.size() / D), rep = H / Hkv;
  // Nothing sized by the segments is captured: the body is copied at every evaluation.
  auto body = [Hkv, D, H, rep, scale](const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    // Inputs: q, then the key segments, then the value segments; each segment a view into a cache's block
    // (1, kv_heads, len, head_dim) with strided heads and rows.
    const float* qs = dense<float>(in, 0);
    const size_t S = (in.size() - 1) / 2;
    thread_local std::vector<int> lens;
    lens.resize(S);
    int L = 0;
    for (size_t s = 0; s < S; ++s) L += (lens[s] = in[1 + s].shape(2));
    struct Seg {
      const float *k, *v;
      int64_t kh, kl, vh, vl;
    };
    thread_local std::vector<Seg> segs;
    thread_local std::vector<float> p, gathered;
    segs.resize(S);
    size_t gather_floats = 0;
    for (size_t s = 0; s < S; ++s) {
      const auto &k = in[1 + s], &v = in[1 + S + s];
      if (k.strides()[3] != 1 || v.strides()[3] != 1) gather_floats += size_t(2) * Hkv * lens[s] * D;
    }
    gathered.resize(gather_floats);
    float* spare = gathered.data();
    for (size_t s = 0; s < S; ++s) {
      const auto &k = in[1 + s], &v = in[1 + S + s];
      const int len = lens[s];
      Seg& g = segs[s];
      g = {k.data<float>(), v.data<float>(), k.strides()[1], k.strides()[2], v.strides()[1], v.strides()[2]};
      if (k.strides()[3] == 1 && v.strides()[3] == 1) continue;
      // head_dim itself strided (not seen from the caches): gather the segment into rows.
      float *kb = spare, *vb = spare + size_t(Hkv) * len * D;
      spare += size_t(2) * Hkv * len * D;
      for (int h = 0; h < Hkv; ++h)
        for (int l = 0; l < len; ++l)
          for (int d = 0; d < D; ++d) {
            kb[(size_t(h) * len + l) * D + d] = g.k[h * g.kh + l * g.kl + d * k.strides()[3]];
            vb[(size_t(h) * len + l) * D + d] = g.v[h * g.vh + l * g.vl + d * v.strides()[3]];
          }
      g = {kb, vb, int64_t(len) * D, D, int64_t(len) * D, D};
    }
    float* out = outs[0].data<float>();
    // The scores of each KV head's query heads, their softmax, their mix of the values, with the chosen
    // CPU's vector kernels. The scores of KV head h lie at p + h * rep * L, segment s's at rep * (its first
    // position) within, as rep rows of its length. Positions are visited in order for every head, so a
    // list of segments computes the bits of their concatenation. Segments are walked outermost: a paged
    // cache's block holds every head's rows in one stretch of memory, read front to back, where a walk
    // head by head jumps from block to block (measured about a tenth slower over blocks of 128 positions).
    const Kernels& kern = current_kernels();
    p.resize(size_t(H) * L);
    std::fill_n(out, size_t(H) * D, 0.0f);
    // Plain pointers for the loops: thread_local storage may be reached through a call in a shared library.
    const int* len = lens.data();
    const Seg* sg = segs.data();
    float* ps = p.data();
    const size_t head_scores = size_t(rep) * L;
    for (size_t s = 0, at = 0; s < S; at += len[s++])
      for (int h = 0; h < Hkv; ++h)
        kern.scores(qs + size_t(h) * rep * D, rep, D, sg[s].k + h * sg[s].kh, sg[s].kl, len[s], scale,
                    ps + h * head_scores + rep * at);
    for (int h = 0; h < Hkv; ++h)
      for (int r = 0; r < rep; ++r) {
        float* ph = ps + h * head_scores;
        float m = -INFINITY;
        for (size_t s = 0, at = 0; s < S; at += len[s++]) {
          const float* pr = ph + rep * at + size_t(r) * len[s];
          for (int l = 0, n = len[s]; l < n; ++l) m = std::fmax(m, pr[l]);
        }
        float total = 0.0f;
        for (size_t s = 0, at = 0; s < S; at += len[s++]) {
          float* pr = ph + rep * at + size_t(r) * len[s];
          for (int l = 0, n = len[s]; l < n; ++l) total += (pr[l] = exp_approx(pr[l] - m));
        }
        const float inv = 1.0f / total;
        for (size_t s = 0, at = 0; s < S; at += len[s++]) {
          float* pr = ph + rep * at + size_t(r) * len[s];
          for (int l = 0, n = len[s]; l < n; ++l) pr[l] *= inv;
        }
      }
    for (size_t s = 0, at = 0; s < S; at += len[s++])
      for (int h = 0; h < Hkv; ++h)
        kern.mix(ps + h * head_scores + rep * at, rep, D, sg[s].v + h * sg[s].vh, sg[s].vl, len[s],
                 out + size_t(h) * rep * D);
  };
  std::vector<mx::array> inputs{q};
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  return one({1, 1, H * D}, mx::float32, "ShardlineDecodeAttention", body, std::move(inputs));
}

mx::array decode_attention(const mx::array& q, const mx::array& keys, const mx::array& values, float scale) {
  return decode_attention(q, std::vector<mx::array>{keys}, std::vector<mx::array>{values}, scale);
}

std::vector<mx::array> add_rms_norm(const mx::array& a, const mx::array& b, const mx::array& w, float eps) {
  need_f32(a, "add_rms_norm: a");
  need_f32(b, "add_rms_norm: b");
  need_f32(w, "add_rms_norm: weight");
  if (a.shape() != b.shape() || w.ndim() != 1 || a.ndim() < 1 || w.shape(0) != a.shape(-1))
    throw std::invalid_argument("add_rms_norm: a and b of one shape, weight 1-D with their last dimension");
  const int D = a.shape(-1);
  auto body = [eps, D](const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const float* as = dense<float>(in, 0);
    const float* bs = dense<float>(in, 1);
    const float* ws = dense<float>(in, 2);
    float* hs = outs[0].data<float>();
    float* ys = outs[1].data<float>();
    const size_t rows = D ? in[0].size() / D : 0;
    for (size_t r = 0; r < rows; ++r) {
      float* hr = hs + r * D;
      float ss = 0.0f;
      for (int i = 0; i < D; ++i) {
        hr[i] = as[r * D + i] + bs[r * D + i];
        ss += hr[i] * hr[i];
      }
      const float inv = 1.0f / std::sqrt(ss / float(D) + eps);
      for (int i = 0; i < D; ++i) ys[r * D + i] = (hr[i] * inv) * ws[i];
    }
  };
  auto prim = std::make_shared<SmallOp>(cpu(), "ShardlineAddRMSNorm", body);
  return mx::array::make_arrays({a.shape(), a.shape()}, {mx::float32, mx::float32}, prim, {a, b, w});
}

std::vector<mx::array> greedy(const mx::array& logits) {
  need_f32(logits, "greedy: logits");
  if (logits.ndim() != 1 || logits.size() == 0) throw std::invalid_argument("greedy: logits must be 1-D");
  auto body = [](const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const float* x = dense<float>(in, 0);
    const size_t n = in[0].size();
    // Sixteen partial maxima and sums: loops the compiler vectorises without reassociating anything itself.
    constexpr size_t W = 16;
    float part[W];
    std::fill_n(part, W, -INFINITY);
    size_t i = 0;
    for (; i + W <= n; i += W)
      for (size_t j = 0; j < W; ++j) part[j] = part[j] > x[i + j] ? part[j] : x[i + j];
    float m = -INFINITY;
    for (size_t j = 0; j < W; ++j) m = part[j] > m ? part[j] : m;
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    size_t best = 0;
    while (best < n && !(x[best] == m)) ++best;  // the first of equal maxima, as argmax
    if (best == n) best = 0;  // all NaN
    float total = 0.0f;
    if (std::isfinite(m)) {
      std::fill_n(part, W, 0.0f);
      for (i = 0; i + W <= n; i += W)
        for (size_t j = 0; j < W; ++j) part[j] += exp_approx(x[i + j] - m);
      for (size_t j = 0; j < W; ++j) total += part[j];
      for (; i < n; ++i) total += exp_approx(x[i] - m);
    }
    outs[0].data<int32_t>()[0] = int32_t(best);
    outs[1].data<float>()[0] = std::isfinite(m) ? -std::log(total) : (m > 0 ? NAN : -INFINITY);
  };
  auto prim = std::make_shared<SmallOp>(cpu(), "ShardlineGreedy", body);
  return mx::array::make_arrays({{}, {}}, {mx::int32, mx::float32}, prim, {logits});
}

mx::array silu_mul(const mx::array& gate, const mx::array& up) {
  need_f32(gate, "silu_mul: gate");
  need_f32(up, "silu_mul: up");
  if (gate.shape() != up.shape()) throw std::invalid_argument("silu_mul: gate and up must have one shape");
  auto body = [](const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    mx::array& out = outs[0];
    const float* g = dense<float>(in, 0);
    const float* u = dense<float>(in, 1);
    float* y = out.data<float>();
    for (size_t i = 0, n = out.size(); i < n; ++i) y[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
  };
  return one(gate.shape(), mx::float32, "ShardlineSiluMul", body, {gate, up});
}

}  // namespace shardline_qmm
