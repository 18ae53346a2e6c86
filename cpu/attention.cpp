// The engine's attention on the CPU (float32 or bfloat16): few query rows against a KV cache, under
// tree_attn.PrefixMask's mask. Request n's Q rows were written at slots [prefix[n], prefix[n] + Q) of its cache
// row; row i sees every slot below prefix[n] and the new slot prefix[n] + j where allow[n, i, j] is nonzero. Slots
// from prefix[n] + Q on are not read.
//
// Why a kernel of our own (docs/compile.md, "CPU attention kernel"): inductor's CPU FlexAttention template (torch
// 2.13) computes q k^T with a fixed 1 x 16 micro-kernel and P V with one sgemm call per KV block, which at the 1-17
// rows of a decode step, draft or verify costs several times the arithmetic. Here the G query heads that share a
// KV head are one block of G * Q rows: each K and V row is read once for all of them. torch.ops.ddtree.tree_attention
// is registered in C++, so a compiled graph's C++ wrapper calls it through the dispatcher with no Python in between.
//
// Built by tree_attn.load_cpu_kernel (g++ -O3 -march=native); the vector type below is 16 floats, which the compiler
// splits into the machine's registers (one AVX-512 register, two AVX2 ones).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {

typedef float vf __attribute__((vector_size(64)));  // 16 floats

typedef uint16_t vh __attribute__((vector_size(32)));  // 16 bfloat16s
typedef uint32_t vu __attribute__((vector_size(64)));

// The caches and queries are float32 or bfloat16 (a bfloat16 is the top half of a float32); every sum is float32.
inline vf load(const float *p) { vf x; std::memcpy(&x, p, sizeof x); return x; }
inline vf load(const c10::BFloat16 *p) {
    vh h;
    std::memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
template <int D> inline void store(float *dst, const vf *o) { std::memcpy(dst, o, D * 4); }
template <int D> inline void store(c10::BFloat16 *dst, const vf *o) {  // rounded to nearest even
    for (int d = 0; d < D; d++) dst[d] = c10::BFloat16(o[d / 16][d % 16]);
}

inline float hsum(vf x) {
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += x[l];
    return s;
}

// exp(x) for x <= 0 (scores minus their row's max): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial
// (Cephes' expf coefficients; relative error at most 2.4e-7 over [-87, 0] against double exp); plain arithmetic, so
// the compiler vectorizes the loops that call it.
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, 4);
    return p * two_n;
}

// One KV head of one request: its G query heads' Q rows (M = G * Q rows) against slots [0, L).
template <typename T, int D>
void attend_group(const T *q, int64_t qs_h, int64_t qs_q, const T *K, const T *V, int64_t p, int64_t L,
                  const uint8_t *allow, T *out, int64_t G, int64_t Q, int64_t H, int64_t h0, float scale,
                  std::vector<float> &buf) {
    constexpr int C = D / 16;
    const int64_t M = G * Q, MP = (M + 3) / 4 * 4, LP = (L + 15) / 16 * 16;
    buf.assign(MP * D + MP * LP + 16 * D, 0.0f);
    float *qs = buf.data(), *sc = qs + MP * D, *kt = sc + MP * LP;
    for (int64_t m = 0; m < M; m++) {  // row m = query g * Q + i of head h0 + g, scaled; rows past M stay zero
        const T *src = q + (h0 + m / Q) * qs_h + (m % Q) * qs_q;
        for (int d = 0; d < D; d++) qs[m * D + d] = to_float(src[d]) * scale;
    }
    if (M <= 4) {
        // Few rows: each K row against each query row, lanes summed per score (no transposed copy of K).
        for (int64_t s = 0; s < L; s++) {
            vf k[C];
            for (int c = 0; c < C; c++) k[c] = load(K + s * D + 16 * c);
            for (int64_t m = 0; m < M; m++) {
                vf a = {0};
                for (int c = 0; c < C; c++) a += load(qs + m * D + 16 * c) * k[c];
                sc[m * LP + s] = hsum(a);
            }
        }
    } else {
        // More rows: 16 K rows transposed once, then four query rows at a time against them (16 scores a vector).
        for (int64_t s0 = 0; s0 < L; s0 += 16) {
            const int64_t nb = L - s0 < 16 ? L - s0 : 16;
            for (int64_t j = 0; j < 16; j++)
                for (int d = 0; d < D; d++) kt[d * 16 + j] = j < nb ? to_float(K[(s0 + j) * D + d]) : 0.0f;
            for (int64_t m = 0; m < MP; m += 4) {
                const float *q0 = qs + m * D;
                vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int d = 0; d < D; d++) {
                    vf k = load(kt + d * 16);
                    a0 += q0[d] * k; a1 += q0[D + d] * k; a2 += q0[2 * D + d] * k; a3 += q0[3 * D + d] * k;
                }
                std::memcpy(sc + m * LP + s0, &a0, sizeof a0);
                std::memcpy(sc + (m + 1) * LP + s0, &a1, sizeof a1);
                std::memcpy(sc + (m + 2) * LP + s0, &a2, sizeof a2);
                std::memcpy(sc + (m + 3) * LP + s0, &a3, sizeof a3);
            }
        }
    }
    for (int64_t m = 0; m < M; m++) {  // softmax over the visible slots; hidden ones get weight 0
        float *row = sc + m * LP;
        const uint8_t *al = allow + (m % Q) * Q;
        float mx = -3.0e38f;
        for (int64_t s = 0; s < p; s++) mx = row[s] > mx ? row[s] : mx;
        for (int64_t s = p; s < L; s++) mx = al[s - p] && row[s] > mx ? row[s] : mx;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t s = 0; s < p; s++) {
            float e = exp_nonpositive(row[s] - mx);
            row[s] = e;
            sum += e;
        }
        for (int64_t s = p; s < L; s++) {
            float e = al[s - p] ? exp_nonpositive(row[s] - mx) : 0.0f;
            row[s] = e;
            sum += e;
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma omp simd
        for (int64_t s = 0; s < L; s++) row[s] *= inv;
    }
    for (int64_t m = 0; m < M; m += 2) {  // out rows two at a time, each V row read once per pair
        vf o0[C] = {}, o1[C] = {};
        const float *w0 = sc + m * LP, *w1 = w0 + LP;
        for (int64_t s = 0; s < p; s++) {  // slots every row sees
            const float a = w0[s], b = w1[s];
            for (int c = 0; c < C; c++) {
                vf v = load(V + s * D + 16 * c);
                o0[c] += a * v;
                o1[c] += b * v;
            }
        }
        for (int64_t s = p; s < L; s++) {  // the new rows: a row adds only those it sees (0 * NaN is NaN)
            const float a = w0[s], b = w1[s];
            for (int c = 0; c < C; c++) {
                vf v = load(V + s * D + 16 * c);
                if (a != 0.0f) o0[c] += a * v;
                if (b != 0.0f) o1[c] += b * v;
            }
        }
        store<D>(out + ((m % Q) * H + h0 + m / Q) * D, o0);
        if (m + 1 < M) store<D>(out + (((m + 1) % Q) * H + h0 + (m + 1) / Q) * D, o1);
    }
}

template <typename T>
void attend(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache, const at::Tensor &prefix,
            const at::Tensor &allow, double scale, at::Tensor &out) {
    const int64_t N = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3);
    const int64_t KVH = k_cache.size(1), S = k_cache.size(2), G = H / KVH;
    auto run = D == 16 ? attend_group<T, 16> : D == 32 ? attend_group<T, 32> : D == 64 ? attend_group<T, 64>
             : D == 128 ? attend_group<T, 128> : D == 256 ? attend_group<T, 256> : nullptr;
    TORCH_CHECK(run != nullptr, "tree_attention: head_dim 16, 32, 64, 128 or 256");
    const T *qp = static_cast<const T *>(q.data_ptr()), *kp = static_cast<const T *>(k_cache.data_ptr()),
            *vp = static_cast<const T *>(v_cache.data_ptr());
    const int64_t *pp = static_cast<const int64_t *>(prefix.data_ptr());
    const uint8_t *ap = static_cast<const uint8_t *>(allow.data_ptr());
    T *op = static_cast<T *>(out.data_ptr());
    at::parallel_for(0, N * KVH, 1, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> buf;
        for (int64_t t = begin; t < end; t++) {
            const int64_t n = t / KVH, kh = t % KVH, p = pp[n] < 0 ? 0 : pp[n] < S ? pp[n] : S;
            const int64_t L = p + Q < S ? p + Q : S;
            const T *K = kp + t * S * D, *V = vp + t * S * D;
            run(qp + n * q.stride(0), q.stride(1), q.stride(2), K, V, p, L, ap + n * Q * Q, op + n * Q * H * D, G, Q,
                H, kh * G, static_cast<float>(scale), buf);
        }
    });
}

at::Tensor tree_attention(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                          const at::Tensor &prefix, const at::Tensor &allow, double scale) {
    const auto dtype = q.scalar_type();
    TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_cache.scalar_type() == dtype &&
                v_cache.scalar_type() == dtype, "tree_attention: float32 or bfloat16, the same for q and the caches");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(3) == 1,
                "tree_attention: contiguous caches and unit-stride query rows");
    TORCH_CHECK(prefix.scalar_type() == at::kLong && allow.scalar_type() == at::kByte && allow.is_contiguous(),
                "tree_attention: int64 prefix, contiguous uint8 allow");
    const int64_t N = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3), KVH = k_cache.size(1);
    TORCH_CHECK(q.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == N && k_cache.size(3) == D &&
                H % KVH == 0 && prefix.numel() == N && allow.sizes() == at::IntArrayRef({N, Q, Q}),
                "tree_attention: q [N, H, Q, D], caches [N, KVH, S, D], prefix [N], allow [N, Q, Q]");
    auto out = at::empty({N, Q, H, D}, q.options());
    if (dtype == at::kFloat)
        attend<float>(q, k_cache, v_cache, prefix, allow, scale, out);
    else
        attend<c10::BFloat16>(q, k_cache, v_cache, prefix, allow, scale, out);
    return out;
}

}  // namespace

TORCH_LIBRARY(ddtree, m) {
    m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor prefix, Tensor allow, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ddtree, CPU, m) { m.impl("tree_attention", &tree_attention); }
