// CommStream and CommHandle: order, errors, counters, shutdown. The streams
// drive the MPI world, so collectives submitted here run on every rank.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "comm_test_util.h"
#include "core/error.h"

namespace zinc::comm::testing {
namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

std::string wait_message(CommHandle& h) {
  try {
    h.wait();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

std::string sync_message(CommStream& s) {
  try {
    s.synchronize();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

TEST(CommStream, RunsWorkInSubmissionOrder) {
  CommStream stream(world());
  std::vector<int> seen;  // touched only by the stream's thread until synchronize()
  std::vector<CommHandle> handles;
  for (int k = 0; k < 500; ++k) {
    handles.push_back(stream.submit([&seen, k](Communicator&) {
      if (k % 50 == 0) sleep_ms(1);  // give later submissions time to pile up
      seen.push_back(k);
    }));
  }
  stream.synchronize();
  ASSERT_EQ(seen.size(), 500u);
  for (int k = 0; k < 500; ++k) EXPECT_EQ(seen[k], k);
  for (const CommHandle& h : handles) EXPECT_TRUE(h.done());
}

TEST(CommStream, CollectivesSubmittedInOrderMatchOnEveryRank) {
  // Eight all-reduces queued back to back; every rank queues them in the same
  // order, and each result must be the sum of its own buffer.
  Communicator& c = world();
  CommStream stream(c);
  const int64_t n = 1001;
  std::vector<std::vector<float>> bufs(8, std::vector<float>(n));
  std::vector<CommHandle> handles;
  for (int k = 0; k < 8; ++k) {
    for (int64_t i = 0; i < n; ++i) bufs[k][i] = small_int(c.rank() + k, i);
    float* p = bufs[k].data();
    handles.push_back(stream.submit([p, n](Communicator& cc) { cc.all_reduce(p, p, n, DType::kF32); }));
  }
  for (int k = 7; k >= 0; --k) handles[k].wait();  // waiting out of order is fine
  for (int k = 0; k < 8; ++k) {
    for (int64_t i = 0; i < n; ++i) {
      float expect = 0;
      for (int r = 0; r < c.size(); ++r) expect += small_int(r + k, i);
      EXPECT_EQ(bufs[k][i], expect) << "buffer " << k << " element " << i;
    }
  }
}

TEST(CommStream, WaitRethrowsTheWorkErrorAndTheStreamKeepsWorking) {
  CommStream stream(world());
  CommHandle bad = stream.submit([](Communicator&) { throw CommError("injected failure"); });
  EXPECT_EQ(wait_message(bad), "injected failure");
  EXPECT_EQ(wait_message(bad), "injected failure");  // the handle keeps its error
  EXPECT_TRUE(bad.done());
  EXPECT_EQ(sync_message(stream), "(nothing thrown)");  // wait() already reported it
  double one = 1.0;
  CommHandle good = stream.submit([&one](Communicator& c) { c.all_reduce_f64(&one, 1); });
  good.wait();
  EXPECT_EQ(one, world().size());
}

TEST(CommStream, SynchronizeReportsEachUnwaitedErrorOnceInOrder) {
  CommStream stream(world());
  stream.submit([](Communicator&) { throw CommError("first"); });  // handles dropped
  stream.submit([](Communicator&) { throw std::runtime_error("second"); });
  std::atomic<bool> ran_after{false};
  stream.submit([&ran_after](Communicator&) { ran_after = true; });
  EXPECT_EQ(sync_message(stream), "first");
  EXPECT_TRUE(ran_after.load());  // an error does not stop the queue
  EXPECT_EQ(sync_message(stream), "second");
  EXPECT_EQ(sync_message(stream), "(nothing thrown)");
  double one = 1.0;
  stream.submit([&one](Communicator& c) { c.all_reduce_f64(&one, 1); });
  stream.synchronize();
  EXPECT_EQ(one, world().size());
}

TEST(CommStream, WaitSecondsCountOnlyTheTimeCallersAreBlocked) {
  CommStream stream(world());
  CommHandle slow = stream.submit([](Communicator&) { sleep_ms(150); });
  slow.wait();
  EXPECT_GE(stream.wait_seconds(), 0.1);
  EXPECT_GE(stream.busy_seconds(), 0.14);

  stream.reset_counters();
  EXPECT_EQ(stream.wait_seconds(), 0.0);
  EXPECT_EQ(stream.busy_seconds(), 0.0);
  slow.wait();  // already done: not blocked
  stream.synchronize();  // nothing queued: not blocked
  EXPECT_EQ(stream.wait_seconds(), 0.0);

  // 200 ms of work, 120 ms of it hidden behind the caller's own work: the
  // caller is blocked for the remaining ~80 ms only.
  CommHandle h = stream.submit([](Communicator&) { sleep_ms(200); });
  sleep_ms(120);
  h.wait();
  EXPECT_GE(stream.busy_seconds(), 0.19);
  EXPECT_GT(stream.wait_seconds(), 0.02);
  EXPECT_LT(stream.wait_seconds(), 0.17);

  stream.reset_counters();
  stream.submit([](Communicator&) { sleep_ms(100); });
  stream.synchronize();
  EXPECT_GE(stream.wait_seconds(), 0.05);
}

TEST(CommStream, StreamsOverACommunicatorAndItsDuplicateDoNotWaitForEachOther) {
  expect_duplicate_streams_independent(world());
}

TEST(CommStream, TheTwinIsMadeOnceAndKeptByItsCommunicator) {
  Communicator* t = world().twin();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(world().twin(), t);
  EXPECT_EQ(t->size(), world().size());
  EXPECT_EQ(t->backend(), world().backend());
  double x = 1.0;
  t->all_reduce_f64(&x, 1);
  EXPECT_EQ(x, static_cast<double>(world().size()));
}

TEST(CommStream, DestructorRunsEverythingQueued) {
  std::atomic<int> ran{0};
  {
    CommStream stream(world());
    for (int k = 0; k < 20; ++k)
      stream.submit([&ran](Communicator&) {
        sleep_ms(1);
        ++ran;
      });
  }
  EXPECT_EQ(ran.load(), 20);
}

TEST(CommStream, HandleOutlivesItsStream) {
  CommHandle ok, bad;
  {
    CommStream stream(world());
    ok = stream.submit([](Communicator&) { sleep_ms(20); });
    bad = stream.submit([](Communicator&) { throw CommError("late failure"); });
    EXPECT_EQ(wait_message(bad), "late failure");
  }
  EXPECT_TRUE(ok.done());
  ok.wait();
  EXPECT_EQ(wait_message(bad), "late failure");
}

TEST(CommHandle, DefaultHandleIsInvalidAndDone) {
  CommHandle h;
  EXPECT_FALSE(h.valid());
  EXPECT_TRUE(h.done());
  h.wait();  // nothing to wait for
}

}  // namespace
}  // namespace zinc::comm::testing
