// The kernels of dynamic_token_norm_cpu.cpp, included there once per instruction set, each time
// inside a namespace of its own (hence no include guard and no includes: CellView, Grid and the
// standard headers come from the including file).
// The cell statistics of Eq. 5 for one channel: mu_it = first + centre, and var_it, which is
// ``second`` itself or, when ``second`` is the raw second moment P^h T_1, second - first^2 >= 0.
template <typename T, bool RAW>
inline T inter_token_variance(T first, T second) {
  return RAW ? std::max(second - first * first, T(0)) : second;
}

// The rows lambda_m, 1 - lambda_m, lambda_v, 1 - lambda_v of the contiguous (4, C) ratios.
template <typename T>
inline std::array<const T*, 4> ratio_rows(const torch::Tensor& ratios, int64_t C) {
  const T* r = ratios.data_ptr<T>();
  return {r, r + C, r + 2 * C, r + 3 * C};
}

// The Wp cell sums (Wp, C) of unit u divided by the cells' numbers of real tokens.
template <typename T>
inline void sums_to_means(T* sums, int64_t u, const Grid& g) {
  for (int64_t cj = 0; cj < g.Wp; ++cj) {
    const T inv = T(1) / T(g.cell_tokens(u, cj));
    for (int64_t c = 0; c < g.C; ++c) sums[cj * g.C + c] *= inv;
  }
}

// Eq. 2 per token (mean, and variance about it divided by n_var) and, with pooling, the mean of x
// over every cell's real tokens; without pooling the sum of x over every unit (one token row).
template <typename T>
void statistics_impl(const torch::Tensor& x, double n_var, const Grid& g, torch::Tensor& mean_ln,
                     torch::Tensor& var_ln, torch::Tensor& cells) {
  const T* px = x.data_ptr<T>();
  T* pmu = mean_ln.data_ptr<T>();
  T* pvar = var_ln.data_ptr<T>();
  T* pcell = cells.data_ptr<T>();
  const int64_t C = g.C;
  const T n = static_cast<T>(n_var);
  const int64_t cells_per_unit = g.s > 1 ? g.Wp : 1;
  at::parallel_for(0, g.units(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / g.Hp;
      T* sums = pcell + u * cells_per_unit * C;
      std::fill(sums, sums + cells_per_unit * C, T(0));
      for (int64_t i = g.first_row(u); i < g.end_row(u); ++i) {
        for (int64_t j = 0; j < g.W; ++j) {
          const int64_t t = (b * g.H + i) * g.W + j;
          const T* xt = px + t * C;
          T* st = sums + (g.s > 1 ? j / g.s : 0) * C;
          T total = 0;
#pragma omp simd reduction(+ : total)
          for (int64_t c = 0; c < C; ++c) {
            total += xt[c];
            st[c] += xt[c];
          }
          const T mu = total / T(C);
          T squares = 0;
#pragma omp simd reduction(+ : squares)
          for (int64_t c = 0; c < C; ++c) squares += (xt[c] - mu) * (xt[c] - mu);
          pmu[t] = mu;
          pvar[t] = squares / n;
        }
      }
      if (g.s > 1) sums_to_means(sums, u, g);
    }
  });
}

// The mean of (x - centre)^2 over every cell's real tokens (pooling only).
template <typename T>
void second_moment_impl(const torch::Tensor& x, const torch::Tensor& centre, const Grid& g,
                        torch::Tensor& second) {
  const T* px = x.data_ptr<T>();
  const T* pcen = centre.data_ptr<T>();
  T* pout = second.data_ptr<T>();
  const int64_t C = g.C;
  at::parallel_for(0, g.units(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / g.Hp;
      const T* cen = pcen + b * C;
      T* sums = pout + u * g.Wp * C;
      std::fill(sums, sums + g.Wp * C, T(0));
      for (int64_t i = g.first_row(u); i < g.end_row(u); ++i) {
        for (int64_t j = 0; j < g.W; ++j) {
          const T* xt = px + ((b * g.H + i) * g.W + j) * C;
          T* st = sums + (j / g.s) * C;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) st[c] += (xt[c] - cen[c]) * (xt[c] - cen[c]);
        }
      }
      sums_to_means(sums, u, g);
    }
  });
}

// Eq. 5 inside Eq. 4 for one token and channel: x, its token's mean_ln and var_ln (mu, var), the
// channel's cell statistics mu_it and var_it, ratios lambda and 1 - lambda, weight and bias.
template <typename T>
inline T token_output(T x, T mu, T var, T mean_it, T var_it, T lam_m, T kap_m, T lam_v, T kap_v,
                      T w, T b, T e) {
  const T rstd = T(1) / std::sqrt(kap_v * var_it + e + lam_v * var);
  return (x - lam_m * mu - kap_m * mean_it) * rstd * w + b;
}

template <typename T, bool RAW>
void forward_impl(const torch::Tensor& x, const torch::Tensor& mean_ln,
                  const torch::Tensor& var_ln, const torch::Tensor& first,
                  const torch::Tensor& second, const torch::Tensor& centre,
                  const torch::Tensor& ratios, const torch::Tensor& weight,
                  const torch::Tensor& bias, double eps, const Grid& g, torch::Tensor& y) {
  const T* px = x.data_ptr<T>();
  const T* pmu = mean_ln.data_ptr<T>();
  const T* pvar = var_ln.data_ptr<T>();
  const T* pcen = centre.data_ptr<T>();
  const auto [lam_m, kap_m, lam_v, kap_v] = ratio_rows<T>(ratios, g.C);
  const T* pw = weight.data_ptr<T>();
  const T* pb = bias.data_ptr<T>();
  T* pout = y.data_ptr<T>();
  const CellView<T> f(first), q(second);
  const T e = static_cast<T>(eps);
  at::parallel_for(0, g.units(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / g.Hp, ci = u % g.Hp;
      for (int64_t i = g.first_row(u); i < g.end_row(u); ++i) {
        for (int64_t j = 0; j < g.W; ++j) {
          const int64_t t = (b * g.H + i) * g.W + j;
          const T mu = pmu[t], var = pvar[t];
          const T* xt = px + t * g.C;
          T* yt = pout + t * g.C;
          for (int64_t h = 0; h < g.nh; ++h) {
            const T* fh = f.head(b, ci, j / g.s, h);
            const T* qh = q.head(b, ci, j / g.s, h);
            const int64_t c0 = h * g.d;
#pragma omp simd
            for (int64_t k = 0; k < g.d; ++k) {
              const int64_t c = c0 + k;
              yt[c] = token_output(xt[c], mu, var, fh[k] + pcen[b * g.C + c],
                                   inter_token_variance<T, RAW>(fh[k], qh[k]), lam_m[c],
                                   kap_m[c], lam_v[c], kap_v[c], pw[c], pb[c], e);
            }
          }
        }
      }
    }
  });
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

// The operands of the backward passes over the tokens (BackwardTensors), as raw pointers.
template <typename T>
struct BackwardPointers {
  const T *g, *x, *mu, *var, *centre, *w;
  std::array<const T*, 4> ratios;
  T *dx, *tok1, *tok2, *sums;
  CellView<T> f, q, dmf, dmq;
  T eps;
  explicit BackwardPointers(const BackwardTensors& t)
      : g(t.g_y.data_ptr<T>()), x(t.x.data_ptr<T>()), mu(t.mean_ln.data_ptr<T>()),
        var(t.var_ln.data_ptr<T>()), centre(t.centre.data_ptr<T>()), w(t.weight.data_ptr<T>()),
        ratios(ratio_rows<T>(t.ratios, t.x.size(2))), dx(t.dx.data_ptr<T>()),
        tok1(t.tok1.data_ptr<T>()), tok2(t.tok2.data_ptr<T>()), sums(t.sums.data_ptr<T>()),
        f(t.first), q(t.second), dmf(t.dm_first), dmq(t.dm_second),
        eps(static_cast<T>(t.eps)) {}
};

// Backward pass over the tokens: D1 (written into dx) and D2; their per-token channel sums with
// the lambdas (tok1, tok2); per-unit channel sums for the gradients of weight, bias and the gates
// (xhat g, g, mu_ln D1, var_ln D2, mu_it D1, var_it D2); and dL/dm of every cell of the unit:
// dL/dm_second = -(1 - lam_v) / 2 sum D2 [var_it > 0] and
// dL/dm_first = -(1 - lam_m) sum D1 - 2 m_first dL/dm_second.
// Tokens of one cell are taken in pairs, which halves the updates of the sums. With pooling only
// (``second`` holds var_it); backward_tokens_impl serves the tokens without pooling.
template <typename T>
void backward_impl(const BackwardTensors& t, const Grid& g) {
  const BackwardPointers<T> o(t);
  const auto [lam_m, kap_m, lam_v, kap_v] = o.ratios;
  const T e = o.eps;
  const int64_t C = g.C;
  at::parallel_for(0, g.units(), 1, [&](int64_t begin, int64_t end) {
    // per cell of the unit: (1 - lam_m) mu_it, (1 - lam_v) var_it + eps, sum D1, sum D2
    std::vector<T> cell_mean(g.Wp * C), cell_var(g.Wp * C), cell_d1(g.Wp * C),
        cell_d2(g.Wp * C);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / g.Hp, ci = u % g.Hp;
      T* s_xg = o.sums + u * 6 * C;
      T* s_g = s_xg + C;
      T* s_mu = s_g + C;
      T* s_var = s_mu + C;
      std::fill(s_xg, s_xg + 6 * C, T(0));
      std::fill(cell_d1.begin(), cell_d1.end(), T(0));
      std::fill(cell_d2.begin(), cell_d2.end(), T(0));
      for (int64_t cj = 0; cj < g.Wp; ++cj) {
        for (int64_t h = 0; h < g.nh; ++h) {
          const T* fh = o.f.head(b, ci, cj, h);
          const T* qh = o.q.head(b, ci, cj, h);
#pragma omp simd
          for (int64_t k = 0; k < g.d; ++k) {
            const int64_t c = h * g.d + k;
            cell_mean[cj * C + c] = kap_m[c] * (fh[k] + o.centre[b * C + c]);
            cell_var[cj * C + c] = kap_v[c] * qh[k] + e;
          }
        }
      }
      for (int64_t i = g.first_row(u); i < g.end_row(u); ++i) {
        for (int64_t j = 0; j < g.W;) {
          const int64_t t = (b * g.H + i) * g.W + j, cj = j / g.s;
          const T* cm = cell_mean.data() + cj * C;
          const T* cv = cell_var.data() + cj * C;
          T* c1 = cell_d1.data() + cj * C;
          T* c2 = cell_d2.data() + cj * C;
          const T* x0 = o.x + t * C;
          const T* g0 = o.g + t * C;
          T* dx0 = o.dx + t * C;
          const T mu0 = o.mu[t], var0 = o.var[t];
          if (j + 1 < g.end_col(cj)) {  // a pair of tokens of this cell
            const T *x1 = x0 + C, *g1 = g0 + C;
            T* dx1 = dx0 + C;
            const T mu1 = o.mu[t + 1], var1 = o.var[t + 1];
            T a10 = 0, a11 = 0, a20 = 0, a21 = 0;
#pragma omp simd reduction(+ : a10, a11, a20, a21)
            for (int64_t c = 0; c < C; ++c) {
              const auto r0 = token_grad(x0[c], g0[c], o.w[c], mu0, var0, lam_m[c], lam_v[c],
                                         cm[c], cv[c]);
              const auto r1 = token_grad(x1[c], g1[c], o.w[c], mu1, var1, lam_m[c], lam_v[c],
                                         cm[c], cv[c]);
              dx0[c] = r0.d1;
              dx1[c] = r1.d1;
              a10 += r0.d1 * lam_m[c];
              a11 += r1.d1 * lam_m[c];
              a20 += r0.d2 * lam_v[c];
              a21 += r1.d2 * lam_v[c];
              s_xg[c] += r0.xg + r1.xg;
              s_g[c] += g0[c] + g1[c];
              s_mu[c] += mu0 * r0.d1 + mu1 * r1.d1;
              s_var[c] += var0 * r0.d2 + var1 * r1.d2;
              c1[c] += r0.d1 + r1.d1;
              c2[c] += r0.d2 + r1.d2;
            }
            o.tok1[t] = a10;
            o.tok1[t + 1] = a11;
            o.tok2[t] = a20;
            o.tok2[t + 1] = a21;
            j += 2;
          } else {
            T a1 = 0, a2 = 0;
#pragma omp simd reduction(+ : a1, a2)
            for (int64_t c = 0; c < C; ++c) {
              const auto r = token_grad(x0[c], g0[c], o.w[c], mu0, var0, lam_m[c], lam_v[c],
                                        cm[c], cv[c]);
              dx0[c] = r.d1;
              a1 += r.d1 * lam_m[c];
              a2 += r.d2 * lam_v[c];
              s_xg[c] += r.xg;
              s_g[c] += g0[c];
              s_mu[c] += mu0 * r.d1;
              s_var[c] += var0 * r.d2;
              c1[c] += r.d1;
              c2[c] += r.d2;
            }
            o.tok1[t] = a1;
            o.tok2[t] = a2;
            j += 1;
          }
        }
      }
      T* s_mit = s_var + C;
      T* s_vit = s_mit + C;
      for (int64_t cj = 0; cj < g.Wp; ++cj) {
        for (int64_t h = 0; h < g.nh; ++h) {
          const T* fh = o.f.head(b, ci, cj, h);
          const T* qh = o.q.head(b, ci, cj, h);
          T* of = o.dmf.head(b, ci, cj, h);
          T* oq = o.dmq.head(b, ci, cj, h);
#pragma omp simd
          for (int64_t k = 0; k < g.d; ++k) {
            const int64_t c = h * g.d + k;
            const T var_it = qh[k];
            const T sum_d1 = cell_d1[cj * C + c], sum_d2 = cell_d2[cj * C + c];
            s_mit[c] += (fh[k] + o.centre[b * C + c]) * sum_d1;
            s_vit[c] += var_it * sum_d2;
            const auto dm = moment_grad(fh[k], var_it, kap_m[c], kap_v[c], sum_d1, sum_d2);
            oq[k] = dm.dq;
            of[k] = dm.df;
          }
        }
      }
    }
  });
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

// backward_impl without pooling, in one pass: every token is a cell of its own, so its dL/dm is
// written as soon as its gradient terms are known, without per-cell sums. Units are token rows,
// taken head by head: the head-major dL/dm and m of a head's row are contiguous, which keeps the
// number of memory streams small however many heads there are.
template <typename T>
void backward_tokens_impl(const BackwardTensors& t, const Grid& g) {
  const BackwardPointers<T> o(t);
  const auto [lam_m, kap_m, lam_v, kap_v] = o.ratios;
  const T e = o.eps;
  const int64_t C = g.C, d = g.d, W = g.W;
  at::parallel_for(0, g.units(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / g.H, i = u % g.H;
      const T* cen = o.centre + b * C;
      T* a1 = o.tok1 + u * W;  // the row's tokens (b, i, :)
      T* a2 = o.tok2 + u * W;
      std::fill(a1, a1 + W, T(0));
      std::fill(a2, a2 + W, T(0));
      T* sums = o.sums + u * 6 * C;
      std::fill(sums, sums + 6 * C, T(0));
      for (int64_t h = 0; h < g.nh; ++h) {
        const int64_t c0 = h * d;
        const T *lm = lam_m + c0, *km = kap_m + c0, *lv = lam_v + c0, *kv = kap_v + c0;
        const T *w = o.w + c0, *ch = cen + c0;
        for (int64_t j = 0; j < W; ++j) {
          const int64_t t = u * W + j;
          const T *xt = o.x + t * C + c0, *gt = o.g + t * C + c0;
          T* dxt = o.dx + t * C + c0;
          const T *fh = o.f.head(b, i, j, h), *qh = o.q.head(b, i, j, h);
          T *of = o.dmf.head(b, i, j, h), *oq = o.dmq.head(b, i, j, h);
          const auto [sum1, sum2] = own_cell_head(d, xt, gt, w, o.mu[t], o.var[t], lm, km, lv, kv,
                                                  ch, fh, qh, e, dxt, of, oq, sums + c0, C);
          a1[j] += sum1;
          a2[j] += sum2;
        }
      }
    }
  });
}

// dx += x beta + alpha + (dT_0 + 2 (x - centre) dT_1) / n, with n the number of tokens of the cell
// and dT the gradients of the positional products' inputs (cell views; dT_1 may be absent).
template <typename T, bool SECOND>
void input_grad_impl(torch::Tensor& dx, const torch::Tensor& x, const torch::Tensor& beta,
                     const torch::Tensor& alpha, const torch::Tensor& d_first,
                     const torch::Tensor& d_second, const torch::Tensor& centre, const Grid& g) {
  const T* px = x.data_ptr<T>();
  const T* pbeta = beta.data_ptr<T>();
  const T* palpha = alpha.data_ptr<T>();
  const T* pcen = centre.data_ptr<T>();
  T* pdx = dx.data_ptr<T>();
  const CellView<T> d0(d_first), d1(SECOND ? d_second : d_first);
  at::parallel_for(0, g.units(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / g.Hp, ci = u % g.Hp;
      for (int64_t i = g.first_row(u); i < g.end_row(u); ++i) {
        for (int64_t j = 0; j < g.W; ++j) {
          const int64_t t = (b * g.H + i) * g.W + j, cj = j / g.s;
          const T inv_n = T(1) / T(g.cell_tokens(u, cj));
          const T beta_t = pbeta[t], alpha_t = palpha[t];
          const T* xt = px + t * g.C;
          T* dxt = pdx + t * g.C;
          for (int64_t h = 0; h < g.nh; ++h) {
            const T* p0 = d0.head(b, ci, cj, h);
            const T* p1 = d1.head(b, ci, cj, h);
            const int64_t c0 = h * g.d;
#pragma omp simd
            for (int64_t k = 0; k < g.d; ++k) {
              const int64_t c = c0 + k;
              T cell = p0[k];
              if (SECOND) cell += T(2) * (xt[c] - pcen[b * g.C + c]) * p1[k];
              dxt[c] += xt[c] * beta_t + alpha_t + cell * inv_n;
            }
          }
        }
      }
    }
  });
}

// Banded products with the positional factors (P_x or P_y, Eq. 6), which are exact zeros far
// from the diagonal (see _softmax in dynamic_token_norm.py): only the nonzero spans of the rows of
// P are visited. P is (nP, L, L) contiguous; matrix k of the batch uses P[k / group]. X, Y and A
// are contiguous (n, L, N). Both kernels work on kRows rows of P at a time over the union of their
// spans, with the accumulators in vector registers (GCC vector extensions, 64 bytes: one AVX-512
// register, or four SSE registers in the baseline build).
template <typename T>
struct VecOf;
template <>
struct VecOf<float> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct VecOf<double> {
  typedef double type __attribute__((vector_size(64)));
};
template <typename T>
using Vec = typename VecOf<T>::type;

template <typename T>
inline void load(Vec<T>& v, const T* p) {
  __builtin_memcpy(&v, p, sizeof(v));
}

template <typename T>
inline void store(T* p, const Vec<T>& v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

template <typename T>
inline T lane_sum(const Vec<T>& v) {
  T total = 0;
  for (size_t c = 0; c < sizeof(v) / sizeof(T); ++c) total += v[c];
  return total;
}

constexpr int64_t kRows = 4;

// The span [j0, j1) of the nonzero entries of row i of the L x L matrix p (of column i with
// ``transpose``); empty (j0 == j1) for a zero row.
template <typename T>
inline std::pair<int64_t, int64_t> nonzero_span(const T* p, int64_t i, int64_t L, bool transpose) {
  const int64_t step = transpose ? L : 1;
  const T* row = transpose ? p + i : p + i * L;
  int64_t j0 = 0, j1 = L;
  while (j0 < L && row[j0 * step] == T(0)) ++j0;
  while (j1 > j0 && row[(j1 - 1) * step] == T(0)) --j1;
  return {j0, j1};
}

// The spans of rows [i0, i0 + rows) of p (of its columns with ``transpose``), into ``span``,
// and their union [j0, j1).
template <typename T>
inline std::pair<int64_t, int64_t> row_spans(const T* p, int64_t i0, int64_t rows, int64_t L,
                                             bool transpose, std::pair<int64_t, int64_t>* span) {
  int64_t j0 = L, j1 = 0;
  for (int64_t q = 0; q < rows; ++q) {
    span[q] = nonzero_span(p, i0 + q, L, transpose);
    if (span[q].first < span[q].second)
      j0 = std::min(j0, span[q].first), j1 = std::max(j1, span[q].second);
  }
  return {j0, std::max(j0, j1)};
}

// Rows [i0, i0 + rows) of p (transposed or not): the union [j0, j1) of their spans and their
// weights there, w[(j - j0) * kRows + q] (0 for q >= rows).
template <typename T>
inline std::pair<int64_t, int64_t> row_block(const T* p, int64_t i0, int64_t rows, int64_t L,
                                             bool transpose, std::vector<T>& w) {
  std::pair<int64_t, int64_t> span[kRows];
  const auto [j0, j1] = row_spans(p, i0, rows, L, transpose, span);
  w.assign((j1 - j0) * kRows, T(0));
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t q = 0; q < rows; ++q)
      w[(j - j0) * kRows + q] = transpose ? p[j * L + i0 + q] : p[(i0 + q) * L + j];
  return {j0, j1};
}

// Y[k, i] = sum_j P[i, j] X[k, j] (P[j, i] with ``transpose``) over the nonzero span of row i.
template <typename T>
void band_matmul_impl(const T* P, const T* X, T* Y, int64_t n, int64_t group, int64_t L,
                      int64_t N, bool transpose) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  constexpr int64_t kTile = 4 * V;
  const int64_t blocks = (L + kRows - 1) / kRows;
  at::parallel_for(0, n * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> w;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t k = r / blocks, i0 = (r % blocks) * kRows, rows = std::min(kRows, L - i0);
      const auto [j0, j1] = row_block(P + (k / group) * L * L, i0, rows, L, transpose, w);
      const T* x = X + k * L * N;
      T* y = Y + (k * L + i0) * N;
      int64_t c0 = 0;
      for (; c0 + kTile <= N; c0 += kTile) {
        Vec<T> acc[kRows][4] = {};
        for (int64_t j = j0; j < j1; ++j) {
          const T* xj = x + j * N + c0;
          Vec<T> x0, x1, x2, x3;
          load<T>(x0, xj);
          load<T>(x1, xj + V);
          load<T>(x2, xj + 2 * V);
          load<T>(x3, xj + 3 * V);
          const T* wj = w.data() + (j - j0) * kRows;
#pragma GCC unroll 4
          for (int64_t q = 0; q < kRows; ++q) {
            acc[q][0] += wj[q] * x0;
            acc[q][1] += wj[q] * x1;
            acc[q][2] += wj[q] * x2;
            acc[q][3] += wj[q] * x3;
          }
        }
        for (int64_t q = 0; q < rows; ++q)
          for (int64_t v = 0; v < 4; ++v) store<T>(y + q * N + c0 + v * V, acc[q][v]);
      }
      for (int64_t q = 0; q < rows; ++q)
        for (int64_t c = c0; c < N; ++c) {
          T total = 0;
          for (int64_t j = j0; j < j1; ++j) total += w[(j - j0) * kRows + q] * x[j * N + c];
          y[q * N + c] = total;
        }
    }
  });
}

// G[k, i, j] = sum_c A[k, i, c] X[k, j, c] over the nonzero span of row i of P[k / group], 0
// elsewhere (the gradient of P, wherever the softmax passes it on).
template <typename T>
void band_outer_impl(const T* P, const T* A, const T* X, T* G, int64_t n, int64_t group,
                     int64_t L, int64_t N) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  constexpr int64_t kCols = 6;
  const int64_t blocks = (L + kRows - 1) / kRows, full = N / V * V;
  at::parallel_for(0, n * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t k = r / blocks, i0 = (r % blocks) * kRows, rows = std::min(kRows, L - i0);
      std::pair<int64_t, int64_t> span[kRows];
      const auto [j0, j1] = row_spans(P + (k / group) * L * L, i0, rows, L, false, span);
      const T* a[kRows];
      for (int64_t q = 0; q < kRows; ++q) a[q] = A + (k * L + i0 + std::min(q, rows - 1)) * N;
      const T* x = X + k * L * N;
      T* g = G + (k * L + i0) * L;
      std::fill(g, g + rows * L, T(0));
      for (int64_t jb = j0; jb < j1; jb += kCols) {
        const T* xs[kCols];
        for (int64_t jj = 0; jj < kCols; ++jj) xs[jj] = x + std::min(jb + jj, j1 - 1) * N;
        Vec<T> acc[kRows][kCols] = {};
        for (int64_t c = 0; c < full; c += V) {
          Vec<T> av[kRows];
#pragma GCC unroll 4
          for (int64_t q = 0; q < kRows; ++q) load<T>(av[q], a[q] + c);
#pragma GCC unroll 6
          for (int64_t jj = 0; jj < kCols; ++jj) {
            Vec<T> xv;
            load<T>(xv, xs[jj] + c);
#pragma GCC unroll 4
            for (int64_t q = 0; q < kRows; ++q) acc[q][jj] += av[q] * xv;
          }
        }
        for (int64_t q = 0; q < rows; ++q)
          for (int64_t jj = 0; jj < kCols && jb + jj < j1; ++jj) {
            const int64_t j = jb + jj;
            if (j < span[q].first || j >= span[q].second) continue;  // stays 0
            T total = lane_sum<T>(acc[q][jj]);
            for (int64_t c = full; c < N; ++c) total += a[q][c] * xs[jj][c];
            g[q * L + j] = total;
          }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Without pooling, the fused passes over the tokens. u = P_x T (T: the moments x - centre and
// (x - centre)^2) and m = P_y u are as large as x; these passes never store them. Every task, a
// group of d channels of one head h of one image b, walks the token rows in order: it forms the
// rows of u with P_x straight from x into a ring holding the rows that P_y still needs, and from
// them m (and, backward, dL/dm and dL/du) one row at a time, in cache. A row tile is (2, W, d):
// both moments, W tokens, d channels; d must be a multiple of the vector width. A head's channels
// are split into groups only when there would be too few tasks for the threads otherwise.

// The nonzero spans and weights of one axis factor P (nh, L, L) of every head, in blocks of kRows
// rows (of columns with ``transpose``), as the banded products take them.
template <typename T>
struct BandBlocks {
  int64_t L, blocks, width = 1;  // width: the widest union span of a block
  std::vector<std::pair<int64_t, int64_t>> row, block;  // spans of every row, of every block
  std::vector<std::vector<T>> weights;                   // per block, see row_block
  BandBlocks(const T* P, int64_t nh, int64_t L_, bool transpose)
      : L(L_), blocks((L_ + kRows - 1) / kRows), row(nh * L_), block(nh * blocks),
        weights(nh * blocks) {
    for (int64_t r = 0; r < nh * blocks; ++r) {
      const int64_t h = r / blocks, i0 = (r % blocks) * kRows, rows = std::min(kRows, L - i0);
      const T* p = P + h * L * L;
      block[r] = row_block(p, i0, rows, L, transpose, weights[r]);
      for (int64_t q = 0; q < rows; ++q)
        row[h * L + i0 + q] = nonzero_span(p, i0 + q, L, transpose);
      width = std::max(width, block[r].second - block[r].first);
    }
  }
};

// The number of rows a ring must hold when row i needs the source rows span[i] and is taken up
// once they are formed (and, with ``own``, not before source row i): the rows formed so far back to
// the smallest start of the spans of the rows still to come.
inline int64_t ring_rows(const std::pair<int64_t, int64_t>* span, int64_t L, bool own) {
  std::vector<int64_t> first(L + 1, L);
  for (int64_t i = L - 1; i >= 0; --i)
    first[i] = std::min(first[i + 1], span[i].first < span[i].second ? span[i].first : L);
  int64_t last = 0, rows = 1;
  for (int64_t i = 0; i < L; ++i) {
    if (span[i].first < span[i].second) last = std::max(last, span[i].second);
    if (own) last = std::max(last, i + 1);
    rows = std::max(rows, last - first[i]);
  }
  return rows;
}

// Source rows of the banded products: the moments of one head's channels of a token row (x at
// channel h * d of token (b, y, 0), centre at channel h * d of image b) ...
template <typename T>
struct TokenMoments {
  const T* x;
  const T* centre;
  int64_t C;
  void load2(int64_t j, int64_t e, Vec<T>& t0, Vec<T>& t1) const {
    Vec<T> c;
    load<T>(t0, x + j * C + e);
    load<T>(c, centre + e);
    t0 -= c;
    t1 = t0 * t0;
  }
};

// ... or a row tile (2, W, d).
template <typename T>
struct TileRow {
  const T* tile;
  int64_t Wd, d;
  void load2(int64_t j, int64_t e, Vec<T>& t0, Vec<T>& t1) const {
    load<T>(t0, tile + j * d + e);
    load<T>(t1, tile + Wd + j * d + e);
  }
};

// out[s, i] = sum_j P[h, i, j] in_s[j] over the nonzero span of every row i (P[h, j, i] for the
// blocks of a transposed factor), for both slots of the row tile ``out``.
template <typename T, typename In>
void band_row(const BandBlocks<T>& bands, int64_t h, int64_t d, const In& in, T* out) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  const int64_t W = bands.L, Wd = W * d;
  for (int64_t blk = 0; blk < bands.blocks; ++blk) {
    const int64_t i0 = blk * kRows, rows = std::min(kRows, W - i0);
    const auto [j0, j1] = bands.block[h * bands.blocks + blk];
    const T* w = bands.weights[h * bands.blocks + blk].data();
    for (int64_t e = 0; e < d; e += 2 * V) {
      const bool two = e + 2 * V <= d;  // two vectors per slot, or the last one
      Vec<T> acc[kRows][4] = {};
      for (int64_t j = j0; j < j1; ++j) {
        Vec<T> a0, a1, b0, b1;
        in.load2(j, e, a0, a1);
        if (two) in.load2(j, e + V, b0, b1);
        const T* wj = w + (j - j0) * kRows;
#pragma GCC unroll 4
        for (int64_t q = 0; q < kRows; ++q) {
          acc[q][0] += wj[q] * a0;
          acc[q][1] += wj[q] * a1;
          if (two) {
            acc[q][2] += wj[q] * b0;
            acc[q][3] += wj[q] * b1;
          }
        }
      }
      for (int64_t q = 0; q < rows; ++q) {
        T* o0 = out + (i0 + q) * d + e;
        store<T>(o0, acc[q][0]);
        store<T>(o0 + Wd, acc[q][1]);
        if (two) {
          store<T>(o0 + V, acc[q][2]);
          store<T>(o0 + Wd + V, acc[q][3]);
        }
      }
    }
  }
}

// acc[i0 + q, j - j0] += sum_{s, e} A_s[i0 + q, e] T_s(x)[j, e] over the blocks of rows of P_x
// and their union spans [j0, j1): one token row's share of the gradient of P_x, in lane-wise
// accumulators (vectors of the width of Vec, ``stride`` of them per row of P_x).
template <typename T>
void band_outer_row(const BandBlocks<T>& bands, int64_t h, int64_t d, const T* a,
                    const TokenMoments<T>& in, T* acc, int64_t stride) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  constexpr int64_t kCols = 5;
  const int64_t W = bands.L, Wd = W * d;
  for (int64_t blk = 0; blk < bands.blocks; ++blk) {
    const int64_t i0 = blk * kRows, rows = std::min(kRows, W - i0);
    const auto [j0, j1] = bands.block[h * bands.blocks + blk];
    T* ab = acc + blk * kRows * stride * V;
    for (int64_t jb = j0; jb < j1; jb += kCols) {
      Vec<T> s[kRows][kCols];
#pragma GCC unroll 4
      for (int64_t q = 0; q < kRows; ++q)
#pragma GCC unroll 5
        for (int64_t jj = 0; jj < kCols; ++jj)
          load<T>(s[q][jj], ab + (q * stride + jb - j0 + jj) * V);
      for (int64_t e = 0; e < d; e += V) {
        Vec<T> a0[kRows], a1[kRows];
#pragma GCC unroll 4
        for (int64_t q = 0; q < kRows; ++q) {
          const T* aq = a + (i0 + std::min(q, rows - 1)) * d + e;
          load<T>(a0[q], aq);
          load<T>(a1[q], aq + Wd);
        }
#pragma GCC unroll 5
        for (int64_t jj = 0; jj < kCols; ++jj) {
          Vec<T> t0, t1;
          in.load2(std::min(jb + jj, j1 - 1), e, t0, t1);
#pragma GCC unroll 4
          for (int64_t q = 0; q < kRows; ++q) s[q][jj] += a0[q] * t0 + a1[q] * t1;
        }
      }
#pragma GCC unroll 4
      for (int64_t q = 0; q < kRows; ++q)
#pragma GCC unroll 5
        for (int64_t jj = 0; jj < kCols; ++jj)
          store<T>(ab + (q * stride + jb - j0 + jj) * V, s[q][jj]);
    }
  }
}

// Prefetch the n values at p (a head's channels of a token of the next row: walking one head, the
// hardware prefetchers do not see these strided streams).
template <typename T, bool WRITE = false>
inline void prefetch(const T* p, int64_t n) {
  for (int64_t k = 0; k < n; k += 64 / sizeof(T)) __builtin_prefetch(p + k, WRITE ? 1 : 0);
}

// Scratch memory of the calling thread, slot ``slot``, kept for the next call: freshly allocated
// memory costs a page fault per 4 KiB when first written.
template <typename T>
T* thread_scratch(int slot, int64_t n) {
  static thread_local std::vector<T> buffers[8];
  if (int64_t(buffers[slot].size()) < n) buffers[slot].resize(n);
  return buffers[slot].data();
}

// Rows of tiles, row r in slot r % size, in the calling thread's scratch slot ``slot``.
template <typename T>
struct TileRing {
  T* data;
  int64_t size, tile;
  std::vector<const T*> picked;  // scratch of combine_rows and row_dots
  TileRing(int64_t rows, int64_t tile_, int slot)
      : data(thread_scratch<T>(slot, rows * tile_)), size(rows), tile(tile_) {}
  T* operator[](int64_t r) { return data + (r % size) * tile; }
  const T* const* pick(std::pair<int64_t, int64_t> span) {
    picked.resize(std::max<int64_t>(span.second - span.first, 0));
    for (int64_t j = span.first; j < span.second; ++j) picked[j - span.first] = (*this)[j];
    return picked.data();
  }
};

// out = sum_{j in span} P[j] rows[j] over whole tiles (out = 0 for an empty span), P[j] at
// p + j * step; four vectors of out at a time stay in registers while the rows are summed.
template <typename T>
void combine_rows(const T* p, int64_t step, std::pair<int64_t, int64_t> span, TileRing<T>& rows,
                  T* out) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  const int64_t n = rows.tile, count = std::max<int64_t>(span.second - span.first, 0);
  const T* const* r = rows.pick(span);
  const T* w = p + span.first * step;
  int64_t c = 0;
  for (; c + 4 * V <= n; c += 4 * V) {
    Vec<T> acc[4] = {};
    for (int64_t j = 0; j < count; ++j) {
      const T wj = w[j * step];
#pragma GCC unroll 4
      for (int64_t v = 0; v < 4; ++v) {
        Vec<T> a;
        load<T>(a, r[j] + c + v * V);
        acc[v] += wj * a;
      }
    }
    for (int64_t v = 0; v < 4; ++v) store<T>(out + c + v * V, acc[v]);
  }
  for (; c < n; c += V) {  // tiles are whole vectors
    Vec<T> acc = {};
    for (int64_t j = 0; j < count; ++j) {
      Vec<T> a;
      load<T>(a, r[j] + c);
      acc += w[j * step] * a;
    }
    store<T>(out + c, acc);
  }
}

// out[j - span.first] = a . rows[j] over whole tiles for the rows j of span, eight at a time.
template <typename T>
void row_dots(const T* a, std::pair<int64_t, int64_t> span, TileRing<T>& rows, T* out) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  constexpr int64_t kDots = 8;
  const int64_t n = rows.tile, count = std::max<int64_t>(span.second - span.first, 0);
  const T* const* r = rows.pick(span);
  for (int64_t j0 = 0; j0 < count; j0 += kDots) {
    const int64_t m = std::min(kDots, count - j0);
    Vec<T> acc[kDots] = {};
    for (int64_t c = 0; c < n; c += V) {
      Vec<T> av;
      load<T>(av, a + c);
#pragma GCC unroll 8
      for (int64_t jj = 0; jj < kDots; ++jj) {
        Vec<T> b;
        load<T>(b, r[j0 + std::min(jj, m - 1)] + c);
        acc[jj] += av * b;
      }
    }
    for (int64_t jj = 0; jj < m; ++jj) out[j0 + jj] = lane_sum<T>(acc[jj]);
  }
}

// A task of the fused passes: image b, head h, and the group of channels from c0 on.
struct HeadTask {
  int64_t b, h, c0;
};

// What the tasks of a fused pass share: the operands, P_x's blocks (of rows, and for the backward
// pass of columns, for P_x^T), P_y's row and column spans, and the sizes of the rings of rows of
// u = P_x T and of dL/dm. ``parts`` groups of d channels per head.
template <typename T>
struct OwnHeadPass {
  const T *x, *mu, *var, *centre, *py;
  std::array<const T*, 4> ratios;
  const T* w;
  T eps;
  int64_t B, H, W, C, nh, parts, d;
  BandBlocks<T> bx, bxt;
  std::vector<std::pair<int64_t, int64_t>> y_rows, y_cols;  // (nh * H) spans of P_y
  int64_t u_rows = 1, dm_rows = 1;

  OwnHeadPass(const TokenPassTensors& t, int64_t H_, int64_t W_, int64_t nh_, int64_t parts_,
              bool backward)
      : x(t.x.data_ptr<T>()), mu(t.mean_ln.data_ptr<T>()), var(t.var_ln.data_ptr<T>()),
        centre(t.centre.data_ptr<T>()), py(t.p_y.data_ptr<T>()),
        ratios(ratio_rows<T>(t.ratios, t.x.size(2))), w(t.weight.data_ptr<T>()),
        eps(static_cast<T>(t.eps)), B(t.x.size(0)), H(H_), W(W_), C(t.x.size(2)), nh(nh_),
        parts(parts_), d(t.x.size(2) / nh_ / parts_), bx(t.p_x.data_ptr<T>(), nh_, W_, false),
        bxt(t.p_x.data_ptr<T>(), backward ? nh_ : 0, W_, true), y_rows(nh_ * H_),
        y_cols(nh_ * H_) {
    for (int64_t h = 0; h < nh; ++h) {
      const T* p = py + h * H * H;
      for (int64_t i = 0; i < H; ++i) {
        y_rows[h * H + i] = nonzero_span(p, i, H, false);
        y_cols[h * H + i] = nonzero_span(p, i, H, true);
      }
      u_rows = std::max(u_rows, ring_rows(y_rows.data() + h * H, H, false));
      dm_rows = std::max(dm_rows, ring_rows(y_cols.data() + h * H, H, true));
    }
  }
  int64_t tasks() const { return B * nh * parts; }
  HeadTask task(int64_t k) const {
    const int64_t h = k / parts % nh;
    return {k / (parts * nh), h, (h * parts + k % parts) * d};
  }
  int64_t tile() const { return 2 * W * d; }
  TokenMoments<T> moments(const HeadTask& k, int64_t y) const {
    return {x + (k.b * H + y) * W * C + k.c0, centre + k.b * C + k.c0, C};
  }
  // whether the sources of row k of dL/du = P_y^T dL/dm (the rows i of P_y's column k) are all
  // among the rows <= i
  bool complete(int64_t h, int64_t k, int64_t i) const {
    const auto span = y_cols[h * H + k];
    return span.first >= span.second || span.second <= i + 1;
  }
  // m row i of task k into ``m``, forming the rows of u it needs (next: the next row of u)
  void m_row(const HeadTask& k, int64_t i, TileRing<T>& u, int64_t& next, T* m) const {
    const auto span = y_rows[k.h * H + i];
    for (; next < span.second; ++next) {
      if (next + 1 < H) {  // the x of the next row of u, strided: the prefetchers miss it
        const T* xn = moments(k, next + 1).x;
        for (int64_t j = 0; j < W; ++j) prefetch<T>(xn + j * C, d);
      }
      band_row(bx, k.h, d, moments(k, next), u[next]);
    }
    combine_rows(py + (k.h * H + i) * H, int64_t(1), span, u, m);
  }
};

// Eqs. 4 and 5 without pooling, fused with the products of Eq. 5: y, task by task.
template <typename T>
void tokens_forward_impl(const TokenPassTensors& t, const torch::Tensor& bias, int64_t H,
                         int64_t W, int64_t nh, int64_t parts, torch::Tensor& y) {
  const OwnHeadPass<T> o(t, H, W, nh, parts, false);
  const auto [lam_m, kap_m, lam_v, kap_v] = o.ratios;
  const T* pb = bias.data_ptr<T>();
  T* pout = y.data_ptr<T>();
  const int64_t C = o.C, d = o.d, Wd = W * d;
  at::parallel_for(0, o.tasks(), 1, [&](int64_t begin, int64_t end) {
    TileRing<T> u(o.u_rows, o.tile(), 0);
    T* m = thread_scratch<T>(1, o.tile());
    for (int64_t k = begin; k < end; ++k) {
      const auto task = o.task(k);
      const int64_t b = task.b, c0 = task.c0;
      const T* cen = o.centre + b * C + c0;
      int64_t next = 0;
      for (int64_t i = 0; i < H; ++i) {
        o.m_row(task, i, u, next, m);
        for (int64_t j = 0; j < W; ++j) {
          const int64_t tok = (b * H + i) * W + j;
          const T mu = o.mu[tok], var = o.var[tok];
          const T *xt = o.x + tok * C + c0, *f = m + j * d, *q = f + Wd;
          const T *lm = lam_m + c0, *km = kap_m + c0, *lv = lam_v + c0, *kv = kap_v + c0;
          const T *w = o.w + c0, *bb = pb + c0;
          T* yt = pout + tok * C + c0;
          if (i + 1 < H) {
            prefetch<T>(xt + W * C, d);
            prefetch<T, true>(yt + W * C, d);
          }
#pragma omp simd
          for (int64_t k = 0; k < d; ++k)
            yt[k] = token_output(xt[k], mu, var, f[k] + cen[k],
                                 inter_token_variance<T, true>(f[k], q[k]), lm[k], km[k], lv[k],
                                 kv[k], w[k], bb[k], o.eps);
        }
      }
    }
  });
}

// The backward pass without pooling, fused with the products of Eq. 5. Per task, row i:
// m_i, then the terms of own_cell_grad (D1 into dx, dL/dm_i into a ring), the gradient of P_y
// (dL/dm_i . u_j), and, in order, every row k <= i of dL/du = P_y^T dL/dm whose sources are all
// formed (OwnHeadPass::complete): its share of the gradient of P_x, and dx_k += dT_0 + 2 (x -
// centre) dT_1 with dT = P_x^T dL/du. Then, per token, dx += x beta + alpha with beta and alpha
// from Eq. 2 (see _dtn_backward). Writes the gradients of P_y (per task, (tasks, H, H)) and of P_x
// ((tasks, W, W)) into g_y and g_x, within the nonzero spans (zeros elsewhere), the per-image sums
// (B, 6, C) as backward_tokens_impl, and the per-task token sums into tok.
template <typename T>
void tokens_backward_impl(const TokenPassTensors& t, const torch::Tensor& grad, double n_var,
                          int64_t H, int64_t W, int64_t nh, int64_t parts, torch::Tensor& dx,
                          torch::Tensor& g_y, torch::Tensor& g_x, torch::Tensor& sums,
                          torch::Tensor& tok) {
  const OwnHeadPass<T> o(t, H, W, nh, parts, true);
  const auto [lam_m, kap_m, lam_v, kap_v] = o.ratios;
  const T* pg = grad.data_ptr<T>();
  T* pdx = dx.data_ptr<T>();
  T *pgy = g_y.data_ptr<T>(), *pgx = g_x.data_ptr<T>(), *psums = sums.data_ptr<T>();
  T* ptok = tok.data_ptr<T>();  // (2, tasks, N): per task D1 . lam_m and D2 . lam_v
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  const int64_t C = o.C, d = o.d, Wd = W * d, N = H * W, n = o.tile();
  const int64_t stride = (o.bx.width + 4) / 5 * 5 + 5;  // accumulators per row of P_x
  const int64_t tasks = o.tasks(), per_image = tasks / o.B;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    TileRing<T> u(o.u_rows, n, 0), dm(o.dm_rows, n, 1);
    T *m = thread_scratch<T>(2, n), *du = thread_scratch<T>(3, n), *dT = thread_scratch<T>(4, n);
    std::vector<T> s(6 * d);
    const int64_t acc_size = o.bx.blocks * kRows * stride * V;
    T* acc = thread_scratch<T>(5, acc_size);
    for (int64_t k = begin; k < end; ++k) {
      const auto task = o.task(k);
      const int64_t b = task.b, h = task.h, c0 = task.c0;
      const T* cen = o.centre + b * C + c0;
      const T *lm = lam_m + c0, *km = kap_m + c0, *lv = lam_v + c0, *kv = kap_v + c0;
      const T* w = o.w + c0;
      const T* py = o.py + h * H * H;
      T* gy = pgy + k * H * H;
      T *tok1 = ptok + k * N, *tok2 = tok1 + tasks * N;
      std::fill(s.begin(), s.end(), T(0));
      std::fill(acc, acc + acc_size, T(0));
      int64_t next_u = 0, next_k = 0;
      // row r of dL/du: its share of the gradient of P_x, and P_x^T dL/du into dx
      auto du_row = [&](int64_t r) {
        combine_rows(py + r, H, o.y_cols[h * H + r], dm, du);
        const auto in = o.moments(task, r);
        band_outer_row(o.bx, h, d, du, in, acc, stride);
        band_row(o.bxt, h, d, TileRow<T>{du, Wd, d}, dT);
        for (int64_t j = 0; j < W; ++j) {
          const T* xt = in.x + j * C;
          T* dxt = pdx + ((b * H + r) * W + j) * C + c0;
          const T *t0 = dT + j * d, *t1 = t0 + Wd;
          if (r + 1 < H) {
            prefetch<T>(xt + W * C, d);
            prefetch<T, true>(dxt + W * C, d);
          }
#pragma omp simd
          for (int64_t e = 0; e < d; ++e) dxt[e] += t0[e] + T(2) * (xt[e] - cen[e]) * t1[e];
        }
      };
      for (int64_t i = 0; i < H; ++i) {
        o.m_row(task, i, u, next_u, m);
        T* dmi = dm[i];
        for (int64_t j = 0; j < W; ++j) {
          const int64_t tk = (b * H + i) * W + j;
          const T *xt = o.x + tk * C + c0, *gt = pg + tk * C + c0;
          const T *f = m + j * d, *q = f + Wd;
          T *dxt = pdx + tk * C + c0, *of = dmi + j * d, *oq = of + Wd;
          if (i + 1 < H) {
            prefetch<T>(xt + W * C, d);
            prefetch<T>(gt + W * C, d);
            prefetch<T, true>(dxt + W * C, d);
          }
          const auto [sum1, sum2] = own_cell_head(d, xt, gt, w, o.mu[tk], o.var[tk], lm, km, lv,
                                                  kv, cen, f, q, o.eps, dxt, of, oq, s.data(), d);
          tok1[i * W + j] = sum1;
          tok2[i * W + j] = sum2;
        }
        // the gradient of P_y: dL/dP_y[i, j] = dL/dm_i . u_j
        const auto span = o.y_rows[h * H + i];
        row_dots(dmi, span, u, gy + i * H + span.first);
        for (; next_k <= i && o.complete(h, next_k, i); ++next_k) du_row(next_k);
      }
      for (; next_k < H; ++next_k) du_row(next_k);
      // the gradient of P_x from the lane-wise accumulators, within the rows' spans
      T* gx = pgx + k * W * W;
      for (int64_t a = 0; a < W; ++a) {
        const auto [j0, j1] = o.bx.row[h * W + a];
        const int64_t b0 = o.bx.block[h * o.bx.blocks + a / kRows].first;
        for (int64_t j = j0; j < j1; ++j) {
          Vec<T> lanes;
          load<T>(lanes, acc + (a * stride + j - b0) * V);
          gx[a * W + j] = lane_sum<T>(lanes);
        }
      }
      for (int64_t r = 0; r < 6; ++r)
        std::copy(s.begin() + r * d, s.begin() + (r + 1) * d, psums + (b * 6 + r) * C + c0);
    }
  });
  // dx += x beta + alpha, beta = -2 dL/dvar_ln / n_var, alpha = dL/dmu_ln / C - beta mu_ln
  at::parallel_for(0, o.B * N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t tk = begin; tk < end; ++tk) {
      const int64_t b = tk / N, r = tk % N;
      T a1 = 0, a2 = 0;
      for (int64_t k = b * per_image; k < (b + 1) * per_image; ++k) {
        a1 += ptok[k * N + r];
        a2 += ptok[(tasks + k) * N + r];
      }
      const T beta = -a2 / T(n_var), alpha = -a1 / T(C) - beta * o.mu[tk];
      const T* xt = o.x + tk * C;
      T* dxt = pdx + tk * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dxt[c] += xt[c] * beta + alpha;
    }
  });
}
