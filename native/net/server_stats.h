// Counters and latency histograms of a data-plane server, lock-free.
#ifndef TF_DLT_NATIVE_NET_SERVER_STATS_H_
#define TF_DLT_NATIVE_NET_SERVER_STATS_H_

#include <atomic>
#include <cstdint>
#include <vector>

namespace dlt {

// Log-scale histogram of microseconds: 4 buckets per power of two.
class LatencyHistogram {
 public:
  static constexpr int kBuckets = 128;
  void Record(uint64_t micros);
  std::vector<uint64_t> Snapshot() const;
  // Sum of every recorded value (Prometheus' _sum).
  uint64_t SumMicros() const { return sum_micros_.load(std::memory_order_relaxed); }
  // Upper bound in microseconds of bucket `i`.
  static double UpperBoundMicros(int i);

 private:
  std::atomic<uint64_t> counts_[kBuckets] = {};
  std::atomic<uint64_t> sum_micros_{0};
};

struct ServerCounters {
  std::atomic<uint64_t> connections_accepted{0};
  std::atomic<uint64_t> connections_open{0};           // gauge: every open socket
  std::atomic<uint64_t> connections_authenticated{0};  // gauge: said Hello
  std::atomic<uint64_t> connections_refused{0};        // Hello past the connection cap
  std::atomic<uint64_t> connections_evicted{0};        // unauthenticated, closed for a newer one
  std::atomic<uint64_t> connections_waiting{0};        // gauge: waiting for buffer memory
  std::atomic<uint64_t> memory_waits{0};
  std::atomic<uint64_t> hello_timeouts{0};
  std::atomic<uint64_t> idle_timeouts{0};
  std::atomic<uint64_t> io_timeouts{0};
  std::atomic<uint64_t> accept_errors{0};   // accept failed (out of descriptors or memory)
  std::atomic<uint64_t> buffered_bytes{0};  // gauge: frames and replies held
  std::atomic<uint64_t> hellos{0};
  std::atomic<uint64_t> pulls{0};
  std::atomic<uint64_t> pushes{0};
  std::atomic<uint64_t> pulled_rows{0};
  std::atomic<uint64_t> pushed_rows{0};
  std::atomic<uint64_t> assigned_rows{0};
  // Identified pushes sent again and answered without applying them twice.
  std::atomic<uint64_t> repeated_pushes{0};
  // A standby's replication rounds past its buffer, dropped (copied afresh).
  std::atomic<uint64_t> standby_rounds_dropped{0};
  std::atomic<uint64_t> bytes_in{0};
  std::atomic<uint64_t> bytes_out{0};
  std::atomic<uint64_t> errors[17] = {};  // by Code
  LatencyHistogram pull_latency;
  LatencyHistogram push_latency;
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_SERVER_STATS_H_
