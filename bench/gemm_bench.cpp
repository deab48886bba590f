// zinc-bench gemm: oneDNN's fp32 rate at the matmul shapes of one training
// step (the bound train-step divides by) against Intel MKL's cblas_sgemm at
// the same shapes, in the same rounds (issue 28: is oneDNN the best GEMM this
// machine has?). --bf16 does the same for the bf16 step: bf16 operands, fp32
// sums and C, through zinc's bf16 matmul (oneDNN's native bf16 kernel, or
// the fp32 route where the CPU has no bf16 arithmetic) and MKL's
// cblas_gemm_bf16bf16f32, which has no batched form and loops over batches.
//
// MKL is not a dependency of zinc: it is loaded at run time with dlopen
// (--mkl PATH, else the dynamic linker's libmkl_rt.so.3 / .so.2 / .so; the
// peers venv's `mkl` package provides one, bench/peers/setup.sh). Its OpenMP
// layer is set to GNU so that MKL and oneDNN share one thread pool (libgomp)
// and neither spins while the other runs. Without MKL the figure is oneDNN's
// alone and the line says why.
//
// --shapes prints the shapes as JSON and stops: bench/peers/gemm_peer.py
// times PyTorch's GEMM on exactly these.
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "bench/benches.h"
#include "core/alloc.h"
#include "core/dtype.h"
#include "core/parallel.h"
#include "core/rng.h"

namespace zinc::bench {
namespace {

// The CBLAS entry points used, by value (mkl_cblas.h is not needed).
enum { kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112 };
enum { kMklThreadingGnu = 3 };  // MKL_THREADING_GNU in mkl_service.h
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
using SgemmBatchStridedFn = void (*)(int, int, int, int, int, int, float, const float*, int, int, const float*, int,
                                     int, float, float*, int, int, int);
using GemmBf16Fn = void (*)(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int, float,
                           float*, int);
using SetLayerFn = int (*)(int);
using SetThreadsFn = void (*)(int);
using VersionFn = void (*)(char*, int);

struct Mkl {
  void* handle = nullptr;
  std::string path, version, why;
  SgemmFn sgemm = nullptr;
  SgemmBatchStridedFn sgemm_batch_strided = nullptr;
  GemmBf16Fn gemm_bf16 = nullptr;

  explicit Mkl(const std::string& want) {
    std::vector<std::string> tries = want.empty()
                                         ? std::vector<std::string>{"libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"}
                                         : std::vector<std::string>{want};
    for (const std::string& t : tries) {
      handle = dlopen(t.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle) {
        path = t;
        break;
      }
      why = dlerror();
    }
    if (!handle) return;
    // Before any other MKL call: libgomp (MKL_THREADING_GNU), the
    // runtime oneDNN and zinc already run on.
    if (auto set_layer = reinterpret_cast<SetLayerFn>(dlsym(handle, "MKL_Set_Threading_Layer"))) set_layer(kMklThreadingGnu);
    if (auto set_threads = reinterpret_cast<SetThreadsFn>(dlsym(handle, "MKL_Set_Num_Threads")))
      set_threads(zinc::num_threads());
    sgemm = reinterpret_cast<SgemmFn>(dlsym(handle, "cblas_sgemm"));
    sgemm_batch_strided = reinterpret_cast<SgemmBatchStridedFn>(dlsym(handle, "cblas_sgemm_batch_strided"));
    gemm_bf16 = reinterpret_cast<GemmBf16Fn>(dlsym(handle, "cblas_gemm_bf16bf16f32"));
    if (auto ver = reinterpret_cast<VersionFn>(dlsym(handle, "MKL_Get_Version_String"))) {
      char buf[256] = {};
      ver(buf, sizeof buf);
      version = buf;
    }
    if (!sgemm) {
      why = path + " has no cblas_sgemm";
      dlclose(handle);
      handle = nullptr;
    }
  }
  ~Mkl() {
    if (handle) dlclose(handle);
  }
  Mkl(const Mkl&) = delete;
  Mkl& operator=(const Mkl&) = delete;

  // zinc's MatmulDesc in row-major CBLAS terms: A stored (M,K) or (K,M),
  // B stored (K,N) or (N,K), batches contiguous. bf16 operands when
  // d.compute is kBF16, fp32 otherwise; C is fp32 either way.
  void run(const zinc::kernels::MatmulDesc& d, const void* a, const void* b, float* c) const {
    const int M = static_cast<int>(d.M), N = static_cast<int>(d.N), K = static_cast<int>(d.K);
    const int ta = d.trans_a ? kCblasTrans : kCblasNoTrans, tb = d.trans_b ? kCblasTrans : kCblasNoTrans;
    const int lda = d.trans_a ? M : K, ldb = d.trans_b ? K : N;
    const float beta = d.accumulate ? 1.0f : 0.0f;
    if (d.compute == zinc::DType::kBF16) {
      const auto* a16 = static_cast<const uint16_t*>(a);
      const auto* b16 = static_cast<const uint16_t*>(b);
      for (int64_t i = 0; i < d.batch; ++i)
        gemm_bf16(kCblasRowMajor, ta, tb, M, N, K, d.alpha, a16 + i * M * K, lda, b16 + i * K * N, ldb, beta,
                  c + i * M * N, N);
      return;
    }
    const auto* a32 = static_cast<const float*>(a);
    const auto* b32 = static_cast<const float*>(b);
    if (d.batch > 1 && sgemm_batch_strided) {
      sgemm_batch_strided(kCblasRowMajor, ta, tb, M, N, K, d.alpha, a32, lda, M * K, b32, ldb, K * N, beta, c, N,
                          M * N, static_cast<int>(d.batch));
      return;
    }
    for (int64_t i = 0; i < d.batch; ++i)
      sgemm(kCblasRowMajor, ta, tb, M, N, K, d.alpha, a32 + i * M * K, lda, b32 + i * K * N, ldb, beta, c + i * M * N,
            N);
  }
};

struct Operands {
  zinc::AlignedBuffer a, b, c;
};

using ShapeKey = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool, bool>;
ShapeKey key_of(const zinc::kernels::MatmulDesc& d) {
  return {d.batch, d.M, d.N, d.K, d.trans_a, d.trans_b, d.accumulate};
}

}  // namespace

int bench_gemm(const BenchOptions& o) {
  const StepSizes sz = step_sizes(o);
  const zinc::DType dt = o.bf16 ? zinc::DType::kBF16 : zinc::DType::kF32;
  const char* dt_name = o.bf16 ? "bf16" : "fp32";
  const std::vector<zinc::kernels::MatmulDesc> descs = sz.matmuls(dt);
  // The distinct shapes, with how often one step runs each.
  std::map<ShapeKey, std::pair<zinc::kernels::MatmulDesc, int>> shapes;
  for (const auto& d : descs) {
    auto [it, fresh] = shapes.try_emplace(key_of(d), d, 0);
    ++it->second.second;
  }
  if (o.shapes) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& [k, v] : shapes) {
      const auto& d = v.first;
      list.push_back({{"batch", d.batch}, {"M", d.M}, {"N", d.N}, {"K", d.K}, {"trans_a", d.trans_a},
                      {"trans_b", d.trans_b}, {"accumulate", d.accumulate}, {"count", v.second}});
    }
    std::printf("%s\n", nlohmann::json{{"model", sz.name()}, {"shapes", list}}.dump().c_str());
    return 0;
  }
  Mkl mkl(o.mkl);
  if (mkl.handle && o.bf16 && !mkl.gemm_bf16) {
    mkl.why = mkl.path + " has no cblas_gemm_bf16bf16f32";
    dlclose(mkl.handle);
    mkl.handle = nullptr;
  }
  // What zinc's matmul runs for these operands: oneDNN's implementation, and
  // for bf16 whether it multiplies in bf16 or takes the fp32 route.
  const zinc::kernels::MatmulPath path = zinc::kernels::matmul_path(descs.front());
  const std::string onednn_path =
      path.impl + (o.bf16 && path.multiply == zinc::DType::kF32 ? ", bf16 via fp32: " + path.why : "");
  const size_t esize = zinc::dtype_bytes(dt);
  zinc::Rng rng(1);
  std::vector<Operands> ops;
  std::vector<const zinc::kernels::MatmulDesc*> order;
  for (const auto& [k, v] : shapes) {
    const auto& d = v.first;
    Operands op{zinc::AlignedBuffer(static_cast<size_t>(d.batch * d.M * d.K) * esize),
                zinc::AlignedBuffer(static_cast<size_t>(d.batch * d.K * d.N) * esize),
                zinc::AlignedBuffer(static_cast<size_t>(d.batch * d.M * d.N) * 4)};
    for (float& x : op.c.span<float>()) x = static_cast<float>(rng.uniform() - 0.5) * 1e-3f;
    for (zinc::AlignedBuffer* buf : {&op.a, &op.b}) {
      if (o.bf16) {
        for (zinc::bf16& x : buf->span<zinc::bf16>())
          x = zinc::float_to_bf16(static_cast<float>(rng.uniform() - 0.5) * 1e-3f);
      } else {
        for (float& x : buf->span<float>()) x = static_cast<float>(rng.uniform() - 0.5) * 1e-3f;
      }
    }
    ops.push_back(std::move(op));
    order.push_back(&v.first);
  }
  // One step's matmuls = each distinct shape times its count.
  auto time_shape = [&](size_t i, bool use_mkl) {
    const auto& d = *order[i];
    const int count = shapes.at(key_of(d)).second;
    const double t0 = now_s();
    for (int r = 0; r < count; ++r) {
      if (use_mkl)
        mkl.run(d, ops[i].a.data(), ops[i].b.data(), ops[i].c.as<float>());
      else
        zinc::kernels::matmul(d, {ops[i].a.data(), dt}, {ops[i].b.data(), dt}, ops[i].c.as<float>());
    }
    return now_s() - t0;
  };
  const bool have_mkl = mkl.handle != nullptr;
  // MKL must compute what oneDNN computes, shape by shape (a wrong transpose
  // or leading dimension would time a different product): both from the same
  // C, compared to fp32 rounding of the sums.
  if (have_mkl)
    for (size_t i = 0; i < order.size(); ++i) {
      const auto& d = *order[i];
      const size_t nc = static_cast<size_t>(d.batch * d.M * d.N);
      std::vector<float> c0(ops[i].c.as<float>(), ops[i].c.as<float>() + nc), c_mkl = c0;
      zinc::kernels::matmul(d, {ops[i].a.data(), dt}, {ops[i].b.data(), dt}, ops[i].c.as<float>());
      mkl.run(d, ops[i].a.data(), ops[i].b.data(), c_mkl.data());
      double worst = 0, scale = 0;
      for (size_t k = 0; k < nc; ++k) {
        worst = std::max(worst, std::fabs(static_cast<double>(ops[i].c.as<float>()[k]) - c_mkl[k]));
        scale = std::max(scale, std::fabs(static_cast<double>(c_mkl[k])));
      }
      if (!(worst <= 1e-4 * scale))
        throw zinc::Error("gemm: MKL and oneDNN disagree at " + std::to_string(d.batch) + " x " +
                          std::to_string(d.M) + " x " + std::to_string(d.N) + " x " + std::to_string(d.K) +
                          (d.trans_a ? " A^T" : " A") + (d.trans_b ? " B^T" : " B") + ": max difference " +
                          std::to_string(worst) + " of " + std::to_string(scale));
      std::copy(c0.begin(), c0.end(), ops[i].c.as<float>());
    }
  // Warm up (primitive creation, MKL's dispatch, page faults), then rounds
  // alternating oneDNN and MKL shape by shape, so both see the same machine.
  for (size_t i = 0; i < order.size(); ++i) {
    time_shape(i, false);
    if (have_mkl) time_shape(i, true);
  }
  std::vector<std::vector<double>> t_dnnl(order.size()), t_mkl(order.size());
  std::vector<double> step_dnnl, step_mkl;
  for (int r = 0; r < o.rounds; ++r) {
    double sd = 0, sm = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      const bool mkl_first = (r + i) % 2 == 1;
      if (have_mkl && mkl_first) sm += (t_mkl[i].emplace_back(time_shape(i, true)));
      sd += (t_dnnl[i].emplace_back(time_shape(i, false)));
      if (have_mkl && !mkl_first) sm += (t_mkl[i].emplace_back(time_shape(i, true)));
    }
    step_dnnl.push_back(sd);
    if (have_mkl) step_mkl.push_back(sm);
  }
  double flops = 0;
  for (const auto& d : descs) flops += 2.0 * d.batch * d.M * d.N * d.K;
  const double dnnl_gfs = flops / median(step_dnnl) / 1e9;
  const double mkl_gfs = have_mkl ? flops / median(step_mkl) / 1e9 : 0;
  nlohmann::json per_shape = nlohmann::json::array();
  std::string text;
  for (size_t i = 0; i < order.size(); ++i) {
    const auto& d = *order[i];
    const int count = shapes.at(key_of(d)).second;
    const double f = 2.0 * d.batch * d.M * d.N * d.K * count;
    const double gd = f / median(t_dnnl[i]) / 1e9, gm = have_mkl ? f / median(t_mkl[i]) / 1e9 : 0;
    per_shape.push_back({{"batch", d.batch}, {"M", d.M}, {"N", d.N}, {"K", d.K}, {"trans_a", d.trans_a},
                         {"trans_b", d.trans_b}, {"accumulate", d.accumulate}, {"count", count},
                         {"flop_share", f / flops}, {"onednn_gflops", gd}, {"mkl_gflops", gm}});
    char line[256], mkl_col[32] = "";
    if (have_mkl) std::snprintf(mkl_col, sizeof mkl_col, " | MKL %6.1f", gm);
    std::snprintf(line, sizeof line, "\n  %4lldx %5lldx%5lldx%5lld %s%s%s x%-2d %4.1f%% of FLOPs | oneDNN %6.1f%s GFLOP/s",
                  (long long)d.batch, (long long)d.M, (long long)d.N, (long long)d.K, d.trans_a ? "A^T" : "A",
                  d.trans_b ? "B^T" : "B", d.accumulate ? "+=" : "", count, 100 * f / flops, gd, mkl_col);
    text += line;
  }
  nlohmann::json out = {{"bench", "gemm"},
                        {"case", std::string(sz.name()) + " " + dt_name},
                        {"figure", dnnl_gfs},
                        {"unit", "GFLOP/s"},
                        {"bound", have_mkl ? nlohmann::json(mkl_gfs) : nlohmann::json(nullptr)},
                        {"ratio", have_mkl ? nlohmann::json(dnnl_gfs / mkl_gfs) : nlohmann::json(nullptr)},
                        {"onednn_gflops", dnnl_gfs},
                        {"onednn_path", onednn_path},
                        {"mkl_gflops", have_mkl ? nlohmann::json(mkl_gfs) : nlohmann::json(nullptr)},
                        {"mkl", have_mkl ? mkl.path : "not loaded: " + mkl.why},
                        {"mkl_version", mkl.version},
                        {"threads", zinc::num_threads()},
                        {"step_flops", flops},
                        {"shapes", per_shape}};
  char mkl_part[384], head[1024];
  if (have_mkl)
    std::snprintf(mkl_part, sizeof mkl_part, "MKL %.1f GFLOP/s (%s) | oneDNN / MKL %.3f", mkl_gfs, mkl.version.c_str(),
                  dnnl_gfs / mkl_gfs);
  else
    std::snprintf(mkl_part, sizeof mkl_part, "MKL not loaded (%s)", mkl.why.c_str());
  std::snprintf(head, sizeof head,
                "gemm %s %s, one step's %zu matmuls (%zu shapes, %.2f GFLOP), %d threads, median of %d rounds:\n"
                "  oneDNN %.1f GFLOP/s (%s) | %s",
                sz.name(), dt_name, descs.size(), order.size(), flops / 1e9, zinc::num_threads(), o.rounds, dnnl_gfs,
                onednn_path.c_str(), mkl_part);
  emit(o.json, out, std::string(head) + text);
  return 0;
}

}  // namespace zinc::bench
