// zinc kernels: plain scalar references of every kernel in kernels.h. They
// are the test oracles: one obvious loop nest per formula, no threads, no
// tricks, sums accumulated in double. Each is a template on the element type
// T (instantiated for float and double) so that tests can also evaluate the
// forward passes in double for finite differences. Parameters are plain T
// arrays: a test that holds bf16 parameters widens them first (exactly).
// Semantics (accumulate vs write) match the fast kernels one for one.
// Thread-safe (pure functions).
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace zinc::kernels::ref {

// C[b] = alpha op(A[b]) op(B[b]) (+ C[b]); d.compute is ignored (the caller
// rounds the inputs to bf16 when it wants the bf16 product).
template <class T>
void matmul(const MatmulDesc& d, const T* a, const T* b, T* c);

template <class T>
void add_bias(T* y, const T* bias, int64_t M, int64_t N);
template <class T>
void bias_backward(T* dbias, const T* dy, int64_t M, int64_t N);

template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, int64_t N,
                       int64_t C, double eps = 1e-5);
// dx += ..., dw += ..., db += ... (recomputes mean and rstd from x).
template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dout, const T* x, const T* w, int64_t N,
                        int64_t C, double eps = 1e-5);

template <class T>
void gelu_forward(T* out, const T* x, int64_t n);
template <class T>
void gelu_backward(T* dx, const T* x, const T* dout, int64_t n);

// Naive per (b, h, t): scores over s <= t, softmax, weighted sum of v.
template <class T>
void attention_forward(T* out, const T* qkv, AttentionShape s);
// dqkv written.
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, AttentionShape s);

// Targets must be valid (the reference does not check).
template <class T>
double cross_entropy(const T* logits, const int32_t* targets, int64_t N, int64_t V, T* dlogits,
                     double dloss_scale);

template <class T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int64_t B,
                       int64_t T_, int64_t C);
template <class T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B,
                        int64_t T_, int64_t C);

template <class T>
void add(T* out, const T* a, const T* b, int64_t n);
template <class T>
void accumulate(T* y, const T* x, int64_t n);
template <class T>
void scale(T* x, T alpha, int64_t n);
template <class T>
void axpy(T* y, T alpha, const T* x, int64_t n);
// Sequential sum in double (the fast kernel sums in another fixed order, so
// compare with a relative tolerance).
template <class T>
double squared_norm(const T* x, int64_t n);
template <class T>
bool all_finite(const T* x, int64_t n);

// Llama-family layers (llama_reference.cpp).
template <class T>
void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int64_t N, int64_t C, double eps);
// dx += ..., dw += ... (recomputes rstd from x).
template <class T>
void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, int64_t N, int64_t C, double eps);
template <class T>
void swiglu_forward(T* out, const T* gate_up, int64_t N, int64_t I);
template <class T>
void swiglu_backward(T* dgate_up, const T* dout, const T* gate_up, int64_t N, int64_t I);
// cos, sin: (T, head_dim/2) as for kernels::rope.
template <class T>
void rope(T* x, const T* cos, const T* sin, RopeShape s, bool inverse);
template <class T>
void gqa_expand(T* qkv, const T* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd);
template <class T>
void gqa_reduce(T* dq_kv, const T* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd);

}  // namespace zinc::kernels::ref
