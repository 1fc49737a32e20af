// One-pass AdamW over a unit's flat buffers: reads the gradient (bf16, fp16 or fp32), updates the fp32
// master and fp32 moments, and writes the refreshed compute copy (bf16/fp16) in the same pass.
// 28 bytes of memory traffic per parameter with a bf16 gradient and copy, against 40 for torch's fused
// kernel plus separate cast passes. The arithmetic follows torch's fused CPU AdamW (lerp for the first
// moment, sqrt(v) / sqrt(bias_correction2) + eps) so that results agree to rounding.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(SF_NO_INTRIN)
#include <immintrin.h>
#define SF_AVX512 1
#endif

namespace {

struct Hyper {
  float lr_wd_decay;  // 1 - lr * weight_decay
  float w1;           // 1 - beta1 (lerp weight)
  float beta2, one_minus_beta2, eps, step_size, bc2_sqrt, coef;
};

Hyper make_hyper(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                 double grad_coef) {
  TORCH_CHECK(step >= 1, "step must be >= 1");
  Hyper h;
  h.lr_wd_decay = static_cast<float>(1.0 - lr * weight_decay);
  h.w1 = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  h.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  h.coef = static_cast<float>(grad_coef);
  return h;
}

// Worker threads started once per thread count and reused: the engine updates a unit chunk by chunk as
// its gradient lands (tens of calls per layer), and starting 15 threads per call would cost more than a
// chunk's update saves. Calls are serialised per pool; the pools live as long as the process (never
// joined at exit, where a worker could still be inside a kernel).
class Pool {
 public:
  explicit Pool(int64_t n) : n_(n) {
    for (int64_t k = 1; k < n; ++k) workers_.emplace_back([this, k] { loop(k); });
  }
  void run(const std::function<void(int64_t)>& fn) {  // fn(k) for every k in [0, n); the caller runs k = 0
    std::lock_guard<std::mutex> one_call(call_);
    {
      std::lock_guard<std::mutex> g(m_);
      job_ = &fn;
      pending_ = n_ - 1;
      ++generation_;
    }
    wake_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> g(m_);
    done_.wait(g, [this] { return pending_ == 0; });
  }

 private:
  void loop(int64_t k) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int64_t)>* job;
      {
        std::unique_lock<std::mutex> g(m_);
        wake_.wait(g, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
      }
      (*job)(k);
      std::lock_guard<std::mutex> g(m_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
  const int64_t n_;
  std::vector<std::thread> workers_;
  std::mutex call_, m_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t pending_ = 0;
  uint64_t generation_ = 0;
};

Pool& pool_of(int64_t threads) {
  static std::mutex m;
  static auto* pools = new std::map<int64_t, Pool*>();  // deliberately leaked: see Pool
  std::lock_guard<std::mutex> g(m);
  auto& p = (*pools)[threads];
  if (p == nullptr) p = new Pool(threads);
  return *p;
}

// Split [0, n) into blocks of 64k elements that the pool's threads take in turn from a shared counter.
// Each call ends at a barrier, and the optimizer shares its cores with the thread that drives the GPU and
// the copy threads: with fixed shares, one preempted thread held up every chunk's call (measured 17%
// slower per step than one call per unit, session 3); with blocks it holds up one block.
constexpr int64_t kBlock = 1 << 16;

template <typename F>
void parallel_ranges(int64_t begin, int64_t end, int64_t threads, F&& fn) {
  const int64_t n = end - begin, blocks = (n + kBlock - 1) / kBlock;
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, blocks));
  if (t == 1) {
    if (n > 0) fn(begin, end);
    return;
  }
  std::atomic<int64_t> next{0};
  const std::function<void(int64_t)> task = [&](int64_t k) {
    if (k >= t) return;
    for (int64_t j; (j = next.fetch_add(1, std::memory_order_relaxed)) < blocks;)
      fn(begin + j * kBlock, std::min(end, begin + (j + 1) * kBlock));
  };
  pool_of(threads).run(task);
}

// A unit's gradient lands chunk by chunk: after chunk k's copy, the copy stream writes `ticket` into
// flags[k] (pinned memory). Each chunk is updated as soon as its flag shows, inside one call per unit:
// the calling Python thread then takes the GIL back once per unit instead of once per chunk, which cost
// 0.18 s per Qwen3-4B b8 step with a call per chunk (bench/NOTES.md, session 3). `abort`, when set by
// the runtime, ends a wait for a chunk that will never land (the GPU failed).
struct Landing {
  const volatile int64_t* flags = nullptr;
  int64_t ticket = 0, chunk = 0;
  const volatile int64_t* abort = nullptr;
};

Landing landing_of(const c10::optional<torch::Tensor>& flags, int64_t ticket, int64_t chunk,
                   const c10::optional<torch::Tensor>& abort, int64_t n) {
  Landing l;
  if (!flags.has_value()) return l;
  TORCH_CHECK(chunk > 0 && flags->is_cpu() && flags->is_contiguous() && flags->scalar_type() == at::kLong &&
                  flags->numel() >= (n + chunk - 1) / chunk,
              "flags: a contiguous int64 CPU tensor with one entry per chunk");
  TORCH_CHECK(!abort.has_value() || (abort->is_cpu() && abort->scalar_type() == at::kLong), "abort: int64 CPU tensor");
  l.flags = flags->data_ptr<int64_t>();
  l.ticket = ticket;
  l.chunk = chunk;
  l.abort = abort.has_value() ? abort->data_ptr<int64_t>() : nullptr;
  return l;
}

// Returns the seconds spent waiting (0 when the chunk was already there).
double wait_landed(const Landing& l, int64_t k) {
  if (l.flags[k] >= l.ticket) {
    std::atomic_thread_fence(std::memory_order_acquire);
    return 0.0;
  }
  const auto start = std::chrono::steady_clock::now();
  for (int64_t spin = 0; l.flags[k] < l.ticket; ++spin) {
    TORCH_CHECK(l.abort == nullptr || *l.abort == 0, "the gradient stream was aborted");
    TORCH_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(120),
                "gradient chunk ", k, " never landed (no copy for 120 s)");
    if (spin < 256) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs ``body`` on each chunk once it has landed; returns the seconds spent waiting for chunks, so that
// the caller can tell the update's own time from the gradient stream's.
template <typename F>
double for_each_landed(int64_t n, const Landing& l, F&& body) {
  const int64_t step = l.flags != nullptr ? l.chunk : std::max<int64_t>(n, 1);
  double waited = 0.0;
  for (int64_t a = 0, k = 0; a < n; a += step, ++k) {
    if (l.flags != nullptr) waited += wait_landed(l, k);
    body(a, std::min(n, a + step));
  }
  return waited;
}

// ---- rows: an embedding's update in two parts (engine: the rows a step's tokens touched, and the rest) ----
// A unit seen as rows of ``len`` elements; ``ids``: sorted, unique row indices. Touched: those rows, their
// gradient packed in ``ids``' order (count x len elements, landing chunk by chunk like a unit's). Untouched:
// every other element of the unit (the rows not in ``ids`` and any padding after the last row), with a zero
// gradient (none given), or ``dense``: read at their own places in a whole unit's gradient (a tied
// embedding's head gradient), landing chunk by chunk. The two parts cover the unit once, and each element
// gets the dense kernel's arithmetic, so the parts together equal one update of the whole unit.
struct Rows {
  const int64_t* ids = nullptr;
  int64_t count = 0, len = 0;
  bool touched = false, dense = false;
};

// Unit elements [begin, end), whose gradient starts at element ``grad`` of the packed rows (-1: zeros).
struct Segment {
  int64_t begin, end, grad;
};

alignas(64) const float kZeros[kBlock] = {};  // the untouched part's gradient (0 in fp32, bf16 and fp16 alike)

// The part ``ids`` names (none: the whole unit), its gradient's size checked: the packed touched rows,
// nothing or the whole unit for the untouched part, else the whole unit.
Rows rows_of(const c10::optional<torch::Tensor>& ids, int64_t len, bool touched, int64_t n, const torch::Tensor& grad) {
  Rows r;
  if (!ids.has_value()) {
    TORCH_CHECK(grad.is_cpu() && grad.is_contiguous() && grad.numel() == n,
                "grad: a contiguous CPU tensor of ", n, " elements (the unit)");
    return r;
  }
  TORCH_CHECK(ids->is_cpu() && ids->is_contiguous() && ids->scalar_type() == at::kLong, "rows: a contiguous int64 CPU tensor");
  TORCH_CHECK(len > 0, "row_len must be positive");
  r.ids = ids->data_ptr<int64_t>();
  r.count = ids->numel();
  r.len = len;
  r.touched = touched;
  for (int64_t k = 0; k < r.count; ++k)
    TORCH_CHECK(r.ids[k] >= 0 && (r.ids[k] + 1) * len <= n && (k == 0 || r.ids[k] > r.ids[k - 1]),
                "rows: sorted, unique row indices inside the unit");
  r.dense = !touched && grad.numel() == n;
  TORCH_CHECK(grad.is_cpu() && grad.is_contiguous() &&
                  (touched ? grad.numel() == r.count * len : grad.numel() == 0 || r.dense),
              "grad: a contiguous CPU tensor of ", touched ? r.count * len : n, " elements (",
              touched ? "the touched rows, packed" : "the unit, or none for a zero gradient", ")");
  return r;
}

// The elements the gradient given has (what its landing flags count): the packed rows, or the unit's.
int64_t grad_numel(const Rows& r, int64_t n) { return r.ids != nullptr && r.touched ? r.count * r.len : n; }

// The touched rows' segments for packed elements [a, b) (one landed chunk), adjacent rows merged up to kBlock.
std::vector<Segment> touched_segments(const Rows& r, int64_t a, int64_t b) {
  std::vector<Segment> out;
  for (int64_t k = a / r.len; k * r.len < b; ++k) {
    const int64_t s = std::max(a, k * r.len), e = std::min(b, (k + 1) * r.len);
    const int64_t begin = r.ids[k] * r.len + (s - k * r.len);
    if (!out.empty() && out.back().end == begin && out.back().grad + (out.back().end - out.back().begin) == s &&
        out.back().end - out.back().begin + (e - s) <= kBlock) {
      out.back().end += e - s;
    } else {
      out.push_back({begin, begin + (e - s), s});
    }
  }
  return out;
}

// The untouched part's segments among unit elements [a, b), each at most kBlock (the zeros' length); a
// dense gradient is read at the segment's own place.
std::vector<Segment> untouched_segments(const Rows& r, int64_t a, int64_t b) {
  std::vector<Segment> out;
  auto gap = [&](int64_t begin, int64_t end) {
    begin = std::max(begin, a), end = std::min(end, b);
    for (int64_t s = begin; s < end; s += kBlock) out.push_back({s, std::min(end, s + kBlock), r.dense ? s : -1});
  };
  int64_t next = a;
  for (const int64_t* k = std::lower_bound(r.ids, r.ids + r.count, a / r.len);  // (the rows ending after a)
       k < r.ids + r.count && *k * r.len < b; ++k) {
    gap(next, *k * r.len);
    next = (*k + 1) * r.len;
  }
  gap(next, b);
  return out;
}

template <typename F>
void run_segments(const std::vector<Segment>& segs, int64_t threads, F&& fn) {
  const int64_t n = static_cast<int64_t>(segs.size()), t = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  if (t == 1) {
    for (const auto& s : segs) fn(s);
    return;
  }
  std::atomic<int64_t> next{0};
  const std::function<void(int64_t)> task = [&](int64_t k) {
    if (k >= t) return;
    for (int64_t j; (j = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(segs[j]);
  };
  pool_of(threads).run(task);
}

// Runs fn(segment) over the part ``r`` names, touched rows chunk by chunk as they land; returns the
// seconds spent waiting for chunks.
template <typename F>
double for_each_row_segment(int64_t n, const Rows& r, const Landing& l, int64_t threads, F&& fn) {
  if (r.dense) {
    return for_each_landed(n, l, [&](int64_t a, int64_t b) { run_segments(untouched_segments(r, a, b), threads, fn); });
  }
  if (!r.touched) {
    run_segments(untouched_segments(r, 0, n), threads, fn);
    return 0.0;
  }
  return for_each_landed(r.count * r.len, l, [&](int64_t a, int64_t b) {
    run_segments(touched_segments(r, a, b), threads, fn);
  });
}

template <typename T>
const T* grad_of(const T* g, const Segment& s) {
  return s.grad >= 0 ? g + s.grad : reinterpret_cast<const T*>(kZeros);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does; branch-free to vectorize
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(f != f ? 0x7fc0u : rounded);
}

struct F32 { using T = float; static float load(float x) { return x; } };
struct BF16 { using T = uint16_t; static float load(uint16_t x) { return bf16_to_f32(x); }
              static uint16_t store(float x) { return f32_to_bf16(x); } };
struct F16 { using T = at::Half; static float load(at::Half x) { return static_cast<float>(x); }
             static at::Half store(float x) { return at::Half(x); } };
struct None { using T = uint8_t; };

// Where a unit's state is read from (p0, m0, v0) and written to (p, m, v): the same buffers for an update
// in place, others for one out of place (a speculative update under clipping, engine/runtime.py, which
// keeps the old state until the global norm says whether the update stands). Each element is read
// before it is written, so in place the two may alias.
template <typename T>
struct State {
  const T *p0, *m0, *v0;
  T *p, *m, *v;
};

template <typename G, typename O, bool LerpLow>
void run_range(const State<float> st, const typename G::T* __restrict g, typename O::T* __restrict out,
               int64_t begin, int64_t end, const Hyper hp) {
  // Copies of the hyperparameters in registers: stores through p/m/v cannot alias them.
  const float decay = hp.lr_wd_decay, w1 = hp.w1, b2 = hp.beta2, omb2 = hp.one_minus_beta2, eps = hp.eps;
  const float step_size = hp.step_size, bc2_sqrt = hp.bc2_sqrt, coef = hp.coef;
  const float *p0 = st.p0, *m0 = st.m0, *v0 = st.v0;
  float *p = st.p, *m = st.m, *v = st.v;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float gi = G::load(g[i]) * coef;
    const float mi0 = m0[i];
    // torch's lerp(a, b, w): a + w * (b - a) for w < 0.5, else b - (b - a) * (1 - w)
    const float mi = LerpLow ? mi0 + w1 * (gi - mi0) : gi - (gi - mi0) * (1.0f - w1);
    const float vi = v0[i] * b2 + omb2 * gi * gi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    const float pi = p0[i] * decay - step_size * mi / denom;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (!std::is_same_v<O, None>) out[i] = O::store(pi);
  }
}

#ifdef SF_AVX512
// The hot case by hand (bf16 gradient in, bf16 copy out), 16 lanes at a time, bit-identical to the
// scalar loop. The copy goes out with non-temporal stores (an ordinary store first reads each line: 30
// instead of 28 bytes per parameter). On the H200 host it runs at 5.2-5.7 G params/s against torch's
// fused kernel's 4.3-4.6; whether the software prefetch 1 KB ahead helps is not settled (+13% in one
// run, -13% in another: within the run-to-run spread, bench/NOTES.md session 3).
#ifndef SF_PREFETCH
#define SF_PREFETCH 1024
#endif
template <bool LerpLow>
int64_t run_range_avx512(const State<float> st, const uint16_t* __restrict g, uint16_t* __restrict out,
                         int64_t begin, int64_t end, const Hyper hp) {
  const float *p0 = st.p0, *m0 = st.m0, *v0 = st.v0;
  float *p = st.p, *m = st.m, *v = st.v;
  const __m512 decay = _mm512_set1_ps(hp.lr_wd_decay), w1 = _mm512_set1_ps(hp.w1),
               omw1 = _mm512_set1_ps(1.0f - hp.w1), b2 = _mm512_set1_ps(hp.beta2),
               omb2 = _mm512_set1_ps(hp.one_minus_beta2), eps = _mm512_set1_ps(hp.eps),
               step_size = _mm512_set1_ps(hp.step_size), coef = _mm512_set1_ps(hp.coef);
  const __m512 bc2_sqrt = _mm512_set1_ps(hp.bc2_sqrt);
  const __m512i round = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), qnan = _mm512_set1_epi32(0x7fc0);
  int64_t i = begin;
  // Non-temporal stores need 32-byte alignment of the copy: the scalar loop takes the lanes before it.
  while (i < end && (reinterpret_cast<uintptr_t>(out + i) & 31u) != 0) ++i;
  const int64_t head = i;
  run_range<BF16, BF16, LerpLow>(st, g, out, begin, head, hp);
  // Out of place (a speculative update into a spare state) the destination is not in cache: ordinary
  // stores would first read each line (40 instead of 28 bytes a parameter), non-temporal ones do not.
  // (SF_STREAM_IN_PLACE: in place too, a build the optimizer benchmark compares; bench/NOTES.md, table18)
#ifndef SF_STREAM_IN_PLACE
#define SF_STREAM_IN_PLACE 0
#endif
  const bool stream = (p != p0 || SF_STREAM_IN_PLACE) &&
                      ((reinterpret_cast<uintptr_t>(p + i) | reinterpret_cast<uintptr_t>(m + i) |
                        reinterpret_cast<uintptr_t>(v + i)) & 63u) == 0;
  for (; i + 16 <= end; i += 16) {
#if SF_PREFETCH > 0
    _mm_prefetch(reinterpret_cast<const char*>(p0 + i) + SF_PREFETCH, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m0 + i) + SF_PREFETCH, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v0 + i) + SF_PREFETCH, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(g + i) + SF_PREFETCH / 2, _MM_HINT_T0);
#endif
    const __m256i graw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i));
    const __m512 gi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(graw), 16)), coef);
    const __m512 mold = _mm512_loadu_ps(m0 + i);
    const __m512 d = _mm512_sub_ps(gi, mold);
    const __m512 mi = LerpLow ? _mm512_fmadd_ps(w1, d, mold) : _mm512_fnmadd_ps(d, omw1, gi);
    const __m512 vi = _mm512_fmadd_ps(_mm512_loadu_ps(v0 + i), b2, _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2_sqrt), eps);
    const __m512 pi = _mm512_fmsub_ps(_mm512_loadu_ps(p0 + i), decay, _mm512_div_ps(_mm512_mul_ps(step_size, mi), denom));
    if (stream) {
      _mm512_stream_ps(p + i, pi);
      _mm512_stream_ps(m + i, mi);
      _mm512_stream_ps(v + i, vi);
    } else {
      _mm512_storeu_ps(p + i, pi);
      _mm512_storeu_ps(m + i, mi);
      _mm512_storeu_ps(v + i, vi);
    }
    // round to nearest even as f32_to_bf16 does; NaN lanes become the canonical quiet NaN
    const __m512i bits = _mm512_castps_si512(pi);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, round),
                                                   _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(pi, pi, _CMP_UNORD_Q), qnan);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
  return i;
}
#endif

template <typename G, typename O>
void run(const State<float> st, const typename G::T* g, typename O::T* out, int64_t begin, int64_t end, Hyper h,
         int64_t threads) {
  parallel_ranges(begin, end, threads, [&](int64_t b, int64_t e) {
#ifdef SF_AVX512
    if constexpr (std::is_same_v<G, BF16> && std::is_same_v<O, BF16>) {
      b = h.w1 < 0.5f ? run_range_avx512<true>(st, g, out, b, e, h) : run_range_avx512<false>(st, g, out, b, e, h);
      _mm_sfence();  // the streamed copy is visible before the caller records its host-to-device copy
    }
#endif
    if (h.w1 < 0.5f) run_range<G, O, true>(st, g, out, b, e, h);
    else run_range<G, O, false>(st, g, out, b, e, h);
  });
}

// One row segment: the dense kernel on pointers moved to the segment's start.
template <typename G, typename O>
void run_segment(const State<float> st, const typename G::T* g, typename O::T* out, const Segment& s, Hyper h) {
  const int64_t b = s.begin, len = s.end - s.begin;
  const State<float> at{st.p0 + b, st.m0 + b, st.v0 + b, st.p + b, st.m + b, st.v + b};
  const auto* gs = grad_of(g, s);
  auto* os = out == nullptr ? out : out + b;
  int64_t i = 0;
#ifdef SF_AVX512
  if constexpr (std::is_same_v<G, BF16> && std::is_same_v<O, BF16>) {
    i = h.w1 < 0.5f ? run_range_avx512<true>(at, gs, os, 0, len, h) : run_range_avx512<false>(at, gs, os, 0, len, h);
    _mm_sfence();
  }
#endif
  if (h.w1 < 0.5f) run_range<G, O, true>(at, gs, os, i, len, h);
  else run_range<G, O, false>(at, gs, os, i, len, h);
}

template <typename G>
void segment_out(const State<float> st, const torch::Tensor& g, const c10::optional<torch::Tensor>& out,
                 const Segment& s, Hyper h) {
  auto* gp = reinterpret_cast<const typename G::T*>(g.data_ptr());
  if (!out.has_value()) run_segment<G, None>(st, gp, nullptr, s, h);
  else if (out->scalar_type() == at::kBFloat16) run_segment<G, BF16>(st, gp, reinterpret_cast<uint16_t*>(out->data_ptr()), s, h);
  else run_segment<G, F16>(st, gp, reinterpret_cast<at::Half*>(out->data_ptr()), s, h);
}

template <typename G>
void dispatch_out(const State<float> st, const torch::Tensor& g, const c10::optional<torch::Tensor>& out,
                  int64_t begin, int64_t end, Hyper h, int64_t threads) {
  auto* gp = reinterpret_cast<const typename G::T*>(g.data_ptr());
  if (!out.has_value()) {
    run<G, None>(st, gp, nullptr, begin, end, h, threads);
  } else if (out->scalar_type() == at::kBFloat16) {
    run<G, BF16>(st, gp, reinterpret_cast<uint16_t*>(out->data_ptr()), begin, end, h, threads);
  } else {
    run<G, F16>(st, gp, reinterpret_cast<at::Half*>(out->data_ptr()), begin, end, h, threads);
  }
}

// The state an update reads: ``src`` (master, moments) when given, else the buffers it writes.
template <typename T>
State<T> state_of(const std::vector<torch::Tensor>& dst, const c10::optional<std::vector<torch::Tensor>>& src,
                  at::ScalarType dtype) {
  const int64_t n = dst[0].numel();
  if (src.has_value()) {
    TORCH_CHECK(src->size() == dst.size(), "src: one tensor per state tensor");
    for (size_t k = 0; k < dst.size(); ++k)
      TORCH_CHECK((*src)[k].is_cpu() && (*src)[k].is_contiguous() && (*src)[k].scalar_type() == dtype &&
                      (*src)[k].numel() == n,
                  "src: contiguous CPU tensors of the state's dtype and size");
  }
  const auto& in = src.has_value() ? *src : dst;
  auto ptr = [](const torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); };
  return State<T>{ptr(in[0]), ptr(in[1]), ptr(in[2]), ptr(dst[0]), ptr(dst[1]), ptr(dst[2])};
}

double adamw_step(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                  c10::optional<torch::Tensor> out, int64_t step, double lr, double beta1, double beta2, double eps,
                  double weight_decay, double grad_coef, int64_t threads, c10::optional<torch::Tensor> flags,
                  int64_t ticket, int64_t chunk, c10::optional<torch::Tensor> abort,
                  c10::optional<std::vector<torch::Tensor>> src, c10::optional<torch::Tensor> rows,
                  int64_t row_len, bool touched) {
  for (const auto* t : {&param, &exp_avg, &exp_avg_sq})
    TORCH_CHECK(t->is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat, "master and moments: contiguous fp32 CPU");
  const int64_t n = param.numel();
  TORCH_CHECK(exp_avg.numel() == n && exp_avg_sq.numel() == n, "sizes differ");
  const Rows r = rows_of(rows, row_len, touched, n, grad);
  TORCH_CHECK(r.ids == nullptr || !src.has_value(), "a row update is in place");
  if (out.has_value()) {
    TORCH_CHECK(out->is_cpu() && out->is_contiguous() && out->numel() == n, "out: contiguous CPU tensor of the same size");
    TORCH_CHECK(out->scalar_type() == at::kBFloat16 || out->scalar_type() == at::kHalf, "out: bf16 or fp16");
  }
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16 || grad.scalar_type() == at::kHalf,
              "grad must be fp32, bf16 or fp16");
  const Hyper h = make_hyper(step, lr, beta1, beta2, eps, weight_decay, grad_coef);
  const Landing landing = landing_of(flags, ticket, chunk, abort, grad_numel(r, n));
  const State<float> st = state_of<float>({param, exp_avg, exp_avg_sq}, src, at::kFloat);
  pybind11::gil_scoped_release no_gil;
  if (r.ids != nullptr) {
    // (the untouched part reads zeros in the gradient's type: the same code path as the dense update's)
    return for_each_row_segment(n, r, landing, threads, [&](const Segment& seg) {
      switch (grad.scalar_type()) {
        case at::kFloat: segment_out<F32>(st, grad, out, seg, h); break;
        case at::kBFloat16: segment_out<BF16>(st, grad, out, seg, h); break;
        default: segment_out<F16>(st, grad, out, seg, h); break;
      }
    });
  }
  return for_each_landed(n, landing, [&](int64_t b, int64_t e) {
    switch (grad.scalar_type()) {
      case at::kFloat: dispatch_out<F32>(st, grad, out, b, e, h, threads); break;
      case at::kBFloat16: dispatch_out<BF16>(st, grad, out, b, e, h, threads); break;
      default: dispatch_out<F16>(st, grad, out, b, e, h, threads); break;
    }
  });
}


// ---- compact state: bf16 master with a bf16 compensation term, bf16 moments with stochastic rounding ----
// 8 bytes of state per parameter instead of 12 (+2 for the bf16 copy, which here is the master's high
// half itself), and 18 bytes of traffic per update instead of 28. The master is hi + lo, both bf16
// (about 16 significant bits); the moments are rounded stochastically so that updates smaller than a
// bf16 step (v's decay by beta2 = 0.999, for one) still move them on average. The random bits are a
// hash of (seed, index): the same step gives the same bits, so resume stays bit-identical.

inline uint32_t mix32(uint32_t x) {  // lowbias32 (Chris Wellons): a cheap, well-mixed integer hash
  x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
  return x;
}

inline uint16_t f32_to_bf16_sr(float f, uint32_t noise16) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + noise16) >> 16);
}

// The compact state read (hi0, lo0, m0, v0) and written (hi, lo, m, v): the same buffers in place.
struct CompactState {
  const uint16_t *hi0, *lo0, *m0, *v0;
  uint16_t *hi, *lo, *m, *v;
};

template <typename G>
void compact_range(const CompactState st, const typename G::T* __restrict g, int64_t begin, int64_t end,
                   const Hyper hp, uint32_t seed_m, uint32_t seed_v, int64_t offset) {
  const float decay = hp.lr_wd_decay, w1 = hp.w1, b2 = hp.beta2, omb2 = hp.one_minus_beta2, eps = hp.eps;
  const float step_size = hp.step_size, bc2_sqrt = hp.bc2_sqrt, coef = hp.coef;
  const uint16_t *hi0 = st.hi0, *lo0 = st.lo0, *m0 = st.m0, *v0 = st.v0;
  uint16_t *hi = st.hi, *lo = st.lo, *m = st.m, *v = st.v;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float gi = G::load(g[i]) * coef;
    const float mi0 = bf16_to_f32(m0[i]);
    const float mi = w1 < 0.5f ? mi0 + w1 * (gi - mi0) : gi - (gi - mi0) * (1.0f - w1);
    const float vi = bf16_to_f32(v0[i]) * b2 + omb2 * gi * gi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    const float p0 = bf16_to_f32(hi0[i]) + bf16_to_f32(lo0[i]);
    const float pi = p0 * decay - step_size * mi / denom;
    const uint16_t h = f32_to_bf16(pi);
    hi[i] = h;
    lo[i] = f32_to_bf16(pi - bf16_to_f32(h));
    const uint32_t idx = static_cast<uint32_t>(offset + i);  // the position in the unit: chunking keeps the bits
    m[i] = f32_to_bf16_sr(mi, mix32(idx ^ seed_m) & 0xffffu);
    v[i] = f32_to_bf16_sr(vi, mix32(idx ^ seed_v) & 0xffffu);
  }
}

// The compact update spelled out in AVX-512 for a bf16 gradient, bit-identical to compact_range (tests/
// test_optim.py compares it with the optimizer benchmark's `compact_scalar` build, the compiler's vector
// code of compact_range): 7.57 against 6.99 G params/s on the H200 host, 2.10 against 1.99 a core in cache
// on the development machine (bench/results/2026-11-30-optimizer-d1e6a3a.jsonl, bench/NOTES.md session 8).
// Returns where it stopped.
#ifndef SF_COMPACT_AVX512
#define SF_COMPACT_AVX512 1
#endif
#if defined(SF_AVX512) && SF_COMPACT_AVX512
inline __m512i mix32x16(__m512i x) {  // mix32, 16 lanes
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline void store_high_halves(uint16_t* p, __m512i bits) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

inline __m512i round_bf16x16(__m512 f) {  // f32_to_bf16 in the high halves: nearest even, NaN quiet
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)),
                                     _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
}

template <bool LerpLow>
int64_t compact_range_avx512(const CompactState st, const uint16_t* __restrict g, int64_t begin, int64_t end,
                             const Hyper hp, uint32_t seed_m, uint32_t seed_v, int64_t offset) {
  const __m512 decay = _mm512_set1_ps(hp.lr_wd_decay), w1 = _mm512_set1_ps(hp.w1),
               omw1 = _mm512_set1_ps(1.0f - hp.w1), b2 = _mm512_set1_ps(hp.beta2),
               omb2 = _mm512_set1_ps(hp.one_minus_beta2), eps = _mm512_set1_ps(hp.eps),
               step_size = _mm512_set1_ps(hp.step_size), coef = _mm512_set1_ps(hp.coef),
               bc2_sqrt = _mm512_set1_ps(hp.bc2_sqrt);
  const __m512i sm = _mm512_set1_epi32(static_cast<int>(seed_m)), sv = _mm512_set1_epi32(static_cast<int>(seed_v)),
                low16 = _mm512_set1_epi32(0xffff),
                lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 gi = _mm512_mul_ps(load_bf16x16(g + i), coef);
    const __m512 mold = load_bf16x16(st.m0 + i);
    const __m512 d = _mm512_sub_ps(gi, mold);
    const __m512 mi = LerpLow ? _mm512_fmadd_ps(w1, d, mold) : _mm512_fnmadd_ps(d, omw1, gi);
    const __m512 vi = _mm512_fmadd_ps(load_bf16x16(st.v0 + i), b2, _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2_sqrt), eps);
    const __m512 p0 = _mm512_add_ps(load_bf16x16(st.hi0 + i), load_bf16x16(st.lo0 + i));
    const __m512 pi = _mm512_fmsub_ps(p0, decay, _mm512_div_ps(_mm512_mul_ps(step_size, mi), denom));
    const __m512i h = round_bf16x16(pi);
    const __m512 hf = _mm512_castsi512_ps(_mm512_andnot_si512(low16, h));  // the bf16 value, as fp32
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset + i))), lanes);
    store_high_halves(st.hi + i, h);
    store_high_halves(st.lo + i, round_bf16x16(_mm512_sub_ps(pi, hf)));
    store_high_halves(st.m + i, _mm512_add_epi32(_mm512_castps_si512(mi),
                                                 _mm512_and_si512(mix32x16(_mm512_xor_si512(idx, sm)), low16)));
    store_high_halves(st.v + i, _mm512_add_epi32(_mm512_castps_si512(vi),
                                                 _mm512_and_si512(mix32x16(_mm512_xor_si512(idx, sv)), low16)));
  }
  return i;
}
#endif

double adamw_step_compact(torch::Tensor hi, torch::Tensor lo, torch::Tensor grad, torch::Tensor exp_avg,
                          torch::Tensor exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double eps,
                          double weight_decay, double grad_coef, int64_t seed, int64_t offset, int64_t threads,
                          c10::optional<torch::Tensor> flags, int64_t ticket, int64_t chunk,
                          c10::optional<torch::Tensor> abort, c10::optional<std::vector<torch::Tensor>> src,
                          c10::optional<torch::Tensor> rows, int64_t row_len, bool touched) {
  const int64_t n = hi.numel();
  for (const auto* t : {&hi, &lo, &exp_avg, &exp_avg_sq})
    TORCH_CHECK(t->is_cpu() && t->is_contiguous() && t->scalar_type() == at::kBFloat16 && t->numel() == n,
                "compact state: contiguous bf16 CPU tensors of one size");
  const Rows r = rows_of(rows, row_len, touched, n, grad);
  TORCH_CHECK(r.ids == nullptr || !src.has_value(), "a row update is in place");
  const Hyper h = make_hyper(step, lr, beta1, beta2, eps, weight_decay, grad_coef);
  const uint32_t base = mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(step)));
  const uint32_t seed_m = mix32(base ^ 0x6d6d6d6du), seed_v = mix32(base ^ 0x76767676u);
  const std::vector<torch::Tensor> dst{hi, lo, exp_avg, exp_avg_sq};
  if (src.has_value()) {
    TORCH_CHECK(src->size() == 4, "src: hi, lo, exp_avg, exp_avg_sq");
    for (const auto& t : *src)
      TORCH_CHECK(t.is_cpu() && t.is_contiguous() && t.scalar_type() == at::kBFloat16 && t.numel() == n,
                  "src: contiguous bf16 CPU tensors of the state's size");
  }
  const auto& in = src.has_value() ? *src : dst;
  auto ptr = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  const CompactState st{ptr(in[0]), ptr(in[1]), ptr(in[2]), ptr(in[3]), ptr(hi), ptr(lo), ptr(exp_avg), ptr(exp_avg_sq)};
  const bool bf16_grad = grad.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16_grad || grad.scalar_type() == at::kFloat, "grad must be bf16 or fp32");
  const Landing landing = landing_of(flags, ticket, chunk, abort, grad_numel(r, n));
  pybind11::gil_scoped_release no_gil;
  if (r.ids != nullptr) {  // each segment on pointers moved to its start, its rounding bits hashed from there
    return for_each_row_segment(n, r, landing, threads, [&](const Segment& seg) {
      const int64_t b = seg.begin, len = seg.end - seg.begin;
      const CompactState at{st.hi0 + b, st.lo0 + b, st.m0 + b, st.v0 + b, st.hi + b, st.lo + b, st.m + b, st.v + b};
      if (bf16_grad) {
        const auto* g = grad_of(reinterpret_cast<const uint16_t*>(grad.data_ptr()), seg);
        int64_t i = 0;
#if defined(SF_AVX512) && SF_COMPACT_AVX512
        i = h.w1 < 0.5f ? compact_range_avx512<true>(at, g, 0, len, h, seed_m, seed_v, offset + b)
                        : compact_range_avx512<false>(at, g, 0, len, h, seed_m, seed_v, offset + b);
#endif
        compact_range<BF16>(at, g, i, len, h, seed_m, seed_v, offset + b);
      } else {
        compact_range<F32>(at, grad_of(reinterpret_cast<const float*>(grad.data_ptr()), seg), 0, len, h, seed_m,
                           seed_v, offset + b);
      }
    });
  }
  return for_each_landed(n, landing, [&](int64_t begin, int64_t end) {
    parallel_ranges(begin, end, threads, [&](int64_t b, int64_t e) {
      if (bf16_grad) {
        const auto* g = reinterpret_cast<const uint16_t*>(grad.data_ptr());
#if defined(SF_AVX512) && SF_COMPACT_AVX512
        b = h.w1 < 0.5f ? compact_range_avx512<true>(st, g, b, e, h, seed_m, seed_v, offset)
                        : compact_range_avx512<false>(st, g, b, e, h, seed_m, seed_v, offset);
#endif
        compact_range<BF16>(st, g, b, e, h, seed_m, seed_v, offset);  // (all of it, or the lanes after)
      } else {
        compact_range<F32>(st, grad.data_ptr<float>(), b, e, h, seed_m, seed_v, offset);
      }
    });
  });
}

// ---- 8-bit state: the compact master, moments as 8-bit codes with an fp32 scale per block (optim/formats.py) ----
// A moment buffer holds n codes, then n / kBlock8 fp32 scales. A block's new moments are computed in fp32
// and used unrounded for this step's update; then each is stored as the nearest code of the sorted
// dynamic map, after division by the block's absolute maximum (optim/adamw.py adamw_8bit_, the reference).
constexpr int64_t kBlock8 = 128;

struct Moments8 {
  const uint8_t* codes0;
  const float* scales0;
  uint8_t* codes;
  float* scales;
};

// The nearest code of y (in [-1, 1]) by two lookups on its top 16 bits (optim/formats.py code_tables: the
// code is base[k], plus one past the bucket's threshold), equal to the binary search over the map.
struct CodeTable {
  const int32_t* base;
  const float* threshold;
};

// The table lookups one element at a time: scalar loads issue two a cycle, where vector gathers of the
// same loads ran the update 3x slower on the development host.
__attribute__((optimize("no-tree-vectorize"))) void lookup_codes(const float* __restrict y, uint8_t* __restrict codes,
                                                                   const CodeTable t) {
  for (int64_t k = 0; k < kBlock8; ++k) {
    uint32_t bits;
    std::memcpy(&bits, &y[k], 4);
    const uint32_t b = bits >> 16;
    codes[k] = static_cast<uint8_t>(t.base[b] + (y[k] >= t.threshold[b] ? 1 : 0));
  }
}

__attribute__((optimize("no-tree-vectorize"))) void lookup_values(const uint8_t* __restrict codes,
                                                                    const float* __restrict q, float* __restrict out) {
  for (int64_t k = 0; k < kBlock8; ++k) out[k] = q[codes[k]];
}

// Without contracted multiply-adds (GCC's per-function option): a value one rounding off its PyTorch
// reference's lands on the other side of a code's midpoint about once in a thousand elements a step, and
// the codes then differ for good; unfused, the kernel is the reference's arithmetic.
template <typename G>
__attribute__((optimize("fp-contract=off"))) void range_8bit(const uint16_t* hi0, const uint16_t* lo0, uint16_t* hi, uint16_t* lo, const Moments8 m,
                const Moments8 v, const typename G::T* __restrict g, int64_t begin, int64_t end, const Hyper hp,
                const float* __restrict qs, const float* __restrict qu, const CodeTable ts, const CodeTable tu) {
  const float decay = hp.lr_wd_decay, w1 = hp.w1, omb2 = hp.one_minus_beta2, eps = hp.eps;
  const float step_size = hp.step_size, bc2_sqrt = hp.bc2_sqrt, coef = hp.coef;
  alignas(64) float mv[kBlock8], vv[kBlock8], m0[kBlock8], v0[kBlock8];
  for (int64_t b = begin; b < end; b += kBlock8) {
    const int64_t j = b / kBlock8;
    const float sm0 = m.scales0[j], sv0 = v.scales0[j];
    float am = 0.0f, av = 0.0f;
    int nan_m = 0, nan_v = 0;  // (max() drops a NaN; the reference's block maximum keeps it)
    lookup_values(m.codes0 + b, qs, m0);
    lookup_values(v.codes0 + b, qu, v0);
#pragma omp simd reduction(max : am, av) reduction(| : nan_m, nan_v)
    for (int64_t k = 0; k < kBlock8; ++k) {
      const int64_t i = b + k;
      const float gi = G::load(g[i]) * coef;
      const float mi0 = m0[k] * sm0, vi0 = v0[k] * sv0;
      // torch's lerp(a, b, w): a + w * (b - a) for w < 0.5, else b - (b - a) * (1 - w)
      const float mi = w1 < 0.5f ? mi0 + w1 * (gi - mi0) : gi - (gi - mi0) * (1.0f - w1);
      const float g2 = gi * gi;
      const float vi = omb2 < 0.5f ? vi0 + omb2 * (g2 - vi0) : g2 - (g2 - vi0) * (1.0f - omb2);
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      const float pi = (bf16_to_f32(hi0[i]) + bf16_to_f32(lo0[i])) * decay - step_size * mi / denom;
      const uint16_t h = f32_to_bf16(pi);
      hi[i] = h;
      lo[i] = f32_to_bf16(pi - bf16_to_f32(h));
      mv[k] = mi;
      vv[k] = vi;
      am = std::max(am, std::fabs(mi));
      av = std::max(av, std::fabs(vi));
      nan_m |= mi != mi;
      nan_v |= vi != vi;
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float sm = nan_m ? nan : std::max(am, 1e-12f), sv = nan_v ? nan : std::max(av, 1e-12f);
#pragma omp simd
    for (int64_t k = 0; k < kBlock8; ++k) {
      mv[k] /= sm;
      vv[k] /= sv;
    }
    lookup_codes(mv, m.codes + b, ts);
    lookup_codes(vv, v.codes + b, tu);
    m.scales[j] = sm;
    v.scales[j] = sv;
  }
}

double adamw_step_8bit(torch::Tensor hi, torch::Tensor lo, torch::Tensor grad, torch::Tensor exp_avg,
                       torch::Tensor exp_avg_sq, torch::Tensor qmap_signed, torch::Tensor qmap_unsigned,
                       torch::Tensor base_signed, torch::Tensor threshold_signed, torch::Tensor base_unsigned,
                       torch::Tensor threshold_unsigned, int64_t step,
                       double lr, double beta1, double beta2, double eps, double weight_decay, double grad_coef,
                       int64_t threads, c10::optional<torch::Tensor> flags, int64_t ticket, int64_t chunk,
                       c10::optional<torch::Tensor> abort, c10::optional<std::vector<torch::Tensor>> src,
                       c10::optional<torch::Tensor> rows, int64_t row_len, bool touched) {
  const int64_t n = hi.numel(), bytes = n + 4 * (n / kBlock8);
  TORCH_CHECK(n % kBlock8 == 0, "8-bit state: units padded to ", kBlock8, " elements");
  auto check = [&](const torch::Tensor& h, const torch::Tensor& l, const torch::Tensor& a, const torch::Tensor& b) {
    for (const auto* t : {&h, &l})
      TORCH_CHECK(t->is_cpu() && t->is_contiguous() && t->scalar_type() == at::kBFloat16 && t->numel() == n,
                  "8-bit state: contiguous bf16 CPU master halves of one size");
    for (const auto* t : {&a, &b})
      TORCH_CHECK(t->is_cpu() && t->is_contiguous() && t->scalar_type() == at::kByte && t->numel() == bytes &&
                      reinterpret_cast<uintptr_t>(t->data_ptr()) % 4 == 0,
                  "8-bit state: moments as contiguous 4-byte-aligned uint8 CPU buffers of n codes and n/",
                  kBlock8, " fp32 scales");
  };
  check(hi, lo, exp_avg, exp_avg_sq);
  for (const auto* q : {&qmap_signed, &qmap_unsigned})
    TORCH_CHECK(q->is_cpu() && q->is_contiguous() && q->scalar_type() == at::kFloat && q->numel() == 256,
                "qmap: 256 fp32 values");
  for (const auto* b : {&base_signed, &base_unsigned})
    TORCH_CHECK(b->is_cpu() && b->is_contiguous() && b->scalar_type() == at::kInt && b->numel() == 65536,
                "code table base: 65536 int32");
  for (const auto* t : {&threshold_signed, &threshold_unsigned})
    TORCH_CHECK(t->is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == 65536,
                "code table threshold: 65536 fp32");
  const CodeTable ts{base_signed.data_ptr<int32_t>(), threshold_signed.data_ptr<float>()};
  const CodeTable tu{base_unsigned.data_ptr<int32_t>(), threshold_unsigned.data_ptr<float>()};
  const Rows r = rows_of(rows, row_len, touched, n, grad);
  TORCH_CHECK(r.ids == nullptr || (!src.has_value() && row_len % kBlock8 == 0),
              "a row update is in place, on rows of whole 8-bit blocks");
  if (src.has_value()) {
    TORCH_CHECK(src->size() == 4, "src: hi, lo, exp_avg, exp_avg_sq");
    check((*src)[0], (*src)[1], (*src)[2], (*src)[3]);
  }
  const Hyper h = make_hyper(step, lr, beta1, beta2, eps, weight_decay, grad_coef);
  const std::vector<torch::Tensor> dst{hi, lo, exp_avg, exp_avg_sq};
  const auto& in = src.has_value() ? *src : dst;
  auto u16 = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  auto moments = [&](const torch::Tensor& from, const torch::Tensor& to) {
    auto* f = reinterpret_cast<uint8_t*>(from.data_ptr());
    auto* t = reinterpret_cast<uint8_t*>(to.data_ptr());
    return Moments8{f, reinterpret_cast<const float*>(f + n), t, reinterpret_cast<float*>(t + n)};
  };
  const Moments8 m = moments(in[2], exp_avg), v = moments(in[3], exp_avg_sq);
  const uint16_t *hi0 = u16(in[0]), *lo0 = u16(in[1]);
  const float *qs = qmap_signed.data_ptr<float>(), *qu = qmap_unsigned.data_ptr<float>();
  const bool bf16_grad = grad.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16_grad || grad.scalar_type() == at::kFloat, "grad must be bf16 or fp32");
  const Landing landing = landing_of(flags, ticket, chunk, abort, grad_numel(r, n));
  TORCH_CHECK(landing.flags == nullptr || chunk % kBlock8 == 0, "gradient chunks of whole 8-bit blocks");
  pybind11::gil_scoped_release no_gil;
  if (r.ids != nullptr) {  // segments of whole blocks (rows, chunks and kBlock are): pointers moved to the start
    return for_each_row_segment(n, r, landing, threads, [&](const Segment& seg) {
      const int64_t b = seg.begin, len = seg.end - seg.begin, j = b / kBlock8;
      const Moments8 ms{m.codes0 + b, m.scales0 + j, m.codes + b, m.scales + j};
      const Moments8 vs{v.codes0 + b, v.scales0 + j, v.codes + b, v.scales + j};
      if (bf16_grad)
        range_8bit<BF16>(hi0 + b, lo0 + b, u16(hi) + b, u16(lo) + b, ms, vs,
                         grad_of(reinterpret_cast<const uint16_t*>(grad.data_ptr()), seg), 0, len, h, qs, qu, ts, tu);
      else
        range_8bit<F32>(hi0 + b, lo0 + b, u16(hi) + b, u16(lo) + b, ms, vs,
                        grad_of(reinterpret_cast<const float*>(grad.data_ptr()), seg), 0, len, h, qs, qu, ts, tu);
    });
  }
  return for_each_landed(n, landing, [&](int64_t begin, int64_t end) {
    parallel_ranges(begin, end, threads, [&](int64_t b, int64_t e) {  // (blocks of kBlock, whole 8-bit blocks)
      if (bf16_grad)
        range_8bit<BF16>(hi0, lo0, u16(hi), u16(lo), m, v, reinterpret_cast<const uint16_t*>(grad.data_ptr()), b, e,
                         h, qs, qu, ts, tu);
      else
        range_8bit<F32>(hi0, lo0, u16(hi), u16(lo), m, v, grad.data_ptr<float>(), b, e, h, qs, qu, ts, tu);
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pybind11::literals;
  m.def("adamw_step", &adamw_step, "one-pass AdamW (fp32 master and moments, optional bf16/fp16 copy out); returns the seconds it waited for gradient chunks",
        "param"_a, "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, "out"_a, "step"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a,
        "weight_decay"_a, "grad_coef"_a, "threads"_a, "flags"_a = pybind11::none(), "ticket"_a = 0, "chunk"_a = 0,
        "abort"_a = pybind11::none(), "src"_a = pybind11::none(),
        "rows"_a = pybind11::none(), "row_len"_a = 0, "touched"_a = true);
  m.def("adamw_step_compact", &adamw_step_compact, "one-pass AdamW on compact state (bf16 hi/lo master, bf16 moments); returns the seconds it waited for gradient chunks",
        "hi"_a, "lo"_a, "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, "step"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a,
        "weight_decay"_a, "grad_coef"_a, "seed"_a, "offset"_a, "threads"_a, "flags"_a = pybind11::none(),
        "ticket"_a = 0, "chunk"_a = 0, "abort"_a = pybind11::none(), "src"_a = pybind11::none(),
        "rows"_a = pybind11::none(), "row_len"_a = 0, "touched"_a = true);
  m.def("adamw_step_8bit", &adamw_step_8bit, "one-pass AdamW on 8-bit state (bf16 hi/lo master, 8-bit block-quantized moments); returns the seconds it waited for gradient chunks",
        "hi"_a, "lo"_a, "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, "qmap_signed"_a, "qmap_unsigned"_a,
        "base_signed"_a, "threshold_signed"_a, "base_unsigned"_a, "threshold_unsigned"_a, "step"_a, "lr"_a,
        "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "grad_coef"_a, "threads"_a, "flags"_a = pybind11::none(),
        "ticket"_a = 0, "chunk"_a = 0, "abort"_a = pybind11::none(), "src"_a = pybind11::none(),
        "rows"_a = pybind11::none(), "row_len"_a = 0, "touched"_a = true);
}
