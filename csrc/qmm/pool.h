// The extension's own threads: one product split by output rows over a small persistent pool, without
// MLX's scheduler in between (one op stays one op). The calling thread takes a share; workers spin briefly
// after each job (the next product of a token follows within microseconds) and then sleep, so an idle
// runner costs nothing.
#pragma once

#include <cstddef>
#include <functional>

namespace shardline_qmm {

// Threads per product, the calling one included (default 1: no worker threads at all); a product is split
// only where each thread gets at least min_bytes of weights (fewer: waking a thread costs more than it saves).
void set_threads(int n, size_t min_bytes = 32768);
int threads();

// fn(n0, n1) over [0, n) in contiguous chunks, one per thread, their bounds multiples of `align` (the last
// chunk ends at n): each output row is computed by one thread, with the same arithmetic whatever the count.
// row_bytes: the weight bytes per row. Another thread's call while the pool is busy runs on its caller alone.
void parallel_rows(int n, int align, size_t row_bytes, const std::function<void(int, int)>& fn);

}  // namespace shardline_qmm
