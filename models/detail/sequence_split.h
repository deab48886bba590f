// zinc models, private: the Ulysses exchanges both decoders run around
// their attention (Note [sequence parallelism] in
// engine/sequence_parallel.cpp).
//
// A rank of S holds t = T/S tokens of each of B rows. Its attention input
// is (B t, W) rows made of `sections` sections (q, k and v: 3; the
// attention's output: 1) of S w columns each, w = (H/S) d the columns of
// one rank's heads. to_heads sends rank r the columns of r's heads in
// every section of its t tokens and receives every rank's tokens of its
// own heads: whole rows, (B T, sections w), token r t + i of a row from
// rank r's i-th. to_tokens is the reverse. Both work in place (the first
// copy reads all of `src` into the send buffer before anything is
// written to `dst`), so dst may be src.
#pragma once

#include <cstdint>

#include "engine/model.h"
#include "models/detail/ops.h"

namespace zinc::models::detail {

struct SequenceExchange {
  Buf send, recv;
  // Room for `floats` per buffer (grown, never shrunk).
  void ensure(Ops& ops, int64_t floats) {
    if (send.bytes() >= static_cast<size_t>(floats) * sizeof(float)) return;
    send = ops.alloc_f32(static_cast<size_t>(floats));
    recv = ops.alloc_f32(static_cast<size_t>(floats));
  }

  void to_heads(Ops& ops, StepContext& ctx, float* dst, const float* src, int64_t B, int64_t sections,
                int64_t w) {
    const SequenceSplit& sp = ctx.sequence_split();
    const int64_t S = sp.size, t = sp.T / S, W = sections * S * w, sw = sections * w, per = B * t * sw;
    ensure(ops, S * per);
    float* out = send.as<float>();
    for (int64_t r = 0; r < S; ++r)
      for (int64_t j = 0; j < sections; ++j)
        ops.copy_columns(out + r * per + j * w, sw, src + j * S * w + r * w, W, B * t, w);
    ctx.sequence_all_to_all(out, recv.as<float>(), per);
    const float* in = recv.as<float>();
    for (int64_t r = 0; r < S; ++r)
      for (int64_t b = 0; b < B; ++b)
        ops.copy_columns(dst + (b * sp.T + r * t) * sw, sw, in + r * per + b * t * sw, sw, t, sw);
  }

  void to_tokens(Ops& ops, StepContext& ctx, float* dst, const float* src, int64_t B, int64_t sections,
                 int64_t w) {
    const SequenceSplit& sp = ctx.sequence_split();
    const int64_t S = sp.size, t = sp.T / S, W = sections * S * w, sw = sections * w, per = B * t * sw;
    ensure(ops, S * per);
    float* out = send.as<float>();
    for (int64_t r = 0; r < S; ++r)
      for (int64_t b = 0; b < B; ++b)
        ops.copy_columns(out + r * per + b * t * sw, sw, src + (b * sp.T + r * t) * sw, sw, t, sw);
    ctx.sequence_all_to_all(out, recv.as<float>(), per);
    const float* in = recv.as<float>();
    for (int64_t r = 0; r < S; ++r)
      for (int64_t j = 0; j < sections; ++j)
        ops.copy_columns(dst + j * S * w + r * w, W, in + r * per + j * w, sw, B * t, w);
  }
};

}  // namespace zinc::models::detail
