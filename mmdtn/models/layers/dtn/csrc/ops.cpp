// The Python entry points of DynamicTokenNorm's CPU kernels (see backends/cpu.py, which calls them
// inside its torch.library custom ops): argument checks, the allocation of the results, and the
// choice between the baseline and the AVX-512 build of the kernels (kernels.h). Every argument is
// named; Python passes them by keyword.
#include "common.h"
#include "kernels.h"

namespace mmdtn::cpu {
namespace {

namespace py = pybind11;

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

// The table of one family for this CPU.
template <typename Table>
const Table& pick(const Table& baseline_table, const Table& avx512_table) {
  return use_avx512() ? avx512_table : baseline_table;
}
#ifdef MMDTN_AVX512
#define KERNELS(family) pick(baseline::family, avx512::family)
#else
#define KERNELS(family) baseline::family
#endif

void check_cell_view(const Tensor& t, const Grid& g, const char* name) {
  TORCH_CHECK(t.dim() == 5 && t.size(0) == g.B && t.size(1) == g.Hp && t.size(2) == g.Wp &&
                  t.size(3) == g.nh && t.size(4) == g.d && t.stride(4) == 1,
              name, ": expected a (B, Hp, Wp, nh, d) view with a contiguous last dimension");
}

void check_centre(const Tensor& centre, const Grid& g) {
  TORCH_CHECK(centre.is_contiguous() && centre.numel() == g.B * g.C,
              "centre: expected a contiguous (B, 1, 1, C) tensor");
}

void check_tokens(const Tensor& x, const Grid& g) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() == 3,
              "x: expected a contiguous CPU tensor (B, N, C)");
  TORCH_CHECK(x.size(1) == g.H * g.W && g.C % g.nh == 0 && g.s >= 1, "inconsistent grid");
}

std::vector<Tensor> statistics(const Tensor& x, double n_var, int64_t H, int64_t W,
                               int64_t pool) {
  const Grid g(x, H, W, pool, 1);
  check_tokens(x, g);
  auto mean_ln = x.new_empty({g.B, H * W, 1});
  auto var_ln = x.new_empty({g.B, H * W, 1});
  auto cells = pool > 1 ? x.new_empty({g.B, g.Hp, g.Wp, g.C}) : x.new_empty({g.B, g.Hp, g.C});
  KERNELS(token_passes).statistics({x, n_var, mean_ln, var_ln, cells}, g);
  return {mean_ln, var_ln, cells};
}

Tensor second_moment(const Tensor& x, const Tensor& centre, int64_t H, int64_t W, int64_t pool) {
  const Grid g(x, H, W, pool, 1);
  check_tokens(x, g);
  TORCH_CHECK(pool > 1, "second_moment: expected pooling");
  check_centre(centre, g);
  auto second = x.new_empty({g.B, g.Hp, g.Wp, g.C});
  KERNELS(token_passes).second_moment({x, centre, second}, g);
  return second;
}

Tensor output(const Tensor& x, const Tensor& mean_ln, const Tensor& var_ln, const Tensor& first,
              const Tensor& second, const Tensor& centre, const Tensor& ratios,
              const Tensor& weight, const Tensor& bias, double eps, int64_t H, int64_t W,
              int64_t pool, int64_t num_heads) {
  const Grid g(x, H, W, pool, num_heads);
  check_tokens(x, g);
  check_cell_view(first, g, "first");
  check_cell_view(second, g, "second");
  auto y = torch::empty_like(x);
  KERNELS(token_passes)
      .output({x, mean_ln, var_ln, first, second, centre, ratios, weight, bias, eps, y}, g);
  return y;
}

std::vector<Tensor> token_gradients(const Tensor& grad, const Tensor& x, const Tensor& mean_ln,
                                    const Tensor& var_ln, const Tensor& first,
                                    const Tensor& second, const Tensor& centre,
                                    const Tensor& ratios, const Tensor& weight, double eps,
                                    const Tensor& dm_first, const Tensor& dm_second, int64_t H,
                                    int64_t W, int64_t pool, int64_t num_heads) {
  const Grid g(x, H, W, pool, num_heads);
  check_tokens(x, g);
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.is_contiguous(), "grad: expected x's shape");
  for (auto* t : {&first, &second, &dm_first, &dm_second}) check_cell_view(*t, g, "cell tensor");
  auto dx = torch::empty_like(x);
  auto tok1 = x.new_empty({g.B, H * W, 1});
  auto tok2 = x.new_empty({g.B, H * W, 1});
  auto sums = x.new_empty({g.units(), 6, g.C});
  KERNELS(token_passes)
      .token_gradients({grad, x, mean_ln, var_ln, first, second, centre, ratios, weight, eps, dx,
                        tok1, tok2, sums, dm_first, dm_second},
                       g);
  return {dx, tok1, tok2, sums.sum(0)};
}

void input_gradient(Tensor& dx, const Tensor& x, const Tensor& tok1, const Tensor& tok2,
                    const Tensor& mean_ln, double n_var, const Tensor& d_first,
                    const c10::optional<Tensor>& d_second, const Tensor& centre, int64_t H,
                    int64_t W, int64_t pool, int64_t num_heads) {
  const Grid g(x, H, W, pool, num_heads);
  check_tokens(x, g);
  TORCH_CHECK(dx.sizes() == x.sizes() && dx.is_contiguous(), "dx: expected x's shape");
  for (const auto* t : {&tok1, &tok2, &mean_ln})
    TORCH_CHECK(t->is_contiguous() && t->numel() == g.B * H * W,
                "tok1, tok2, mean_ln: expected contiguous (B, N, 1) tensors");
  check_cell_view(d_first, g, "d_first");
  if (d_second) check_cell_view(*d_second, g, "d_second");
  KERNELS(token_passes)
      .input_gradient({dx, x, tok1, tok2, mean_ln, n_var, d_first,
                       d_second ? &*d_second : nullptr, centre},
                      g);
}

void check_band(const BandOperands& o) {
  const Tensor &p = o.p, &x = o.x;
  TORCH_CHECK(p.device().is_cpu() && p.is_contiguous() && p.dim() == 3 && p.size(1) == p.size(2),
              "P: expected contiguous CPU matrices (nP, L, L)");
  TORCH_CHECK(x.is_contiguous() && x.dim() == 3 && x.size(1) == p.size(1) &&
                  x.scalar_type() == p.scalar_type() && o.group >= 1 &&
                  x.size(0) == p.size(0) * o.group,
              "X: expected a contiguous (nP * group, L, N) tensor of P's dtype");
}

// The offsets of every index of dims [from, to) of t, in row-major order.
std::vector<int64_t> index_offsets(const Tensor& t, int64_t from, int64_t to) {
  std::vector<int64_t> offsets{0};
  for (int64_t dim = from; dim < to; ++dim) {
    std::vector<int64_t> next;
    next.reserve(offsets.size() * t.size(dim));
    for (const int64_t base : offsets)
      for (int64_t i = 0; i < t.size(dim); ++i) next.push_back(base + i * t.stride(dim));
    offsets = std::move(next);
  }
  return offsets;
}

// P X (or P^T X) into ``out`` if given, else into a new (n, L, N) tensor. ``out``: any strided
// view whose dims [0, lead) index the matrices, dim ``lead`` the rows and the remaining dims the
// columns, the last one contiguous (e.g. a permutation of a new tensor: the product lands in it
// in that layout).
Tensor band_matmul(const Tensor& p, const Tensor& x, int64_t group, bool transpose,
                   const c10::optional<Tensor>& out, int64_t lead) {
  const BandOperands o{p, x, group};
  check_band(o);
  const Tensor y = out ? *out : torch::empty_like(x);
  if (!out) lead = 1;
  const int64_t n = x.size(0), L = x.size(1);
  TORCH_CHECK(lead >= 1 && y.dim() >= lead + 2 && y.scalar_type() == x.scalar_type() &&
                  y.stride(-1) == 1 && y.size(lead) == L &&
                  y.numel() == x.numel() && c10::multiply_integers(y.sizes().slice(0, lead)) == n,
              "out: expected a view of X's dtype and size with (n) matrices in its first ", lead,
              " dims, then the L rows, then the N columns, the last dim contiguous");
  const BandDestination destination{y, index_offsets(y, 0, lead),
                                    index_offsets(y, lead + 1, y.dim() - 1), y.stride(lead),
                                    y.size(-1)};
  KERNELS(band_products).matmul(o, transpose, destination);
  return y;
}

Tensor band_outer(const Tensor& p, const Tensor& a, const Tensor& x, int64_t group) {
  const BandOperands o{p, x, group};
  check_band(o);
  TORCH_CHECK(a.is_contiguous() && a.sizes() == x.sizes() && a.scalar_type() == x.scalar_type(),
              "A: expected a contiguous tensor of X's shape and dtype");
  auto out = x.new_empty({x.size(0), x.size(1), x.size(1)});
  KERNELS(band_products).outer(o, a, out);
  return out;
}

void check_fused(const FusedRowOperands& o, const Grid& g) {
  check_tokens(o.x, g);
  check_centre(o.centre, g);
  for (const auto* p : {&o.p_y, &o.p_x}) {
    const int64_t L = p == &o.p_y ? g.H : g.W;
    TORCH_CHECK(p->is_contiguous() && p->dim() == 3 && p->size(0) == g.nh && p->size(1) == L &&
                    p->size(2) == L && p->scalar_type() == o.x.scalar_type(),
                "P_y, P_x: expected contiguous (nh, H, H) and (nh, W, W) matrices of x's dtype");
  }
  TORCH_CHECK(g.d % (64 / o.x.element_size()) == 0,
              "the channels per head must be a multiple of the vector width");
}

// Groups of channels per head in the tasks of the fused passes: the fewest (whole vectors each)
// that give a multiple of the thread count or at least four tasks per thread.
int64_t channel_groups(const Tensor& x, const Grid& g) {
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

Tensor fused_forward(const Tensor& x, const Tensor& mean_ln, const Tensor& var_ln,
                     const Tensor& centre, const Tensor& p_y, const Tensor& p_x,
                     const Tensor& ratios, const Tensor& weight, const Tensor& bias, double eps,
                     int64_t H, int64_t W, int64_t num_heads) {
  const Grid g(x, H, W, 1, num_heads);
  const FusedRowOperands o{x, mean_ln, var_ln, centre, p_y, p_x, ratios, weight, eps,
                           channel_groups(x, g)};
  check_fused(o, g);
  auto y = torch::empty_like(x);
  KERNELS(fused_rows).forward(o, g, bias, y);
  return y;
}

// dx, the gradients of P_y and P_x, and the sums (6, C) of token_gradients.
std::vector<Tensor> fused_backward(const Tensor& grad, const Tensor& x, const Tensor& mean_ln,
                                   const Tensor& var_ln, const Tensor& centre, const Tensor& p_y,
                                   const Tensor& p_x, const Tensor& ratios, const Tensor& weight,
                                   double eps, double n_var, int64_t H, int64_t W,
                                   int64_t num_heads) {
  const Grid g(x, H, W, 1, num_heads);
  const int64_t parts = channel_groups(x, g);
  const FusedRowOperands o{x, mean_ln, var_ln, centre, p_y, p_x, ratios, weight, eps, parts};
  check_fused(o, g);
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.is_contiguous(), "grad: expected x's shape");
  auto dx = torch::empty_like(x);
  auto g_y = x.new_empty({g.B, g.nh, parts, H, H});  // every task writes its own in full
  auto g_x = x.new_empty({g.B, g.nh, parts, W, W});
  auto sums = x.new_empty({g.B, 6, g.C});
  auto tok = x.new_empty({2, g.B * g.nh * parts, H * W});
  KERNELS(fused_rows).backward(o, g, grad, n_var, dx, g_y, g_x, sums, tok);
  if (g.B * parts == 1)  // one task per head: nothing to add up
    return {dx, g_y.view({g.nh, H, H}), g_x.view({g.nh, W, W}), sums.view({6, g.C})};
  return {dx, g_y.sum({0, 2}), g_x.sum({0, 2}), sums.sum(0)};
}

}  // namespace
}  // namespace mmdtn::cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace mmdtn::cpu;
  using py::arg;
  m.def("statistics", &statistics, "Eq. 2 per token and the cell means of x (sums per token row "
        "without pooling)", arg("x"), arg("n_var"), arg("H"), arg("W"), arg("pool"));
  m.def("second_moment", &second_moment, "the cell means of (x - centre)^2", arg("x"),
        arg("centre"), arg("H"), arg("W"), arg("pool"));
  m.def("output", &output, "Eqs. 4 and 5 with the cell statistics", arg("x"), arg("mean_ln"),
        arg("var_ln"), arg("first"), arg("second"), arg("centre"), arg("ratios"), arg("weight"),
        arg("bias"), arg("eps"), arg("H"), arg("W"), arg("pool"), arg("num_heads"));
  m.def("token_gradients", &token_gradients, "the first backward pass over the tokens",
        arg("grad"), arg("x"), arg("mean_ln"), arg("var_ln"), arg("first"), arg("second"),
        arg("centre"), arg("ratios"), arg("weight"), arg("eps"), arg("dm_first"),
        arg("dm_second"), arg("H"), arg("W"), arg("pool"), arg("num_heads"));
  m.def("input_gradient", &input_gradient, "the second backward pass over the tokens, into dx",
        arg("dx"), arg("x"), arg("tok1"), arg("tok2"), arg("mean_ln"), arg("n_var"),
        arg("d_first"), arg("d_second"), arg("centre"), arg("H"), arg("W"), arg("pool"),
        arg("num_heads"));
  m.def("band_matmul", &band_matmul, "P X (or P^T X) over the nonzero span of every row of P",
        arg("p"), arg("x"), arg("group"), arg("transpose"), arg("out") = py::none(),
        arg("lead") = 1);
  m.def("band_outer", &band_outer, "A X^T where P is nonzero, 0 elsewhere", arg("p"), arg("a"),
        arg("x"), arg("group"));
  m.def("fused_forward", &fused_forward, "Eqs. 4 and 5 without pooling, products fused",
        arg("x"), arg("mean_ln"), arg("var_ln"), arg("centre"), arg("p_y"), arg("p_x"),
        arg("ratios"), arg("weight"), arg("bias"), arg("eps"), arg("H"), arg("W"),
        arg("num_heads"));
  m.def("fused_backward", &fused_backward, "the backward pass without pooling, products fused",
        arg("grad"), arg("x"), arg("mean_ln"), arg("var_ln"), arg("centre"), arg("p_y"),
        arg("p_x"), arg("ratios"), arg("weight"), arg("eps"), arg("n_var"), arg("H"), arg("W"),
        arg("num_heads"));
}
