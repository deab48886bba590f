// zinc comm, private: the arithmetic and copies of the shared-memory
// backend (shm_communicator.cpp). Not included outside comm/.
//
// Every element of a reduction is summed in fp32 in source order,
// ((x0 + x1) + x2) + ..., independent of how the caller chunks the buffer,
// so results are deterministic for a given number of sources. bf16 (fp16)
// inputs are widened to fp32, summed in fp32 and rounded to bf16 (fp16) once
// at the end.
// The vector loops are compiled per ISA (ZINC_ISA_VARIANTS, core/cpu.h) and
// chosen at run time, capped by ONEDNN_MAX_CPU_ISA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace zinc::comm::detail {

// Outputs of at least this many bytes per call are written with
// non-temporal stores: they leave the caches before they are read again, so
// streaming skips the read-for-ownership of every output line (a third of the
// memory traffic of a copy; bench/RESULTS.md, shared memory). Streamed
// stores are weakly ordered: a caller that streamed ends with an sfence.
inline constexpr size_t kStreamMinBytes = size_t{4} << 20;

// memcpy, through non-temporal stores when `stream`.
void copy_out(void* dst, const void* src, size_t bytes, bool stream);

// dst[i] = src[0][i] + src[1][i] + ... + src[L-1][i] (left to right, fp32),
// i < n, and the same into dst2 unless it is null (dst streamed when
// `stream`, dst2 when `stream2`). dst or dst2 may be one of the sources (the
// same elements): each tile is read before it is written.
void reduce_sum(void* dst, void* dst2, const std::vector<const char*>& src, int64_t n, DType dtype,
                bool stream = false, bool stream2 = false);

}  // namespace zinc::comm::detail
