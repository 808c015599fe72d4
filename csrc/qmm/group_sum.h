// A tensor-parallel group's sum as an MLX op (the wire format and the rules are dataplane/group.py's).
//
// Done from Python, each of a layer's two sums ends the graph there: an evaluation, a wake of the caller
// (tens of microseconds on a VM), numpy conversions, and the graph built again after it. As an op, a
// step's layers are one graph: the sum runs on MLX's CPU stream where the partial is computed, with the
// same frames on the same sockets, the same deadline, the same order of additions.
//
// An op cannot raise through MLX's scheduler, so a failure is kept in the link (which peer, what kind, a
// message), the op passes its partial through, and every later sum of the link does nothing: the runner
// checks the link after the step's evaluation (before anything of the step leaves it) and fails there.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mlx/array.h"

namespace shardline_qmm {

namespace mx = mlx::core;

// CLOCK_MONOTONIC in seconds: the clock of the op's deadlines.
double monotonic();

class SumLink {
 public:
  // face: this runner is member 0 and `fds` are its members' streams in member order; otherwise `fds` is
  // the one stream to the face. pair: a group of two. The sockets are non-blocking and owned by Python
  // (never closed here). A read spins spin_s before it sleeps in poll().
  SumLink(std::vector<int> fds, bool face, bool pair, double spin_s);

  // Kinds of failure: 0 none, 1 stalled (the deadline passed), 2 vanished (the stream broke or closed),
  // 3 a frame that was not the sum due.
  std::tuple<int, int, std::string> error();
  // The sums timed since the last call: (few positions, microseconds from the partial ready to the total).
  std::vector<std::pair<bool, double>> drain();

  // The total of every member's `partial`, added in member order (p0 + p1 + ...): the same bits in every
  // member. A pair exchanges its partials both ways at once; a larger group sends to the face, which adds
  // and returns the total to each.
  void sum(const float* partial, float* out, size_t n, int64_t seq, int32_t index, double deadline, bool small);

 private:
  bool exchange(int k, const uint8_t* send, size_t send_n, uint8_t* recv, size_t recv_n, double deadline,
                const std::string& what);
  bool check(const std::vector<uint8_t>& frame, int k, int64_t seq, int32_t index, size_t n);
  void fail(int kind, int k, std::string message);

  std::vector<int> fds_;
  bool face_, pair_;
  double spin_s_;
  std::mutex mu_;
  int kind_ = 0, peer_ = -1;
  std::string message_;
  std::vector<std::pair<bool, double>> timings_;
};

// The group's total of float32 `x` (any shape) through `link`, as a lazy op: sum `index` of step `seq`,
// waiting at most until `deadline` (CLOCK_MONOTONIC seconds, Python's time.monotonic()); `small`: a decode
// step's sum (timed apart from a prefill chunk's).
mx::array group_sum(const mx::array& x, std::shared_ptr<SumLink> link, int64_t seq, int32_t index,
                    double deadline, bool small);

}  // namespace shardline_qmm
