// CPU optimizer steps (Adam/AdamW, Adagrad, Lion) for ZeRO-Offload-style training.
//
// fp32 params and states; grads in fp32, bf16 or fp16; optional fused copy-back of the updated
// params into bf16/fp16 (or fp32) tensors, done chunk by chunk right after each chunk's update
// while it is still in cache, instead of in a second sweep over memory.
//
// Vectorisation: the element loops are written once (inline templates) and instantiated inside
// wrappers compiled for AVX-512 and AVX2+FMA with GCC/Clang target attributes, plus a generic
// build (SSE2 on x86-64, NEON on aarch64, where NEON is the baseline ISA). The compiler
// vectorises each wrapper for its ISA (`#pragma omp simd`); the wrapper is chosen at run time
// from the CPU's flags (`__builtin_cpu_supports`), or forced by name for tests.
// Threads: one OpenMP parallel region per step over fixed-size chunks of every tensor, so
// many small tensors and a few huge ones both spread evenly over the cores. The team size is
// process-wide (set_num_threads), not OpenMP's per-thread ICV: offload steps run on worker
// threads, which would otherwise get OMP_NUM_THREADS (1 under torchrun). The schedule is the
// caller's: "static" gives each thread one contiguous share of the chunks; "dynamic" lets the
// threads take chunks one at a time, so a thread the OS deschedules (the training process's
// other threads share the cores) does not hold the whole step up.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <atomic>
#include <chrono>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define SLIPSTREAM_HAS_STREAM_STORES 1
#endif

namespace {

// Threads every step's parallel region uses; 0 = OpenMP's default for the calling thread.
std::atomic<int> g_threads{0};

inline int step_threads() {
#ifdef _OPENMP
  const int chosen = g_threads.load(std::memory_order_relaxed);
  return chosen > 0 ? chosen : omp_get_max_threads();
#else
  return 1;
#endif
}

// How the last Adam step called from this thread spent its time (benchmarks read it through
// last_step_stats()): the parallel region's wall time and, per thread, when it started and
// ended its share, counted from the region's start. With the static schedule every thread has
// the same work, so a thread that ends far later than the mean was descheduled or starved;
// one that starts late was not running when the region forked.
struct StepStats {
  double wall = 0.0;
  std::vector<double> starts;
  std::vector<double> ends;
};
thread_local StepStats g_stats;

inline double seconds_since(std::chrono::steady_clock::time_point origin) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin).count();
}

inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Sets the schedule of the parallel loops below (schedule(runtime)) for the calling thread,
// which is the one that starts their parallel region.
void apply_schedule(const std::string& schedule) {
  TORCH_CHECK(schedule == "static" || schedule == "dynamic",
              "CPU optimizer schedule must be 'static' or 'dynamic', got '", schedule, "'");
#ifdef _OPENMP
  if (schedule == "dynamic") {
    omp_set_schedule(omp_sched_dynamic, 1);
  } else {
    omp_set_schedule(omp_sched_static, 0);
  }
#endif
}

// Everything the per-ISA runners call is force-inlined: a helper the inliner leaves out of line
// would be compiled for the baseline ISA only, losing the AVX2/AVX-512 code for that loop.
#define SLIPSTREAM_INLINE inline __attribute__((always_inline))

constexpr int64_t kChunk = 1 << 14;  // elements per work item (64 KiB of fp32 per stream)

enum class Kind : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

SLIPSTREAM_INLINE float bf16_to_float(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

SLIPSTREAM_INLINE uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  // Round to nearest even; NaN stays NaN (quiet bit set) instead of rounding into infinity.
  uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);
  uint32_t nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : (rounded >> 16));
}

#if defined(__FLT16_MAX__)
// _Float16 conversions compile to F16C / AVX-512 conversion instructions and vectorise.
SLIPSTREAM_INLINE float half_to_float(uint16_t bits) {
  _Float16 value;
  std::memcpy(&value, &bits, sizeof(value));
  return static_cast<float>(value);
}

SLIPSTREAM_INLINE uint16_t float_to_half(float value) {
  _Float16 half = static_cast<_Float16>(value);
  uint16_t bits;
  std::memcpy(&bits, &half, sizeof(bits));
  return bits;
}
#else
SLIPSTREAM_INLINE float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

SLIPSTREAM_INLINE uint16_t float_to_half(float value) { return c10::Half(value).x; }
#endif

// Storage of a grad or a param copy: fp32 as float, bf16/fp16 as their 16-bit patterns.
template <Kind K>
using Storage = std::conditional_t<K == Kind::kF32, float, uint16_t>;

template <Kind K>
SLIPSTREAM_INLINE float load(const Storage<K>* __restrict base, int64_t i) {
  if constexpr (K == Kind::kF32) {
    return base[i];
  } else if constexpr (K == Kind::kBF16) {
    return bf16_to_float(base[i]);
  } else {
    return half_to_float(base[i]);
  }
}

template <Kind K>
SLIPSTREAM_INLINE void store(Storage<K>* __restrict base, int64_t i, float value) {
  if constexpr (K == Kind::kF32) {
    base[i] = value;
  } else if constexpr (K == Kind::kBF16) {
    base[i] = float_to_bf16(value);
  } else if constexpr (K == Kind::kF16) {
    base[i] = float_to_half(value);
  }
}

// The copy-back as a second, simple loop over the span just updated (64 KiB of fp32, still in
// L2): the compiler vectorises this loop reliably, where one extra 16-bit store stream inside
// the optimizer loop can make it give up on the whole loop. fp16 goes through _Float16 /
// c10::Half conversions, which vectorise only on CPUs with AVX-512 FP16, so fp16 copies are
// slower than bf16 ones.
template <Kind C>
SLIPSTREAM_INLINE void copy_span(const float* __restrict p, Storage<C>* __restrict copy, int64_t n) {
  if constexpr (C != Kind::kNone) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store<C>(copy, i, p[i]);
  }
}

enum Stores : int { kMixed = 0, kStream = 1, kStreamOut = 3 };

struct AdamArgs {
  float beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bc2, decay_factor;
  bool adam_w;
  float grad_scale;  // unscale and clip folded into the load (1.0: exact no-op)
  // 1 - beta computed in double and rounded once, as torch does: 1.0f - float(0.999) is
  // 1.3e-5 away from float(0.001), which shifts every second moment by that much.
  float one_minus_beta1, one_minus_beta2;
  // How the step moves memory (never what it computes): kMixed, the earlier kernel (adam_span
  // in place, adam_span_out out of place); kStream (adam_span_stream): every result block by
  // block with non-temporal stores of store_bytes each (0: the widest the ISA has), each
  // block's inputs prefetched prefetch elements ahead (0: none); kStreamOut: adam_span_stream out of place, adam_span in place.
  int stores = 0;
  int store_bytes = 0;
  int64_t prefetch = 0;
};

// AdamArgs' scalars as local values for one element loop. Every Adam loop reads them from
// here, not from the AdamArgs reference: a load through the reference inside the loop is one
// the vectoriser must prove loop-invariant, and where the loop is inlined into a large runner
// it can fail to, leaving the loop scalar (several times slower, and with other roundings:
// the vector loop fuses the multiply-adds its own way).
struct AdamScalars {
  float beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bc2, decay_factor, grad_scale;
  float one_minus_beta1, one_minus_beta2;
  bool adam_w;
};

inline AdamScalars scalars_of(const AdamArgs& a) {
  return AdamScalars{a.beta1,           a.beta2,        a.eps,
                     a.weight_decay,    a.step_size,    a.inv_sqrt_bc2,
                     a.decay_factor,    a.grad_scale,   a.one_minus_beta1,
                     a.one_minus_beta2, a.adam_w};
}

// One element of Adam/AdamW: the gradient as read (widened), the master, both moments in;
// the new values out through w, m, v. Every Adam path uses exactly these expressions.
SLIPSTREAM_INLINE void adam_element(const AdamScalars& k, float raw_grad, float& w, float& m,
                                    float& v) {
  float g = raw_grad * k.grad_scale;
  if (!k.adam_w) g += k.weight_decay * w;  // L2 mode: the moments see the decay
  float mi = k.beta1 * m + k.one_minus_beta1 * g;
  float vi = k.beta2 * v + k.one_minus_beta2 * g * g;
  float denom = std::sqrt(vi) * k.inv_sqrt_bc2 + k.eps;
  if (k.adam_w) w *= k.decay_factor;
  w -= k.step_size * (mi / denom);
  m = mi;
  v = vi;
}

struct AdagradArgs {
  float lr, eps, weight_decay;
  float grad_scale;
};

struct LionArgs {
  float lr, beta1, beta2, decay_factor;
  float grad_scale;
  float one_minus_beta1, one_minus_beta2;  // rounded once from double (see AdamArgs)
};

// One contiguous span of one tensor; the element loops below run over a span.
struct Span {
  float* param;
  const void* grad;
  float* state1;
  float* state2;
  void* copy;
  int64_t length;
  Kind grad_kind;
  Kind copy_kind;
  // Out of place (Adam only): the updated param and states go here and the inputs above are
  // left untouched. nullptr: in place.
  float* param_out = nullptr;
  float* state1_out = nullptr;
  float* state2_out = nullptr;
};

// Writes n floats from src (in L1) to dst with non-temporal stores where the CPU has them:
// an out-of-place update's destinations are not in cache, and ordinary stores would first read
// every destination line from memory (read-for-ownership), 12 more bytes per element for a
// step that is bound by memory bandwidth. Callers fence once per span (store_fence).
SLIPSTREAM_INLINE void stream_floats(float* __restrict dst, const float* __restrict src,
                                     int64_t n) {
  int64_t i = 0;
#ifdef SLIPSTREAM_HAS_STREAM_STORES
  while (i < n && (reinterpret_cast<uintptr_t>(dst + i) & 15u) != 0) {
    dst[i] = src[i];
    ++i;
  }
  for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

SLIPSTREAM_INLINE void store_fence() {
#ifdef SLIPSTREAM_HAS_STREAM_STORES
  _mm_sfence();  // non-temporal stores are weakly ordered: publish them before returning
#endif
}

// Non-temporal stores of W floats (16, 8 or 4: one 64-byte line, 32 or 16 bytes) from src to a
// dst aligned to W * 4 bytes. Inline assembly, not intrinsics: this template is inlined into the
// per-ISA runners, and an AVX/AVX-512 intrinsic called from a function compiled for the
// baseline ISA does not compile (GCC: "target specific option mismatch"); the assembly takes
// its register from the runner's ISA after inlining.
template <int W>
SLIPSTREAM_INLINE void stream_vector(char* dst, const char* src) {
#ifdef SLIPSTREAM_HAS_STREAM_STORES
  typedef float Vector __attribute__((vector_size(W * 4), aligned(4)));
  Vector value;
  std::memcpy(&value, src, sizeof(value));
  if constexpr (W == 16) {
    asm volatile("vmovntps %1, %0" : "=m"(*reinterpret_cast<Vector*>(dst)) : "v"(value));
  } else if constexpr (W == 8) {
    asm volatile("vmovntps %1, %0" : "=m"(*reinterpret_cast<Vector*>(dst)) : "x"(value));
  } else {
    asm volatile("movntps %1, %0" : "=m"(*reinterpret_cast<Vector*>(dst)) : "x"(value));
  }
#else
  std::memcpy(dst, src, W * 4);
#endif
}

// Writes bytes from src (in L1) to dst: plain stores up to dst's first W * 4-byte boundary and
// after its last, non-temporal stores of W * 4 bytes in between (whole 64-byte lines with
// W = 16: the line goes to memory in one write, with no read-for-ownership and no partial
// write-combining flush). Callers fence once per span (store_fence).
template <int W>
SLIPSTREAM_INLINE void stream_bytes(void* dst_, const void* src_, int64_t bytes) {
  char* dst = static_cast<char*>(dst_);
  const char* src = static_cast<const char*>(src_);
  constexpr int64_t kWidth = W * 4;
  int64_t head = static_cast<int64_t>((-reinterpret_cast<uintptr_t>(dst)) & (kWidth - 1));
  if (head > bytes) head = bytes;
  std::memcpy(dst, src, static_cast<size_t>(head));
  int64_t i = head;
  for (; i + kWidth <= bytes; i += kWidth) stream_vector<W>(dst + i, src + i);
  std::memcpy(dst + i, src + i, static_cast<size_t>(bytes - i));
}

// Software prefetch of n elements of a 4-byte (fp32) or 2-byte (bf16/fp16) stream, one
// prefetch per 64-byte line, into L1 (the hardware prefetchers stop at 4 KiB page boundaries;
// these do not).
SLIPSTREAM_INLINE void prefetch_lines(const void* base, int64_t bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

constexpr int64_t kOutBlock = 512;  // elements per block of the blocked paths (2 KiB of fp32)
constexpr int64_t kPrefetchPiece = 64;  // elements per prefetch step of adam_span_stream

// The streaming step (AdamArgs::stores == kStream), in place or out of place: a block at a time into L1
// buffers, then every result (the param, both moments and the model-dtype copy) leaves with
// non-temporal stores of W floats. Per element the CPU then moves exactly what the step needs
// through memory: the inputs once (14 B with a bf16 gradient) and the outputs once (12 B, plus
// 2 for a bf16 copy), with no read-for-ownership of any output line and, in place, no dirty
// line left to write back later from the caches. AdamArgs::prefetch issues the inputs' loads
// that many elements ahead.
template <Kind G, Kind C, int W>
SLIPSTREAM_INLINE void adam_span_stream(const Span& s, const AdamArgs& a) {
  alignas(64) float wb[kOutBlock];
  alignas(64) float mb[kOutBlock];
  alignas(64) float vb[kOutBlock];
  alignas(64) Storage<C> cb[C == Kind::kNone ? 1 : kOutBlock];
  const Storage<G>* grad = static_cast<const Storage<G>*>(s.grad);
  float* po = s.param_out != nullptr ? s.param_out : s.param;
  float* mo = s.state1_out != nullptr ? s.state1_out : s.state1;
  float* vo = s.state2_out != nullptr ? s.state2_out : s.state2;
  Storage<C>* copy = static_cast<Storage<C>*>(s.copy);
  const AdamScalars k = scalars_of(a);
  const int64_t ahead = a.prefetch;
  for (int64_t start = 0; start < s.length; start += kOutBlock) {
    const int64_t n = std::min(kOutBlock, s.length - start);
    // With prefetch, the block is updated 64 elements (a line of each fp32 stream x 4) at a
    // time, each piece after the prefetches of the piece `ahead` elements further on: the
    // prefetches go out evenly instead of in one burst that fills the line-fill buffers.
    const int64_t piece = ahead > 0 ? kPrefetchPiece : n;
    for (int64_t at = 0; at < n; at += piece) {
      const int64_t count = std::min(piece, n - at);
      const int64_t from = start + at + ahead;
      if (ahead > 0 && from < s.length) {
        const int64_t lines = std::min(count, s.length - from);
        prefetch_lines(s.param + from, lines * 4);
        prefetch_lines(s.state1 + from, lines * 4);
        prefetch_lines(s.state2 + from, lines * 4);
        prefetch_lines(grad + from, lines * static_cast<int64_t>(sizeof(Storage<G>)));
      }
      // The loop of adam_span_out, word for word (the same code, so the same roundings).
      const float* __restrict p = s.param + start + at;
      const float* __restrict m = s.state1 + start + at;
      const float* __restrict v = s.state2 + start + at;
      const Storage<G>* __restrict g = grad + start + at;
      float* __restrict wp = wb + at;
      float* __restrict mp = mb + at;
      float* __restrict vp = vb + at;
#pragma omp simd
      for (int64_t i = 0; i < count; ++i) {
        float w = p[i], mi = m[i], vi = v[i];
        adam_element(k, load<G>(g, i), w, mi, vi);
        mp[i] = mi;
        vp[i] = vi;
        wp[i] = w;
      }
    }  // in place, the stores below overwrite what p, m and v pointed at: after their scope
    stream_bytes<W>(po + start, wb, n * 4);
    stream_bytes<W>(mo + start, mb, n * 4);
    stream_bytes<W>(vo + start, vb, n * 4);
    if constexpr (C != Kind::kNone) {
      copy_span<C>(wb, cb, n);
      stream_bytes<W>(copy + start, cb, n * static_cast<int64_t>(sizeof(Storage<C>)));
    }
  }
  store_fence();
}

// The store width (in floats) a runner whose widest is `widest` uses for store_bytes (0: widest).
inline int stream_width(int store_bytes, int widest) {
  const int wanted = store_bytes == 0 ? widest : store_bytes / 4;
  return std::min(wanted, widest);
}

template <Kind G, Kind C>
SLIPSTREAM_INLINE void adam_span_stream4(const Span& s, const AdamArgs& a) {
  adam_span_stream<G, C, 4>(s, a);
}
template <Kind G, Kind C>
SLIPSTREAM_INLINE void adam_span_stream8(const Span& s, const AdamArgs& a) {
  adam_span_stream<G, C, 8>(s, a);
}
template <Kind G, Kind C>
SLIPSTREAM_INLINE void adam_span_stream16(const Span& s, const AdamArgs& a) {
  adam_span_stream<G, C, 16>(s, a);
}

template <Kind G, Kind C>
SLIPSTREAM_INLINE void adam_span(const Span& s, const AdamArgs& a) {
  float* __restrict p = s.param;
  float* __restrict m = s.state1;
  float* __restrict v = s.state2;
  const Storage<G>* __restrict grad = static_cast<const Storage<G>*>(s.grad);
  Storage<C>* __restrict copy = static_cast<Storage<C>*>(s.copy);
  const AdamScalars k = scalars_of(a);
#pragma omp simd
  for (int64_t i = 0; i < s.length; ++i) {
    float w = p[i], mi = m[i], vi = v[i];
    adam_element(k, load<G>(grad, i), w, mi, vi);
    m[i] = mi;
    v[i] = vi;
    p[i] = w;
  }
  copy_span<C>(p, copy, s.length);
}

// Out of place: the same arithmetic as adam_span, a block at a time into L1 buffers that are
// then streamed to the outputs (the element loop stays one the compiler vectorises).

template <Kind G, Kind C>
SLIPSTREAM_INLINE void adam_span_out(const Span& s, const AdamArgs& a) {
  alignas(64) float wb[kOutBlock];
  alignas(64) float mb[kOutBlock];
  alignas(64) float vb[kOutBlock];
  const Storage<G>* grad_base = static_cast<const Storage<G>*>(s.grad);
  Storage<C>* copy_base = static_cast<Storage<C>*>(s.copy);
  const AdamScalars k = scalars_of(a);
  for (int64_t start = 0; start < s.length; start += kOutBlock) {
    const int64_t n = std::min(kOutBlock, s.length - start);
    const float* __restrict p = s.param + start;
    const float* __restrict m = s.state1 + start;
    const float* __restrict v = s.state2 + start;
    const Storage<G>* __restrict grad = grad_base + start;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      float w = p[i], mi = m[i], vi = v[i];
      adam_element(k, load<G>(grad, i), w, mi, vi);
      mb[i] = mi;
      vb[i] = vi;
      wb[i] = w;
    }
    stream_floats(s.param_out + start, wb, n);
    stream_floats(s.state1_out + start, mb, n);
    stream_floats(s.state2_out + start, vb, n);
    if constexpr (C != Kind::kNone) copy_span<C>(wb, copy_base + start, n);
  }
  store_fence();
}

// Memory probes (memory_probe): Adam's data movement without its arithmetic, to measure what
// the host's memory gives a step of this shape. kRead reads param, both states and the gradient
// (14 B per element with bf16 gradients) and writes nothing; kCopy also writes three fp32
// outputs as adam_span_stream does (out of place, or over the inputs); kWrite only writes them.
enum class Probe : int { kRead = 0, kCopy = 1, kWrite = 2 };

template <Kind G, int W>
SLIPSTREAM_INLINE float probe_span(const Span& s, Probe mode) {
  const Storage<G>* grad = static_cast<const Storage<G>*>(s.grad);
  if (mode == Probe::kRead) {
    const float* __restrict p = s.param;
    const float* __restrict m = s.state1;
    const float* __restrict v = s.state2;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < s.length; ++i) acc += p[i] + m[i] + v[i] + load<G>(grad, i);
    return acc;
  }
  alignas(64) float wb[kOutBlock];
  alignas(64) float mb[kOutBlock];
  alignas(64) float vb[kOutBlock];
  if (mode == Probe::kWrite) {
    for (int64_t i = 0; i < kOutBlock; ++i) wb[i] = mb[i] = vb[i] = 0.0f;
  }
  float* po = s.param_out != nullptr ? s.param_out : s.param;
  float* mo = s.state1_out != nullptr ? s.state1_out : s.state1;
  float* vo = s.state2_out != nullptr ? s.state2_out : s.state2;
  for (int64_t start = 0; start < s.length; start += kOutBlock) {
    const int64_t n = std::min(kOutBlock, s.length - start);
    if (mode == Probe::kCopy) {
      const float* __restrict p = s.param + start;
      const float* __restrict m = s.state1 + start;
      const float* __restrict v = s.state2 + start;
      const Storage<G>* __restrict g = grad + start;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        wb[i] = p[i] + load<G>(g, i);
        mb[i] = m[i];
        vb[i] = v[i];
      }
    }
    stream_bytes<W>(po + start, wb, n * 4);
    stream_bytes<W>(mo + start, mb, n * 4);
    stream_bytes<W>(vo + start, vb, n * 4);
  }
  store_fence();
  return 0.0f;
}

template <int W>
SLIPSTREAM_INLINE float probe_dispatch(const Span& s, Probe mode) {
  switch (s.grad_kind) {
    case Kind::kF32: return probe_span<Kind::kF32, W>(s, mode);
    case Kind::kBF16: return probe_span<Kind::kBF16, W>(s, mode);
    default: return probe_span<Kind::kF16, W>(s, mode);
  }
}

template <Kind G, Kind C>
SLIPSTREAM_INLINE void adagrad_span(const Span& s, const AdagradArgs& a) {
  float* __restrict p = s.param;
  float* __restrict sum = s.state1;
  const Storage<G>* __restrict grad = static_cast<const Storage<G>*>(s.grad);
  Storage<C>* __restrict copy = static_cast<Storage<C>*>(s.copy);
#pragma omp simd
  for (int64_t i = 0; i < s.length; ++i) {
    float w = p[i];
    float g = load<G>(grad, i) * a.grad_scale + a.weight_decay * w;
    float acc = sum[i] + g * g;
    w -= a.lr * (g / (std::sqrt(acc) + a.eps));
    sum[i] = acc;
    p[i] = w;
  }
  copy_span<C>(p, copy, s.length);
}

template <Kind G, Kind C>
SLIPSTREAM_INLINE void lion_span(const Span& s, const LionArgs& a) {
  float* __restrict p = s.param;
  float* __restrict m = s.state1;
  const Storage<G>* __restrict grad = static_cast<const Storage<G>*>(s.grad);
  Storage<C>* __restrict copy = static_cast<Storage<C>*>(s.copy);
#pragma omp simd
  for (int64_t i = 0; i < s.length; ++i) {
    float g = load<G>(grad, i) * a.grad_scale;
    float mi = m[i];
    float direction = a.beta1 * mi + a.one_minus_beta1 * g;
    float sign = direction > 0.0f ? 1.0f : (direction < 0.0f ? -1.0f : 0.0f);
    float w = p[i] * a.decay_factor - a.lr * sign;
    m[i] = a.beta2 * mi + a.one_minus_beta2 * g;
    p[i] = w;
  }
  copy_span<C>(p, copy, s.length);
}

// Picks the template instance for a span's (grad kind, copy kind): 3 x 4 combinations.
#define SLIPSTREAM_DISPATCH(FN, SPAN, ARGS)                                              \
  do {                                                                                   \
    switch (static_cast<int>((SPAN).grad_kind) * 4 + static_cast<int>((SPAN).copy_kind)) { \
      case 0: FN<Kind::kF32, Kind::kF32>(SPAN, ARGS); break;                             \
      case 1: FN<Kind::kF32, Kind::kBF16>(SPAN, ARGS); break;                            \
      case 2: FN<Kind::kF32, Kind::kF16>(SPAN, ARGS); break;                             \
      case 3: FN<Kind::kF32, Kind::kNone>(SPAN, ARGS); break;                            \
      case 4: FN<Kind::kBF16, Kind::kF32>(SPAN, ARGS); break;                            \
      case 5: FN<Kind::kBF16, Kind::kBF16>(SPAN, ARGS); break;                           \
      case 6: FN<Kind::kBF16, Kind::kF16>(SPAN, ARGS); break;                            \
      case 7: FN<Kind::kBF16, Kind::kNone>(SPAN, ARGS); break;                           \
      case 8: FN<Kind::kF16, Kind::kF32>(SPAN, ARGS); break;                             \
      case 9: FN<Kind::kF16, Kind::kBF16>(SPAN, ARGS); break;                            \
      case 10: FN<Kind::kF16, Kind::kF16>(SPAN, ARGS); break;                            \
      default: FN<Kind::kF16, Kind::kNone>(SPAN, ARGS); break;                           \
    }                                                                                    \
  } while (0)

// The parallel loop over every span, compiled once per ISA by the macro below.
// WIDEST: the widest non-temporal store of the ISA, in floats (16: AVX-512, 8: AVX2, 4: SSE2).
#define SLIPSTREAM_DEFINE_RUNNERS(SUFFIX, ATTRIBUTE, WIDEST)                                  \
  ATTRIBUTE void adam_run_##SUFFIX(const std::vector<Span>& spans, const AdamArgs& a,         \
                                   StepStats& stats) {                                        \
    const int64_t count = static_cast<int64_t>(spans.size());                                 \
    const auto origin = std::chrono::steady_clock::now();                                     \
    _Pragma("omp parallel num_threads(step_threads())") {                                     \
      const double begin = seconds_since(origin);                                             \
      _Pragma("omp for schedule(runtime) nowait") for (int64_t k = 0; k < count; ++k) {       \
        if (a.stores == kStream || (a.stores == kStreamOut && spans[k].param_out != nullptr)) { \
          const int width = stream_width(a.store_bytes, WIDEST);                              \
          if constexpr (WIDEST >= 16) {                                                       \
            if (width == 16) SLIPSTREAM_DISPATCH(adam_span_stream16, spans[k], a);            \
          }                                                                                   \
          if constexpr (WIDEST >= 8) {                                                        \
            if (width == 8) SLIPSTREAM_DISPATCH(adam_span_stream8, spans[k], a);              \
          }                                                                                   \
          if (width == 4) SLIPSTREAM_DISPATCH(adam_span_stream4, spans[k], a);                \
        } else if (spans[k].param_out != nullptr) {                                           \
          SLIPSTREAM_DISPATCH(adam_span_out, spans[k], a);                                    \
        } else {                                                                              \
          SLIPSTREAM_DISPATCH(adam_span, spans[k], a);                                        \
        }                                                                                     \
      }                                                                                       \
      const size_t me = static_cast<size_t>(thread_index());                                  \
      if (me < stats.starts.size()) {                                                         \
        stats.starts[me] = begin;                                                             \
        stats.ends[me] = seconds_since(origin);                                               \
      }                                                                                       \
    }                                                                                         \
    stats.wall = seconds_since(origin);                                                       \
  }                                                                                           \
  ATTRIBUTE double probe_run_##SUFFIX(const std::vector<Span>& spans, Probe mode,              \
                                     int store_bytes) {                                       \
    const int64_t count = static_cast<int64_t>(spans.size());                                 \
    const int width = stream_width(store_bytes, WIDEST);                                      \
    double total = 0.0;                                                                       \
    _Pragma("omp parallel for schedule(runtime) reduction(+ : total) num_threads(step_threads())") \
    for (int64_t k = 0; k < count; ++k) {                                                     \
      float part = 0.0f;                                                                      \
      if constexpr (WIDEST >= 16) {                                                           \
        if (width == 16) part = probe_dispatch<16>(spans[k], mode);                           \
      }                                                                                       \
      if constexpr (WIDEST >= 8) {                                                            \
        if (width == 8) part = probe_dispatch<8>(spans[k], mode);                             \
      }                                                                                       \
      if (width == 4) part = probe_dispatch<4>(spans[k], mode);                               \
      total += part;                                                                          \
    }                                                                                         \
    return total;                                                                             \
  }                                                                                           \
  ATTRIBUTE void adagrad_run_##SUFFIX(const std::vector<Span>& spans, const AdagradArgs& a) { \
    const int64_t count = static_cast<int64_t>(spans.size());                                 \
    _Pragma("omp parallel for schedule(runtime) num_threads(step_threads())") for (int64_t k = 0; k < count; ++k) {        \
      SLIPSTREAM_DISPATCH(adagrad_span, spans[k], a);                                         \
    }                                                                                         \
  }                                                                                           \
  ATTRIBUTE void lion_run_##SUFFIX(const std::vector<Span>& spans, const LionArgs& a) {       \
    const int64_t count = static_cast<int64_t>(spans.size());                                 \
    _Pragma("omp parallel for schedule(runtime) num_threads(step_threads())") for (int64_t k = 0; k < count; ++k) {        \
      SLIPSTREAM_DISPATCH(lion_span, spans[k], a);                                            \
    }                                                                                         \
  }

SLIPSTREAM_DEFINE_RUNNERS(generic, , 4)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SLIPSTREAM_HAS_X86_CLONES 1
SLIPSTREAM_DEFINE_RUNNERS(avx2, __attribute__((target("avx2,fma,f16c"))), 8)
SLIPSTREAM_DEFINE_RUNNERS(avx512,
                          __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))),
                          16)
#endif

std::vector<std::string> supported_isas() {
  std::vector<std::string> isas;
#ifdef SLIPSTREAM_HAS_X86_CLONES
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    isas.push_back("avx512");
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isas.push_back("avx2");
#endif
  isas.push_back("generic");
  return isas;
}

std::string resolve_isa(const std::string& requested) {
  auto isas = supported_isas();
  if (requested.empty() || requested == "auto") return isas.front();
  if (std::find(isas.begin(), isas.end(), requested) == isas.end()) {
    std::string known;
    for (const auto& name : isas) known += (known.empty() ? "" : ", ") + name;
    TORCH_CHECK(false, "CPU optimizer ISA '", requested, "' is not supported on this CPU (or ",
                "this build); supported: ", known);
  }
  return requested;
}

Kind kind_of(const at::Tensor& t, const char* what, bool allow_f32) {
  switch (t.scalar_type()) {
    case at::kFloat:
      TORCH_CHECK(allow_f32, what, " must be bf16 or fp16");
      return Kind::kF32;
    case at::kBFloat16:
      return Kind::kBF16;
    case at::kHalf:
      return Kind::kF16;
    default:
      TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return Kind::kNone;
}

void check_tensor(const at::Tensor& t, const char* what, int64_t numel, size_t index) {
  TORCH_CHECK(t.device().is_cpu(), what, " ", index, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), what, " ", index, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, what, " ", index, " has ", t.numel(),
              " elements but its param has ", numel);
}

void check_fp32(const at::Tensor& t, const char* what, size_t index) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, " ", index,
              " must be float32 (the CPU optimizers keep fp32 params and states), got ",
              t.scalar_type());
}

// Splits every tensor into kChunk-element spans (the unit of parallel work).
std::vector<Span> make_spans(const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& grads,
                             const std::vector<at::Tensor>& state1,
                             const std::vector<at::Tensor>* state2,
                             const std::vector<at::Tensor>& copies) {
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && state1.size() == count &&
                  (state2 == nullptr || state2->size() == count) &&
                  (copies.empty() || copies.size() == count),
              "CPU optimizer: params, grads, states (and copies) must have equal lengths");
  std::vector<Span> spans;
  for (size_t t = 0; t < count; ++t) {
    const int64_t n = params[t].numel();
    check_fp32(params[t], "param", t);
    check_tensor(params[t], "param", n, t);
    check_tensor(grads[t], "grad", n, t);
    check_fp32(state1[t], "state", t);
    check_tensor(state1[t], "state", n, t);
    if (state2 != nullptr) {
      check_fp32((*state2)[t], "state", t);
      check_tensor((*state2)[t], "state", n, t);
    }
    Kind grad_kind = kind_of(grads[t], "grad", true);
    Kind copy_kind = Kind::kNone;
    char* copy_base = nullptr;
    if (!copies.empty()) {
      check_tensor(copies[t], "param copy", n, t);
      copy_kind = kind_of(copies[t], "param copy", true);
      copy_base = static_cast<char*>(copies[t].data_ptr());
    }
    float* p = params[t].data_ptr<float>();
    const char* g = static_cast<const char*>(grads[t].data_ptr());
    float* s1 = state1[t].data_ptr<float>();
    float* s2 = state2 == nullptr ? nullptr : (*state2)[t].data_ptr<float>();
    const int64_t grad_size = grads[t].element_size();
    const int64_t copy_size = copies.empty() ? 0 : copies[t].element_size();
    for (int64_t start = 0; start < n; start += kChunk) {
      Span span;
      span.param = p + start;
      span.grad = g + start * grad_size;
      span.state1 = s1 + start;
      span.state2 = s2 == nullptr ? nullptr : s2 + start;
      span.copy = copy_base == nullptr ? nullptr : copy_base + start * copy_size;
      span.length = std::min(kChunk, n - start);
      span.grad_kind = grad_kind;
      span.copy_kind = copy_kind;
      spans.push_back(span);
    }
  }
  return spans;
}

// Points every span of make_spans(params, ...) at its slice of the out-of-place outputs.
void set_outputs(std::vector<Span>& spans, const std::vector<at::Tensor>& params,
                 const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& state1,
                 const std::vector<at::Tensor>& state2, const std::vector<at::Tensor>& copies,
                 const std::vector<at::Tensor>& params_out,
                 const std::vector<at::Tensor>& state1_out,
                 const std::vector<at::Tensor>& state2_out) {
  const size_t count = params.size();
  TORCH_CHECK(params_out.size() == count && state1_out.size() == count &&
                  state2_out.size() == count,
              "adam out of place: params_out, exp_avgs_out and exp_avg_sqs_out must each have "
              "one tensor per param");
  size_t next = 0;
  for (size_t t = 0; t < count; ++t) {
    const int64_t n = params[t].numel();
    const std::vector<const at::Tensor*> outs = {&params_out[t], &state1_out[t], &state2_out[t]};
    for (const at::Tensor* out : outs) {
      check_fp32(*out, "output", t);
      check_tensor(*out, "output", n, t);
      // An output must not share memory with any input of its param (the kernel reads the
      // inputs after it has started writing the outputs).
      const char* lo = static_cast<const char*>(out->data_ptr());
      const char* hi = lo + n * 4;
      std::vector<const at::Tensor*> inputs = {&params[t], &grads[t], &state1[t], &state2[t]};
      if (!copies.empty()) inputs.push_back(&copies[t]);
      for (const at::Tensor* in : inputs) {
        const char* in_lo = static_cast<const char*>(in->data_ptr());
        const char* in_hi = in_lo + in->numel() * in->element_size();
        TORCH_CHECK(hi <= in_lo || in_hi <= lo, "adam out of place: output ", t,
                    " overlaps an input of the same param; use the in-place step instead");
      }
    }
    float* po = params_out[t].data_ptr<float>();
    float* mo = state1_out[t].data_ptr<float>();
    float* vo = state2_out[t].data_ptr<float>();
    for (int64_t start = 0; start < n; start += kChunk, ++next) {
      spans[next].param_out = po + start;
      spans[next].state1_out = mo + start;
      spans[next].state2_out = vo + start;
    }
  }
}

void check_memory_options(int64_t store_bytes, int64_t prefetch) {
  TORCH_CHECK(store_bytes == 0 || store_bytes == 16 || store_bytes == 32 || store_bytes == 64,
              "CPU optimizer store_bytes must be 0 (the widest the ISA has), 16, 32 or 64, got ",
              store_bytes);
  TORCH_CHECK(prefetch >= 0, "CPU optimizer prefetch must be >= 0 elements (0: off), got ",
              prefetch);
}

}  // namespace

// Adam's memory traffic without its arithmetic, over Adam's own argument lists (see Probe):
// "read", "copy" or "write"; outputs as adam_step's out lists (empty: in place). Returns the
// sum that "read" took (so that the reads cannot be left out), else 0.
double memory_probe(const std::string& mode, const std::vector<at::Tensor>& params,
                    const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& exp_avgs,
                    const std::vector<at::Tensor>& exp_avg_sqs,
                    const std::vector<at::Tensor>& params_out,
                    const std::vector<at::Tensor>& exp_avgs_out,
                    const std::vector<at::Tensor>& exp_avg_sqs_out, int64_t store_bytes,
                    const std::string& isa, const std::string& schedule) {
  TORCH_CHECK(mode == "read" || mode == "copy" || mode == "write",
              "memory_probe mode must be 'read', 'copy' or 'write', got '", mode, "'");
  check_memory_options(store_bytes, 0);
  const Probe probe = mode == "read" ? Probe::kRead : (mode == "copy" ? Probe::kCopy : Probe::kWrite);
  const std::string chosen = resolve_isa(isa);
  auto spans = make_spans(params, grads, exp_avgs, &exp_avg_sqs, {});
  if (!params_out.empty() || !exp_avgs_out.empty() || !exp_avg_sqs_out.empty()) {
    set_outputs(spans, params, grads, exp_avgs, exp_avg_sqs, {}, params_out, exp_avgs_out,
                exp_avg_sqs_out);
  }
  apply_schedule(schedule);
  const int bytes = static_cast<int>(store_bytes);
  pybind11::gil_scoped_release no_gil;
#ifdef SLIPSTREAM_HAS_X86_CLONES
  if (chosen == "avx512") return probe_run_avx512(spans, probe, bytes);
  if (chosen == "avx2") return probe_run_avx2(spans, probe, bytes);
#endif
  return probe_run_generic(spans, probe, bytes);
}

std::string adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& exp_avgs,
                      const std::vector<at::Tensor>& exp_avg_sqs,
                      const std::vector<at::Tensor>& copies, double lr, double beta1,
                      double beta2, double eps, double weight_decay, bool adam_w_mode,
                      bool bias_correction, int64_t step, double grad_scale,
                      const std::string& isa, const std::string& schedule,
                      const std::vector<at::Tensor>& params_out,
                      const std::vector<at::Tensor>& exp_avgs_out,
                      const std::vector<at::Tensor>& exp_avg_sqs_out, const std::string& stores,
                      int64_t store_bytes, int64_t prefetch) {
  TORCH_CHECK(step >= 1, "adam: step must be >= 1 (the step being taken), got ", step);
  check_memory_options(store_bytes, prefetch);
  const std::string chosen = resolve_isa(isa);
  auto spans = make_spans(params, grads, exp_avgs, &exp_avg_sqs, copies);
  if (!params_out.empty() || !exp_avgs_out.empty() || !exp_avg_sqs_out.empty()) {
    set_outputs(spans, params, grads, exp_avgs, exp_avg_sqs, copies, params_out, exp_avgs_out,
                exp_avg_sqs_out);
  }
  // Scalars in double on the host, then one rounding to float, as torch's CPU kernels do.
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  AdamArgs a{static_cast<float>(beta1),        static_cast<float>(beta2),
             static_cast<float>(eps),          static_cast<float>(weight_decay),
             static_cast<float>(lr / bc1),     static_cast<float>(1.0 / std::sqrt(bc2)),
             static_cast<float>(1.0 - lr * weight_decay), adam_w_mode,
             static_cast<float>(grad_scale),  static_cast<float>(1.0 - beta1),
             static_cast<float>(1.0 - beta2)};
  TORCH_CHECK(stores == "mixed" || stores == "stream" || stores == "stream_out",
              "CPU optimizer stores must be 'stream_out', 'mixed' or 'stream', got '", stores,
              "'");
  a.stores = stores == "stream"       ? kStream
             : stores == "stream_out" ? kStreamOut
                                      : kMixed;
  a.store_bytes = static_cast<int>(store_bytes);
  a.prefetch = prefetch;
  apply_schedule(schedule);
  StepStats& stats = g_stats;
  const size_t team = static_cast<size_t>(std::max(1, step_threads()));
  stats.starts.assign(team, -1.0);  // -1: the thread was not in the team
  stats.ends.assign(team, -1.0);
  pybind11::gil_scoped_release no_gil;
#ifdef SLIPSTREAM_HAS_X86_CLONES
  if (chosen == "avx512") {
    adam_run_avx512(spans, a, stats);
    return chosen;
  }
  if (chosen == "avx2") {
    adam_run_avx2(spans, a, stats);
    return chosen;
  }
#endif
  adam_run_generic(spans, a, stats);
  return chosen;
}

// The last Adam step called from this thread: {wall seconds of its parallel region, then each
// thread's start and end (seconds from the region's start), interleaved}; empty before any.
std::vector<double> last_step_stats() {
  std::vector<double> out;
  if (g_stats.starts.empty()) return out;
  out.push_back(g_stats.wall);
  for (size_t i = 0; i < g_stats.starts.size(); ++i) {
    if (g_stats.starts[i] < 0.0) continue;
    out.push_back(g_stats.starts[i]);
    out.push_back(g_stats.ends[i]);
  }
  return out;
}

std::string adagrad_step(const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& sums, const std::vector<at::Tensor>& copies,
                         double lr, double eps, double weight_decay, double grad_scale,
                         const std::string& isa, const std::string& schedule) {
  const std::string chosen = resolve_isa(isa);
  auto spans = make_spans(params, grads, sums, nullptr, copies);
  AdagradArgs a{static_cast<float>(lr), static_cast<float>(eps), static_cast<float>(weight_decay),
                static_cast<float>(grad_scale)};
  apply_schedule(schedule);
  pybind11::gil_scoped_release no_gil;
#ifdef SLIPSTREAM_HAS_X86_CLONES
  if (chosen == "avx512") {
    adagrad_run_avx512(spans, a);
    return chosen;
  }
  if (chosen == "avx2") {
    adagrad_run_avx2(spans, a);
    return chosen;
  }
#endif
  adagrad_run_generic(spans, a);
  return chosen;
}

std::string lion_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& exp_avgs,
                      const std::vector<at::Tensor>& copies, double lr, double beta1,
                      double beta2, double weight_decay, double grad_scale,
                      const std::string& isa, const std::string& schedule) {
  const std::string chosen = resolve_isa(isa);
  auto spans = make_spans(params, grads, exp_avgs, nullptr, copies);
  LionArgs a{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
             static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(grad_scale),
             static_cast<float>(1.0 - beta1), static_cast<float>(1.0 - beta2)};
  apply_schedule(schedule);
  pybind11::gil_scoped_release no_gil;
#ifdef SLIPSTREAM_HAS_X86_CLONES
  if (chosen == "avx512") {
    lion_run_avx512(spans, a);
    return chosen;
  }
  if (chosen == "avx2") {
    lion_run_avx2(spans, a);
    return chosen;
  }
#endif
  lion_run_generic(spans, a);
  return chosen;
}

// The team size a step's parallel region gets when called from this thread.
int max_threads() {
#ifdef _OPENMP
  int size = 1;
#pragma omp parallel num_threads(step_threads())
  {
#pragma omp single
    size = omp_get_num_threads();
  }
  return size;
#else
  return 1;
#endif
}

// This extension links its own OpenMP runtime, which may not be the copy torch uses, so
// torch.set_num_threads() does not reach it: callers (CPU offload) set the count here. It
// holds for steps called from any thread.
void set_num_threads(int threads) {
  if (threads > 0) g_threads.store(threads, std::memory_order_relaxed);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Slipstream CPU optimizers: Adam/AdamW, Adagrad, Lion (SIMD + OpenMP)";
  m.def("adam_step", &adam_step,
        "Adam/AdamW step over lists of CPU tensors (in place, or into the *_out lists); "
        "returns the ISA used");
  m.def("adagrad_step", &adagrad_step, "Adagrad step over lists of CPU tensors");
  m.def("memory_probe", &memory_probe,
        "Adam's memory traffic without its arithmetic ('read', 'copy' or 'write'; benchmarks)");
  m.def("lion_step", &lion_step, "Lion step over lists of CPU tensors");
  m.def("supported_isas", &supported_isas, "ISAs usable on this CPU, best first");
  m.def("max_threads", &max_threads, "OpenMP threads a step called from this thread uses");
  m.def("last_step_stats", &last_step_stats,
        "The last Adam step called from this thread: [wall s, (start s, end s) per thread]");
  m.def("set_num_threads", &set_num_threads, "Set the OpenMP threads later steps use (any thread)");
}
