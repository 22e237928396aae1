// Fused CPU kernels for the full-resolution passes of Dynamic Token Normalization (Shao et al.,
// ICLR 2022, Eqs. 4 and 5); see dynamic_token_norm.py, which calls them and keeps a pure-PyTorch
// implementation of the same passes for other devices and as their reference.
//
// Tokens x are (B, H * W, C), row-major on the H x W grid. Token (b, i, j) takes the statistics of
// cell (b, i / s, j / s) of the pooled grid (Hp, Wp) = (ceil(H / s), ceil(W / s)). Cell tensors are
// strided views (B, Hp, Wp, nh, d) whose last dimension is contiguous (head-major or column-major
// results of the positional products). Work is split over (image, cell row) units, so that every
// cell is written by one thread; each element costs one pass over memory instead of about ten
// eager element-wise kernels.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace {

// Read access to one cell tensor (B, Hp, Wp, nh, d) with a contiguous last dimension.
template <typename T>
struct CellView {
  T* data;
  int64_t sb, si, sj, sh;
  explicit CellView(const torch::Tensor& t)
      : data(t.data_ptr<T>()), sb(t.stride(0)), si(t.stride(1)), sj(t.stride(2)),
        sh(t.stride(3)) {}
  T* head(int64_t b, int64_t i, int64_t j, int64_t h) const {
    return data + b * sb + i * si + j * sj + h * sh;
  }
};

struct Grid {
  int64_t B, H, W, C, nh, d, s, Hp, Wp;
  Grid(const torch::Tensor& x, int64_t H_, int64_t W_, int64_t s_, int64_t nh_)
      : B(x.size(0)), H(H_), W(W_), C(x.size(2)), nh(nh_), d(x.size(2) / nh_), s(s_),
        Hp((H_ + s_ - 1) / s_), Wp((W_ + s_ - 1) / s_) {}
  int64_t units() const { return B * Hp; }
  // token rows [i0, i1) of unit u = b * Hp + ci
  int64_t first_row(int64_t u) const { return (u % Hp) * s; }
  int64_t end_row(int64_t u) const { return std::min(H, first_row(u) + s); }
  // token columns [cj * s, end_col(cj)) of cell column cj
  int64_t end_col(int64_t cj) const { return std::min(W, (cj + 1) * s); }
  // real tokens of cell (unit u, column cj)
  int64_t cell_tokens(int64_t u, int64_t cj) const {
    return (end_row(u) - first_row(u)) * (end_col(cj) - cj * s);
  }
};

// The tensors of the backward passes over the tokens (backward_impl, backward_tokens_impl).
struct BackwardTensors {
  const torch::Tensor &g_y, &x, &mean_ln, &var_ln, &first, &second, &centre, &ratios, &weight;
  double eps;
  torch::Tensor &dx, &tok1, &tok2, &sums;
  const torch::Tensor &dm_first, &dm_second;
};

// The operands of the fused passes without pooling (tokens_forward_impl, tokens_backward_impl).
struct TokenPassTensors {
  const torch::Tensor &x, &mean_ln, &var_ln, &centre, &p_y, &p_x, &ratios, &weight;
  double eps;
};

void check_cell_view(const torch::Tensor& t, const Grid& g, const char* name) {
  TORCH_CHECK(t.dim() == 5 && t.size(0) == g.B && t.size(1) == g.Hp && t.size(2) == g.Wp &&
                  t.size(3) == g.nh && t.size(4) == g.d && t.stride(4) == 1,
              name, ": expected a (B, Hp, Wp, nh, d) view with a contiguous last dimension");
}

void check_centre(const torch::Tensor& centre, const Grid& g) {
  TORCH_CHECK(centre.is_contiguous() && centre.numel() == g.B * g.C,
              "centre: expected a contiguous (B, 1, 1, C) tensor");
}

void check_inputs(const torch::Tensor& x, const Grid& g) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() == 3,
              "x: expected a contiguous CPU tensor (B, N, C)");
  TORCH_CHECK(x.size(1) == g.H * g.W && g.C % g.nh == 0 && g.s >= 1, "inconsistent grid");
}

}  // namespace

// The kernels, compiled for the baseline instruction set and, on x86-64 with GCC or Clang, also
// for AVX-512, chosen at run time (the backward pass keeps many values live, and AVX-512's 32
// vector registers halve its time). ATEN_CPU_CAPABILITY=default or avx2, PyTorch's own switch,
// also keeps these kernels off AVX-512.
namespace baseline {
#include "dynamic_token_norm_cpu_kernels.h"
}  // namespace baseline

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MMDTN_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512cd,avx512bw,avx512dq,avx512vl,avx2,fma")
namespace avx512 {
#include "dynamic_token_norm_cpu_kernels.h"
}  // namespace avx512
#pragma GCC pop_options
#endif

namespace {

bool use_avx512() {
#ifdef MMDTN_AVX512
  static const bool enabled = [] {
    const char* capability = std::getenv("ATEN_CPU_CAPABILITY");
    if (capability && (std::string(capability) == "default" || std::string(capability) == "avx2"))
      return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return enabled;
#else
  return false;
#endif
}

// KERNEL(f<T>(args)) calls the AVX-512 or the baseline f
#ifdef MMDTN_AVX512
#define KERNEL(...) (use_avx512() ? avx512::__VA_ARGS__ : baseline::__VA_ARGS__)
#else
#define KERNEL(...) baseline::__VA_ARGS__
#endif

std::vector<torch::Tensor> statistics(const torch::Tensor& x, double n_var, int64_t H, int64_t W,
                                      int64_t s) {
  const Grid g(x, H, W, s, 1);
  check_inputs(x, g);
  auto mean_ln = x.new_empty({g.B, H * W, 1});
  auto var_ln = x.new_empty({g.B, H * W, 1});
  auto cells = s > 1 ? x.new_empty({g.B, g.Hp, g.Wp, g.C}) : x.new_empty({g.B, g.Hp, g.C});
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtn_statistics", [&] {
    KERNEL(statistics_impl<scalar_t>(x, n_var, g, mean_ln, var_ln, cells));
  });
  return {mean_ln, var_ln, cells};
}

torch::Tensor second_moment(const torch::Tensor& x, const torch::Tensor& centre, int64_t H,
                            int64_t W, int64_t s) {
  const Grid g(x, H, W, s, 1);
  check_inputs(x, g);
  TORCH_CHECK(s > 1, "second_moment: expected pooling");
  check_centre(centre, g);
  auto second = x.new_empty({g.B, g.Hp, g.Wp, g.C});
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtn_second_moment", [&] {
    KERNEL(second_moment_impl<scalar_t>(x, centre, g, second));
  });
  return second;
}

torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mean_ln,
                      const torch::Tensor& var_ln, const torch::Tensor& first,
                      const torch::Tensor& second, const torch::Tensor& centre,
                      const torch::Tensor& ratios, const torch::Tensor& weight,
                      const torch::Tensor& bias, double eps, int64_t H, int64_t W, int64_t s,
                      int64_t num_heads) {
  const Grid g(x, H, W, s, num_heads);
  check_inputs(x, g);
  check_cell_view(first, g, "first");
  check_cell_view(second, g, "second");
  auto y = torch::empty_like(x);
  // ``second``: without pooling the raw second moment P^h T_1, with pooling the variance
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtn_forward", [&] {
    if (s == 1)
      KERNEL(forward_impl<scalar_t, true>(x, mean_ln, var_ln, first, second, centre, ratios,
                                          weight, bias, eps, g, y));
    else
      KERNEL(forward_impl<scalar_t, false>(x, mean_ln, var_ln, first, second, centre, ratios,
                                           weight, bias, eps, g, y));
  });
  return y;
}

std::vector<torch::Tensor> backward(const torch::Tensor& g_y, const torch::Tensor& x,
                                    const torch::Tensor& mean_ln, const torch::Tensor& var_ln,
                                    const torch::Tensor& first, const torch::Tensor& second,
                                    const torch::Tensor& centre,
                                    const torch::Tensor& ratios, const torch::Tensor& weight,
                                    double eps, int64_t H, int64_t W, int64_t s,
                                    int64_t num_heads, const torch::Tensor& dm_first,
                                    const torch::Tensor& dm_second) {
  const Grid g(x, H, W, s, num_heads);
  check_inputs(x, g);
  TORCH_CHECK(g_y.sizes() == x.sizes() && g_y.is_contiguous(), "grad: expected x's shape");
  for (auto* t : {&first, &second, &dm_first, &dm_second}) check_cell_view(*t, g, "cell tensor");
  auto dx = torch::empty_like(x);
  auto tok1 = x.new_empty({g.B, H * W, 1});
  auto tok2 = x.new_empty({g.B, H * W, 1});
  auto sums = x.new_empty({g.units(), 6, g.C});
  const BackwardTensors t{g_y, x, mean_ln, var_ln, first, second, centre, ratios, weight, eps,
                          dx, tok1, tok2, sums, dm_first, dm_second};
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtn_backward", [&] {  // ``second`` as in forward
    if (s == 1)
      KERNEL(backward_tokens_impl<scalar_t>(t, g));
    else
      KERNEL(backward_impl<scalar_t>(t, g));
  });
  return {dx, tok1, tok2, sums.sum(0)};
}

void input_grad(torch::Tensor& dx, const torch::Tensor& x, const torch::Tensor& beta,
                const torch::Tensor& alpha, const torch::Tensor& d_first,
                const c10::optional<torch::Tensor>& d_second, const torch::Tensor& centre,
                int64_t H, int64_t W, int64_t s, int64_t num_heads) {
  const Grid g(x, H, W, s, num_heads);
  check_inputs(x, g);
  TORCH_CHECK(dx.sizes() == x.sizes() && dx.is_contiguous(), "dx: expected x's shape");
  check_cell_view(d_first, g, "d_first");
  if (d_second) check_cell_view(*d_second, g, "d_second");
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtn_input_grad", [&] {
    if (d_second)
      KERNEL(input_grad_impl<scalar_t, true>(dx, x, beta, alpha, d_first, *d_second, centre, g));
    else
      KERNEL(input_grad_impl<scalar_t, false>(dx, x, beta, alpha, d_first, d_first, centre, g));
  });
}

void check_band_operands(const torch::Tensor& p, const torch::Tensor& x, int64_t group) {
  TORCH_CHECK(p.device().is_cpu() && p.is_contiguous() && p.dim() == 3 && p.size(1) == p.size(2),
              "P: expected contiguous CPU matrices (nP, L, L)");
  TORCH_CHECK(x.is_contiguous() && x.dim() == 3 && x.size(1) == p.size(1) &&
                  x.scalar_type() == p.scalar_type() && group >= 1 &&
                  x.size(0) == p.size(0) * group,
              "X: expected a contiguous (nP * group, L, N) tensor of P's dtype");
}

void band_matmul(const torch::Tensor& p, const torch::Tensor& x, torch::Tensor& out,
                 int64_t group, bool transpose) {
  check_band_operands(p, x, group);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() &&
                  out.scalar_type() == x.scalar_type(),
              "out: expected a contiguous tensor of X's shape and dtype");
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtn_band_matmul", [&] {
    KERNEL(band_matmul_impl<scalar_t>(p.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                                      out.data_ptr<scalar_t>(), x.size(0), group, x.size(1),
                                      x.size(2), transpose));
  });
}

torch::Tensor band_outer(const torch::Tensor& p, const torch::Tensor& a, const torch::Tensor& x,
                         int64_t group) {
  check_band_operands(p, x, group);
  TORCH_CHECK(a.is_contiguous() && a.sizes() == x.sizes() && a.scalar_type() == x.scalar_type(),
              "A: expected a contiguous tensor of X's shape and dtype");
  auto g = x.new_empty({x.size(0), x.size(1), x.size(1)});
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtn_band_outer", [&] {
    KERNEL(band_outer_impl<scalar_t>(p.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(),
                                     x.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), x.size(0),
                                     group, x.size(1), x.size(2)));
  });
  return g;
}

// The operands of the fused passes without pooling (see OwnHeadPass).
void check_token_pass(const TokenPassTensors& t, const Grid& g) {
  check_inputs(t.x, g);
  check_centre(t.centre, g);
  for (const auto* p : {&t.p_y, &t.p_x}) {
    const int64_t L = p == &t.p_y ? g.H : g.W;
    TORCH_CHECK(p->is_contiguous() && p->dim() == 3 && p->size(0) == g.nh && p->size(1) == L &&
                    p->size(2) == L && p->scalar_type() == t.x.scalar_type(),
                "P_y, P_x: expected contiguous (nh, H, H) and (nh, W, W) matrices of x's dtype");
  }
  TORCH_CHECK(g.d % (64 / t.x.element_size()) == 0,
              "the channels per head must be a multiple of the vector width");
}

// Groups of channels per head in the tasks of the fused passes: the fewest (whole vectors each)
// that give a multiple of the thread count or at least four tasks per thread.
int64_t channel_groups(const torch::Tensor& x, const Grid& g) {
  const int64_t threads = at::get_num_threads(), vectors = g.d / (64 / x.element_size());
  int64_t parts = 1;
  for (int64_t p = 1; p <= vectors; ++p) {
    if (vectors % p) continue;
    parts = p;
    const int64_t tasks = g.B * g.nh * p;
    if (tasks % threads == 0 || tasks >= 4 * threads) break;
  }
  return parts;
}

// Eqs. 4 and 5 without pooling, the positional products included.
torch::Tensor tokens_forward(const torch::Tensor& x, const torch::Tensor& mean_ln,
                             const torch::Tensor& var_ln, const torch::Tensor& centre,
                             const torch::Tensor& p_y, const torch::Tensor& p_x,
                             const torch::Tensor& ratios, const torch::Tensor& weight,
                             const torch::Tensor& bias, double eps, int64_t H, int64_t W,
                             int64_t num_heads) {
  const Grid g(x, H, W, 1, num_heads);
  const TokenPassTensors t{x, mean_ln, var_ln, centre, p_y, p_x, ratios, weight, eps};
  check_token_pass(t, g);
  auto y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtn_tokens_forward", [&] {
    KERNEL(tokens_forward_impl<scalar_t>(t, bias, H, W, num_heads, channel_groups(x, g), y));
  });
  return y;
}

// The backward pass without pooling, the positional products included: dx, the gradients of P_y
// and P_x, and the sums (6, C) of backward.
std::vector<torch::Tensor> tokens_backward(const torch::Tensor& grad, const torch::Tensor& x,
                                           const torch::Tensor& mean_ln,
                                           const torch::Tensor& var_ln,
                                           const torch::Tensor& centre, const torch::Tensor& p_y,
                                           const torch::Tensor& p_x, const torch::Tensor& ratios,
                                           const torch::Tensor& weight, double eps, double n_var,
                                           int64_t H, int64_t W, int64_t num_heads) {
  const Grid g(x, H, W, 1, num_heads);
  const TokenPassTensors t{x, mean_ln, var_ln, centre, p_y, p_x, ratios, weight, eps};
  check_token_pass(t, g);
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.is_contiguous(), "grad: expected x's shape");
  const int64_t parts = channel_groups(x, g);
  auto dx = torch::empty_like(x);
  auto g_y = torch::zeros({g.B, g.nh, parts, H, H}, x.options());
  auto g_x = torch::zeros({g.B, g.nh, parts, W, W}, x.options());
  auto sums = x.new_empty({g.B, 6, g.C});
  auto tok = x.new_empty({2, g.B * g.nh * parts, H * W});
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dtn_tokens_backward", [&] {
    KERNEL(tokens_backward_impl<scalar_t>(t, grad, n_var, H, W, num_heads, parts, dx, g_y, g_x,
                                          sums, tok));
  });
  return {dx, g_y.sum({0, 2}), g_x.sum({0, 2}), sums.sum(0)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("statistics", &statistics, "Eq. 2 per token and the cell means of x");
  m.def("second_moment", &second_moment, "cell means of (x - centre)^2");
  m.def("forward", &forward, "DTN output pass (Eqs. 4, 5)");
  m.def("backward", &backward, "DTN backward pass over the tokens");
  m.def("input_grad", &input_grad, "DTN input gradient pass");
  m.def("band_matmul", &band_matmul, "P X (or P^T X) over the nonzero span of every row of P");
  m.def("band_outer", &band_outer, "A X^T where P is nonzero, 0 elsewhere");
  m.def("tokens_forward", &tokens_forward, "DTN output pass without pooling, products fused");
  m.def("tokens_backward", &tokens_backward, "DTN backward pass without pooling, products fused");
}
