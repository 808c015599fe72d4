#include "pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QMM_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define QMM_PAUSE() asm volatile("yield")
#else
#define QMM_PAUSE() ((void)0)
#endif

namespace shardline_qmm {

namespace {

// How long a worker keeps polling for the next job before it sleeps: longer than the gap between two
// products of one token, far shorter than the gap between tokens of an idle runner.
constexpr auto kSpin = std::chrono::microseconds(200);

class Pool {
 public:
  ~Pool() { resize(1); }

  int size() {
    std::lock_guard<std::mutex> run(run_mu_);
    return int(workers_.size()) + 1;
  }

  void resize(int n) {
    std::lock_guard<std::mutex> run(run_mu_);
    n = std::max(1, n);
    if (int(workers_.size()) + 1 == n) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_ = false;
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { work(); });
  }

  // Runs job(c) for c in [0, chunks); false if the pool was busy (the caller then runs it alone).
  bool run(int chunks, const std::function<void(int)>& job) {
    std::unique_lock<std::mutex> run(run_mu_, std::try_to_lock);
    if (!run.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &job;
      pending_.store(chunks, std::memory_order_relaxed);
      // A new generation with its chunk count and next chunk 0, in one word: a worker still draining the
      // last job can never claim a chunk of this one by mistake.
      const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
      state_.store(gen << 32 | uint64_t(chunks) << 16, std::memory_order_release);
    }
    cv_.notify_all();
    drain();
    while (pending_.load(std::memory_order_acquire) > 0) QMM_PAUSE();
    return true;
  }

 private:
  void drain() {
    uint64_t v = state_.load(std::memory_order_acquire);
    for (;;) {
      const int c = int(v & 0xffff), chunks = int((v >> 16) & 0xffff);
      if (c >= chunks) return;
      if (!state_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      (*job_)(c);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
      v = state_.load(std::memory_order_acquire);
    }
  }

  uint64_t gen() const { return state_.load(std::memory_order_acquire) >> 32; }

  void work() {
    uint64_t seen = gen();
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      bool got = false;
      for (int i = 0; !got; ++i) {
        if (gen() != seen) {
          got = true;
          break;
        }
        if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) break;
        QMM_PAUSE();
      }
      std::unique_lock<std::mutex> lk(mu_);
      if (!got) cv_.wait(lk, [&] { return stop_ || gen() != seen; });
      if (stop_) return;
      seen = gen();
      lk.unlock();
      drain();
    }
  }

  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
  std::atomic<uint64_t> state_{0};  // generation << 32 | chunks << 16 | next chunk
  std::atomic<int> pending_{0};
  const std::function<void(int)>* job_ = nullptr;
};

std::atomic<int> g_threads{1};

// Never destroyed: workers must not be joined during static destruction. A forked child has none of its
// parent's workers (and maybe a mutex held by one of them): it leaves the parent's pool alone and starts
// over with one thread.
Pool* g_pool = nullptr;

void after_fork_in_child() {
  g_pool = new Pool();
  g_threads.store(1);
}

Pool& pool() {
  static const bool once = [] {
    g_pool = new Pool();
    pthread_atfork(nullptr, nullptr, &after_fork_in_child);
    return true;
  }();
  (void)once;
  return *g_pool;
}
std::atomic<size_t> g_min_bytes{32768};

}  // namespace

void set_threads(int n, size_t min_bytes) {
  n = std::max(1, std::min(n, 256));
  g_min_bytes.store(std::max<size_t>(1, min_bytes));
  pool().resize(n);
  g_threads.store(n);
}

int threads() { return g_threads.load(); }

void parallel_rows(int n, int align, size_t row_bytes, const std::function<void(int, int)>& fn) {
  const size_t min_bytes = g_min_bytes.load(std::memory_order_relaxed);
  const int t = g_threads.load(std::memory_order_relaxed);
  align = std::max(1, align);
  const int units = (n + align - 1) / align;
  const size_t unit_bytes = std::max<size_t>(1, row_bytes * size_t(align));
  int chunks = std::min<int>(t, units);
  chunks = std::min<int>(chunks, int(std::max<size_t>(1, unit_bytes * units / min_bytes)));
  if (chunks <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  auto job = [&](int c) {
    const int u0 = int(int64_t(units) * c / chunks), u1 = int(int64_t(units) * (c + 1) / chunks);
    const int n0 = u0 * align, n1 = std::min(n, u1 * align);
    if (n0 < n1) fn(n0, n1);
  };
  const std::function<void(int)> f(job);
  if (!pool().run(chunks, f))
    for (int c = 0; c < chunks; ++c) job(c);
}

}  // namespace shardline_qmm
