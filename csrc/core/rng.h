// zinc core: a small deterministic random generator (splitmix64 stream).
// Results depend only on the seed, never on the platform's <random>, so runs
// are reproducible across compilers. Not thread-safe; use one per thread or
// derive independent streams with Rng(mix(seed, k)).
#pragma once

#include <cmath>
#include <cstdint>

namespace zinc {

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Combine a seed with a stream index into a new independent seed.
inline uint64_t mix_seed(uint64_t seed, uint64_t k) {
  uint64_t s = seed ^ (k * 0xd1b54a32d192ed03ull + 0x8cb92ba72f3d8dd7ull);
  return splitmix64(s);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next_u64() { return splitmix64(state_); }
  // Uniform in [0, 1) with 53 bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n), n > 0 (Lemire's multiply; bias < 2^-32 for n < 2^32).
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next_u64()) * n) >> 64);
  }
  // Standard normal (Box-Muller, both outputs used).
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * M_PI * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * M_PI * u2);
  }

 private:
  uint64_t state_;
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace zinc
