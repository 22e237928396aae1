"""The positional products of DynamicTokenNorm (Eq. 5) as float32 batched matrix products.

P^h = P_y^h (kron) P_x^h (:mod:`...positional`), so m = P^h T is two matrix products per head,
u = T P_x^T along the cell columns and m = P_y u along the cell rows, and backward four more:
dP_y = dm u^T, du = P_y^T dm, dP_x = du^T T, dT = du P_x. They are ``torch.bmm`` calls (cuBLAS on
CUDA), batched over the heads, on planes laid out so that every one of them reads and writes its
operands in place, with no copies between them: a plane is (heads, Hp, 2, B, d, Wp) float32, the
cell columns innermost and the cell rows outermost within a head, so that a head's plane is both
a (Hp 2 B d, Wp) matrix for P_x and a (Hp, 2 B d Wp) matrix for P_y. The passes over the tokens
(:mod:`.kernels`) read and write the planes through their strides.

The products always run in full float32 (:func:`full_float32`): with TF32 inputs the second
moment P T_1 - (P T_0)^2 loses most of its digits where a channel's mean varies over the image.

With pooling the planes are small (the cell grid) and the forward pass keeps T, u and m for
backward. Without pooling each plane is 16 bytes per channel and token, eight times 16-bit tokens:
backward forms T, u and m again (three launches, T from x) rather than keep them, so that a layer
adds no more memory to a model than LayerNorm between its forward and backward passes.
"""
import contextlib

import torch

__all__ = ['full_float32', 'plane_strides', 'forward_products', 'backward_products']


@contextlib.contextmanager
def full_float32():
    """float32 matrix products in full precision inside, whatever the setting
    (``torch.set_float32_matmul_precision``, ``torch.backends.cuda.matmul.allow_tf32`` or the
    per-backend ``fp32_precision``), which is restored afterwards through the API it was made
    with: PyTorch refuses to read settings made through the other."""
    cuda, cpu = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    try:
        saved = torch.get_float32_matmul_precision()
    except RuntimeError:  # the per-backend settings are in use
        saved = None
    if saved == 'highest':
        yield
    elif saved is None:
        before = cuda.fp32_precision, cpu.fp32_precision
        cuda.fp32_precision = cpu.fp32_precision = 'ieee'
        try:
            yield
        finally:
            cuda.fp32_precision, cpu.fp32_precision = before
    elif saved == 'high' and cpu.fp32_precision == 'none':  # allow_tf32 = True, CUDA alone
        cuda.allow_tf32 = False
        try:
            yield
        finally:
            cuda.allow_tf32 = True
    else:
        torch.set_float32_matmul_precision('highest')
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(saved)


def plane_strides(B, Hp, Wp, heads, d):
    """The strides of a plane (heads, Hp, 2, B, d, Wp) as the kernels take them: (image, cell
    row, cell column, head, channel within the head, moment)."""
    s_chan = Wp
    s_b = d * s_chan
    s_moment = B * s_b
    s_row = 2 * s_moment
    return s_b, s_row, 1, Hp * s_row, s_chan, s_moment


def forward_products(T, u, m, p_y, p_x, plan):
    """u = T P_x^T and m = P_y u (Eq. 5) into the planes ``u`` and ``m``."""
    heads, rows, columns = plan.heads, plan.Hp, plan.Wp
    with full_float32():
        torch.bmm(T.view(heads, -1, columns), p_x.transpose(1, 2), out=u.view(heads, -1, columns))
        torch.bmm(p_y, u.view(heads, rows, -1), out=m.view(heads, rows, -1))


def backward_products(dm, T, u, p_y, p_x, du, dT, plan):
    """From dL/dm and the forward planes T and u: the gradients of P_y and P_x (heads, L, L), and
    dL/du, dL/dT into the planes ``du`` and ``dT`` (which may be u's and T's own: each is
    written after its last read)."""
    heads, rows, columns = plan.heads, plan.Hp, plan.Wp
    by_rows, by_columns = (heads, rows, -1), (heads, -1, columns)
    with full_float32():
        grad_p_y = torch.bmm(dm.view(by_rows), u.view(by_rows).transpose(1, 2))
        torch.bmm(p_y.transpose(1, 2), dm.view(by_rows), out=du.view(by_rows))
        grad_p_x = torch.bmm(du.view(by_columns).transpose(1, 2), T.view(by_columns))
        torch.bmm(du.view(by_columns), p_x, out=dT.view(by_columns))
    return grad_p_y, grad_p_x
