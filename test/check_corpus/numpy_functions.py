"""NumPy-backed Functions in the manner of PyTorch's extending guides:
forward leaves torch for NumPy, backward is written so that it is
differentiable (through the Function's own outputs), and a custom ``vmap``
staticmethod makes the NumPy code work under ``torch.func.vmap``."""
import numpy as np
import torch

from ._case import Case, sample


def to_numpy(t):
    return t.detach().cpu().numpy()


class NumpyTanh(torch.autograd.Function):
    """Returns tanh(x) and its derivative; backward uses only the Function's
    outputs (differentiable), so double backward works through this Function."""

    @staticmethod
    def forward(x):
        y = np.tanh(to_numpy(x))
        return torch.tensor(y, device=x.device), torch.tensor(1 - y * y, device=x.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        y, dy = output
        ctx.save_for_backward(y, dy)

    @staticmethod
    def backward(ctx, grad_y, grad_dy):
        y, dy = ctx.saved_tensors
        return grad_y * dy + grad_dy * (-2 * y * dy)


class NumpySort(torch.autograd.Function):
    """Sorted values, the permutation and its inverse (integer outputs,
    marked); a vmap staticmethod moves the batch dimension in front."""

    @staticmethod
    def forward(x, dim):
        ind = np.argsort(to_numpy(x), axis=dim)
        ind_inv = np.argsort(ind, axis=dim)
        result = np.take_along_axis(to_numpy(x), ind, axis=dim)
        return (torch.tensor(result, device=x.device), torch.tensor(ind, device=x.device),
                torch.tensor(ind_inv, device=x.device))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, dim = inputs
        _, ind, ind_inv = output
        ctx.mark_non_differentiable(ind, ind_inv)
        ctx.save_for_backward(ind, ind_inv)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, grad_output, _grad_ind, _grad_ind_inv):
        ind, ind_inv = ctx.saved_tensors
        return torch.gather(grad_output, ctx.dim, ind_inv), None

    @staticmethod
    def vmap(info, in_dims, x, dim):
        x_bdim, _ = in_dims
        x = x.movedim(x_bdim, 0)
        dim = dim if dim >= 0 else dim + x.dim() - 1
        return NumpySort.apply(x, dim + 1), (0, 0, 0)


class NumpySortVmapForgetsBatchDim(NumpySort):
    """Moves the batch dimension in front but does not shift ``dim`` past
    it: sorts along the wrong axis."""

    @staticmethod
    def vmap(info, in_dims, x, dim):
        x_bdim, _ = in_dims
        return NumpySortVmapForgetsBatchDim.apply(x.movedim(x_bdim, 0), dim), (0, 0, 0)


CASES = [
    Case("numpy_tanh_setup_context", "NumPy-backed (extending guide)", NumpyTanh,
         lambda: (sample(2, 3),), "correct, and twice differentiable through its outputs"),
    Case("numpy_sort_with_vmap_rule", "NumPy-backed with a vmap staticmethod", NumpySort,
         lambda: (sample(2, 4), 1), "correct, batched and per sample"),
    Case("numpy_sort_vmap_forgets_batch_dim", "NumPy-backed with a vmap staticmethod",
         NumpySortVmapForgetsBatchDim, lambda: (sample(2, 4), 1),
         "broken vmap rule: sorts along the wrong axis", failing={"vmap.matches_loop"}),
]
