// The sequential core of the Feedback Transformer: forward and hand-written backward.
//
// Why C++: a training step is seq_len * n_layers tiny steps of a few dozen small ops each,
// and at these sizes the cost is per-op overhead, not arithmetic. Driving ATen ops from
// C++ removes the interpreter from the loop; on a CPU the batch is split into one shard per
// thread (rows of a batch never interact in the sweep, and one shard's small ops leave the
// other cores idle), and attention over a step's window is one loop per (row, head)
// (WindowAttention) instead of a dozen tiny ATen calls. The algorithm is described in the
// docstring of fbtrain/models/core/spec.py, which also fixes the order of the ops'
// arguments (CoreInputs, CoreOutputs, CoreSpec, LayerTensors; tests check this file
// against it); tests/reference.py checks the numbers against a slow autograd
// implementation written straight from the equations.
//
// Shapes: B batch, T steps in this call, D model width, H heads, dk = D / H, L layers,
// F feed-forward width, S = n0 + T memory slots (n0 carried over from an earlier call),
// n_kv key/value sets (1 shared, or L), P position rows. A shard owns batch rows
// [b0, b0 + nb) of every buffer; buffers are full-batch, so the weight gradients at the
// end are single large matmuls whatever the shard count.

// at::vec's 256-bit kernels where the core is built for AVX2 (native.py: -mavx2 -mfma); it
// picks NEON on ARM by itself, and plain loops elsewhere.
#if defined(__AVX2__) && defined(__FMA__) && !defined(CPU_CAPABILITY_AVX2)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

// Per-layer tensors, in the order of LayerTensors (LAYER_PARAMS) in spec.py.
enum Param { LN1_W, LN1_B, WQ, UQ, RT, CPOS, WO_T, BO, LN2_W, LN2_B, W1_T, B1, W2_T, B2, N_PARAMS };

// What the forward keeps for the backward, one buffer each (order = the list the op returns).
// Attention records are [L, n_att, B, .] over the steps that attend (non-empty memory);
// feed-forward records are [L, T, B, .]. The attention probabilities have a different
// width every step, so they are packed per layer as [L, sum_t B*H*ell_t].
// MEM_HAT, MEM_MU, MEM_RS: the normalised memory [T, B, D] and its statistics [T, B, 1]
// (empty unless memory_norm).
// Dropout masks (MASK_*) are bool, scaled by mask_scale where they are applied: a quarter of
// float masks' memory, which at a GPU's batch sizes is gigabytes. The hidden layer after its
// dropout is not kept (dropped_hidden recomputes it for W2's gradient).
enum Record { A, MU1, RS1, QU, O, MASK_ATT, PROB, PROB_USED, MASK_PROB,
              Y, MU2, RS2, CN, HID, MASK_H, MASK_FF, MEM_HAT, MEM_MU, MEM_RS,
              N_RECORDS };

struct Spec {
  int64_t L, H, window;
  bool shared_kv;
  double dropout, eps;
  bool memory_norm;  // keys/values from the (affine-free) LayerNorm of memory
};

// The inverted-dropout scale 1/(1-p) in the records' dtype, as a double that holds that value
// exactly: x * mask * mask_scale is then bitwise x * m for the float mask m = 1/(1-p) that
// `bernoulli_(1-p).div_(1-p)` makes (ATen divides in the tensor's dtype).
double mask_scale(const Spec& s, at::ScalarType dtype) {
  if (dtype == at::kDouble) return 1.0 / (1.0 - s.dropout);
  return static_cast<double>(1.0f / static_cast<float>(1.0 - s.dropout));
}

// out = x * mask * scale (mask bool): the dropout of x, written into out.
void drop_out(Tensor out, const Tensor& x, const Tensor& mask, double scale) {
  at::mul_out(out, x, mask).mul_(scale);
}

// First slot and length of the memory window seen by the step that creates `slot`.
std::pair<int64_t, int64_t> window_of(int64_t slot, int64_t window) {
  const int64_t lo = std::max<int64_t>(0, slot - window);
  return {lo, slot - lo};
}

// The shape of one call: steps, the steps that attend, and where each step's
// probabilities sit in the packed buffer. With keep = false (no backward to come) every
// step reuses record 0 as scratch.
struct Layout {
  int64_t B, T, D, H, dk, F, n0, n_kv, first_att, n_att;
  bool keep;
  std::vector<int64_t> prob_offset;  // per step, in elements of one layer's packed row
  int64_t prob_size = 0, max_ell = 0;

  Layout(const Spec& s, int64_t B_, int64_t T_, int64_t D_, int64_t F_, int64_t n0_,
         int64_t n_kv_, bool keep_)
      : B(B_), T(T_), D(D_), H(s.H), dk(D_ / s.H), F(F_), n0(n0_), n_kv(n_kv_),
        first_att(n0_ > 0 ? 0 : 1), n_att(std::max<int64_t>(0, T_ - (n0_ > 0 ? 0 : 1))),
        keep(keep_), prob_offset(T_, 0) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t ell = window_of(n0 + t, s.window).second;
      prob_offset[t] = prob_size;
      prob_size += keep ? B * H * ell : 0;
      max_ell = std::max(max_ell, ell);
    }
    if (!keep) prob_size = B * H * max_ell;
  }
  // Where rows [b0, ...) of step t's [B, H, ell] probabilities start in a layer's row.
  // Scratch (keep = false) gives each row room for the widest step: shards run at their
  // own pace, so one may be at a wider step than its neighbour.
  int64_t prob_start(int64_t t, int64_t ell, int64_t b0) const {
    return keep ? prob_offset[t] + b0 * H * ell : b0 * H * max_ell;
  }
  int64_t att_index(int64_t t) const { return keep ? t - first_att : 0; }
  int64_t ff_index(int64_t t) const { return keep ? t : 0; }
};

// Rows [b0, b0 + nb) of entry i of a contiguous [N, B, w] buffer (any leading dims
// flattened into N), as one as_strided view: the hot loops take a dozen such views per
// layer step, and a select/select/narrow chain costs three ops each.
Tensor rows(const Tensor& buf, int64_t i, int64_t b0, int64_t nb) {
  const int64_t B = buf.size(-2), w = buf.size(-1);
  return buf.as_strided({nb, w}, {w, 1}, buf.storage_offset() + (i * B + b0) * w);
}

struct Tape {
  std::vector<Tensor> rec;
  const Layout* lay;

  // Record r of layer l at step t, rows [b0, b0 + nb): [nb, width].
  Tensor att(int r, int64_t l, int64_t t, int64_t b0, int64_t nb) const {
    return rows(rec[r], l * rec[r].size(1) + lay->att_index(t), b0, nb);
  }
  Tensor ff(int r, int64_t l, int64_t t, int64_t b0, int64_t nb) const {
    return rows(rec[r], l * rec[r].size(1) + lay->ff_index(t), b0, nb);
  }
  // [nb, H, ell] probabilities (PROB, PROB_USED or MASK_PROB) of layer l at step t.
  Tensor prob(int r, int64_t l, int64_t t, int64_t ell, int64_t b0, int64_t nb) const {
    const Tensor& buf = rec[r];
    const int64_t H = lay->H;
    return buf.as_strided({nb, H, ell}, {H * ell, ell, 1},
                          buf.storage_offset() + l * buf.size(1) + lay->prob_start(t, ell, b0));
  }
  // [nb*H, ell, L]: the same for every layer at once (the layers' rows are a packed row
  // apart), as the left factor of a matmul that sums over the layers.
  Tensor prob_layers(int r, int64_t t, int64_t ell, int64_t b0, int64_t nb) const {
    const Tensor& buf = rec[r];
    return buf.as_strided({nb * lay->H, ell, buf.size(0)}, {ell, 1, buf.size(1)},
                          buf.storage_offset() + lay->prob_start(t, ell, b0));
  }
};

// The QU record holds each step's queries [B, D] on both paths: the ATen path projects a
// query and its position scores together (AtenQuery) into scratch, and keeps the queries
// alone (the backward needs nothing else of that row; the position scores would be
// P / dk times the queries' memory).
// The probabilities after dropout (PROB_USED) are kept on the CPU loops only; the ATen path
// recomputes them from PROB and MASK_PROB where the backward needs them (dropped_probs).
Tape make_tape(const Spec& s, const Layout& lay, const Tensor& like, bool loops) {
  const int64_t L = s.L, B = lay.B, D = lay.D, F = lay.F;
  const int64_t n_att = lay.keep ? lay.n_att : 1, n_ff = lay.keep ? lay.T : 1;
  const bool drop = s.dropout > 0;
  auto buf = [&](std::initializer_list<int64_t> shape) { return like.new_empty(shape); };
  auto none = [&]() { return like.new_empty({0}); };
  std::vector<Tensor> r(N_RECORDS);
  // LayerNorm outputs and statistics (A, MU1, RS1, CN, MU2, RS2) are not written in the
  // sweep: record_layer_norms recomputes them afterwards, one call per layer.
  r[QU] = buf({L, n_att, B, D});
  r[O] = buf({L, n_att, B, D});
  r[PROB] = buf({L, lay.prob_size});
  r[Y] = buf({L, n_ff, B, D});
  r[HID] = buf({L, n_ff, B, F});
  // Inverted-dropout masks (bool: kept or dropped) are drawn here, on one thread and in one
  // go, so the result does not depend on how the batch is sharded; the draws are those of
  // float masks (bernoulli_ draws one value per element whatever the dtype).
  auto mask = [&](std::initializer_list<int64_t> shape) {
    return like.new_empty(shape, like.options().dtype(at::kBool)).bernoulli_(1.0 - s.dropout);
  };
  r[MASK_ATT] = drop ? mask({L, n_att, B, D}) : none();
  r[PROB_USED] = !drop ? r[PROB] : loops ? buf({L, lay.prob_size}) : none();
  r[MASK_PROB] = drop ? mask({L, lay.prob_size}) : none();
  r[MASK_H] = drop ? mask({L, n_ff, B, F}) : none();
  r[MASK_FF] = drop ? mask({L, n_ff, B, D}) : none();
  r[MEM_HAT] = r[MEM_MU] = r[MEM_RS] = none();  // see record_memory_norm
  return Tape{std::move(r), &lay};
}

// Shards: one per intra-op thread on a CPU (at most one per batch row), one elsewhere.
int64_t shard_count(const Tensor& x, int64_t B) {
  return x.is_cpu() ? std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B)) : 1;
}

// Runs fn(shard, b0, nb) for every shard, in parallel when there are several (inside
// at::parallel_for nested intra-op parallelism is off, which is what a shard wants). Each
// shard runs under the profiler mark `mark` on its own thread, so a profile shows the
// sweep's own time (the mark's self time) on every thread (scripts/benchmark.py --profile).
template <typename Fn>
void for_each_shard(int64_t shards, int64_t B, const char* mark, const Fn& fn) {
  auto run = [&](int64_t s) {
    RECORD_FUNCTION(mark, std::vector<c10::IValue>());
    const int64_t b0 = B * s / shards, b1 = B * (s + 1) / shards;
    fn(s, b0, b1 - b0);
  };
  if (shards == 1) return run(0);
  at::parallel_for(0, shards, 1, [&](int64_t s0, int64_t s1) {
    at::InferenceMode guard;  // thread-local, so set again in each worker
    for (int64_t s = s0; s < s1; ++s) run(s);
  });
}

// Attention over one step's memory window, for CPU tensors: one pass per (row, head), each
// loop vectorised over the window's slots (at::vec: AVX2 where the core is built for it,
// NEON on ARM, plain loops elsewhere). At these sizes (d_k 32, a window of tens to hundreds
// of slots) such a pass costs less than the ten-odd ATen calls it replaces (each a dispatch
// and a tiny batched gemm). Other devices and dtypes take the same steps as ATen calls.
//
// Layout: each (row, head) has its keys or values as one block, [S, dk] slot-major as the
// core keeps them, or transposed, [dk, S] (slot j of feature d at d * S + j). The
// forward's scores, a sum over features for every slot, read the transposed keys and run
// along the slots, a vector of slots at a time (and the softmax along them too); its
// weighted sum of values runs along the features of slot-major rows, a tile of rows at a
// time. The backward reads and updates slot-major rows, each touched once per layer: the
// probabilities' gradients (dot products with the values) W slots at a time, reduced
// across lanes together, the query's gradient slot by slot with a row's vectors of
// features side by side (reading transposed values, or deferring a step's key/value
// gradients to one pass over all layers, measured slower: the loops wait on memory).
// Every sum is taken in the order the previous scalar-reduction loops took it, so results
// are bitwise those of earlier versions on an AVX2 build.
// Blocks are `kv_stride()` (S * dk) apart; the pointers passed are (row, head) 0's block
// at the window's first slot.
//
// Pointers: qu [nb, H*dk]; rt [H, dk, P] and c [H, P] (their last `ell` positions are this
// window's); prob, prob_used, mask [nb, H, ell]; o [nb, H*dk]. A dropout mask (null
// without dropout) keeps a probability as its value times `scale`, or drops it.
template <typename T>
struct WindowAttention {
  using Vec = at::vec::Vectorized<T>;
  static constexpr int64_t W = Vec::size();
  int64_t nb, H, dk, ell, P, S;
  const T *rt, *c;

  int64_t kv_stride() const { return S * dk; }
  // Slots per tile of a loop over slot-major rows that runs a vector of features at a time:
  // a tile's rows (8 KiB of floats) stay in L1 while each vector of features passes over
  // them, instead of streaming the window's rows once per vector.
  int64_t tile() const { return std::max<int64_t>(4, 2048 / dk); }
  const T* pos_row(const T* table, int64_t h) const { return table + h * dk * P + (P - ell); }
  // The dropout factor of element i: scale or 0, the float mask's value.
  static T kept(const bool* mask, int64_t i, T scale) { return mask[i] ? scale : T(0); }
  // a * b + c, rounded once where the core is built with FMA (as the compiler contracts
  // it there), twice elsewhere: std::fma without the instruction is a slow library call.
  static T mul_add(T a, T b, T c) {
#if defined(__FMA__)
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
  }
  // Vectors of a row of dk features, and the features in vector k.
  int64_t vectors() const { return (dk + W - 1) / W; }
  int64_t width(int64_t k) const { return std::min(W, dk - k * W); }
  // Runs fn(N, first) over [0, count) in chunks [first, first + N) of at most 8, with N a
  // std::integral_constant: a chunk's N accumulators then live in registers and their
  // chains of fused multiply-adds run side by side (one chain at a time waits out each
  // instruction's latency).
  template <typename Fn>
  static void in_chunks(int64_t count, const Fn& fn) {
    using std::integral_constant;
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) fn(integral_constant<int64_t, 8>{}, i);
    switch (count - i) {
      case 7: return fn(integral_constant<int64_t, 7>{}, i);
      case 6: return fn(integral_constant<int64_t, 6>{}, i);
      case 5: return fn(integral_constant<int64_t, 5>{}, i);
      case 4: return fn(integral_constant<int64_t, 4>{}, i);
      case 3: return fn(integral_constant<int64_t, 3>{}, i);
      case 2: return fn(integral_constant<int64_t, 2>{}, i);
      case 1: return fn(integral_constant<int64_t, 1>{}, i);
      default: return;
    }
  }

  // s[j] = c[j] + sum_d q[d] r[d][j] + sum_d q[d] kt[d][j] over the window (r's rows P
  // apart, kt's S apart): the position and content terms summed apart, as two chains.
  void scores(const T* q, const T* r, const T* kt, const T* cb, T* s) const {
    int64_t j = 0;
    for (; j + 2 * W <= ell; j += 2 * W) {  // two vectors of slots: four chains
      Vec p0 = Vec::loadu(cb + j), p1 = Vec::loadu(cb + j + W), k0(0), k1(0);
      for (int64_t d = 0; d < dk; ++d) {
        const Vec qd(q[d]);
        const T *rd = r + d * P + j, *kd = kt + d * S + j;
        p0 = at::vec::fmadd(qd, Vec::loadu(rd), p0);
        p1 = at::vec::fmadd(qd, Vec::loadu(rd + W), p1);
        k0 = at::vec::fmadd(qd, Vec::loadu(kd), k0);
        k1 = at::vec::fmadd(qd, Vec::loadu(kd + W), k1);
      }
      (p0 + k0).store(s + j);
      (p1 + k1).store(s + j + W);
    }
    for (; j < ell; j += W) {
      const int64_t n = std::min(W, ell - j);
      Vec p = Vec::loadu(cb + j, n), k(0);
      for (int64_t d = 0; d < dk; ++d) {
        const Vec qd(q[d]);
        p = at::vec::fmadd(qd, Vec::loadu(r + d * P + j, n), p);
        k = at::vec::fmadd(qd, Vec::loadu(kt + d * S + j, n), k);
      }
      (p + k).store(s + j, n);
    }
  }

  // s <- softmax(s) over the window, in place.
  void softmax(T* s) const {
    const T top = at::vec::reduce_all<T>(
        [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s, ell);
    at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, s, s, ell);
    const T inv = T(1) / at::vec::reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, s, ell);
    at::vec::map([inv](Vec x) { return x * Vec(inv); }, s, s, ell);
  }

  // o[d] = sum_j p[j] v[j][d] (v's slots dk apart), a tile of slots and a vector of
  // features at a time, over the slots in four chains.
  void weighted_sum(const T* p, const T* v, T* o) const {
    std::fill(o, o + dk, T(0));
    for (int64_t j0 = 0; j0 < ell; j0 += tile()) {
      const int64_t j1 = std::min(ell, j0 + tile());
      for (int64_t d = 0; d < dk; d += W) {
        const int64_t n = std::min(W, dk - d);
        Vec a0(0), a1(0), a2(0), a3(0);
        int64_t j = j0;
        for (; j + 4 <= j1; j += 4) {
          const T* vj = v + j * dk + d;
          a0 = at::vec::fmadd(Vec(p[j]), Vec::loadu(vj, n), a0);
          a1 = at::vec::fmadd(Vec(p[j + 1]), Vec::loadu(vj + dk, n), a1);
          a2 = at::vec::fmadd(Vec(p[j + 2]), Vec::loadu(vj + 2 * dk, n), a2);
          a3 = at::vec::fmadd(Vec(p[j + 3]), Vec::loadu(vj + 3 * dk, n), a3);
        }
        for (; j < j1; ++j) a0 = at::vec::fmadd(Vec(p[j]), Vec::loadu(v + j * dk + d, n), a0);
        (Vec::loadu(o + d, n) + ((a0 + a1) + (a2 + a3))).store(o + d, n);
      }
    }
  }

  void forward(const T* qu, const T* kt, const T* v, T* prob, T* prob_used, const bool* mask,
               T scale, T* o) const {
    const int64_t D = H * dk;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t bh = b * H + h;
        T* s = prob + bh * ell;
        scores(qu + b * D + h * dk, pos_row(rt, h), kt + bh * kv_stride(),
               c + h * P + (P - ell), s);
        softmax(s);
        const T* p = s;
        if (mask) {
          T* pu = prob_used + bh * ell;
          for (int64_t j = 0; j < ell; ++j) pu[j] = s[j] * kept(mask, bh * ell + j, scale);
          p = pu;
        }
        weighted_sum(p, v + bh * kv_stride(), o + b * D + h * dk);
      }
    }
  }

  // Given d_o [nb, H*dk]: writes d_qu [nb, H*dk] and the score gradients ds [nb, H, ell]
  // (the softmax's input gradients), and adds into the window's key/value gradients (same
  // layout as K, V); position_grads takes the position tables' from ds. Each slot-major row
  // of the window is touched once: values with their gradients W slots at a time (dots),
  // keys with theirs slot by slot, each row's vectors of features side by side in
  // registers. `scratch` holds ell values.
  void backward(const T* qu, const T* K, const T* V, const T* prob, const T* prob_used,
                const bool* mask, T scale, const T* d_o, T* d_qu, T* dK, T* dV, T* ds_out,
                T* scratch) const {
    const int64_t D = H * dk;
    T* dp = scratch;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t bh = b * H + h;
        const T *q = qu + b * D + h * dk, *g = d_o + b * D + h * dk;
        const T *Kb = K + bh * kv_stride(), *Vb = V + bh * kv_stride();
        T* dKb = dK + bh * kv_stride();
        const T* p = prob + bh * ell;
        T* ds = ds_out + bh * ell;
        // dp[j] = g . v_j, and dv_j += pu[j] g in the same pass.
        dots(g, dk, Vb, dk, ell, dp, prob_used + bh * ell, dV + bh * kv_stride());
        T dot = 0;
        for (int64_t j = 0; j < ell; ++j) {
          if (mask) dp[j] *= kept(mask, bh * ell + j, scale);
          dot = mul_add(p[j], dp[j], dot);
        }
        for (int64_t j = 0; j < ell; ++j) ds[j] = p[j] * (dp[j] - dot);  // softmax backward
        // The query's gradient: position terms (dq[d] = ds . r_d, rows P apart), then the
        // content terms slot by slot (dq += ds[j] k_j, and dk_j += ds[j] q).
        T* dq = d_qu + b * D + h * dk;
        dots(ds, ell, pos_row(rt, h), P, dk, dq);
        in_chunks(vectors(), [&](auto nv, int64_t v0) {
          constexpr int64_t NV = decltype(nv)::value;
          Vec a[NV], qv[NV];
          for (int64_t k = 0; k < NV; ++k) {
            a[k] = Vec::loadu(dq + (v0 + k) * W, width(v0 + k));
            qv[k] = Vec::loadu(q + (v0 + k) * W, width(v0 + k));
          }
          for (int64_t j = 0; j < ell; ++j) {
            const Vec c(ds[j]);
            const T* kj = Kb + j * dk + v0 * W;
            T* dkj = dKb + j * dk + v0 * W;
            for (int64_t k = 0; k < NV; ++k) {
              const int64_t n = width(v0 + k);
              a[k] = at::vec::fmadd(c, Vec::loadu(kj + k * W, n), a[k]);
              at::vec::fmadd(c, qv[k], Vec::loadu(dkj + k * W, n)).store(dkj + k * W, n);
            }
          }
          for (int64_t k = 0; k < NV; ++k) a[k].store(dq + (v0 + k) * W, width(v0 + k));
        });
      }
    }
  }

  // out[i] = sum_e x[e] y_i[e] over e < len, for i < count, with y_i's elements contiguous
  // and y_i `row` apart: W of the y_i at a time, their lanes reduced together (lane_sums).
  // Each sum in a fixed order: lane k of a vector accumulates the terms e = k (mod W) of
  // the whole vectors, the last len % W terms go into lane 0 one by one, and the lanes are
  // added in order from 0. With `upd`, in the same pass: upd_i += coef[i] x (upd_i laid
  // out as y_i).
  static void dots(const T* x, int64_t len, const T* y, int64_t row, int64_t count, T* out,
                   const T* coef = nullptr, T* upd = nullptr) {
    const int64_t body = len - len % W;
    int64_t i = 0;
    for (; i + W <= count; i += W) {
      Vec acc[W];
      for (int64_t k = 0; k < W; ++k) acc[k] = Vec(0);
      for (int64_t e = 0; e < body; e += W) {
        const Vec xe = Vec::loadu(x + e);
        for (int64_t k = 0; k < W; ++k) {
          acc[k] = at::vec::fmadd(xe, Vec::loadu(y + (i + k) * row + e), acc[k]);
          if (upd) {
            T* u = upd + (i + k) * row + e;
            at::vec::fmadd(Vec(coef[i + k]), xe, Vec::loadu(u)).store(u);
          }
        }
      }
      if (upd) {
        for (int64_t k = 0; k < W; ++k)
          for (int64_t e = body; e < len; ++e) {
            T& u = upd[(i + k) * row + e];
            u = mul_add(coef[i + k], x[e], u);
          }
      }
      lane_sums(acc, x, y + i * row, row, body, len, out + i);
    }
    for (; i < count; ++i) {  // the last count % W one at a time, in the same order
      T lanes[W] = {};
      for (int64_t e = 0; e < len; ++e) {
        T& lane = lanes[e < body ? e % W : 0];
        lane = mul_add(x[e], y[i * row + e], lane);
        if (upd) upd[i * row + e] = mul_add(coef[i], x[e], upd[i * row + e]);
      }
      T s = 0;
      for (int64_t k = 0; k < W; ++k) s += lanes[k];
      out[i] = s;
    }
  }

  // out[k] = the lanes of acc[k] (after the tail terms e in [body, len) of x . y_k are added
  // into lane 0) summed in order from 0, for k < W; y_k rows `row` apart. With AVX2 and no
  // tail, the W accumulators are transposed (8 x 8) so that the sums run as vector adds.
  static void lane_sums(Vec* acc, const T* x, const T* y, int64_t row, int64_t body,
                        int64_t len, T* out) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, float>) {
      if (body == len) {
        __m256 r[8];
        for (int k = 0; k < 8; ++k) r[k] = acc[k];
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        // c_k holds lane k of every acc
        const __m256 c[8] = {
            _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
            _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
            _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
            _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
        __m256 s = _mm256_setzero_ps();
        for (int k = 0; k < 8; ++k) s = _mm256_add_ps(s, c[k]);
        _mm256_storeu_ps(out, s);
        return;
      }
    }
#endif
    for (int64_t k = 0; k < W; ++k) {
      T lanes[W];
      acc[k].store(lanes);
      for (int64_t e = body; e < len; ++e) lanes[0] = mul_add(x[e], y[k * row + e], lanes[0]);
      T s = 0;
      for (int64_t m = 0; m < W; ++m) s += lanes[m];
      out[k] = s;
    }
  }

  // Adds the position-table gradients of one layer's step, d_rt [H, dk, P] and d_c [H, P],
  // from the score gradients ds [nb, H, ell] and the queries qu [nb, H*dk]: a vector of
  // positions at a time, summed over the rows in their order.
  void position_grads(const T* qu, const T* ds, T* d_rt, T* d_c) const {
    const int64_t D = H * dk;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < ell; j += W) {
        const int64_t n = std::min(W, ell - j);
        T* dc = d_c + h * P + (P - ell) + j;
        Vec acc = Vec::loadu(dc, n);
        for (int64_t b = 0; b < nb; ++b) acc = acc + Vec::loadu(ds + (b * H + h) * ell + j, n);
        acc.store(dc, n);
        in_chunks(dk, [&](auto nd, int64_t d0) {  // up to 8 features' rows at a time
          constexpr int64_t ND = decltype(nd)::value;
          T* dr = d_rt + (h * dk + d0) * P + (P - ell) + j;
          Vec r[ND];
          for (int64_t m = 0; m < ND; ++m) r[m] = Vec::loadu(dr + m * P, n);
          for (int64_t b = 0; b < nb; ++b) {
            const Vec x = Vec::loadu(ds + (b * H + h) * ell + j, n);
            const T* qb = qu + b * D + h * dk + d0;
            for (int64_t m = 0; m < ND; ++m) r[m] = at::vec::fmadd(Vec(qb[m]), x, r[m]);
          }
          for (int64_t m = 0; m < ND; ++m) r[m].store(dr + m * P, n);
        });
      }
    }
  }
};

// Layer w's WindowAttention over a window of ell slots, for nb rows of S-slot blocks.
template <typename T>
WindowAttention<T> window_attention(const std::vector<Tensor>& w, int64_t nb, int64_t ell,
                                    int64_t P, int64_t S) {
  const int64_t H = w[RT].size(0), dk = w[RT].size(1);
  return {nb, H, dk, ell, P, S, w[RT].data_ptr<T>(), w[CPOS].data_ptr<T>()};
}

// Whether a tensor's sweep uses WindowAttention (CPU, float or double). The environment
// variable FBTRAIN_CORE_ATEN forces the ATen calls on the CPU too: the tests check that
// path, which every GPU run takes, against the reference on a machine without one.
bool loops_for(const Tensor& x) {
  return x.is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) &&
         std::getenv("FBTRAIN_CORE_ATEN") == nullptr;
}

// The ATen path (any device but the CPU's loops) folds the position terms into the query
// projection, so a step's attention is four calls and its backward has no position terms:
// qu_h . r_hj + c_hj = a (Wq_h r_h) + (u_h . r_h + c_hj), one projection to a row of
// [H, dk + P] per batch row (each head's query, then its P position scores), whose
// position part the content scores are then added into in place (baddbmm_). Its gradient
// [H, dk + P] (d_qu, then the score gradients; zero outside a step's window) goes back
// through the same projection in one matmul, and the gradients of wq, uq, rt and c follow
// from that of the folded projection once per call (aten_query_grads).
struct AtenQuery {
  Tensor w, b, w_t;  // [D, H*(dk+P)], [H*(dk+P)], w transposed
};

AtenQuery aten_query(const std::vector<Tensor>& w, int64_t H) {
  const Tensor &wq = w[WQ], &rt = w[RT];
  const int64_t D = wq.size(0), dk = D / H, P = rt.size(-1);
  const Tensor wq_h = wq.view({D, H, dk});
  const Tensor w_pos = at::bmm(wq_h.transpose(0, 1), rt).transpose(0, 1);  // [D, H, P]
  const Tensor b_pos = at::bmm(w[UQ].view({H, 1, dk}), rt).view({H, P}) + w[CPOS].view({H, P});
  const Tensor fw = at::cat({wq_h, w_pos}, 2).reshape({D, H * (dk + P)});
  const Tensor fb = at::cat({w[UQ].view({H, dk}), b_pos}, 1).reshape({-1});
  return {fw, fb, fw.t()};
}

// The ATen path keeps keys and values slot-major, [S, B, H, 2, n_kv, dk]: a new slot's keys
// and values of every set are one row block, written by the projection in a single call
// (its columns put in that order once per call), and the backward's gradients, laid out
// alike, give a slot's memory gradient in one matmul and (with one key/value set) a step's
// window gradients from all layers in two batched matmuls. The keys and values the core returns are views of it in the
// [n_kv, B*H, S, dk] shape; per (row, head) a window is still an [ell, dk] matrix with unit
// stride along dk, which is all a batched matmul needs (cuBLAS takes any other stride).
Tensor kv_slot_buffer(const Tensor& like, int64_t S, int64_t B, int64_t H, int64_t n_kv,
                      int64_t dk) {
  return like.new_empty({S, B, H, 2, n_kv, dk});
}

// Keys (c = 0) or values (c = 1) of a slot-major buffer, as [n_kv, B*H, S, dk] (a view).
Tensor kv_view(const Tensor& slots, int64_t c) {
  const int64_t S = slots.size(0), B = slots.size(1), H = slots.size(2);
  return slots.select(3, c).permute({3, 1, 2, 0, 4}).view({slots.size(4), B * H, S, slots.size(5)});
}

// The last dimension of w, 2 * n_kv * H * dk wide, from the projection's order
// (key/value, set, head, dk) to the slot-major buffer's (head, key/value, set, dk), or back
// (to_slots = false).
Tensor kv_columns(const Tensor& w, int64_t n_kv, int64_t H, bool to_slots) {
  std::vector<int64_t> shape(w.sizes().begin(), w.sizes().end() - 1), perm;
  const int64_t lead = static_cast<int64_t>(shape.size()), dk = w.size(-1) / (2 * n_kv * H);
  for (int64_t i = 0; i < lead; ++i) perm.push_back(i);
  if (to_slots) {
    shape.insert(shape.end(), {2, n_kv, H, dk});
    perm.insert(perm.end(), {lead + 2, lead, lead + 1, lead + 3});
  } else {
    shape.insert(shape.end(), {H, 2, n_kv, dk});
    perm.insert(perm.end(), {lead + 1, lead + 2, lead, lead + 3});
  }
  return w.reshape(shape).permute(perm).reshape(w.sizes());
}

struct Forward {
  const Spec& s;
  const Layout& lay;
  const std::vector<std::vector<Tensor>>& p;  // [L][N_PARAMS]
  const Tensor &mix, &wkv;
  const std::optional<Tensor>& bkv;
  Tensor hidden, memory, keys, values;  // [T, L+1, B, D], [T, B, D], [n_kv, B*H, S, dk] x2
  Tape tape;
  // The CPU loops: the keys again, transposed ([n_kv, B*H, dk, S]: WindowAttention's
  // scores read them so), each slot written there as it is made.
  Tensor keys_t;
  std::vector<AtenQuery> query;  // per layer, on the ATen path only
  // The ATen path: the slot-major buffer that keys and values are views of, and the
  // projection with its columns in that buffer's order (kv_columns).
  Tensor kv_slots, wkv_slots;
  std::optional<Tensor> bkv_slots;

  void shard(int64_t b0, int64_t nb) const {
    const int64_t L = s.L, H = s.H, dk = lay.dk, D = lay.D, T = lay.T, n0 = lay.n0;
    const int64_t n_kv = lay.n_kv, S = n0 + T, nbH = nb * H, n_pos = p[0][RT].size(-1);
    const bool drop = s.dropout > 0, loops = loops_for(hidden);
    const bool prefilled = !loops && lay.keep;  // see prefill_biases
    const std::vector<int64_t> shape{D};
    const double scale = drop ? mask_scale(s, hidden.scalar_type()) : 1.0;
    // The hidden layer after its dropout: scratch, since only W2's gradient needs it again.
    Tensor h_dropped = drop ? hidden.new_empty({nb, lay.F}) : Tensor();
    // The ATen path's query and position scores of a step, [nb, H*(dk+P)] (AtenQuery).
    Tensor q_scores = loops ? Tensor() : hidden.new_empty({nb, H * (dk + n_pos)});
    // The ATen path's probabilities after dropout of a step, [nb*H*ell] of nb*H*max_ell.
    Tensor p_dropped = drop && !loops ? hidden.new_empty({nbH * lay.max_ell}) : Tensor();
    // This shard's rows of the memory buffers, and of the same seen as [n_kv, nb, H, S, dk].
    const Tensor keys_s = keys.narrow(1, b0 * H, nbH), values_s = values.narrow(1, b0 * H, nbH);
    const Tensor key_rows = keys_s.view({n_kv, nb, H, S, dk});
    const Tensor value_rows = values_s.view({n_kv, nb, H, S, dk});
    // This shard's transposed keys (the CPU loops), [n_kv, nbH, dk, S].
    const Tensor keys_t_s = loops ? keys_t.narrow(1, b0 * H, nbH) : Tensor();
    std::vector<Tensor> k_t(n_kv), v_w(n_kv);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = n0 + t;
      const auto [lo, ell] = window_of(slot, s.window);
      for (int64_t kv = 0; ell && kv < n_kv; ++kv) {  // this step's window of every set
        k_t[kv] = keys_s.select(0, kv).narrow(1, lo, ell).transpose(1, 2);  // [nbH, dk, ell]
        v_w[kv] = values_s.select(0, kv).narrow(1, lo, ell);  // [nbH, ell, dk]
      }
      const Tensor hid_t = hidden.select(0, t).narrow(1, b0, nb);  // [L+1, nb, D]
      Tensor x = hid_t.select(0, 0);
      for (int64_t l = 0; l < L; ++l) {
        const auto& w = p[l];
        const int64_t set = s.shared_kv ? 0 : l;
        Tensor y = tape.ff(Y, l, t, b0, nb);
        if (ell) {  // attention is skipped while memory is empty
          const Tensor a = std::get<0>(at::native_layer_norm(x, shape, w[LN1_W], w[LN1_B], s.eps));
          Tensor qu = tape.att(QU, l, t, b0, nb);  // (q + u) / sqrt(dk): [nb, D]
          if (loops) at::addmm_out(qu, w[UQ], a, w[WQ]);
          else at::addmm_out(q_scores, query[l].b, a, query[l].w);  // [nb, H*(dk+P)]
          Tensor o = tape.att(O, l, t, b0, nb);
          if (loops) {
            const Tensor prob = tape.prob(PROB, l, t, ell, b0, nb);
            const Tensor prob_used = drop ? tape.prob(PROB_USED, l, t, ell, b0, nb) : prob;
            AT_DISPATCH_FLOATING_TYPES(qu.scalar_type(), "attend", [&] {
              const auto att = window_attention<scalar_t>(w, nb, ell, n_pos, S);
              att.forward(qu.data_ptr<scalar_t>(),
                          keys_t_s.select(0, set).data_ptr<scalar_t>() + lo,
                          v_w[set].data_ptr<scalar_t>(), prob.data_ptr<scalar_t>(),
                          prob_used.data_ptr<scalar_t>(),
                          drop ? tape.prob(MASK_PROB, l, t, ell, b0, nb).data_ptr<bool>()
                               : nullptr,
                          static_cast<scalar_t>(scale), o.data_ptr<scalar_t>());
            });
          } else {  // any other device: the same, in ATen calls
            // Content scores plus the projected position scores (out of place: an in-place
            // baddbmm_ on the strided record runs one gemm per batch entry on a CPU).
            const Tensor qp = q_scores.view({nbH, dk + n_pos});
            const Tensor scores = at::baddbmm(qp.narrow(1, dk + n_pos - ell, ell).unsqueeze(1),
                                              qp.narrow(1, 0, dk).unsqueeze(1), k_t[set]);
            if (lay.keep) qu.view({nb, H, dk}).copy_(qp.view({nb, H, dk + n_pos}).narrow(2, 0, dk));
            Tensor prob = tape.prob(PROB, l, t, ell, b0, nb);
            Tensor prob3 = prob.view({nbH, 1, ell});
            at::_softmax_out(prob3, scores, -1, false);
            Tensor prob_used = prob;
            if (drop) {
              prob_used = p_dropped.narrow(0, 0, nbH * ell).view({nb, H, ell});
              drop_out(prob_used, prob, tape.prob(MASK_PROB, l, t, ell, b0, nb), scale);
            }
            Tensor o3 = o.view({nbH, 1, dk});
            at::bmm_out(o3, prob_used.view({nbH, 1, ell}), v_w[set]);
          }
          if (prefilled) {  // y holds bo already (prefill_biases)
            y.addmm_(o, w[WO_T]);
            // x + (scale * mask) * y: the mask first, so that y is multiplied by the float
            // mask's value as before (bitwise, however the kernel contracts it).
            if (drop) at::addcmul_out(y, x, tape.att(MASK_ATT, l, t, b0, nb), y, scale);
            else y.add_(x);
          } else {
            Tensor z = at::addmm(w[BO], o, w[WO_T]);
            if (drop) z.mul_(tape.att(MASK_ATT, l, t, b0, nb)).mul_(scale);
            at::add_out(y, z, x);
          }
        } else {
          y.copy_(x);
        }
        const Tensor c = std::get<0>(at::native_layer_norm(y, shape, w[LN2_W], w[LN2_B], s.eps));
        Tensor h = tape.ff(HID, l, t, b0, nb);  // [nb, F]
        if (loops) at::addmm_out(h, w[B1], c, w[W1_T]).relu_();
        else at::_addmm_activation_out(h, w[B1], c, w[W1_T]);  // CUDA: relu in cuBLASLt's
                                                                // epilogue, one kernel
        Tensor h_used = h;
        if (drop) {
          h_used = h_dropped;
          drop_out(h_used, h, tape.ff(MASK_H, l, t, b0, nb), scale);
        }
        if (loops) {
          Tensor f = at::addmm(w[B2], h_used, w[W2_T]);
          if (drop) f.mul_(tape.ff(MASK_FF, l, t, b0, nb)).mul_(scale);
          x = hid_t.select(0, l + 1);
          at::add_out(x, y, f);
        } else {  // the ATen path: hidden holds b2 already (prefill_biases)
          x = hid_t.select(0, l + 1);
          x.addmm_(h_used, w[W2_T]);
          if (drop) at::addcmul_out(x, y, tape.ff(MASK_FF, l, t, b0, nb), x, scale);
          else x.add_(y);
        }
      }
      // m_t = sum_l softmax(w)_l h_t^l, then its keys/values for every key set at once.
      Tensor m = memory.select(0, t).narrow(0, b0, nb), m_row = m.view({1, nb * D});  // [nb, D]
      at::mm_out(m_row, mix.view({1, L + 1}), hid_t.view({L + 1, nb * D}));
      // With memory_norm the projection reads LayerNorm(m_t); its affine part is folded
      // into wkv/bkv by the caller, so only the normalisation happens here.
      const Tensor kv_in =
          s.memory_norm ? std::get<0>(at::native_layer_norm(m, shape, {}, {}, s.eps)) : m;
      if (loops) {
        Tensor kv_new = bkv ? at::addmm(*bkv, kv_in, wkv) : at::mm(kv_in, wkv);
        kv_new = kv_new.view({nb, 2, n_kv, H, dk});
        key_rows.select(3, slot).copy_(kv_new.select(1, 0).transpose(0, 1));
        value_rows.select(3, slot).copy_(kv_new.select(1, 1).transpose(0, 1));
        keys_t_s.view({n_kv, nb, H, dk, S}).select(4, slot)
            .copy_(kv_new.select(1, 0).transpose(0, 1));
      } else {  // straight into the slot's row block
        Tensor block = kv_slots.select(0, slot).narrow(0, b0, nb).view({nb, -1});
        if (bkv_slots) at::addmm_out(block, *bkv_slots, kv_in, wkv_slots);
        else at::mm_out(block, kv_in, wkv_slots);
      }
    }
  }
};

// The LayerNorm records of the tape: outputs and statistics of both LayerNorms of every
// layer at every step, recomputed from their inputs (hidden states and Y) in one call per
// layer and LayerNorm. The sweep itself uses each result at once and keeps nothing: out=
// writes of the per-step calls would copy, and these big calls cost less than the copies.
// The kernel normalises each row on its own, so the rows equal the sweep's.
void record_layer_norms(const Spec& s, const Layout& lay,
                        const std::vector<std::vector<Tensor>>& p, const Tensor& hidden,
                        std::vector<Tensor>& rec) {
  const int64_t D = lay.D;
  const std::vector<int64_t> shape{D};
  std::vector<Tensor> a, mu1, rs1, c, mu2, rs2;
  for (int64_t l = 0; l < s.L; ++l) {
    const auto& w = p[l];
    const Tensor x_att = hidden.narrow(0, lay.first_att, lay.n_att).select(1, l);
    auto [a_l, mu1_l, rs1_l] = at::native_layer_norm(x_att, shape, w[LN1_W], w[LN1_B], s.eps);
    auto [c_l, mu2_l, rs2_l] =
        at::native_layer_norm(rec[Y].select(0, l), shape, w[LN2_W], w[LN2_B], s.eps);
    a.push_back(a_l);
    mu1.push_back(mu1_l);
    rs1.push_back(rs1_l);
    c.push_back(c_l);
    mu2.push_back(mu2_l);
    rs2.push_back(rs2_l);
  }
  rec[A] = at::stack(a);
  rec[MU1] = at::stack(mu1);
  rec[RS1] = at::stack(rs1);
  rec[CN] = at::stack(c);
  rec[MU2] = at::stack(mu2);
  rec[RS2] = at::stack(rs2);
}

// The normalised memory and its statistics, recomputed from the memory buffer in one call
// (rows equal the sweep's, as in record_layer_norms).
void record_memory_norm(const Spec& s, const Tensor& memory, std::vector<Tensor>& rec) {
  if (!s.memory_norm) return;
  auto [hat, mu, rs] = at::native_layer_norm(memory, {memory.size(-1)}, {}, {}, s.eps);
  rec[MEM_HAT] = hat;
  rec[MEM_MU] = mu;
  rec[MEM_RS] = rs;
}

// The ATen path's bias prefill: every step's output rows of the attention block (Y) and
// each layer (hidden) start as their bias, a few calls per call of the core, so that each step's matmul accumulates
// into them in place (addmm_) instead of copying its bias in first and adding the
// residual apart. Records are per step only with a tape (Layout::keep); without one the
// steps share scratch rows and take the plain calls.
void prefill_biases(const Spec& s, const Layout& lay, const std::vector<std::vector<Tensor>>& p,
                    const std::vector<AtenQuery>& query, const Tensor& hidden,
                    std::vector<Tensor>& rec) {
  for (int64_t l = 0; l < s.L; ++l) {
    hidden.select(1, l + 1).copy_(p[l][B2]);
    if (!lay.keep) continue;
    rec[Y].select(0, l).copy_(p[l][BO]);
  }
}

Spec make_spec(int64_t n_layers, int64_t n_heads, bool shared_kv, int64_t window,
               double dropout, double eps, bool memory_norm) {
  TORCH_CHECK(n_layers > 0 && n_heads > 0 && window > 0, "fbtrain core: bad spec");
  return Spec{n_layers, n_heads, window, shared_kv, dropout, eps, memory_norm};
}

std::vector<std::vector<Tensor>> split_layers(at::TensorList flat, int64_t L) {
  TORCH_CHECK(static_cast<int64_t>(flat.size()) == L * N_PARAMS,
              "fbtrain core: expected ", L * N_PARAMS, " layer tensors, got ", flat.size());
  std::vector<std::vector<Tensor>> p(L);
  for (int64_t l = 0; l < L; ++l) {
    p[l].assign(flat.begin() + l * N_PARAMS, flat.begin() + (l + 1) * N_PARAMS);
    for (int k : {RT, CPOS}) p[l][k] = p[l][k].contiguous();  // WindowAttention indexes them
  }
  return p;
}

// Runs T steps. x0: [B, T, D]; mem_k, mem_v: [n_kv, B*H, n0, dk] carried memory; mix:
// [L+1]; wkv: [D, 2*n_kv*D]; bkv: [2*n_kv*D] or None; layers: L * 14 tensors as
// LAYER_PARAMS (the tensors in CoreInputs order).
// Returns hidden [T, L+1, B, D], memory [T, B, D], keys and values [n_kv, B*H, S, dk], and
// the tape (the records in Record order; empty unless keep_tape).
std::tuple<Tensor, Tensor, Tensor, Tensor, std::vector<Tensor>> core_forward(
    const Tensor& x0, const Tensor& mem_k, const Tensor& mem_v, const Tensor& mix,
    const Tensor& wkv, const std::optional<Tensor>& bkv, at::TensorList layers, int64_t n_layers,
    int64_t n_heads, bool shared_kv, int64_t window, double dropout, double eps,
    bool memory_norm, bool keep_tape) {
  at::InferenceMode guard;
  const Spec s = make_spec(n_layers, n_heads, shared_kv, window, dropout, eps, memory_norm);
  const auto p = split_layers(layers, s.L);
  const int64_t B = x0.size(0), T = x0.size(1), D = x0.size(2), H = s.H, dk = D / H;
  const int64_t n_kv = mem_k.size(0), n0 = mem_k.size(2), S = n0 + T;
  // With dropout the full tape is kept anyway: its masks are drawn in one go, and a
  // no-grad call must draw the same ones as a training call from the same seed.
  const Layout lay(s, B, T, D, p[0][W1_T].size(1), n0, n_kv, keep_tape || s.dropout > 0);
  const bool loops = loops_for(x0);
  const Tensor kv_slots = loops ? Tensor() : kv_slot_buffer(x0, S, B, H, n_kv, dk);
  Forward fw{s, lay, p, mix, wkv, bkv,
             x0.new_empty({T, s.L + 1, B, D}), x0.new_empty({T, B, D}),
             loops ? x0.new_empty({n_kv, B * H, S, dk}) : kv_view(kv_slots, 0),
             loops ? x0.new_empty({n_kv, B * H, S, dk}) : kv_view(kv_slots, 1),
             make_tape(s, lay, x0, loops), {}};
  if (!loops) {
    for (const auto& w : p) fw.query.push_back(aten_query(w, H));
    prefill_biases(s, lay, p, fw.query, fw.hidden, fw.tape.rec);
    fw.kv_slots = kv_slots;
    fw.wkv_slots = kv_columns(wkv, n_kv, H, true);
    if (bkv) fw.bkv_slots = kv_columns(*bkv, n_kv, H, true);
  }
  fw.keys.narrow(2, 0, n0).copy_(mem_k);
  fw.values.narrow(2, 0, n0).copy_(mem_v);
  if (loops) {
    fw.keys_t = x0.new_empty({n_kv, B * H, dk, S});
    fw.keys_t.narrow(3, 0, n0).copy_(mem_k.transpose(2, 3));
  }
  fw.hidden.select(1, 0).copy_(x0.transpose(0, 1));
  {
    RECORD_FUNCTION("fbtrain::forward_sweep", std::vector<c10::IValue>());  // profiler marks (benchmark.py --profile)
    for_each_shard(shard_count(x0, B), B, "fbtrain::forward_shard",
                   [&](int64_t, int64_t b0, int64_t nb) { fw.shard(b0, nb); });
  }
  if (!keep_tape) {
    fw.tape.rec.clear();
  } else {
    record_layer_norms(s, lay, p, fw.hidden, fw.tape.rec);
    record_memory_norm(s, fw.memory, fw.tape.rec);
  }
  return {fw.hidden, fw.memory, fw.keys, fw.values, fw.tape.rec};
}


// Activation gradients of the backward sweep, full-batch like the tape: [L, n_att, B, .]
// for the attention blocks, [L, T, B, .] for the feed-forward blocks.
enum Grad { DZ, DQU, DA, DF, DH, DC, N_GRADS };

struct Backward {
  const Spec& s;
  const Layout& lay;
  const std::vector<std::vector<Tensor>>& p;
  const std::vector<Tensor>& back;  // per layer: wq^T, rt^T [H, P, dk], wo^T, w1^T, w2^T
  const Tape& tape;
  const std::vector<double>& mix;
  const Tensor &wkv_t, &d_top, &hidden, &memory, &keys, &values;
  Tensor d_keys, d_values, d_kv, d_memory, d_x0;  // d_kv: [T, B, 2, n_kv, H, dk]
  std::vector<Tensor> g;  // Grad order
  std::vector<std::vector<Tensor>> d_rt, d_c;  // per shard, per layer: [H, dk, P], [H, P]
  // The ATen path: the folded query projections, and mix as a tensor (the loops read
  // `mix` on the host, which on a GPU would be a sync).
  std::vector<AtenQuery> query;
  Tensor mix_t;
  // The ATen path's key/value gradients, slot-major like its keys (kv_slot_buffer; d_keys,
  // d_values and d_kv stay empty): a slot's gradients are one row block for the d_memory
  // matmul, with no per-step gather, and the last T slots are d_kv for the weight gradient.
  Tensor d_kv_slots;
  // With one key/value set on the ATen path (feedback_kv), a step's window gradients from
  // all its layers are two batched matmuls after the step (see shared_kv_grads) instead of
  // two rank-1 updates per layer.
  bool batch_kv_grads = false;

  Tensor grad(int r, int64_t l, int64_t step, int64_t b0, int64_t nb) const {
    return rows(g[r], l * g[r].size(1) + step, b0, nb);
  }

  void shard(int64_t shard_id, int64_t b0, int64_t nb) const {
    const int64_t L = s.L, H = s.H, dk = lay.dk, D = lay.D, T = lay.T, n0 = lay.n0;
    const int64_t n_kv = lay.n_kv, S = n0 + T, nbH = nb * H, n_pos = p[0][RT].size(-1);
    const bool drop = s.dropout > 0, loops = loops_for(hidden);
    const std::vector<int64_t> shape{D};
    const double scale = drop ? mask_scale(s, hidden.scalar_type()) : 1.0;
    const std::array<bool, 3> input_grad_only{true, false, false};
    const Tensor keys_s = keys.narrow(1, b0 * H, nbH), values_s = values.narrow(1, b0 * H, nbH);
    Tensor d_keys_s, d_values_s, d_key_rows, d_value_rows;  // [n_kv, nb(H), (H,) S, dk]
    if (loops) {
      d_keys_s = d_keys.narrow(1, b0 * H, nbH);
      d_values_s = d_values.narrow(1, b0 * H, nbH);
      d_key_rows = d_keys_s.view({n_kv, nb, H, S, dk});
      d_value_rows = d_values_s.view({n_kv, nb, H, S, dk});
    } else {  // views of d_kv_slots, [n_kv, nb, H, S, dk]
      const Tensor rows_s = d_kv_slots.narrow(1, b0, nb);
      d_key_rows = rows_s.select(3, 0).permute({3, 1, 2, 0, 4});
      d_value_rows = rows_s.select(3, 1).permute({3, 1, 2, 0, 4});
    }
    // Each layer's output-projection gradient of the current step, [L, nb, D], for
    // shared_kv_grads.
    const Tensor d_o_layers =
        batch_kv_grads ? at::empty({L, nb, D}, hidden.options()) : Tensor();
    // The loops' score gradients of a layer's step, [nb*H*ell] of [nb*H*max_ell]
    // (WindowAttention::backward writes them, position_grads reads them).
    const Tensor ds_scratch = loops ? hidden.new_empty({nbH * lay.max_ell}) : Tensor();
    // The ATen path's probabilities after dropout, recomputed: a step's [nb*H*ell] of one
    // layer, or of every layer ([L, nb*H*max_ell]) for shared_kv_grads.
    const Tensor p_dropped = drop && !loops
        ? hidden.new_empty({batch_kv_grads ? L : 1, nbH * lay.max_ell}) : Tensor();
    std::vector<Tensor> k_w(n_kv), v_t(n_kv), dk_w(n_kv), dv_w(n_kv);
    for (int64_t t = T - 1; t >= 0; --t) {
      const int64_t slot = n0 + t;
      const auto [lo, ell] = window_of(slot, s.window);
      Tensor dm;  // gradient of this step's memory vector, [nb, D]
      if (t < T - 1) {  // the newest slot is read by no later step of this call
        Tensor dkv_t;  // [nb, 2, n_kv, H, dk]
        if (loops) {
          dkv_t = d_kv.select(0, t).narrow(0, b0, nb);
          dkv_t.select(1, 0).copy_(d_key_rows.select(3, slot).transpose(0, 1));
          dkv_t.select(1, 1).copy_(d_value_rows.select(3, slot).transpose(0, 1));
        } else {
          dkv_t = d_kv_slots.select(0, slot).narrow(0, b0, nb);
        }
        dm = d_memory.select(0, t).narrow(0, b0, nb);
        at::mm_out(dm, dkv_t.view({nb, -1}), wkv_t);
        if (s.memory_norm) {  // through the normalisation, back to m_t
          dm.copy_(std::get<0>(at::native_layer_norm_backward(
              dm, rows(memory, t, b0, nb), shape, rows(tape.rec[MEM_MU], t, b0, nb),
              rows(tape.rec[MEM_RS], t, b0, nb), {}, {}, input_grad_only)));
        }
      }
      for (int64_t kv = 0; ell && kv < n_kv; ++kv) {
        k_w[kv] = keys_s.select(0, kv).narrow(1, lo, ell);  // [nbH, ell, dk]
        v_t[kv] = values_s.select(0, kv).narrow(1, lo, ell).transpose(1, 2);  // [nbH, dk, ell]
        if (loops) {
          dk_w[kv] = d_keys_s.select(0, kv).narrow(1, lo, ell);
          dv_w[kv] = d_values_s.select(0, kv).narrow(1, lo, ell);
        } else {  // [nb, H, ell, dk]
          dk_w[kv] = d_key_rows.select(0, kv).narrow(2, lo, ell);
          dv_w[kv] = d_value_rows.select(0, kv).narrow(2, lo, ell);
        }
      }
      // Each gradient is written straight where it is recorded: the gradient of layer l's
      // output is (without dropout) its DF record, that of y its DZ record, and that of
      // the embedding a row of d_x0, saving a copy apiece per layer and step.
      auto output_grad = [&](int64_t l) {  // where the gradient of layer l's output goes
        if (l < 0) return d_x0.select(1, t).narrow(0, b0, nb);
        return drop ? at::empty({nb, D}, d_x0.options()) : grad(DF, l, t, b0, nb);
      };
      const Tensor top_t = d_top.select(1, t).narrow(0, b0, nb);
      Tensor dx = output_grad(L - 1);
      if (dm.defined() && loops) at::add_out(dx, top_t, dm, mix[L]);
      else if (dm.defined()) at::addcmul_out(dx, top_t, dm, mix_t.select(0, L));
      else dx.copy_(top_t);
      for (int64_t l = L - 1; l >= 0; --l) {
        const auto& w = p[l];
        const Tensor &wq_b = back[5 * l], &rt_b = back[5 * l + 1], &wo_b = back[5 * l + 2];
        const Tensor &w1_b = back[5 * l + 3], &w2_b = back[5 * l + 4];
        const int64_t set = s.shared_kv ? 0 : l;
        // Feed-forward block: x_out = y + Drop(W2 Drop(relu(W1 LN2(y) + b1)) + b2).
        Tensor df = grad(DF, l, t, b0, nb), dh = grad(DH, l, t, b0, nb);
        Tensor dc = grad(DC, l, t, b0, nb);
        if (drop) drop_out(df, dx, tape.ff(MASK_FF, l, t, b0, nb), scale);  // else df is dx
        at::mm_out(dh, df, w2_b);
        if (drop) dh.mul_(tape.ff(MASK_H, l, t, b0, nb)).mul_(scale);
        at::threshold_backward_out(dh, dh, tape.ff(HID, l, t, b0, nb), 0);
        at::mm_out(dc, dh, w1_b);
        const Tensor d_ln2 = std::get<0>(at::native_layer_norm_backward(
            dc, tape.ff(Y, l, t, b0, nb), shape, tape.ff(MU2, l, t, b0, nb),
            tape.ff(RS2, l, t, b0, nb), w[LN2_W], w[LN2_B], input_grad_only));
        Tensor below = output_grad(l - 1);
        if (ell) {
          // Attention block: y = x + Drop(Wo (softmax(scores) V) + bo).
          Tensor dz = grad(DZ, l, t - lay.first_att, b0, nb), dy = dz;
          if (drop) {
            dy = d_ln2 + dx;
            drop_out(dz, dy, tape.att(MASK_ATT, l, t, b0, nb), scale);
          } else {
            at::add_out(dz, d_ln2, dx);
          }
          const Tensor prob = tape.prob(PROB, l, t, ell, b0, nb);
          Tensor prob_used = prob;
          if (drop && loops) {
            prob_used = tape.prob(PROB_USED, l, t, ell, b0, nb);
          } else if (drop && !batch_kv_grads) {  // recomputed (the forward kept no copy)
            prob_used = p_dropped.select(0, 0).narrow(0, 0, nbH * ell).view({nb, H, ell});
            drop_out(prob_used, prob, tape.prob(MASK_PROB, l, t, ell, b0, nb), scale);
          }
          const Tensor qu = tape.att(QU, l, t, b0, nb);
          Tensor dqu = grad(DQU, l, t - lay.first_att, b0, nb);
          Tensor d_o;  // [nb, D]
          if (batch_kv_grads) {
            d_o = d_o_layers.select(0, l);
            at::mm_out(d_o, dz, wo_b);
          } else {
            d_o = at::mm(dz, wo_b);
          }
          if (loops) {
            AT_DISPATCH_FLOATING_TYPES(qu.scalar_type(), "attend_backward", [&] {
              const auto att = window_attention<scalar_t>(w, nb, ell, n_pos, S);
              std::vector<scalar_t> scratch(ell);
              scalar_t* ds = ds_scratch.data_ptr<scalar_t>();
              att.backward(qu.data_ptr<scalar_t>(), k_w[set].data_ptr<scalar_t>(),
                           v_t[set].data_ptr<scalar_t>(), prob.data_ptr<scalar_t>(),
                           prob_used.data_ptr<scalar_t>(),
                           drop ? tape.prob(MASK_PROB, l, t, ell, b0, nb).data_ptr<bool>()
                                : nullptr,
                           static_cast<scalar_t>(scale), d_o.data_ptr<scalar_t>(),
                           dqu.data_ptr<scalar_t>(), dk_w[set].data_ptr<scalar_t>(),
                           dv_w[set].data_ptr<scalar_t>(), ds, scratch.data());
              att.position_grads(qu.data_ptr<scalar_t>(), ds,
                                 d_rt[shard_id][l].data_ptr<scalar_t>(),
                                 d_c[shard_id][l].data_ptr<scalar_t>());
            });
          } else {  // any other device: the same, in ATen calls (AtenQuery's layout)
            d_o = d_o.view({nbH, 1, dk});
            Tensor d_prob = at::bmm(d_o, v_t[set]).view({nbH, 1, ell});
            // Rank-1 updates, broadcast in place (on a CPU, baddbmm_ into a strided view runs
            // one small matmul per batch row; shared_kv_grads takes that cost for one set).
            if (!batch_kv_grads)
              dv_w[set].addcmul_(prob_used.view({nb, H, ell, 1}), d_o.view({nb, H, 1, dk}));
            if (drop)
              d_prob.mul_(tape.prob(MASK_PROB, l, t, ell, b0, nb).view({nbH, 1, ell})).mul_(scale);
            const Tensor dqp = dqu.view({nbH, dk + n_pos});
            // Computed apart and copied in: the CPU kernel's out= variant writes a strided
            // output wrongly (torch 2.x), and a GPU's may copy anyway.
            const Tensor d_scores = at::_softmax_backward_data(
                d_prob, prob.view({nbH, 1, ell}), -1, prob.scalar_type());  // [nbH, 1, ell]
            dqp.narrow(1, dk + n_pos - ell, ell).copy_(d_scores.squeeze(1));
            Tensor dqu3 = dqp.narrow(1, 0, dk).unsqueeze(1);
            at::bmm_out(dqu3, d_scores, k_w[set]);
            if (!batch_kv_grads)
              dk_w[set].addcmul_(d_scores.view({nb, H, ell, 1}), qu.view({nb, H, 1, dk}));
          }
          Tensor da = grad(DA, l, t - lay.first_att, b0, nb);
          at::mm_out(da, dqu, loops ? wq_b : query[l].w_t);
          const Tensor d_ln1 = std::get<0>(at::native_layer_norm_backward(
              da, rows(hidden, t * (L + 1) + l, b0, nb), shape,
              tape.att(MU1, l, t, b0, nb), tape.att(RS1, l, t, b0, nb), w[LN1_W], w[LN1_B],
              input_grad_only));
          at::add_out(below, d_ln1, dy);
        } else {
          at::add_out(below, d_ln2, dx);
        }
        if (dm.defined() && loops) below.add_(dm, mix[l]);
        else if (dm.defined()) below.addcmul_(dm, mix_t.select(0, l));
        dx = below;
      }
      if (batch_kv_grads && ell)
        shared_kv_grads(t, ell, b0, nb, d_o_layers, p_dropped, dk_w[0], dv_w[0]);
    }
  }

  // Step t's gradients of its window's keys and values [nb, H, ell, dk] from every layer
  // (one set, feedback_kv, on the ATen path): d_v += sum_l p_l^T d_o_l and
  // d_k += sum_l d_scores_l^T q_l, each one batched matmul over (row, head) that sums over
  // the layers, read in place from the tape (probabilities), the DQU gradients (score
  // gradients), the QU record (queries) and d_o_layers.
  void shared_kv_grads(int64_t t, int64_t ell, int64_t b0, int64_t nb, const Tensor& d_o_layers,
                       const Tensor& p_dropped, const Tensor& dk_w, const Tensor& dv_w) const {
    const int64_t H = s.H, dk = lay.dk, L = s.L, nbH = nb * H, qp = dk + p[0][RT].size(-1);
    // dqu [L, n_att, B, H * qp]; qu [L, n_att, B, H * dk]
    const Tensor &qu = tape.rec[QU], &dqu = g[DQU];
    const int64_t rows_before = (t - lay.first_att) * lay.B + b0, steps = qu.size(1) * lay.B;
    const Tensor d_scores = dqu.as_strided({nbH, ell, L}, {qp, 1, steps * H * qp},
                                           dqu.storage_offset() + rows_before * H * qp + qp - ell);
    const Tensor q = qu.as_strided({nbH, L, dk}, {dk, steps * H * dk, 1},
                                   qu.storage_offset() + rows_before * H * dk);
    Tensor prob = tape.prob_layers(PROB, t, ell, b0, nb);  // [nbH, ell, L]
    if (s.dropout > 0) {  // every layer's probabilities after dropout: [L, nbH*ell] rows
      const int64_t start = lay.prob_start(t, ell, b0);
      Tensor used = p_dropped.narrow(1, 0, nbH * ell);
      drop_out(used, tape.rec[PROB].narrow(1, start, nbH * ell),
               tape.rec[MASK_PROB].narrow(1, start, nbH * ell),
               mask_scale(s, used.scalar_type()));
      prob = used.as_strided({nbH, ell, L}, {ell, 1, p_dropped.size(1)}, used.storage_offset());
    }
    dv_w.view({nbH, ell, dk}).baddbmm_(prob, d_o_layers.view({L, nbH, dk}).transpose(0, 1));
    dk_w.view({nbH, ell, dk}).baddbmm_(d_scores, q);
  }
};

// Gradients of LayerNorm's weight and bias over all rows: sum(d * x_hat), sum(d).
std::pair<Tensor, Tensor> layer_norm_affine_grads(const Tensor& d, const Tensor& x,
                                                  const Tensor& mu, const Tensor& rs) {
  return {(d * ((x - mu) * rs)).sum(0), d.sum(0)};
}

// The gradients of wq, uq, rt and c (into gl) from those of AtenQuery's folded projection:
// d_w [D, H*(dk+P)] and d_b [H*(dk+P)].
void aten_query_grads(const std::vector<Tensor>& w, int64_t H, const Tensor& d_w,
                      const Tensor& d_b, std::vector<Tensor>& gl) {
  const Tensor &wq = w[WQ], &rt = w[RT];
  const int64_t D = wq.size(0), dk = D / H, P = rt.size(-1);
  const Tensor dw3 = d_w.view({D, H, dk + P}), db2 = d_b.view({H, dk + P});
  const Tensor dw_pos = dw3.narrow(2, dk, P).transpose(0, 1);  // [H, D, P]
  const Tensor db_pos = db2.narrow(1, dk, P).unsqueeze(1);  // [H, 1, P]
  const Tensor rt_t = rt.transpose(1, 2);  // [H, P, dk]
  gl[WQ] = (dw3.narrow(2, 0, dk) + at::bmm(dw_pos, rt_t).transpose(0, 1)).reshape({D, D});
  gl[UQ] = (db2.narrow(1, 0, dk) + at::bmm(db_pos, rt_t).squeeze(1)).reshape({D});
  gl[RT] = at::bmm(wq.view({D, H, dk}).permute({1, 2, 0}), dw_pos) +
           w[UQ].view({H, dk, 1}) * db_pos;
  gl[CPOS] = db_pos.clone();
}

// Layer l's hidden layer after its dropout, over every step and row: [T*B, F]. Recomputed
// for W2's gradient (bitwise what the forward used) rather than kept through the sweep.
Tensor dropped_hidden(const Spec& s, const Tape& tape, int64_t l) {
  const Tensor& hid = tape.rec[HID];
  const Tensor h = hid.select(0, l).reshape({-1, hid.size(-1)});
  if (s.dropout == 0) return h;
  const Tensor mask = tape.rec[MASK_H].select(0, l).reshape({-1, hid.size(-1)});
  return at::mul(h, mask).mul_(mask_scale(s, h.scalar_type()));
}

// Gradients given d_top [B, T, D], the gradient of the last layer's output, and what
// core_forward returned. Returns the gradient of each input in CoreInputs order: d_x0
// [B, T, D], the carried memory's d_mem_k, d_mem_v [n_kv, B*H, n0, dk], d_mix [L+1],
// d_wkv [D, 2*n_kv*D], d_bkv [2*n_kv*D] and the layer gradients (L * 14, as LAYER_PARAMS).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, std::vector<Tensor>> core_backward(
    const Tensor& d_top, const Tensor& hidden, const Tensor& memory, const Tensor& keys,
    const Tensor& values, at::TensorList tape_records, const Tensor& mix, const Tensor& wkv,
    at::TensorList layers, int64_t n_layers, int64_t n_heads, bool shared_kv, int64_t window,
    double dropout, double eps, bool memory_norm) {
  at::InferenceMode guard;
  const Spec s = make_spec(n_layers, n_heads, shared_kv, window, dropout, eps, memory_norm);
  const auto p = split_layers(layers, s.L);
  const int64_t T = hidden.size(0), L = s.L, B = hidden.size(2), D = hidden.size(3);
  const int64_t n_kv = keys.size(0), F = p[0][W1_T].size(1);
  const int64_t n0 = keys.size(2) - T;  // the carried slots come first
  TORCH_CHECK(static_cast<int64_t>(tape_records.size()) == N_RECORDS, "fbtrain core: bad tape");
  const Layout lay(s, B, T, D, F, n0, n_kv, true);
  const Tape tape{std::vector<Tensor>(tape_records.begin(), tape_records.end()), &lay};
  // Transposed weights (views) and position tables, once per call rather than per step.
  std::vector<Tensor> back;
  for (const auto& w : p)
    for (const Tensor& b : {w[WQ].t(), w[RT].transpose(1, 2), w[WO_T].t(), w[W1_T].t(), w[W2_T].t()})
      back.push_back(b);
  const bool loops = loops_for(hidden);
  const auto mix_f = [&] {
    if (!loops) return std::vector<double>();  // the ATen path reads mix as a tensor
    RECORD_FUNCTION("fbtrain::host_sync", std::vector<c10::IValue>());  // profiler marks (benchmark.py --profile)
    const Tensor m = mix.to(at::kDouble).cpu();
    return std::vector<double>(m.data_ptr<double>(), m.data_ptr<double>() + m.numel());
  }();
  const int64_t shards = shard_count(hidden, B), n_att = lay.n_att;
  // On the ATen path the memory gradient reads slot-major key/value gradients, whose
  // columns are in kv_columns' order.
  const Tensor wkv_t = loops ? wkv.t() : kv_columns(wkv, n_kv, s.H, true).t();
  const Tensor none = hidden.new_empty({0});
  Backward bw{s, lay, p, back, tape, mix_f, wkv_t, d_top, hidden, memory, keys, values,
              loops ? at::zeros_like(keys) : none, loops ? at::zeros_like(values) : none,
              loops ? hidden.new_zeros({T, B, 2, n_kv, s.H, lay.dk}) : none,
              hidden.new_zeros({T, B, D}), hidden.new_empty({B, T, D}), {}, {}, {}};
  if (!loops) {
    bw.d_kv_slots = kv_slot_buffer(hidden, n0 + T, B, s.H, n_kv, lay.dk).zero_();
    // cuBLAS takes 32-bit leading dimensions: the layer strides of the records read in
    // place must fit (they do but for records of many GB).
    const int64_t qu_width = s.H * (lay.dk + p[0][RT].size(-1));
    const int64_t widest = std::max({tape.rec[PROB].size(-1), lay.n_att * B * qu_width,
                                     2 * n_kv * B * D});  // the last: the slot stride
    bw.batch_kv_grads = n_kv == 1 && widest <= std::numeric_limits<int32_t>::max();
  }
  // On the ATen path DQU is AtenQuery's [H, dk + P] row, zero outside each step's window.
  const int64_t n_pos = p[0][RT].size(-1);
  bw.g = {hidden.new_empty({L, n_att, B, D}),
          loops ? hidden.new_empty({L, n_att, B, D})
                : hidden.new_zeros({L, n_att, B, s.H * (lay.dk + n_pos)}),
          hidden.new_empty({L, n_att, B, D}), hidden.new_empty({L, T, B, D}),
          hidden.new_empty({L, T, B, F}), hidden.new_empty({L, T, B, D})};
  // Position-table gradients are summed over steps as they come (a [T, T]-sized record
  // would grow quadratically), one accumulator per shard so that threads never share one.
  for (int64_t sh = 0; sh < shards; ++sh) {
    bw.d_rt.emplace_back();
    bw.d_c.emplace_back();
    for (const auto& w : p) {
      bw.d_rt.back().push_back(at::zeros(w[RT].sizes(), w[RT].options()));  // [H, dk, P]
      bw.d_c.back().push_back(at::zeros({w[CPOS].size(0), w[CPOS].size(2)}, w[CPOS].options()));
    }
  }
  if (!loops) {
    for (const auto& w : p) bw.query.push_back(aten_query(w, s.H));
    bw.mix_t = mix.to(hidden.scalar_type());
  }
  {
    RECORD_FUNCTION("fbtrain::backward_sweep", std::vector<c10::IValue>());  // profiler marks (benchmark.py --profile)
    for_each_shard(shards, B, "fbtrain::backward_shard",
                   [&](int64_t sh, int64_t b0, int64_t nb) { bw.shard(sh, b0, nb); });
  }

  // Weight gradients: one large matmul per weight over all steps and rows.
  std::vector<Tensor> grads;
  for (int64_t l = 0; l < L; ++l) {
    auto rows = [](const Tensor& r, int64_t l_) { return r.select(0, l_).reshape({-1, r.size(-1)}); };
    std::vector<Tensor> gl(N_PARAMS);
    const Tensor df = rows(bw.g[DF], l), dh = rows(bw.g[DH], l), dc = rows(bw.g[DC], l);
    gl[W2_T] = at::mm(dropped_hidden(s, tape, l).t(), df);
    gl[B2] = df.sum(0);
    gl[W1_T] = at::mm(rows(tape.rec[CN], l).t(), dh);
    gl[B1] = dh.sum(0);
    std::tie(gl[LN2_W], gl[LN2_B]) = layer_norm_affine_grads(
        dc, rows(tape.rec[Y], l), rows(tape.rec[MU2], l), rows(tape.rec[RS2], l));
    if (n_att == 0) {  // no step attended: attention parameters get zero gradient
      for (int k : {LN1_W, LN1_B, WQ, UQ, WO_T, BO}) gl[k] = at::zeros_like(p[l][k]);
    } else {
      const Tensor dz = rows(bw.g[DZ], l), dqu = rows(bw.g[DQU], l), da = rows(bw.g[DA], l);
      gl[WO_T] = at::mm(rows(tape.rec[O], l).t(), dz);
      gl[BO] = dz.sum(0);
      if (loops) {
        gl[WQ] = at::mm(rows(tape.rec[A], l).t(), dqu);
        gl[UQ] = dqu.sum(0);
      } else {
        aten_query_grads(p[l], s.H, at::mm(rows(tape.rec[A], l).t(), dqu), dqu.sum(0), gl);
      }
      const Tensor x_att = hidden.narrow(0, lay.first_att, n_att).select(1, l).reshape({-1, D});
      std::tie(gl[LN1_W], gl[LN1_B]) = layer_norm_affine_grads(
          da, x_att, rows(tape.rec[MU1], l), rows(tape.rec[RS1], l));
    }
    if (loops || n_att == 0) {
      gl[RT] = bw.d_rt[0][l];
      gl[CPOS] = bw.d_c[0][l];
      for (int64_t sh = 1; sh < shards; ++sh) {
        gl[RT] = gl[RT] + bw.d_rt[sh][l];
        gl[CPOS] = gl[CPOS] + bw.d_c[sh][l];
      }
      gl[CPOS] = gl[CPOS].unsqueeze(1);
    }
    grads.insert(grads.end(), gl.begin(), gl.end());
  }
  const Tensor d_mix = at::einsum("tbd,tlbd->l", {bw.d_memory, hidden});
  const Tensor d_kv_flat = (loops ? bw.d_kv : bw.d_kv_slots.narrow(0, n0, T)).view({T * B, -1});
  const Tensor& kv_in = s.memory_norm ? tape.rec[MEM_HAT] : memory;  // what was projected
  const Tensor d_wkv = at::mm(kv_in.reshape({T * B, D}).t(), d_kv_flat);
  // The carried slots' key/value gradients, for callers that projected them differentiably.
  if (!loops) {  // the carried slots' gradients in the keys' layout [n_kv, B*H, n0, dk]
    const Tensor carried = bw.d_kv_slots.narrow(0, 0, n0);
    return {bw.d_x0, kv_view(carried, 0), kv_view(carried, 1), d_mix, kv_columns(d_wkv, n_kv, s.H, false),
            kv_columns(d_kv_flat.sum(0), n_kv, s.H, false), grads};
  }
  return {bw.d_x0, bw.d_keys.narrow(2, 0, n0), bw.d_values.narrow(2, 0, n0), d_mix, d_wkv,
          d_kv_flat.sum(0), grads};
}

}  // namespace

TORCH_LIBRARY(fbtrain, m) {
  m.def("core_forward(Tensor x0, Tensor mem_k, Tensor mem_v, Tensor mix, Tensor wkv, "
        "Tensor? bkv, Tensor[] layers, int n_layers, int n_heads, bool shared_kv, int window, "
        "float dropout, float eps, bool memory_norm, bool keep_tape) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor[])",
        &core_forward);
  m.def("core_backward(Tensor d_top, Tensor hidden, Tensor memory, Tensor keys, "
        "Tensor values, Tensor[] tape, Tensor mix, Tensor wkv, Tensor[] layers, "
        "int n_layers, int n_heads, bool shared_kv, int window, float dropout, float eps, "
        "bool memory_norm) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor[])",
        &core_backward);
}
