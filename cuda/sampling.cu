// sampling.cu -- sampling helpers.
//
// apply_token_bitmask: the grammar mask of structured decoding (ember_cupy/structured/bitmask.py,
// whose apply_token_bitmask_numpy is its twin). logits [*, vocab] float32, row-major; bitmask
// [num_rows, words] int32, token t allowed when bit t % 32 of word t / 32 is set (llguidance's
// layout); rows [num_rows]: the logits row each mask row applies to. Grid (ceil(vocab / blockDim.x),
// num_rows), one thread per logit; a token past the mask's words counts as disallowed.
#include "common.cuh"

extern "C" __global__ void apply_token_bitmask(float* __restrict__ logits, const int* __restrict__ bitmask,
                                               const int* __restrict__ rows, int vocab, int words) {
  const int mask_row = blockIdx.y;
  const int token = blockIdx.x * blockDim.x + threadIdx.x;
  if (token >= vocab) return;
  const int word = token >> 5;
  const bool allowed =
      word < words && ((static_cast<unsigned>(bitmask[(long long)mask_row * words + word]) >> (token & 31)) & 1u);
  if (!allowed) logits[(long long)rows[mask_row] * vocab + token] = ember::neg_inf();
}

// ---------------------------------------------------------------------------------------------
// Sampling on the device: only token ids (and requested logprobs) leave it. NumPy twins (the host
// path itself): ember_cupy/engine/sampler.py (apply_logit_edits_numpy, sample_tokens_numpy,
// raw_logprobs_numpy); launchers and the tolerance statement: ember_cupy/engine/device_sampler.py.
// Per-row parameters (ember_cupy/engine/sampling_batch.py): ints [rows, kRowInts] = top_k (0: none),
// greedy; reals [rows, kRowReals] = temperature, top_p, min_p, uniform, repetition, frequency,
// presence penalties.
//
// One block per row; thread t owns the contiguous ids [t * seg, (t + 1) * seg). No sort: the
// order the draw walks (decreasing value, lower id first among equals) is searched with radix
// descents over 32-bit order keys, 8 bits a pass, on deterministic integer histograms: token
// counts for top-k / top-n, probability mass in 2^-40 fixed point for top-p and the draw (exact
// and independent of summation order, so a row's token never depends on thread timing).
namespace ember {
namespace sampling {

typedef unsigned long long u64;
constexpr int kRowInts = 2, kRowReals = 8;
constexpr int kBins = 256;
constexpr int kMaxTopLogprobs = 20;
constexpr double kMassScale = 1099511627776.0;  // 2^40: one unit of fixed-point mass

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

// Orderable key of a non-NaN float: a > b <=> key(a) > key(b); -0 and +0 share a key (they tie).
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned bits = static_cast<unsigned>(__float_as_int(v == 0.0f ? 0.0f : v));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ u64 fixed_mass(float p) {  // p in [0, 1]: p * 2^40 is exact in double
  return static_cast<u64>(static_cast<double>(p) * kMassScale + 0.5);
}

__device__ __forceinline__ double mul_no_fma(double a, double b) {  // as NumPy: a * b rounded, then +
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// The values a row samples from: NaN counts as -inf; divided by the temperature; in a row with a
// +inf value (limit), the limit of the softmax: 0 for the +inf tokens, -inf for the rest.
struct RowView {
  const float* x;
  int vocab;
  float temperature;
  bool limit;
  __device__ float value(int i) const {
    float v = x[i];
    if (v != v) v = neg_inf();
    v = v / temperature;
    if (limit) v = v == pos_inf() ? 0.0f : neg_inf();
    return v;
  }
  __device__ int segment_begin() const { return min(vocab, int(threadIdx.x) * segment()); }
  __device__ int segment_end() const { return min(vocab, (int(threadIdx.x) + 1) * segment()); }
  __device__ int segment() const { return (vocab + int(blockDim.x) - 1) / int(blockDim.x); }
};

struct MaxOp { template <class T> __device__ T operator()(T a, T b) const { return a > b ? a : b; } };
struct MinOp { template <class T> __device__ T operator()(T a, T b) const { return a < b ? a : b; } };
struct SumOp { template <class T> __device__ T operator()(T a, T b) const { return a + b; } };

// Reduction over the block, returned to every thread, in a fixed order (deterministic).
template <class T, class Op>
__device__ T block_reduce(T v, Op op) {
  __shared__ T partial[32];
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  T out = partial[0];
  for (int w = 1; w < int(blockDim.x >> 5); ++w) out = op(out, partial[w]);
  __syncthreads();  // partial[] is reused by the next call
  return out;
}

// Exclusive prefix sum over the threads of the block; *total gets the sum of all.
__device__ u64 block_exclusive_scan(u64 v, u64* total) {
  __shared__ u64 warp_total[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u64 inclusive = v;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const u64 other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_total[warp] = inclusive;
  __syncthreads();
  u64 before = 0, all = 0;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) {
    if (w < warp) before += warp_total[w];
    all += warp_total[w];
  }
  __syncthreads();
  *total = all;
  return before + inclusive - v;
}

// Every token, weight 1: radix descents over it find the k-th largest value.
struct AllTokens {
  RowView row;
  __device__ bool take(int i, unsigned* key, u64* weight) const {
    *key = order_key(row.value(i));
    *weight = 1;
    return true;
  }
};

// The tokens a random row may sample (top-k, min_p, and the top-p cut once known) with their
// fixed-point probability masses p = expf(v - top).
struct Candidates {
  RowView row;
  float top;         // the row's largest value (0 in a limit row)
  unsigned kth_key;  // top-k: key >= kth_key (0: no top-k)
  float min_p;       // p >= min_p (0: no min_p)
  unsigned cut_key;  // top-p: at or before (cut_key, cut_id) in the order (cut_key 0: no cut)
  int cut_id;
  __device__ bool take(int i, unsigned* key, u64* weight) const {
    const float v = row.value(i);
    const float p = expf(v - top);
    *key = order_key(v);
    const bool in = *key >= kth_key && p >= min_p && (*key > cut_key || (*key == cut_key && i <= cut_id));
    *weight = in ? fixed_mass(p) : 0ull;
    return in;
  }
};

// How a descent's threshold T follows from the total weight W of the tokens taken.
enum TargetKind { kFixed = 0, kAtLeast = 1, kDraw = 2 };
struct Target {
  int kind;
  double scale;  // kAtLeast: reach scale * W (T = ceil(scale * W) - 1); kDraw: T = floor(scale * W)
  u64 fixed;     // kFixed: T itself
  __device__ u64 resolve(u64 total) const {
    if (kind == kFixed) return fixed;
    const double limit = scale * static_cast<double>(total);
    if (kind == kDraw) return static_cast<u64>(floor(limit));
    const double at_least = ceil(limit);
    return at_least < 1.0 ? 0ull : static_cast<u64>(at_least) - 1ull;
  }
};

// Warp 0 picks the histogram bin where the running weight from the top passes T:
// above + weight of bins > d <= T < above + weight of bins >= d.
__device__ void pick_bin(const u64* hist, bool first_pass, const Target& target, u64* T, u64* above,
                         unsigned* digit, int* found, u64* total) {
  const int lane = threadIdx.x;
  u64 lane_sum = 0;
  for (int k = 0; k < 8; ++k) lane_sum += hist[kBins - 1 - (8 * lane + k)];
  u64 inclusive = lane_sum;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const u64 other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  const u64 all = __shfl_sync(kFullMask, inclusive, 31);
  const u64 threshold = first_pass ? target.resolve(all) : *T;
  const u64 start = *above + inclusive - lane_sum;
  const bool mine = start <= threshold && threshold < start + lane_sum;
  const unsigned hit = __ballot_sync(kFullMask, mine);
  if (mine) {
    u64 run = start;
    for (int k = 0; k < 8; ++k) {
      const int d = kBins - 1 - (8 * lane + k);
      if (run + hist[d] > threshold) { *digit = unsigned(d); *above = run; break; }
      run += hist[d];
    }
  }
  if (lane == 0) {
    *found = hit != 0;
    *T = threshold;
    if (first_pass) *total = all;
  }
}

// Radix descent: the key level L of the first token in the order (key descending) at which the
// running weight passes T = target.resolve(total weight): above(L) <= T < above(L) + weight(L),
// above(L) = the weight of the tokens with a larger key. False when the total is <= T.
template <class Tokens>
__device__ bool descend(const Tokens& tokens, const Target& target, unsigned* level, u64* above, u64* T,
                        u64* total) {
  __shared__ u64 hist[kBins];
  __shared__ u64 s_T, s_above, s_total;
  __shared__ unsigned s_digit;
  __shared__ int s_found;
  const RowView& row = tokens.row;
  const int begin = row.segment_begin(), end = row.segment_end();
  unsigned prefix = 0;
  if (threadIdx.x == 0) s_above = 0;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int b = threadIdx.x; b < kBins; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    int run_digit = 0;
    u64 run = 0;  // runs of one digit are added at once: the first pass has few distinct digits
    for (int i = begin; i < end; ++i) {
      unsigned key;
      u64 weight;
      tokens.take(i, &key, &weight);
      if (weight == 0 || (pass > 0 && (key >> (shift + 8)) != (prefix >> (shift + 8)))) continue;
      const int d = int((key >> shift) & 255u);
      if (d != run_digit && run) { atomicAdd(&hist[run_digit], run); run = 0; }
      run_digit = d;
      run += weight;
    }
    if (run) atomicAdd(&hist[run_digit], run);
    __syncthreads();
    if (threadIdx.x < 32) pick_bin(hist, pass == 0, target, &s_T, &s_above, &s_digit, &s_found, &s_total);
    __syncthreads();
    const bool found = s_found;
    prefix |= s_digit << shift;
    if (pass == 0) { *T = s_T; *total = s_total; }
    *above = s_above;
    __syncthreads();  // the shared picks are rewritten by the next pass
    if (!found) return false;
  }
  *level = prefix;
  return true;
}

// The first token by id (restricted to key == level when by_level) at which above + the running
// weight passes T; -1 if none. *reached: the running weight including that token.
template <class Tokens>
__device__ int first_past(const Tokens& tokens, bool by_level, unsigned level, u64 above, u64 T, u64* reached) {
  __shared__ int s_id;
  __shared__ u64 s_reached;
  const RowView& row = tokens.row;
  const int begin = row.segment_begin(), end = row.segment_end();
  if (threadIdx.x == 0) s_id = -1;
  u64 local = 0;
  for (int i = begin; i < end; ++i) {
    unsigned key;
    u64 weight;
    tokens.take(i, &key, &weight);
    if (!by_level || key == level) local += weight;
  }
  u64 all;
  const u64 start = above + block_exclusive_scan(local, &all);
  if (local && start <= T && T < start + local) {  // exactly one thread: the segment holding it
    u64 run = start;
    for (int i = begin; i < end; ++i) {
      unsigned key;
      u64 weight;
      tokens.take(i, &key, &weight);
      if (by_level && key != level) continue;
      if (run + weight > T) { s_id = i; s_reached = run + weight; break; }
      run += weight;
    }
  }
  __syncthreads();
  const int id = s_id;
  *reached = s_reached;
  __syncthreads();
  return id;
}

// The last token of the order that `tokens` takes: by id (the highest id) or by decreasing value
// (the smallest key, then the highest id). The host path's fallback when the draw passes the end.
template <class Tokens>
__device__ int last_taken(const Tokens& tokens, bool by_id) {
  const RowView& row = tokens.row;
  u64 best = ~0ull;  // minimised: (key, ~id), or (0, ~id) by id
  for (int i = row.segment_begin(); i < row.segment_end(); ++i) {
    unsigned key;
    u64 weight;
    if (!tokens.take(i, &key, &weight)) continue;
    const u64 order = (u64(by_id ? 0u : key) << 32) | u64(0xffffffffu - unsigned(i));
    best = best < order ? best : order;
  }
  best = block_reduce(best, MinOp());
  return best == ~0ull ? 0 : int(0xffffffffu - unsigned(best & 0xffffffffu));
}

struct RowTop {
  int argmax;    // the first id of the largest value
  float top;     // the largest value
  int num_inf;   // how many +inf values
};

__device__ RowTop row_top(const RowView& row) {
  u64 best = 0;
  int infs = 0;
  for (int i = row.segment_begin(); i < row.segment_end(); ++i) {
    const float v = row.value(i);
    const u64 order = (u64(order_key(v)) << 32) | u64(0xffffffffu - unsigned(i));
    best = best > order ? best : order;
    infs += v == pos_inf();
  }
  best = block_reduce(best, MaxOp());
  infs = block_reduce(infs, SumOp());
  RowTop out;
  out.argmax = int(0xffffffffu - unsigned(best & 0xffffffffu));
  out.top = row.value(out.argmax);
  out.num_inf = infs;
  return out;
}

// The k-th largest key of the row (every token counts).
__device__ unsigned kth_key(const RowView& row, int k) {
  Target target = {kFixed, 0.0, u64(k - 1)};
  AllTokens all = {row};
  unsigned level = 0;
  u64 above, T, total;
  descend(all, target, &level, &above, &T, &total);
  return level;
}

// The n best tokens (key descending, lower id first among equals) into keys / ids [0, n), sorted:
// the n-th largest key, the tokens above it, then the lowest ids at it. 1 <= n <= kMaxTopLogprobs.
__device__ void top_n(const RowView& row, int n, unsigned* keys, int* ids) {
  __shared__ int s_count;
  const unsigned level = kth_key(row, n);
  if (threadIdx.x == 0) s_count = 0;
  u64 ties = 0;
  __syncthreads();
  for (int t = row.segment_begin(); t < row.segment_end(); ++t) {
    const unsigned key = order_key(row.value(t));
    if (key > level) {  // fewer than n such tokens
      const int slot = atomicAdd(&s_count, 1);
      keys[slot] = key;
      ids[slot] = t;
    }
    ties += key == level;
  }
  u64 all_ties;
  u64 rank = block_exclusive_scan(ties, &all_ties);  // its barriers also publish s_count
  const int above = s_count;
  for (int t = row.segment_begin(); t < row.segment_end() && above + int(rank) < n; ++t) {
    if (order_key(row.value(t)) != level) continue;
    keys[above + rank] = level;
    ids[above + rank] = t;
    ++rank;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int a = 1; a < n; ++a) {  // insertion sort of at most 20
      const unsigned key = keys[a];
      const int id = ids[a];
      int b = a - 1;
      for (; b >= 0 && (keys[b] < key || (keys[b] == key && ids[b] > id)); --b) {
        keys[b + 1] = keys[b];
        ids[b + 1] = ids[b];
      }
      keys[b + 1] = key;
      ids[b + 1] = id;
    }
  }
}

__device__ int draw(const RowView& row, const RowTop& top, int top_k, double top_p, float min_p, double uniform) {
  Candidates c = {row, top.num_inf ? 0.0f : top.top, 0u, min_p, 0u, 0x7fffffff};
  if (0 < top_k && top_k < row.vocab) c.kth_key = kth_key(row, top_k);
  unsigned level = 0;
  u64 above = 0, T = 0, total = 0, reached = 0;
  if (c.kth_key == 0 && top_p >= 1.0) {  // nothing sorted: the draw walks the ids in order
    Target target = {kDraw, uniform, 0};
    u64 local = 0;
    for (int i = row.segment_begin(); i < row.segment_end(); ++i) {
      unsigned key;
      u64 weight;
      c.take(i, &key, &weight);
      local += weight;
    }
    T = target.resolve(block_reduce(local, SumOp()));
    const int id = first_past(c, false, 0u, 0ull, T, &reached);
    return id >= 0 ? id : last_taken(c, true);
  }
  if (top_p < 1.0) {  // top-p: keep the tokens before the first whose running mass reaches top_p * W
    Target target = {kAtLeast, top_p, 0};
    if (descend(c, target, &level, &above, &T, &total)) {
      const int cut = first_past(c, true, level, above, T, &reached);
      if (cut >= 0) { c.cut_key = level; c.cut_id = cut; }
    }
  }
  Target target = {kDraw, uniform, 0};
  int id = -1;
  if (descend(c, target, &level, &above, &T, &total)) id = first_past(c, true, level, above, T, &reached);
  return id >= 0 ? id : last_taken(c, false);
}

}  // namespace sampling
}  // namespace ember

// min_tokens bans, logit_bias, repetition / frequency / presence penalties, in place, in the host
// path's arithmetic. Edits of row r: entries [offsets[r], offsets[r + 1]) of [token, flags, count,
// bias bits]; flags: 1 logit_bias, 2 banned, 4 repeated (prompt or output, repetition penalty);
// count > 0: the token's count in the output, for frequency / presence. Grid (rows), any block.
extern "C" __global__ void apply_logit_edits(float* __restrict__ logits, const int* __restrict__ offsets,
                                             const int* __restrict__ entries, const double* __restrict__ reals,
                                             int row_stride) {
  using namespace ember::sampling;
  const int r = blockIdx.x;
  const double* p = reals + (long long)r * kRowReals;
  const float repetition = static_cast<float>(p[4]);
  for (int e = offsets[r] + threadIdx.x; e < offsets[r + 1]; e += blockDim.x) {
    const int* entry = entries + 4LL * e;
    const int flags = entry[1], count = entry[2];
    float* x = logits + (long long)r * row_stride + entry[0];
    float v = *x;
    if (flags & 1) v = v + __int_as_float(entry[3]);
    if (flags & 4) v = v > 0.0f ? v / repetition : v * repetition;
    if (count > 0) v = static_cast<float>(static_cast<double>(v) - (mul_no_fma(p[5], double(count)) + p[6]));
    if (flags & 2) v = ember::neg_inf();
    *x = v;
  }
}

// tokens[r]: the argmax of a greedy row (NaN never wins; the first id among equals), else the
// draw of uniform reals[r][3] over the row's temperature-scaled, top-k / min_p / top-p filtered
// distribution, walked as the host path walks it; a row with nothing finite or +inf: its argmax.
// Grid (rows), block: a multiple of 32, at most 1024.
extern "C" __global__ void sample_rows(int* __restrict__ tokens, const float* __restrict__ logits,
                                       const int* __restrict__ ints, const double* __restrict__ reals,
                                       int vocab, int row_stride) {
  using namespace ember::sampling;
  const int r = blockIdx.x;
  const int* q = ints + (long long)r * kRowInts;
  const double* p = reals + (long long)r * kRowReals;
  const bool greedy = q[1] != 0;
  RowView row = {logits + (long long)r * row_stride, vocab, greedy ? 1.0f : static_cast<float>(p[0]), false};
  const RowTop top = row_top(row);
  int token = top.argmax;
  if (!greedy && top.top != ember::neg_inf()) {
    row.limit = top.num_inf > 0;
    token = draw(row, top, q[0], p[1], static_cast<float>(p[2]), p[3]);
  }
  if (threadIdx.x == 0) tokens[r] = token;
}

// Raw logprobs (log_softmax of the unprocessed row; NaN counts as -inf, a +inf row gives log(1/n)
// to its n +inf tokens) of logits row rows[i]: the n best (value descending, lower id first) into
// top_ids / top_values [i, :n] (row stride kMaxTopLogprobs) and that of token tokens[rows[i]].
extern "C" __global__ void raw_logprobs(int* __restrict__ top_ids, float* __restrict__ top_values,
                                        float* __restrict__ chosen, const float* __restrict__ logits,
                                        const int* __restrict__ rows, const int* __restrict__ tokens, int vocab,
                                        int row_stride, int n) {
  using namespace ember::sampling;
  __shared__ unsigned s_key[kMaxTopLogprobs];
  __shared__ int s_id[kMaxTopLogprobs];
  const int i = blockIdx.x, source = rows[i];
  RowView row = {logits + (long long)source * row_stride, vocab, 1.0f, false};
  const RowTop top = row_top(row);
  row.limit = top.num_inf > 0;
  // logprob = (value - top) - log_sum, in the host path's two roundings
  float top_value = 0.0f, log_sum = 0.0f;
  if (row.limit) {
    log_sum = static_cast<float>(log(static_cast<double>(top.num_inf)));
  } else if (top.top != ember::neg_inf()) {
    float sum = 0.0f;
    for (int t = row.segment_begin(); t < row.segment_end(); ++t) sum += expf(row.value(t) - top.top);
    top_value = top.top;
    log_sum = logf(ember::block_sum(sum));
  }
  n = min(n, vocab);
  if (n > 0) top_n(row, n, s_key, s_id);
  if (threadIdx.x == 0) {
    for (int a = 0; a < n; ++a) {
      top_ids[i * kMaxTopLogprobs + a] = s_id[a];
      top_values[i * kMaxTopLogprobs + a] = (row.value(s_id[a]) - top_value) - log_sum;
    }
    chosen[i] = (row.value(tokens[source]) - top_value) - log_sum;
  }
}
