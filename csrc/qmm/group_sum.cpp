#include "group_sum.h"

#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "small_op.h"

namespace shardline_qmm {

namespace {

// dataplane/group.py's frame of a sum: kind (1 byte, SUM = 1), step seq (int64), index (int32), payload
// bytes (uint64), little-endian and unpadded; then the float32 payload.
constexpr uint8_t SUM = 1;
constexpr size_t HEAD = 1 + 8 + 4 + 8;


std::vector<uint8_t> framed(const float* x, size_t n, int64_t seq, int32_t index) {
  std::vector<uint8_t> f(HEAD + n * sizeof(float));
  const uint64_t bytes = n * sizeof(float);
  f[0] = SUM;
  std::memcpy(&f[1], &seq, 8);  // x86-64 and arm64 are little-endian, as the frame is
  std::memcpy(&f[9], &index, 4);
  std::memcpy(&f[13], &bytes, 8);
  std::memcpy(&f[HEAD], x, bytes);
  return f;
}

bool would_block(int e) { return e == EAGAIN || e == EWOULDBLOCK || e == EINTR; }

double now() { return monotonic(); }

}  // namespace

double monotonic() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

SumLink::SumLink(std::vector<int> fds, bool face, bool pair, double spin_s)
    : fds_(std::move(fds)), face_(face), pair_(pair), spin_s_(spin_s) {
  if (fds_.empty() || (pair && fds_.size() != 1) || (!face && fds_.size() != 1))
    throw std::invalid_argument("a group's link: one stream for a member or a pair, one per member for a face");
}

std::tuple<int, int, std::string> SumLink::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return {kind_, peer_, message_};
}

std::vector<std::pair<bool, double>> SumLink::drain() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<bool, double>> out;
  out.swap(timings_);
  return out;
}

void SumLink::fail(int kind, int k, std::string message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (kind_ == 0) kind_ = kind, peer_ = k, message_ = std::move(message);
}

// Send `send` on stream k while reading recv_n bytes into `recv`, both at once: neither side waits for the
// other's whole frame, so frames larger than the sockets' buffers cannot deadlock. Spins spin_s_ first,
// then sleeps in poll() until the deadline.
bool SumLink::exchange(int k, const uint8_t* send, size_t send_n, uint8_t* recv, size_t recv_n, double deadline,
                       const std::string& what) {
  const int fd = fds_[k];
  size_t sent = 0, got = 0;
  const double spin_until = now() + spin_s_;
  while (sent < send_n || got < recv_n) {
    bool moved = false;
    if (sent < send_n) {
      const ssize_t w = ::send(fd, send + sent, send_n - sent, MSG_NOSIGNAL);
      if (w > 0) {
        sent += size_t(w), moved = true;
      } else if (w < 0 && !would_block(errno)) {
        fail(2, k, std::string("vanished: link broken while ") + what + ": " + std::strerror(errno));
        return false;
      }
    }
    if (got < recv_n) {
      const ssize_t r = ::recv(fd, recv + got, recv_n - got, 0);
      if (r > 0) {
        got += size_t(r), moved = true;
      } else if (r == 0) {
        fail(2, k, "vanished: it closed the link while " + what);
        return false;
      } else if (!would_block(errno)) {
        fail(2, k, std::string("vanished: link broken while ") + what + ": " + std::strerror(errno));
        return false;
      }
    }
    if (moved || now() < spin_until) continue;
    const double left = deadline - now();
    pollfd p{fd, short((got < recv_n ? POLLIN : 0) | (sent < send_n ? POLLOUT : 0)), 0};
    const int ready = left > 0 ? ::poll(&p, 1, int(left * 1000) + 1) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0 && now() >= deadline) {
      fail(1, k, "stalled: nothing moved while " + what);
      return false;
    }
  }
  return true;
}

bool SumLink::check(const std::vector<uint8_t>& f, int k, int64_t seq, int32_t index, size_t n) {
  int64_t got_seq;
  int32_t got_index;
  uint64_t bytes;
  std::memcpy(&got_seq, &f[1], 8);
  std::memcpy(&got_index, &f[9], 4);
  std::memcpy(&bytes, &f[13], 8);
  if (f[0] == SUM && got_seq == seq && got_index == index && bytes == n * sizeof(float)) return true;
  fail(3, k,
       "a frame of kind " + std::to_string(f[0]) + ", sum " + std::to_string(got_index) + " of step " +
           std::to_string(got_seq) + " (" + std::to_string(bytes) + " bytes), where sum " + std::to_string(index) +
           " of step " + std::to_string(seq) + " (" + std::to_string(n * sizeof(float)) + " bytes) was due");
  return false;
}

void SumLink::sum(const float* partial, float* out, size_t n, int64_t seq, int32_t index, double deadline,
                  bool small) {
  std::memcpy(out, partial, n * sizeof(float));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (kind_ != 0) return;  // the step has failed already: its runner fails when it checks
  }
  const double started = now();
  const std::string what = "exchanging sum " + std::to_string(index) + " of step " + std::to_string(seq);
  const std::vector<uint8_t> mine = framed(partial, n, seq, index);
  std::vector<uint8_t> theirs(mine.size());
  auto take = [&](int k, bool add) {
    if (!check(theirs, k, seq, index, n)) return false;
    const float* p = reinterpret_cast<const float*>(theirs.data() + HEAD);
    if (add) {
      for (size_t i = 0; i < n; ++i) out[i] += p[i];
    } else {
      std::memcpy(out, p, n * sizeof(float));
    }
    return true;
  };
  if (pair_) {  // both ways at once; each side adds p0 + p1 (addition commutes: the same bits on both)
    if (!exchange(0, mine.data(), mine.size(), theirs.data(), theirs.size(), deadline, what) || !take(0, true))
      return;
  } else if (!face_) {  // a member sends its partial and reads the face's total
    if (!exchange(0, mine.data(), mine.size(), theirs.data(), theirs.size(), deadline, what) || !take(0, false))
      return;
  } else {  // the face adds the members' partials in member order, then returns the total to each
    for (int k = 0; k < int(fds_.size()); ++k)
      if (!exchange(k, nullptr, 0, theirs.data(), theirs.size(), deadline, what) || !take(k, true)) return;
    const std::vector<uint8_t> total = framed(out, n, seq, index);
    for (int k = 0; k < int(fds_.size()); ++k)
      if (!exchange(k, total.data(), total.size(), nullptr, 0, deadline, what)) return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  timings_.emplace_back(small, (now() - started) * 1e6);
}

mx::array group_sum(const mx::array& x, std::shared_ptr<SumLink> link, int64_t seq, int32_t index,
                    double deadline, bool small) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("group_sum: x must be float32");
  auto body = [link, seq, index, deadline, small](const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    link->sum(dense<float>(in, 0), outs[0].data<float>(), in[0].size(), seq, index, deadline, small);
  };
  return one(x.shape(), mx::float32, "ShardlineGroupSum", body, {x});
}

}  // namespace shardline_qmm
