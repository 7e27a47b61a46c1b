// shim.h -- run the unchanged CUDA C text of cuda/*.cu on the CPU (tests only).
//
// Force-included by g++ (-std=c++20 -include shim.h) before a .cu file. Blocks of the grid run one
// after another; the threads of a block run either as fibers (ucontext, switching only at barriers:
// deterministic, in forward or reverse thread order) or as one std::thread each (real concurrency,
// for ThreadSanitizer). __syncthreads and warp shuffles are barriers that also check the rules:
// equal barrier counts at one site, no shuffle with an exited lane, no deadlock. Dynamic shared
// memory is poisoned with NaN bytes at each block start. Errors unwind the launch and come back
// to Python as a message (see launcher.py).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vector_types.h>
#include <math.h>
#include <setjmp.h>
#include <ucontext.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __noinline__
#ifdef EMBER_SHIM_SCAN
#define __global__ __shim_kernel__  // marks kernels for the launcher's scan (g++ -E)
#else
#define __global__
#endif
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define EMBER_SHIM 1

namespace shim {

enum class State { Run, AtBlockBarrier, AtWarpBarrier, Done };
enum Mode { FibersForward = 0, FibersReverse = 1, Threads = 2 };

struct Unwind {};  // thrown inside a thread to leave the kernel after an error was reported

struct Block;
struct Thread {
  uint3 idx;
  int linear = 0, warp = 0, lane = 0;
  State state = State::Run;
  long syncs = 0, warp_ops = 0;
  int site = 0;  // line of the __syncthreads it waits at
  Block* block = nullptr;
  bool started = false;
  ucontext_t ctx;   // first entry only
  jmp_buf resume;   // later switches: _setjmp/_longjmp, no signal-mask syscall
  char* stack = nullptr;
};

struct Block {
  dim3 dim, grid;
  uint3 idx;
  int mode = FibersForward;
  std::vector<Thread> threads;
  std::vector<uint64_t> exchange[2];   // per warp x 32 lanes, double-buffered
  std::vector<unsigned char> dynamic;  // dynamic shared memory of this launch
  std::mutex mu;
  std::condition_variable cv;
  std::string error;
  ucontext_t scheduler;
  jmp_buf scheduler_resume;
  int num_warps() const { return int((threads.size() + 31) / 32); }
};

inline thread_local Thread* current_thread = nullptr;
inline Thread& self() { return *current_thread; }

// --- barrier bookkeeping shared by both modes -------------------------------------------------
// Called with no thread Running (fibers) or under the block mutex (threads). Releases whatever
// can proceed; returns an error message when nothing can and nothing runs.
inline std::string describe(const Block& b, const char* what, State s) {
  std::string ids;
  int shown = 0;
  for (const Thread& t : b.threads)
    if (t.state == s && shown++ < 8) ids += " " + std::to_string(t.linear);
  return std::string(what) + " (threads" + ids + (shown > 8 ? " ..." : "") + ")";
}

inline bool release_warps(Block& b, std::string& error) {
  bool released = false;
  for (int w = 0; w < b.num_warps(); ++w) {
    int begin = w * 32, end = std::min<int>(begin + 32, int(b.threads.size()));
    int waiting = 0, done = 0;
    for (int i = begin; i < end; ++i) {
      waiting += b.threads[i].state == State::AtWarpBarrier;
      done += b.threads[i].state == State::Done;
    }
    if (waiting && (done || end - begin < 32)) {
      error = "warp shuffle/sync with exited or missing lane(s) in warp " + std::to_string(w);
      return false;
    }
    if (waiting == 32) {
      for (int i = begin; i < end; ++i) b.threads[i].state = State::Run;
      released = true;
    }
  }
  return released;
}

inline std::string settle(Block& b) {
  std::string error;
  if (release_warps(b, error) || !error.empty()) return error;
  int running = 0, at_block = 0, at_warp = 0, done = 0, site = -1;
  bool same_site = true;
  for (const Thread& t : b.threads) {
    running += t.state == State::Run;
    at_warp += t.state == State::AtWarpBarrier;
    done += t.state == State::Done;
    if (t.state == State::AtBlockBarrier) {
      ++at_block;
      same_site &= site < 0 || site == t.site;
      site = t.site;
    }
  }
  if (running || at_block == 0) return at_warp && !running ? describe(b, "deadlock: warp barrier never completes", State::AtWarpBarrier) : "";
  if (at_warp) return describe(b, "deadlock: __syncthreads waits on threads blocked in a warp shuffle", State::AtBlockBarrier);
  if (done) return describe(b, "divergent __syncthreads: some threads exited while others wait", State::AtBlockBarrier);
  if (!same_site) return "divergent __syncthreads: threads wait at different barriers (lines differ)";
  for (Thread& t : b.threads) t.state = State::Run;
  return "";
}

// --- blocking: fibers switch to the scheduler, threads wait on the block's condition ----------
inline void fail(const std::string& message) {
  Block& b = *self().block;
  {
    std::lock_guard<std::mutex> lock(b.mu);
    if (b.error.empty()) b.error = message;
  }
  b.cv.notify_all();
  throw Unwind{};
}

inline void wait_as(State state) {
  Thread& t = self();
  Block& b = *t.block;
  if (b.mode != Threads) {
    t.state = state;
    if (_setjmp(t.resume) == 0) _longjmp(b.scheduler_resume, 1);
    current_thread = &t;
    if (t.state != State::Run) throw Unwind{};  // abandoned after an error
    return;
  }
  std::unique_lock<std::mutex> lock(b.mu);
  t.state = state;
  std::string error = settle(b);
  if (!error.empty() && b.error.empty()) b.error = error;
  b.cv.notify_all();
  b.cv.wait(lock, [&] { return t.state == State::Run || !b.error.empty(); });
  if (!b.error.empty()) throw Unwind{};
}

inline void syncthreads(int line) {
  self().site = line;
  ++self().syncs;
  wait_as(State::AtBlockBarrier);
}

template <class T>
inline T exchange(unsigned mask, T value, int (*source)(int lane, int arg, int width), int arg, int width) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  if (mask != 0xffffffffu) fail("shim supports only full-warp masks (0xffffffff)");
  Thread& t = self();
  Block& b = *t.block;
  int phase = int(t.warp_ops++ & 1);
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  b.exchange[phase][t.warp * 32 + t.lane] = bits;
  wait_as(State::AtWarpBarrier);
  int src = source(t.lane, arg, width);
  bits = b.exchange[phase][t.warp * 32 + src];
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

inline int segment(int lane, int width) { return lane & ~(width - 1); }
inline int src_xor(int lane, int mask, int width) {
  int s = lane ^ mask;
  return segment(s, width) == segment(lane, width) ? s : lane;
}
inline int src_idx(int lane, int src, int width) { return segment(lane, width) + (src & (width - 1)); }
inline int src_down(int lane, int delta, int width) {
  int s = lane + delta;
  return segment(s, width) == segment(lane, width) ? s : lane;
}
inline int src_up(int lane, int delta, int width) {
  int s = lane - delta;
  return s >= segment(lane, width) ? s : lane;
}

inline unsigned vote(unsigned mask, int predicate) {
  unsigned bits = 0;
  for (int i = 0; i < 32; ++i)
    bits |= unsigned(exchange<int>(mask, predicate != 0, src_idx, i, 32) != 0) << i;
  return bits;
}

inline unsigned char* dynamic_shared() { return self().block->dynamic.data(); }

}  // namespace shim

// --- CUDA built-ins -------------------------------------------------------------------------
#define threadIdx (::shim::self().idx)
#define blockIdx (::shim::self().block->idx)
#define blockDim (::shim::self().block->dim)
#define gridDim (::shim::self().block->grid)
#define warpSize 32
#define __syncthreads() ::shim::syncthreads(__LINE__)
#define EMBER_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::shim::dynamic_shared())

inline void __syncwarp(unsigned mask = 0xffffffffu) { ::shim::exchange<int>(mask, 0, ::shim::src_idx, 0, 32); }
template <class T> T __shfl_xor_sync(unsigned m, T v, int lane_mask, int w = 32) { return ::shim::exchange(m, v, ::shim::src_xor, lane_mask, w); }
template <class T> T __shfl_sync(unsigned m, T v, int src, int w = 32) { return ::shim::exchange(m, v, ::shim::src_idx, src, w); }
template <class T> T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) { return ::shim::exchange(m, v, ::shim::src_down, int(d), w); }
template <class T> T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) { return ::shim::exchange(m, v, ::shim::src_up, int(d), w); }
inline unsigned __ballot_sync(unsigned m, int p) { return ::shim::vote(m, p); }
inline int __any_sync(unsigned m, int p) { return ::shim::vote(m, p) != 0; }
inline int __all_sync(unsigned m, int p) { return ::shim::vote(m, p) == 0xffffffffu; }

template <class T> T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T> T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <class T> T atomicCAS(T* p, T expected, T desired) {
  std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired);
  return expected;
}
template <class T> T atomicMax(T* p, T v) {
  std::atomic_ref<T> ref(*p);
  T old = ref.load();
  while (old < v && !ref.compare_exchange_weak(old, v)) {}
  return old;
}
template <class T> T atomicMin(T* p, T v) {
  std::atomic_ref<T> ref(*p);
  T old = ref.load();
  while (v < old && !ref.compare_exchange_weak(old, v)) {}
  return old;
}

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
template <class T> T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

#include "launch.h"
