// Helpers of the multi-rank grid tests (pipeline_test, tensor_parallel_test):
// their tiny synthetic data, the model-state peak a trained engine reports
// over every rank, and the message a call throws.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "comm/comm.h"
#include "data/data.h"
#include "engine/engine.h"

namespace zinc::testing {

// The synthetic tokens both tests train on (vocabulary 13, rows of 9).
inline std::shared_ptr<const DataSource> tiny_source() {
  DataConfig dc;
  dc.vocab_size = 13;
  dc.seq_len = 9;
  return std::shared_ptr<const DataSource>(make_data_source(dc));
}
// A loader of this engine's replica over tiny_source().
inline DataLoader tiny_loader(const Engine& e, int64_t micro, int64_t gas) {
  return DataLoader(tiny_source(), micro, gas, e.data_parallel_size(), e.data_parallel_rank(), 7);
}
// Trains one global batch; the largest model-state peak over every rank.
inline double trained_state_peak(Engine& e, comm::Communicator& world, int64_t micro, int64_t gas) {
  DataLoader loader = tiny_loader(e, micro, gas);
  e.train_batch(loader);
  double peak = static_cast<double>(e.model_state_peak_bytes());
  world.all_reduce_max_f64(&peak, 1);
  return peak;
}
// What fn throws ("" when it returns).
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace zinc::testing
