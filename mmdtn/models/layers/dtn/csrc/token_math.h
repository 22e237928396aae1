// Eqs. 4 and 5 and their gradients for one token and channel, shared by the per-token passes
// (token_passes.cpp) and the fused passes without pooling (fused_rows.cpp).
#pragma once

#include "common.h"
#include "isa.h"

namespace mmdtn::cpu::MMDTN_ISA {

// The cell statistics of Eq. 5 for one channel: mu_it = first + centre, and var_it, which is
// ``second`` itself or, when ``second`` is the raw second moment P^h T_1, second - first^2 >= 0.
template <typename T, bool RAW>
inline T inter_token_variance(T first, T second) {
  return RAW ? std::max(second - first * first, T(0)) : second;
}

// The rows lambda_m, 1 - lambda_m, lambda_v, 1 - lambda_v of the contiguous (4, C) ratios.
template <typename T>
inline std::array<const T*, 4> ratio_rows(const Tensor& ratios, int64_t C) {
  const T* r = ratios.data_ptr<T>();
  return {r, r + C, r + 2 * C, r + 3 * C};
}

// Eq. 5 inside Eq. 4 for one token and channel: x, its token's mean_ln and var_ln (mu, var), the
// channel's cell statistics mu_it and var_it, ratios lambda and 1 - lambda, weight and bias.
template <typename T>
inline T token_output(T x, T mu, T var, T mean_it, T var_it, T lam_m, T kap_m, T lam_v, T kap_v,
                      T w, T b, T e) {
  const T rstd = T(1) / std::sqrt(kap_v * var_it + e + lam_v * var);
  return (x - lam_m * mu - kap_m * mean_it) * rstd * w + b;
}

// Gradient terms of one token and channel: D1 = g w rstd (= -dL/dmu), D2 = D1 xhat rstd
// (= -2 dL/dvar) and xhat g (for the weight's gradient).
template <typename T>
struct TokenGrad {
  T d1, d2, xg;
};

template <typename T>
inline TokenGrad<T> token_grad(T x, T g, T w, T mu, T var, T lam_m, T lam_v, T cell_mean,
                               T cell_var) {
  const T rstd = T(1) / std::sqrt(cell_var + lam_v * var);
  const T xhat = (x - lam_m * mu - cell_mean) * rstd;
  const T d1 = g * w * rstd;
  return {d1, d1 * xhat * rstd, xhat * g};
}

// dL/dm of one cell and channel from the sums of D1 and D2 over its tokens and its m_first and
// var_it: {dL/dm_first, dL/dm_second} (see backward_impl).
template <typename T>
struct MomentGrad {
  T df, dq;
};

template <typename T>
inline MomentGrad<T> moment_grad(T first, T var_it, T kap_m, T kap_v, T sum_d1, T sum_d2) {
  const T dq = T(var_it > T(0)) * T(-0.5) * kap_v * sum_d2;  // branch-free
  return {-kap_m * sum_d1 - T(2) * first * dq, dq};
}

// The backward terms of one token and channel without pooling, where the token is its own cell
// and ``second`` is the raw second moment: those of token_grad, and the token's dL/dm
// (df = dL/dm_first, dq = dL/dm_second) and var_it.
template <typename T>
struct OwnCellGrad {
  T d1, d2, xg, var_it, df, dq;
};

template <typename T>
inline OwnCellGrad<T> own_cell_grad(T x, T g, T w, T mu, T var, T lam_m, T kap_m, T lam_v,
                                    T kap_v, T centre, T first, T second, T e) {
  const T var_it = inter_token_variance<T, true>(first, second);
  const auto r = token_grad(x, g, w, mu, var, lam_m, lam_v, kap_m * (first + centre),
                            kap_v * var_it + e);
  const auto dm = moment_grad(first, var_it, kap_m, kap_v, r.d1, r.d2);
  return {r.d1, r.d2, r.xg, var_it, dm.df, dm.dq};
}

// own_cell_grad over the d channels of one head of one token: D1 into dx, dL/dm into df and dq,
// and the head's per-channel sums into s, six rows ``stride`` apart (xhat g, g, mu_ln D1,
// var_ln D2, mu_it D1, var_it D2). Returns the token's sums D1 . lam_m and D2 . lam_v.
template <typename T>
inline std::pair<T, T> own_cell_head(int64_t d, const T* x, const T* g, const T* w, T mu, T var,
                                     const T* lm, const T* km, const T* lv, const T* kv,
                                     const T* cen, const T* f, const T* q, T e, T* dx, T* df,
                                     T* dq, T* s, int64_t stride) {
  T *s_xg = s, *s_g = s + stride, *s_mu = s + 2 * stride, *s_var = s + 3 * stride,
    *s_mit = s + 4 * stride, *s_vit = s + 5 * stride;
  T sum1 = 0, sum2 = 0;
#pragma omp simd reduction(+ : sum1, sum2)
  for (int64_t k = 0; k < d; ++k) {
    const auto r =
        own_cell_grad(x[k], g[k], w[k], mu, var, lm[k], km[k], lv[k], kv[k], cen[k], f[k], q[k], e);
    dx[k] = r.d1;
    df[k] = r.df;
    dq[k] = r.dq;
    sum1 += r.d1 * lm[k];
    sum2 += r.d2 * lv[k];
    s_xg[k] += r.xg;
    s_g[k] += g[k];
    s_mu[k] += mu * r.d1;
    s_var[k] += var * r.d2;
    s_mit[k] += (f[k] + cen[k]) * r.d1;
    s_vit[k] += r.var_it * r.d2;
  }
  return {sum1, sum2};
}

}  // namespace mmdtn::cpu::MMDTN_ISA
