// Two builds of the compact CPU kernel (adam_q8.h) in one process: "old" (another commit's csrc, its ISA
// namespaces renamed old512 / old2 / oldscalar at compile time) and "new" (this checkout's). Checks that both give
// the same bits on every path, then times them interleaved on one thread. Driven by
// benchmarks/compare_kernel_commits.py, which builds it; prints one JSON object.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "adam_span.h"

namespace twinflow {
namespace old512 {
void run_q8_blocks(const Q8Span& span, int64_t begin, int64_t end);
}
namespace old2 {
void run_q8_blocks(const Q8Span& span, int64_t begin, int64_t end);
}
namespace oldscalar {
void run_q8_blocks(const Q8Span& span, int64_t begin, int64_t end);
}
}  // namespace twinflow

using namespace twinflow;
using Fn = void (*)(const Q8Span&, int64_t, int64_t);

// One tensor's state and inputs; every buffer is sized for float32 so that any dtype fits.
struct State {
  int64_t n;
  std::vector<float> param, grad32, out32;
  std::vector<uint16_t> grad16, hi, out16;
  std::vector<uint8_t> lo, ms, vs, v;
  std::vector<int8_t> m;
  State(int64_t n, uint32_t seed, float spread) : n(n) {
    std::mt19937 g(seed);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> uniform(0, 1);
    const int64_t blocks = (n + 255) / 256;
    param.resize(n), grad32.resize(n), out32.assign(n, 0), grad16.resize(n), hi.resize(n), out16.assign(n, 0);
    lo.resize(n), v.resize(n), m.resize(n), ms.resize(blocks), vs.resize(blocks);
    for (int64_t i = 0; i < n; ++i) {
      param[i] = normal(g);
      grad32[i] = normal(g) * (spread > 0 ? std::ldexp(1.0f, -static_cast<int>(uniform(g) * spread)) : 1.0f);
      uint32_t b;
      std::memcpy(&b, &grad32[i], 4);
      grad16[i] = static_cast<uint16_t>(b >> 16);  // bf16 bits (also read as fp16 bits: other values, still valid)
      std::memcpy(&b, &param[i], 4);
      hi[i] = static_cast<uint16_t>(b >> 16), lo[i] = static_cast<uint8_t>(b >> 8);
      m[i] = static_cast<int8_t>(static_cast<int>(g() % 255) - 127), v[i] = static_cast<uint8_t>(g() % 256);
    }
    for (int64_t j = 0; j < blocks; ++j) ms[j] = static_cast<uint8_t>(100 + g() % 30), vs[j] = static_cast<uint8_t>(90 + g() % 40);
    if (n > 9) {  // NaN, infinite and largest finite inputs and masters, of either sign
      grad32[3] = NAN, grad16[3] = 0x7FC1, grad32[5] = INFINITY, grad16[5] = 0x7F80;
      hi[6] = 0x7F80, lo[6] = 0x01, param[6] = NAN;
      hi[7] = 0xFF80, lo[7] = 0x00, param[7] = -INFINITY;
      hi[8] = 0x7F7F, lo[8] = 0xFF, param[8] = 3.4028235e38f;
      hi[9] = 0xFF7F, lo[9] = 0xFF, param[9] = -3.4028235e38f;
    }
  }
  bool operator==(const State& o) const {  // bit for bit: a NaN equals the same NaN
    auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
      return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
    };
    return same(param, o.param) && same(out32, o.out32) && hi == o.hi && lo == o.lo && out16 == o.out16 &&
           m == o.m && v == o.v && ms == o.ms && vs == o.vs;
  }
};

struct Case {
  bool m24;
  Dtype grad, out;
  float grad_scale, l2;
  Body body;
};

AdamConsts consts_of(uint32_t step, float grad_scale, float l2) {
  const float b1 = 0.9f, b2 = 0.999f, lr = 1e-3f, wd = l2 != 0 ? 0.0f : 0.01f;
  const float bc1 = 1 - std::pow(b1, static_cast<float>(step)), bc2 = 1 - std::pow(b2, static_cast<float>(step));
  return {b1, b2, 1 - b1, 1 - b2, 1e-8f, lr / bc1, 1 / std::sqrt(bc2), grad_scale, l2, 1 - lr * wd};
}

Q8Span span_of(State& s, const Case& c, const AdamConsts* k, uint32_t step) {
  Q8Span sp{};
  sp.param = c.m24 ? nullptr : s.param.data();
  sp.grad = c.grad == Dtype::kFloat32 ? static_cast<const void*>(s.grad32.data()) : s.grad16.data();
  sp.m_codes = s.m.data(), sp.m_scales = s.ms.data(), sp.v_codes = s.v.data(), sp.v_scales = s.vs.data();
  sp.out = c.out == Dtype::kFloat32 ? static_cast<void*>(s.out32.data())
                                    : (c.out == Dtype::kNone ? nullptr : static_cast<void*>(s.out16.data()));
  sp.numel = s.n, sp.index_base = 12345, sp.step = step, sp.grad_dtype = c.grad, sp.out_dtype = c.out, sp.consts = k;
  sp.body = c.body;
  sp.master_hi = c.m24 ? reinterpret_cast<bf16_t*>(s.hi.data()) : nullptr;
  sp.master_lo = c.m24 ? s.lo.data() : nullptr;
  return sp;
}

double median_seconds(Fn f, State& s, const Case& c, int calls) {
  std::vector<double> t;
  for (int r = 0; r < calls; ++r) {
    const AdamConsts k = consts_of(r + 1, 1.0f, 0.0f);
    const Q8Span sp = span_of(s, c, &k, r + 1);
    const auto t0 = std::chrono::steady_clock::now();
    f(sp, 0, (s.n + 255) / 256);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  const int64_t big = argc > 1 ? std::atoll(argv[1]) : (int64_t{1} << 24);
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  struct Path {
    const char* name;
    Fn old_fn, new_fn;
    bool ok;
  } paths[] = {{"avx512", old512::run_q8_blocks, avx512::run_q8_blocks, avx512},
               {"avx2", old2::run_q8_blocks, avx2::run_q8_blocks, avx2},
               {"scalar", oldscalar::run_q8_blocks, scalar::run_q8_blocks, true}};
  // Bits: every path, both master kinds, every gradient and copy dtype, the optional terms, step and peek,
  // random and spread moments, sizes with tails.
  int cases = 0, differing = 0;
  std::string first_diff;
  for (const Path& p : paths) {
    if (!p.ok) continue;
    for (int m24 = 0; m24 < 2; ++m24)
      for (Dtype grad : {Dtype::kFloat32, Dtype::kBFloat16, Dtype::kFloat16})
        for (Dtype out : {Dtype::kNone, Dtype::kFloat32, Dtype::kBFloat16, Dtype::kFloat16})
          for (Body body : {Body::kAdam, Body::kPeek})
            for (int terms = 0; terms < 3; ++terms)
              for (float spread : {0.0f, 24.0f})
                for (int64_t n : {int64_t{1000}, int64_t{4096 + 77}}) {
                  if (body == Body::kPeek && out == Dtype::kNone) continue;  // a peek writes only the copy
                  const Case c{m24 == 1, grad, out, terms == 1 ? 0.37f : 1.0f, terms == 2 ? 0.01f : 0.0f, body};
                  State a(n, static_cast<uint32_t>(7 + n + terms), spread), b = a;
                  for (uint32_t step = 1; step <= 3; ++step) {
                    const AdamConsts k = consts_of(step, c.grad_scale, c.l2);
                    p.old_fn(span_of(a, c, &k, step), 0, (n + 255) / 256);
                    p.new_fn(span_of(b, c, &k, step), 0, (n + 255) / 256);
                  }
                  ++cases;
                  if (!(a == b) && differing++ == 0) {
                    char buf[200];
                    std::snprintf(buf, sizeof buf, "%s m24=%d grad=%d out=%d body=%d terms=%d spread=%g n=%ld", p.name,
                                  m24, static_cast<int>(grad), static_cast<int>(out), static_cast<int>(body), terms,
                                  spread, static_cast<long>(n));
                    first_diff = buf;
                  }
                }
  }
  std::printf("{\"bit_cases\": %d, \"bit_cases_differing\": %d, \"first_difference\": \"%s\", \"timings\": [", cases,
              differing, first_diff.c_str());
  // Speed: bf16 gradients and copy (as training runs), one thread, a cache-resident size and `big`.
  bool first = true;
  for (const Path& p : paths) {
    if (!p.ok || !std::strcmp(p.name, "scalar")) continue;
    for (int64_t n : {int64_t{1} << 15, big}) {
      const int calls = n <= (int64_t{1} << 16) ? 1001 : 5;
      for (int m24 = 0; m24 < 2; ++m24) {
        State s(n, 1, 0);
        const Case step{m24 == 1, Dtype::kBFloat16, Dtype::kBFloat16, 1.0f, 0.0f, Body::kAdam};
        Case probe = step;
        probe.body = Body::kProbe;
        std::vector<double> old_t, new_t, probe_t;
        for (int r = 0; r < rounds; ++r) {  // interleaved: drift on the machine favours neither
          old_t.push_back(median_seconds(p.old_fn, s, step, calls));
          new_t.push_back(median_seconds(p.new_fn, s, step, calls));
          probe_t.push_back(median_seconds(p.new_fn, s, probe, calls));
        }
        auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
        std::printf("%s{\"path\": \"%s\", \"mode\": \"%s\", \"params\": %ld, \"old_gparam_s\": %.4f, "
                    "\"new_gparam_s\": %.4f, \"probe_gparam_s\": %.4f}",
                    first ? "" : ", ", p.name, m24 ? "int8_m24" : "int8", static_cast<long>(n), n / med(old_t) / 1e9,
                    n / med(new_t) / 1e9, n / med(probe_t) / 1e9);
        first = false;
      }
    }
  }
  std::printf("]}\n");
  return differing != 0;
}
