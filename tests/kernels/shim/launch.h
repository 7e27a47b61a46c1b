// launch.h -- the grid loop of the CPU shim and the extern "C" entry points ctypes calls.
#pragma once
#include <functional>
#include <type_traits>
#include <utility>

namespace shim {

struct LaunchSpec {
  unsigned grid[3], block[3];
  unsigned long long shared_mem;
  int mode;
};

// --- signature codes, checked by the Python launcher against the arguments it is given -------
template <class T> struct Code;
#define SHIM_CODE(type, text) template <> struct Code<type> { static constexpr const char* value = text; };
SHIM_CODE(float, "f32") SHIM_CODE(double, "f64") SHIM_CODE(__half, "f16") SHIM_CODE(__nv_bfloat16, "bf16")
SHIM_CODE(signed char, "i8") SHIM_CODE(unsigned char, "u8") SHIM_CODE(short, "i16") SHIM_CODE(unsigned short, "u16")
SHIM_CODE(int, "i32") SHIM_CODE(unsigned, "u32") SHIM_CODE(long, "i64") SHIM_CODE(unsigned long, "u64")
SHIM_CODE(long long, "i64") SHIM_CODE(unsigned long long, "u64")
#undef SHIM_CODE

template <class T> std::string type_code() {
  if constexpr (std::is_pointer_v<T>) return "*" + type_code<std::remove_cv_t<std::remove_pointer_t<T>>>();
  else return Code<std::remove_cv_t<T>>::value;
}

template <class... A> std::string signature(void (*)(A...)) {
  std::string out;
  ((out += (out.empty() ? "" : ",") + type_code<A>()), ...);
  return out;
}

// --- running one block -----------------------------------------------------------------------
constexpr size_t kFiberStack = 128 * 1024;
inline thread_local const std::function<void()>* fiber_body = nullptr;

inline thread_local std::vector<std::unique_ptr<char[]>> stack_pool;  // uninitialised, reused

// A fiber runs the kernel body once per block of the launch, parking at the scheduler in between.
inline void fiber_entry() {
  for (;;) {
    try { (*fiber_body)(); } catch (const Unwind&) {}
    Thread& t = self();
    t.state = State::Done;
    if (_setjmp(t.resume) == 0) _longjmp(t.block->scheduler_resume, 1);
  }
}

// Gives every thread of the launch a stack and a fresh context (once per launch, not per block).
inline void prepare_fibers(Block& b) {
  while (stack_pool.size() < b.threads.size()) stack_pool.emplace_back(new char[kFiberStack]);
  for (size_t i = 0; i < b.threads.size(); ++i) {
    Thread& t = b.threads[i];
    t.stack = stack_pool[i].get();
    t.started = false;
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack;
    t.ctx.uc_stack.ss_size = kFiberStack;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, fiber_entry, 0);
  }
}

// Runs fiber t until it blocks or ends: its first entry through its ucontext, later ones by
// _longjmp to where it blocked.
inline void resume_fiber(Block& b, Thread& t) {
  current_thread = &t;
  if (_setjmp(b.scheduler_resume) != 0) return;
  if (!t.started) {
    t.started = true;
    swapcontext(&b.scheduler, &t.ctx);
  } else {
    _longjmp(t.resume, 1);
  }
}

inline void run_fibers(Block& b, const std::function<void()>& body) {
  fiber_body = &body;
  const int n = int(b.threads.size());
  for (;;) {
    for (int k = 0; k < n; ++k) {
      Thread& t = b.threads[b.mode == FibersReverse ? n - 1 - k : k];
      if (t.state != State::Run) continue;
      resume_fiber(b, t);
      if (!b.error.empty()) return;
    }
    bool all_done = true;
    for (const Thread& t : b.threads) all_done &= t.state == State::Done;
    if (all_done) return;
    std::string error = settle(b);
    if (!error.empty()) { b.error = error; return; }
  }
}

inline void run_threads(Block& b, const std::function<void()>& body) {
  std::vector<std::thread> pool;
  pool.reserve(b.threads.size());
  for (Thread& t : b.threads) {
    pool.emplace_back([&b, &t, &body] {
      current_thread = &t;
      try { body(); } catch (const Unwind&) {}
      std::lock_guard<std::mutex> lock(b.mu);
      t.state = State::Done;
      std::string error = settle(b);
      if (!error.empty() && b.error.empty()) b.error = error;
      b.cv.notify_all();
    });
  }
  for (std::thread& th : pool) th.join();
}

inline void reset_block(Block& b, unsigned x, unsigned y, unsigned z) {
  b.idx = uint3{x, y, z};
  std::memset(b.dynamic.data(), 0xff, b.dynamic.size());  // NaN in f32, f16 and bf16
  for (auto& buffer : b.exchange) std::fill(buffer.begin(), buffer.end(), 0);
  int i = 0;
  for (unsigned tz = 0; tz < b.dim.z; ++tz)
    for (unsigned ty = 0; ty < b.dim.y; ++ty)
      for (unsigned tx = 0; tx < b.dim.x; ++tx, ++i) {
        Thread& t = b.threads[i];
        t.idx = uint3{tx, ty, tz};
        t.linear = i, t.warp = i / 32, t.lane = i % 32;
        t.state = State::Run, t.syncs = 0, t.warp_ops = 0, t.site = 0;
        t.block = &b;
      }
}

template <class... A, size_t... I>
std::tuple<std::decay_t<A>...> load_args(void** args, std::index_sequence<I...>) {
  return std::tuple<std::decay_t<A>...>{*static_cast<std::decay_t<A>*>(args[I])...};
}

template <class... A>
int launch(void (*kernel)(A...), const LaunchSpec& spec, void** args, char* error, size_t error_size) {
  auto values = load_args<A...>(args, std::index_sequence_for<A...>{});
  const std::function<void()> body = [&] { std::apply(kernel, values); };
  Block b;
  b.dim = dim3(spec.block[0], spec.block[1], spec.block[2]);
  b.grid = dim3(spec.grid[0], spec.grid[1], spec.grid[2]);
  b.mode = spec.mode;
  b.threads.resize(size_t(b.dim.x) * b.dim.y * b.dim.z);
  for (auto& buffer : b.exchange) buffer.assign(size_t(b.num_warps()) * 32, 0);
  b.dynamic.resize(spec.shared_mem);
  if (b.mode != Threads) prepare_fibers(b);
  for (unsigned z = 0; z < b.grid.z; ++z)
    for (unsigned y = 0; y < b.grid.y; ++y)
      for (unsigned x = 0; x < b.grid.x; ++x) {
        reset_block(b, x, y, z);
        if (b.mode == Threads) run_threads(b, body); else run_fibers(b, body);
        if (!b.error.empty()) {
          std::string where = " in block (" + std::to_string(x) + "," + std::to_string(y) + "," + std::to_string(z) + ")";
          std::snprintf(error, error_size, "%s", (b.error + where).c_str());
          current_thread = nullptr;
          return 1;
        }
      }
  current_thread = nullptr;
  return 0;
}

}  // namespace shim

#define SHIM_EXPORT(name)                                                                        \
  extern "C" int shim_launch_##name(const ::shim::LaunchSpec* spec, void** args, char* error,   \
                                    size_t size) {                                               \
    return ::shim::launch(&name, *spec, args, error, size);                                      \
  }                                                                                              \
  extern "C" const char* shim_signature_##name() {                                               \
    static const std::string text = ::shim::signature(&name);                                    \
    return text.c_str();                                                                         \
  }
