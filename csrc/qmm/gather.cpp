#include "gather.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "kernel.h"
#include "mlx/ops.h"
#include "mlx/utils.h"
#include "product.h"
#include "small_op.h"
#include "util.h"

namespace shardline_qmm {

namespace {

mx::Shape batch_shape(const mx::array& x, const mx::array& indices) {
  const mx::Shape xb(x.shape().begin(), x.shape().end() - 2);
  return mx::broadcast_shapes(xb, indices.shape());
}

// Each output block's x block (flat index over x's batch axes) and expert, in the output's order.
void pairs(const mx::array& x, const mx::array& idx, const mx::Shape& B, std::vector<int64_t>& lhs,
           std::vector<int64_t>& rhs) {
  const int nd = int(B.size());
  size_t P = 1;
  for (int d : B) P *= size_t(d);
  lhs.resize(P);
  rhs.resize(P);
  // Strides (in elements) of x's batch axes and of the indices over B's axes, 0 where broadcast.
  std::vector<int64_t> xs(nd, 0), is(nd, 0);
  const int xnd = int(x.ndim()) - 2, ind = int(idx.ndim());
  for (int d = nd - 1, xd = xnd - 1, step = 1; d >= 0 && xd >= 0; --d, --xd) {
    xs[d] = x.shape(xd) == 1 ? 0 : step;
    step *= x.shape(xd);
  }
  for (int d = nd - 1, id = ind - 1; d >= 0 && id >= 0; --d, --id) is[d] = idx.shape(id) == 1 ? 0 : idx.strides()[id];
  const bool is_signed = idx.dtype() == mx::int32;
  const uint32_t* iu = idx.data<uint32_t>();  // same bytes for int32
  std::vector<int> at(nd, 0);
  int64_t xo = 0, io = 0;
  for (size_t p = 0; p < P; ++p) {
    lhs[p] = xo;
    rhs[p] = is_signed ? int64_t(int32_t(iu[io])) : int64_t(iu[io]);
    for (int d = nd - 1; d >= 0; --d) {
      xo += xs[d];
      io += is[d];
      if (++at[d] < B[d]) break;
      xo -= xs[d] * B[d];
      io -= is[d] * B[d];
      at[d] = 0;
    }
  }
}

void gather_eval(const std::vector<mx::array>& ins, mx::array& out, int group_size, int bits) {
  const mx::array &x = ins[0], &w = ins[1], &scales = ins[2], &biases = ins[3], &idx = ins[4];
  const int K = x.shape(-1), M = x.shape(-2), E = w.shape(0), N = w.shape(1), G = K / group_size;
  const mx::Shape B(out.shape().begin(), out.shape().end() - 2);
  thread_local std::vector<int64_t> lhs, rhs;
  pairs(x, idx, B, lhs, rhs);
  const size_t P = lhs.size(), block = size_t(M) * N;
  if (P == 0 || block == 0) return;

  // The pairs grouped by expert, each group in output order (a stable counting sort).
  thread_local std::vector<size_t> first, order;
  first.assign(size_t(E) + 2, 0);
  for (size_t p = 0; p < P; ++p) ++first[(rhs[p] >= 0 && rhs[p] < E ? rhs[p] : E) + 1];
  for (int e = 0; e <= E; ++e) first[e + 1] += first[e];
  order.resize(P);
  {
    thread_local std::vector<size_t> fill;
    fill.assign(first.begin(), first.end() - 1);
    for (size_t p = 0; p < P; ++p) order[fill[rhs[p] >= 0 && rhs[p] < E ? rhs[p] : E]++] = p;
  }

  thread_local std::vector<float> xf, xg, xp, dx, xsum, ys;
  thread_local std::vector<int16_t> q16;
  thread_local std::vector<uint8_t> wb, sb, bb;
  const float* xrows = float_rows(x, xf);
  const size_t row_bytes = size_t(K) * bits / 8, sb_bytes = size_t(G) * scales.itemsize();
  Problem p;
  p.K = K;
  p.N = N;
  p.w = contiguous_bytes(w, wb);
  p.scales = contiguous_bytes(scales, sb);
  p.biases = contiguous_bytes(biases, bb);
  p.stype = scale_type(scales.dtype());
  p.group_size = group_size;
  p.bits = bits;
  p.ldy = size_t(N);
  const auto* w0 = p.w;
  const auto* s0 = static_cast<const uint8_t*>(p.scales);
  const auto* b0 = static_cast<const uint8_t*>(p.biases);
  const bool direct_out = out.dtype() == mx::float32;

  for (int e = 0; e < E; ++e) {
    const size_t* ps = order.data() + first[e];
    const size_t c = first[e + 1] - first[e];
    if (c == 0) continue;
    const int rows = int(c * M);
    // x's rows for this expert: read in place where its pairs take consecutive blocks of x (a sorted
    // prefill, or one pair), else copied together (a few rows of a small batch).
    bool in_place = true, out_in_place = direct_out;
    for (size_t j = 1; j < c; ++j) {
      in_place &= lhs[ps[j]] == lhs[ps[j - 1]] + 1;
      out_in_place &= ps[j] == ps[j - 1] + 1;
    }
    const float* xe = xrows + size_t(lhs[ps[0]]) * M * K;
    if (!in_place) {
      xg.resize(size_t(rows) * K);
      for (size_t j = 0; j < c; ++j)
        std::memcpy(xg.data() + j * M * K, xrows + size_t(lhs[ps[j]]) * M * K, sizeof(float) * M * K);
      xe = xg.data();
    }
    const Path path = path_for(rows);
    const Prepared px = prepare_rows(xe, rows, K, group_size, bits, path, xp, q16, dx, xsum);
    // The expert's slice of the weights, by offset: nothing is copied.
    p.w = w0 + size_t(e) * N * row_bytes;
    p.scales = s0 + size_t(e) * N * sb_bytes;
    p.biases = b0 + size_t(e) * N * sb_bytes;
    p.x = px.rows;
    p.M = rows;
    if (out_in_place) {
      p.y = out.data<float>() + ps[0] * block;
      run_problem(p, px.q, path);
      continue;
    }
    ys.resize(size_t(rows) * N);
    p.y = ys.data();
    run_problem(p, px.q, path);
    for (size_t j = 0; j < c; ++j) store(ys.data() + j * block, out, ps[j] * block, block);
  }
  // Indices out of range: zeros.
  if (first[E + 1] > first[E]) {
    ys.assign(block, 0.0f);
    for (size_t j = first[E]; j < first[E + 1]; ++j) store(ys.data(), out, order[j] * block, block);
  }
}

void check(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
           const mx::array& indices, int group_size, int bits) {
  auto is_float = [](mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; };
  std::ostringstream err;
  if (!supported_bits(bits)) {
    err << "bits " << bits << " is not supported (4 or 8)";
  } else if (group_size != 32 && group_size != 64 && group_size != 128) {
    err << "group_size " << group_size << " is not supported (32, 64 or 128)";
  } else if (w.ndim() != 3 || w.dtype() != mx::uint32) {
    err << "w must be a 3-D uint32 array (experts, out, in * bits / 32)";
  } else if (x.ndim() < 2 || !is_float(x.dtype())) {
    err << "x must be a float32, float16 or bfloat16 array of at least 2 dimensions";
  } else if (!is_float(scales.dtype()) || scales.dtype() != biases.dtype()) {
    err << "scales and biases must share one of float32, float16, bfloat16";
  } else if (!mx::issubdtype(indices.dtype(), mx::integer)) {
    err << "indices must be integers";
  } else {
    const int K = x.shape(-1), E = w.shape(0), N = w.shape(1);
    const int64_t packed = int64_t(K) * bits / 32;
    if (K % group_size != 0 || w.shape(2) != packed)
      err << "x has " << K << " columns, w holds " << w.shape(2) * 32 / bits << " per row";
    else if (scales.ndim() != 3 || scales.shape(0) != E || scales.shape(1) != N ||
             scales.shape(2) != K / group_size || biases.shape() != scales.shape())
      err << "scales and biases must be (" << E << ", " << N << ", " << K / group_size << ")";
  }
  if (!err.str().empty()) throw std::invalid_argument("gather_qmm: " + err.str());
}

}  // namespace

void GatherQuantizedMatmulCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  dispatch_cpu(stream(), inputs, outputs,
               [gs = group_size_, bits = bits_](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
                 gather_eval(ins, outs[0], gs, bits);
               });
}

void GatherQuantizedMatmulCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("shardline's gather_qmm runs on the CPU only");
}

bool GatherQuantizedMatmulCPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatherQuantizedMatmulCPU&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

std::vector<mx::Shape> GatherQuantizedMatmulCPU::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = batch_shape(inputs[0], inputs[4]);
  shape.push_back(inputs[0].shape(-2));
  shape.push_back(inputs[1].shape(1));
  return {shape};
}

mx::array gather_qmm(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     const mx::array& indices, int group_size, int bits, bool /*sorted_indices*/) {
  check(x, w, scales, biases, indices, group_size, bits);
  const mx::array idx = indices.dtype() == mx::uint32 || indices.dtype() == mx::int32
                            ? indices
                            : mx::astype(indices, mx::int32, mx::Device::cpu);
  auto shape = batch_shape(x, idx);
  shape.push_back(x.shape(-2));
  shape.push_back(w.shape(1));
  auto prim = std::make_shared<GatherQuantizedMatmulCPU>(cpu(), group_size, bits);
  return mx::array(std::move(shape), mx::promote_types(x.dtype(), scales.dtype()), prim,
                   {x, w, scales, biases, idx});
}

}  // namespace shardline_qmm
