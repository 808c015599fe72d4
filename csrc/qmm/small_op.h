// A CPU-only MLX primitive whose work is a function: what the small ops and the group's sum are built of.
#pragma once

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "util.h"

namespace shardline_qmm {

namespace mx = mlx::core;

using Body = std::function<void(const std::vector<mx::array>&, std::vector<mx::array>&)>;

// Allocates the outputs, registers them and the inputs with the CPU stream's encoder, and queues
// work(ins, outs) on that stream over weak copies (the encoder keeps the arrays alive): every CPU
// primitive of this extension evaluates this way.
template <typename Work>
void dispatch_cpu(mx::Stream s, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, Work work) {
  auto& encoder = mx::cpu::get_command_encoder(s);
  std::vector<mx::array> ins, outs;
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
    ins.push_back(mx::array::unsafe_weak_copy(in));
  }
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    outs.push_back(mx::array::unsafe_weak_copy(out));
  }
  encoder.dispatch([ins = std::move(ins), outs = std::move(outs), work = std::move(work)]() mutable { work(ins, outs); });
}

// A CPU-only primitive whose work is `body` (outputs allocated, inputs possibly strided: see dense()).
class SmallOp : public mx::Primitive {
 public:
  SmallOp(mx::Stream s, const char* name, Body body) : mx::Primitive(s), name_(name), body_(std::move(body)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_cpu(stream(), inputs, outputs, body_);
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("shardline's ") + name_ + " runs on the CPU only");
  }
  const char* name() const override { return name_; }

 private:
  const char* name_;
  Body body_;
};

inline mx::Stream cpu() { return mx::default_stream(mx::Device::cpu); }

inline mx::array one(const mx::Shape& shape, mx::Dtype dtype, const char* name, Body body, std::vector<mx::array> inputs) {
  return mx::array(shape, dtype, std::make_shared<SmallOp>(cpu(), name, std::move(body)), std::move(inputs));
}

// Input i's elements in row-major order (copied only where it is a strided view).
template <typename T>
const T* dense(const std::vector<mx::array>& in, size_t i) {
  thread_local std::vector<uint8_t> bufs[3];
  return reinterpret_cast<const T*>(contiguous_bytes(in[i], bufs[i]));
}

}  // namespace shardline_qmm
