// Helpers of the multi-rank grid tests (pipeline_test, tensor_parallel_test):
// their tiny synthetic data, the model-state peak a trained engine reports
// over every rank, and the message a call throws.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "data/data.h"
#include "engine/engine.h"

namespace zinc::testing {

// The synthetic tokens both tests train on (vocabulary 13, rows of 9).
inline std::shared_ptr<const DataSource> tiny_source(int64_t vocab = 13) {
  DataConfig dc;
  dc.vocab_size = vocab;
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
// Micro-batch `index` of a grid test's run: B rows of T tokens (vocabulary
// 13) whose target is a function of the token (so the loss falls); with
// `packed`, documents packed into the rows (Batch::positions) and about a
// quarter of the targets masked.
inline Batch packed_batch(int64_t B, int64_t T, int64_t index, bool packed) {
  uint64_t x = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(index + 1);
  auto next = [&] {
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    return x;
  };
  Batch b;
  b.B = B;
  b.T = T;
  for (int64_t r = 0; r < b.B; ++r) {
    int32_t pos = 0;
    for (int64_t t = 0; t < b.T; ++t) {
      const int32_t tok = static_cast<int32_t>(next() % 13);
      b.inputs.push_back(tok);
      b.targets.push_back(packed && next() % 4 == 0 ? kIgnoreTarget : (tok * 5 + 3) % 13);
      if (packed) {
        pos = t > 0 && next() % 4 == 0 ? 0 : (t == 0 ? 0 : pos + 1);
        b.positions.push_back(pos);
      }
    }
  }
  return b;
}

// Every block's whole weights (Engine::full_params), one after the other.
inline std::vector<float> whole_weights(Engine& e) {
  std::vector<float> out;
  for (size_t b = 0; b < e.model().blocks().size(); ++b) {
    std::vector<float> p = e.full_params(static_cast<int>(b));
    const BlockLayout l = BlockLayout::from_spec(e.model().blocks()[b]);
    EXPECT_GE(p.size(), static_cast<size_t>(l.numel));
    out.insert(out.end(), p.begin(), p.begin() + std::min<int64_t>(l.numel, static_cast<int64_t>(p.size())));
  }
  return out;
}
inline double worst_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  return worst;
}

// What a grid test compares of a run and of its reference without the split.
struct GridRun {
  std::vector<float> weights;
  std::vector<double> losses;
  double norm = 0;
  double eval = 0;
};
// The split run `got` trains the reference's run to rounding: the losses,
// the last norm and the evaluation within `tol` relative (the norm within
// `norm_tol` where given), the weights within `wtol`; and the weights moved
// from `start` (the run's weights before training) far more than that
// (`moved` times the largest difference).
inline void expect_close_runs(const GridRun& got, const GridRun& ref, const std::vector<float>& start, double tol,
                              double wtol, const std::string& what, double moved = 100.0, double norm_tol = -1) {
  ASSERT_EQ(got.weights.size(), ref.weights.size()) << what;
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << what;
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol * std::max(1.0, std::fabs(ref.losses[i]))) << what << " loss " << i;
  EXPECT_NEAR(got.norm, ref.norm, (norm_tol < 0 ? tol : norm_tol) * ref.norm) << what;
  EXPECT_NEAR(got.eval, ref.eval, tol * ref.eval) << what;
  const double worst = worst_difference(got.weights, ref.weights);
  EXPECT_LT(worst, wtol) << what << ": the largest weight difference";
  EXPECT_GT(worst_difference(ref.weights, start), moved * worst) << what << ": the weights moved";
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
