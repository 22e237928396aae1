// The per-token passes of DynamicTokenNorm on CPUs (Shao et al., ICLR 2022, Eqs. 2, 4 and 5):
// the statistics of Eq. 2 with the cell moments, the output, and the two backward passes over the
// tokens. Each element costs one pass over memory instead of about ten eager element-wise kernels.
#include "common.h"
#include "isa.h"
#include "kernels.h"
#include "token_math.h"

namespace mmdtn::cpu::MMDTN_ISA {

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
void statistics_impl(const Tensor& x, double n_var, const Grid& g, Tensor& mean_ln,
                     Tensor& var_ln, Tensor& cells) {
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
void second_moment_impl(const Tensor& x, const Tensor& centre, const Grid& g,
                        Tensor& second) {
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

template <typename T, bool RAW>
void forward_impl(const Tensor& x, const Tensor& mean_ln,
                  const Tensor& var_ln, const Tensor& first,
                  const Tensor& second, const Tensor& centre,
                  const Tensor& ratios, const Tensor& weight,
                  const Tensor& bias, double eps, const Grid& g, Tensor& y) {
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

// The operands of the backward passes over the tokens (TokenGradientOperands), as raw pointers.
template <typename T>
struct BackwardPointers {
  const T *g, *x, *mu, *var, *centre, *w;
  std::array<const T*, 4> ratios;
  T *dx, *tok1, *tok2, *sums;
  CellView<T> f, q, dmf, dmq;
  T eps;
  explicit BackwardPointers(const TokenGradientOperands& t)
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
void backward_impl(const TokenGradientOperands& t, const Grid& g) {
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

// backward_impl without pooling, in one pass: every token is a cell of its own, so its dL/dm is
// written as soon as its gradient terms are known, without per-cell sums. Units are token rows,
// taken head by head: the head-major dL/dm and m of a head's row are contiguous, which keeps the
// number of memory streams small however many heads there are.
template <typename T>
void backward_tokens_impl(const TokenGradientOperands& t, const Grid& g) {
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
// and dT the gradients of the positional products' inputs (cell views; dT_1 may be absent). beta
// and alpha, the gradient of Eq. 2 (function.ln_gradient): beta = -tok2 / n_var and
// alpha = -tok1 / C - beta mu_ln.
template <typename T, bool SECOND>
void input_grad_impl(const InputGradientOperands& o, const Tensor& d_second, const Grid& g) {
  const T* px = o.x.data_ptr<T>();
  const T* ptok1 = o.tok1.data_ptr<T>();
  const T* ptok2 = o.tok2.data_ptr<T>();
  const T* pmu = o.mean_ln.data_ptr<T>();
  const T to_beta = static_cast<T>(-1.0 / o.n_var), to_alpha = static_cast<T>(-1.0 / g.C);
  const T* pcen = o.centre.data_ptr<T>();
  T* pdx = o.dx.data_ptr<T>();
  const CellView<T> d0(o.d_first), d1(d_second);
  at::parallel_for(0, g.units(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / g.Hp, ci = u % g.Hp;
      for (int64_t i = g.first_row(u); i < g.end_row(u); ++i) {
        for (int64_t j = 0; j < g.W; ++j) {
          const int64_t t = (b * g.H + i) * g.W + j, cj = j / g.s;
          const T inv_n = T(1) / T(g.cell_tokens(u, cj));
          const T beta_t = ptok2[t] * to_beta, alpha_t = ptok1[t] * to_alpha - beta_t * pmu[t];
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

namespace {

void statistics(const StatisticsOperands& o, const Grid& g) {
  AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "dtn_statistics", [&] {
    statistics_impl<scalar_t>(o.x, o.n_var, g, o.mean_ln, o.var_ln, o.cells);
  });
}

void second_moment(const SecondMomentOperands& o, const Grid& g) {
  AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "dtn_second_moment", [&] {
    second_moment_impl<scalar_t>(o.x, o.centre, g, o.second);
  });
}

void output(const OutputOperands& o, const Grid& g) {
  AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "dtn_output", [&] {
    if (g.s == 1)  // ``second``: the raw second moment P^h T_1
      forward_impl<scalar_t, true>(o.x, o.mean_ln, o.var_ln, o.first, o.second, o.centre,
                                   o.ratios, o.weight, o.bias, o.eps, g, o.y);
    else  // ``second``: the inter-token variance
      forward_impl<scalar_t, false>(o.x, o.mean_ln, o.var_ln, o.first, o.second, o.centre,
                                    o.ratios, o.weight, o.bias, o.eps, g, o.y);
  });
}

void token_gradients(const TokenGradientOperands& o, const Grid& g) {
  AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "dtn_token_gradients", [&] {
    if (g.s == 1)
      backward_tokens_impl<scalar_t>(o, g);
    else
      backward_impl<scalar_t>(o, g);
  });
}

void input_gradient(const InputGradientOperands& o, const Grid& g) {
  AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "dtn_input_gradient", [&] {
    if (o.d_second)
      input_grad_impl<scalar_t, true>(o, *o.d_second, g);
    else
      input_grad_impl<scalar_t, false>(o, o.d_first, g);
  });
}

}  // namespace

const TokenPassKernels token_passes = {statistics, second_moment, output, token_gradients,
                                       input_gradient};

}  // namespace mmdtn::cpu::MMDTN_ISA
