// zinc comm: the compressed all-reduce of 1-bit Adam (Tang et al. 2021,
// "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
// Convergence Speed"), as DeepSpeed's compressed_allreduce does it
// (deepspeed/runtime/comm/nccl.py, mpi.py, compressed.py). Note [1-bit
// all-reduce] in onebit.cpp states the algorithm and what was matched.
//
// Sign packing: element i of x goes to bit 7 - (i % 8) of byte i / 8 (most
// significant bit first, numpy/cupy packbits' default, which DeepSpeed
// uses); the bit is 1 unless x[i] < 0 (so +0, -0 and NaN pack as +1, as
// DeepSpeed's sign().add_(1).bool() does). Vectorised at AVX2 and AVX-512
// with a scalar fallback, chosen at run time (zinc::detail::dispatch_isa);
// every level gives the same bits and floats.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "comm/comm.h"
#include "core/cpu.h"

namespace zinc::comm {

// bits[0, ceil(n / 8)) = the signs of x[0, n); the unused low bits of the
// last byte are 0.
void pack_signs(const float* x, int64_t n, uint8_t* bits);
// out[i] = bit i ? scale : -scale, i < n; with accumulate, out[i] += that.
void unpack_signs_scaled(const uint8_t* bits, int64_t n, float scale, float* out, bool accumulate = false);

// Per ISA level (tests): the same functions at a fixed level, which must be
// <= the CPU's (zinc::cpu_isa()).
void pack_signs_at(CpuIsa isa, const float* x, int64_t n, uint8_t* bits);
void unpack_signs_scaled_at(CpuIsa isa, const uint8_t* bits, int64_t n, float scale, float* out, bool accumulate);

// The length DeepSpeed pads a buffer of n elements to at world size p: a
// multiple of p * lcm(p, 8) (OnebitAdam's corrected_tensor_size), so that
// every rank's chunk (padded / p elements) is a whole number of bytes.
int64_t onebit_padded_size(int64_t n, int p);

// The two-phase compressed average of one buffer of n elements over the
// ranks of a communicator of size p, with the worker and server error
// feedback that persists from call to call. Every rank calls average() with
// the same n at the same point (it issues one all_to_all and one all_gather
// of f32 words). Not thread safe; one instance per buffer.
class CompressedAllReduce {
 public:
  CompressedAllReduce(int64_t n, int world_size);

  // buf[0, n) := the compressed average over ranks of buf + worker error
  // (every rank ends with the same values).
  void average(Communicator& comm, float* buf, int64_t n);

  // The same without the copy in: the caller writes the n elements into
  // input() (padded_size() floats; the compressor fills the padding), then
  // average_input() leaves the average in out[0, n), which may be input().
  float* input() { return x_.data(); }
  void average_input(Communicator& comm, float* out);

  int64_t size() const { return n_; }
  int64_t padded_size() const { return padded_; }
  int64_t chunk_size() const { return padded_ / p_; }
  // f32 words of one message (a scale, then chunk_size() / 8 bytes of signs,
  // rounded up to whole words); each phase sends size - 1 of them per rank.
  int64_t message_words() const { return words_; }
  // Bytes this rank sends to other ranks per average(): size - 1 messages in
  // the all-to-all and its own message to size - 1 ranks in the all-gather.
  int64_t wire_bytes_per_rank() const { return 2 * int64_t{p_ - 1} * words_ * 4; }

  const std::vector<float>& worker_error() const { return worker_error_; }
  const std::vector<float>& server_error() const { return server_error_; }
  // Restores the error feedback (from a checkpoint): padded_size() and
  // chunk_size() elements.
  void set_errors(const float* worker, const float* server) {
    std::copy(worker, worker + padded_, worker_error_.begin());
    std::copy(server, server + padded_ / p_, server_error_.begin());
  }

 private:
  void check_call(const Communicator& comm, int64_t n) const;
  int64_t n_, padded_;
  int p_;
  int64_t words_;
  std::vector<float> worker_error_;  // padded_ elements
  std::vector<float> server_error_;  // chunk_size() elements
  std::vector<float> x_, y_;         // scratch: padded_ and chunk_size()
  std::vector<float> send_, recv_;   // scratch: p * words_ each
  std::vector<const uint8_t*> bits_;  // the server's view of the p messages
  std::vector<float> scales_;
};

}  // namespace zinc::comm
