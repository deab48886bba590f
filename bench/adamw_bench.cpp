// zinc-bench adamw: the optimizer step against the memory bandwidth that its
// access pattern can draw, measured round-robin in the same process.
#include "bench/benches.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "optim/adam_probe.h"
#include "core/alloc.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "optim/optim.h"

namespace zinc::bench {

namespace {

struct Case {
  const char* name;
  DType grad;
  bool out;
  double bytes;  // per parameter: reads + writes (Lamb: both passes)
  bool lamb = false;
  // Adam over spans of this many parameters (0: one span of all), as the
  // engine updates a model block by block; plain: the bf16 copy-out with
  // plain stores whatever the span's size (optim::set_stream_min_bytes).
  int64_t span = 0;
  bool plain = false;
};

}  // namespace

int bench_adamw(const BenchOptions& o) {
  const int threads = o.threads > 0 ? o.threads : num_threads();
  omp_set_num_threads(threads);
  const optim::Isa isa = o.isa.empty() ? optim::active_isa() : optim::parse_isa(o.isa);
  if (!optim::isa_supported(isa)) throw Error("this CPU does not support " + o.isa);
  const int64_t n = o.numel;
  auto fill = [&](AlignedBuffer& buf, uint64_t seed, float scale) {
    float* p = buf.as<float>();
    parallel_for(static_cast<size_t>(n), 1 << 16, [&](size_t lo, size_t hi) {
      Rng rng(mix_seed(seed, lo));
      for (size_t i = lo; i < hi; ++i) p[i] = static_cast<float>(rng.uniform() - 0.5) * scale;
    });
  };
  const size_t nz = static_cast<size_t>(n);
  AlignedBuffer w = make_buffer<float>(nz, kPageAlign), m = make_buffer<float>(nz, kPageAlign),
                v = make_buffer<float>(nz, kPageAlign), g = make_buffer<float>(nz, kPageAlign),
                g16 = make_buffer<bf16>(nz, kPageAlign), out = make_buffer<bf16>(nz, kPageAlign);
  AlignedBuffer pa = make_buffer<float>(nz, kPageAlign), pb = make_buffer<float>(nz, kPageAlign),
                pc = make_buffer<float>(nz, kPageAlign), pd = make_buffer<float>(nz, kPageAlign);
  fill(w, 1, 2.0f);
  fill(g, 2, 0.01f);
  convert_f32_to_bf16(g.as<float>(), g16.as<bf16>(), nz);
  for (AlignedBuffer* b : {&pa, &pb, &pc, &pd}) fill(*b, 3, 1.0f);
  for (AlignedBuffer* b : {&m, &v, &out}) std::fill_n(b->as<char>(), b->bytes(), 1);  // fault pages in

  // Lamb: pass 1 reads param, grad, m, v (16, or 14 with bf16 grads); pass
  // 2 is Adam's traffic (28 + 2 copy-out, or 28 with bf16 grads).
  const Case cases[] = {{"fp32_grads", DType::kF32, false, 28},
                        {"fp32_grads_bf16_out", DType::kF32, true, 30},
                        {"bf16_grads_bf16_out", DType::kBF16, true, 28},
                        {"lamb_fp32_grads_bf16_out", DType::kF32, true, 46, true},
                        {"lamb_bf16_grads_bf16_out", DType::kBF16, true, 42, true},
                        // A layer of the ~100M Llama is 11.3M parameters: its
                        // 22 MB copy-out streamed (the default) or stored.
                        {"fp32_grads_bf16_out_by_11M", DType::kF32, true, 30, false, 11'300'000},
                        {"fp32_grads_bf16_out_by_11M_plain", DType::kF32, true, 30, false, 11'300'000, true}};
  constexpr int kCases = static_cast<int>(sizeof cases / sizeof cases[0]);
  // Lamb's tensors: 4M-element pieces (a large layer's matrices), the last shorter.
  std::vector<optim::LambSegment> segs;
  for (int64_t b = 0, t = 0; b < n; b += int64_t{1} << 22, ++t)
    segs.push_back({b, std::min(n, b + (int64_t{1} << 22)), static_cast<int>(t)});
  optim::LambParams lp;
  lp.lr = 1e-4;
  lp.weight_decay = 0.01;
  optim::AdamParams p;
  p.lr = 1e-4;
  p.weight_decay = 0.01;
  auto run_case = [&](const Case& c, int64_t step) {
    optim::AdamSpan span{w.as<float>(), c.grad == DType::kF32 ? g.data() : g16.data(), c.grad,
                         m.as<float>(),  v.as<float>(), c.out ? out.as<bf16>() : nullptr, n};
    if (c.plain) optim::set_stream_min_bytes(int64_t{1} << 62);
    double t0 = now_s();
    if (c.lamb) {
      optim::lamb_step(lp, step, 0.5f, span, segs, isa);
    } else if (c.span <= 0) {
      optim::adam_step(p, step, 0.5f, span, isa);
    } else {
      for (int64_t b = 0; b < n; b += c.span) {
        const int64_t e = std::min(n, b + c.span);
        optim::AdamSpan part{span.param + b, static_cast<const char*>(span.grad) + b * dtype_bytes(c.grad), c.grad,
                             span.exp_avg + b, span.exp_avg_sq + b, span.bf16_out ? span.bf16_out + b : nullptr, e - b};
        optim::adam_step(p, step, 0.5f, part, isa);
      }
    }
    const double s = now_s() - t0;
    optim::set_stream_min_bytes(optim::kStreamMinBytes);
    return s;
  };
  std::vector<double> probe_s;
  std::vector<std::vector<double>> case_s(kCases);
  optim::adam_probe(pa.as<float>(), pb.as<float>(), pc.as<float>(), pd.as<float>(), n);  // warm up
  for (int c = 0; c < kCases; ++c) run_case(cases[c], 1);
  // Round-robin: the probe runs right before every case measurement, so the
  // bound and the figure see the same state of the (shared, drifting) host.
  for (int r = 0; r < o.rounds; ++r) {
    for (int c = 0; c < kCases; ++c) {
      double t0 = now_s();
      optim::adam_probe(pa.as<float>(), pb.as<float>(), pc.as<float>(), pd.as<float>(), n);
      probe_s.push_back(now_s() - t0);
      case_s[c].push_back(run_case(cases[c], 2 + r));
    }
  }
  const double probe_gbs = optim::kAdamProbeBytes * static_cast<double>(n) / median(probe_s) / 1e9;
  for (int c = 0; c < kCases; ++c) {
    const double t = median(case_s[c]);
    const double ups = static_cast<double>(n) / t;
    const double bound_ups = probe_gbs * 1e9 / cases[c].bytes;
    const double ratio = ups / bound_ups;
    nlohmann::json line = {{"bench", cases[c].lamb ? "lamb" : "adamw"},
                           {"case", cases[c].name},
                           {"figure", ups / 1e9},
                           {"unit", "G updates/s"},
                           {"bound", bound_ups / 1e9},
                           {"ratio", ratio},
                           {"bytes_per_param", cases[c].bytes},
                           {"achieved_GBps", ups * cases[c].bytes / 1e9},
                           {"probe_GBps", probe_gbs},
                           {"isa", std::string(optim::isa_name(isa))},
                           {"threads", threads},
                           {"numel", n}};
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "%s %-24s %s, %d threads, %lld params: %.3f G updates/s (%.1f GB/s at %.0f B/param) | "
                  "bound %.3f G updates/s (Adam-pattern probe %.1f GB/s) | ratio %.3f",
                  cases[c].lamb ? "lamb " : "adamw", cases[c].name, std::string(optim::isa_name(isa)).c_str(), threads, static_cast<long long>(n),
                  ups / 1e9, ups * cases[c].bytes / 1e9, cases[c].bytes, bound_ups / 1e9, probe_gbs, ratio);
    emit(o.json, line, buf);
  }
  return 0;
}

}  // namespace zinc::bench
