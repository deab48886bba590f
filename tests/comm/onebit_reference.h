// A reference of the 1-bit compressed all-reduce written from the paper's
// equations (Tang et al. 2021, Algorithm 1 with DeepSpeed's two-phase
// worker/server compression), with plain loops and no code shared with
// comm/onebit.cpp: it simulates all p ranks in one process, so every rank
// of a multi-rank test can compute the expected result without
// communicating. The arithmetic is the one Note [1-bit all-reduce] states:
// scales sqrt(sum x^2) / sqrt(count) in double (element i into partial sum
// i % 8, the eight combined ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))),
// rounded to float once; sign +1 unless x < 0; the 1/p folded into each
// worker's scale; the sum over ranks in rank order.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace zinc::comm::testing {

struct OnebitReference {
  int p;
  int64_t n, padded, chunk;
  std::vector<std::vector<float>> worker_error;  // per rank, padded
  std::vector<std::vector<float>> server_error;  // per rank (its chunk), chunk

  OnebitReference(int64_t n_, int p_) : p(p_), n(n_) {
    // lcm(p, 8) by search, then a multiple of p * lcm(p, 8).
    int64_t lcm = 8;
    while (lcm % p != 0) lcm += 8;
    const int64_t unit = p * lcm;
    padded = (n + unit - 1) / unit * unit;
    chunk = padded / p;
    worker_error.assign(p, std::vector<float>(padded, 0.0f));
    server_error.assign(p, std::vector<float>(chunk, 0.0f));
  }

  static float sgn(float v) { return v < 0.0f ? -1.0f : 1.0f; }
  static float scale_of(const std::vector<float>& v) {
    double s[8] = {};
    for (size_t i = 0; i < v.size(); ++i) s[i % 8] += double(v[i]) * double(v[i]);
    const double sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    return float(std::sqrt(sum) / std::sqrt(double(v.size())));
  }

  // in[r] = rank r's buffer (n elements); returns the average every rank gets.
  std::vector<float> step(const std::vector<std::vector<float>>& in) {
    std::vector<std::vector<float>> sign(p, std::vector<float>(padded));
    std::vector<float> scale(p);
    for (int r = 0; r < p; ++r) {
      std::vector<float> x(padded);
      for (int64_t i = 0; i < padded; ++i) x[i] = (i < n ? in[r][i] : 0.0f) + worker_error[r][i];
      scale[r] = scale_of(x);
      for (int64_t i = 0; i < padded; ++i) {
        sign[r][i] = sgn(x[i]);
        worker_error[r][i] = x[i] - scale[r] * sign[r][i];
      }
    }
    std::vector<float> out(padded);
    for (int j = 0; j < p; ++j) {
      std::vector<float> y(chunk);
      for (int64_t i = 0; i < chunk; ++i) {
        float acc = sign[0][j * chunk + i] * (scale[0] * (1.0f / float(p)));
        for (int r = 1; r < p; ++r) acc = acc + sign[r][j * chunk + i] * (scale[r] * (1.0f / float(p)));
        y[i] = acc + server_error[j][i];
      }
      const float t = scale_of(y);
      for (int64_t i = 0; i < chunk; ++i) {
        server_error[j][i] = y[i] - t * sgn(y[i]);
        out[j * chunk + i] = t * sgn(y[i]);
      }
    }
    out.resize(n);
    return out;
  }
};

// Packed signs from the definition: element i -> bit 7 - i % 8 of byte i / 8, 1 unless x < 0.
inline std::vector<uint8_t> reference_pack(const std::vector<float>& x) {
  std::vector<uint8_t> bits((x.size() + 7) / 8, 0);
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] < 0.0f)) bits[i / 8] |= uint8_t(1u << (7 - i % 8));
  return bits;
}

// Rank r's input element i at step s, kind 0: random spread over 2^-8..2^7;
// kind 1: zeros; kind 2: large (+-1e30 scaled, squares beyond fp32).
inline float onebit_input(int kind, int step, int rank, int64_t i) {
  if (kind == 1) return 0.0f;
  uint64_t h = uint64_t(step) * 0x9e3779b97f4a7c15ull + uint64_t(rank) * 0xbf58476d1ce4e5b9ull + uint64_t(i) + 1;
  h ^= h >> 31;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 29;
  const double unit = double(h >> 40) / double(1 << 23) - 1.0;
  if (kind == 2) return float(unit * 1e30);
  return float(std::ldexp(unit, int(h & 15) - 8));
}

}  // namespace zinc::comm::testing
