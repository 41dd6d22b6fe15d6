"""Functions that trade memory for compute or for a single use: activation
checkpointing with dropout (Megatron style), a fused cross-entropy that
computes its gradient in forward and scales it in place in backward (Liger
style), a kernel wrapper that frees its workspace in backward, boxed
backwards that free each gradient once used, and a frozen batch norm that
scales and shifts its input in place, batched by a vmap staticmethod."""
import torch
from torch.autograd.function import once_differentiable

from ._case import Case, sample


def mlp_with_dropout(x, w1, w2):
    h = torch.nn.functional.dropout(torch.tanh(x @ w1), p=0.3, training=True)
    return h @ w2


class CheckpointFunction(torch.autograd.Function):
    """Runs the block without keeping activations; backward recomputes it,
    restoring the random state so that dropout draws the same mask."""

    @staticmethod
    def forward(ctx, run_function, x, w1, w2):
        ctx.run_function = run_function
        ctx.rng_state = torch.get_rng_state()
        ctx.save_for_backward(x, w1, w2)
        with torch.no_grad():
            return run_function(x, w1, w2)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng_state)
            with torch.enable_grad():
                output = ctx.run_function(*inputs)
        torch.autograd.backward(output, grad_output)
        return (None,) + tuple(t.grad for t in inputs)


class CheckpointForgetsRngState(CheckpointFunction):
    """Recomputes without restoring the random state: another dropout mask."""

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            output = ctx.run_function(*inputs)
        torch.autograd.backward(output, grad_output)
        return (None,) + tuple(t.grad for t in inputs)


class FusedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy; the gradient is computed in forward (no logits
    kept) and scaled in place in backward, so backward can run only once."""

    @staticmethod
    def forward(ctx, logits, target):
        n = logits.shape[0]
        loss = (logits.logsumexp(-1) - logits.gather(-1, target[:, None]).squeeze(-1)).mean()
        grad = torch.softmax(logits, dim=-1)
        grad[torch.arange(n), target] -= 1
        ctx.grad_logits = grad.div_(n)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        grad = ctx.grad_logits
        if not torch.equal(grad_output, torch.ones_like(grad_output)):
            grad.mul_(grad_output)  # in place: no second gradient-sized buffer
        return grad, None


class FreesWorkspace(torch.autograd.Function):
    """A kernel wrapper that keeps its operands on ctx and frees them as soon
    as backward has used them."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.workspace = (x, w)
        return torch.tanh(x @ w)

    @staticmethod
    def backward(ctx, grad_output):
        x, w = ctx.workspace
        del ctx.workspace  # free early: backward runs once
        grad_pre = grad_output * (1 - torch.tanh(x @ w) ** 2)
        return grad_pre @ w.t(), x.t() @ grad_pre


class FreesWorkspaceWrongGradient(FreesWorkspace):
    @staticmethod
    def backward(ctx, grad_output):
        x, w = ctx.workspace
        del ctx.workspace
        grad_pre = grad_output * (1 - torch.tanh(x @ w))  # not squared
        return grad_pre @ w.t(), x.t() @ grad_pre


class SplitHeads(torch.autograd.Function):
    """q, k, v = three slices; boxed backward pops each gradient as it is
    copied into the input's gradient."""

    boxed_grads_call = True

    @staticmethod
    def forward(ctx, qkv):
        q, k, v = qkv.chunk(3, dim=-1)
        return q.clone(), k.clone(), v.clone()

    @staticmethod
    def backward(ctx, grads):
        parts = []
        while grads:
            parts.append(grads.pop(0))
        return torch.cat(parts, dim=-1)


class SplitHeadsKeepsGrads(SplitHeads):
    @staticmethod
    def backward(ctx, grads):
        ctx.seen = list(grads)  # "for debugging": keeps every gradient alive
        result = torch.cat(list(grads), dim=-1)
        grads.clear()
        return result


def _checkpoint_args():
    return (mlp_with_dropout, sample(3, 4), sample(4, 5, seed=1), sample(5, 2, seed=2))


def _cross_entropy_args():
    return (sample(4, 5, scale=2.0), torch.tensor([1, 0, 4, 2]))


class FrozenBatchNormInPlace(torch.autograd.Function):
    """A frozen batch norm folded into a scale and a shift, applied to x in
    place (no second activation in memory); elementwise, so its vmap
    staticmethod applies it to the batched x. Not idempotent: a second run
    on the same tensor scales it twice."""

    @staticmethod
    def forward(x, scale, shift):
        return x.mul_(scale).add_(shift)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, scale, _ = inputs
        ctx.mark_dirty(x)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * ctx.scale, None, None

    @staticmethod
    def vmap(info, in_dims, x, scale, shift):
        return FrozenBatchNormInPlace.apply(x, scale, shift), in_dims[0]


CASES = [
    Case("frozen_batch_norm_in_place_with_vmap_rule", "in place (mark_dirty) with a vmap staticmethod",
         FrozenBatchNormInPlace, lambda: (sample(3, 4), 1.5, -0.25),
         "correct: marked dirty, batched and per sample (each run must get its own copy "
         "of the input it changes)"),
    Case("checkpoint_restores_rng", "activation checkpointing", CheckpointFunction,
         _checkpoint_args, "correct: the recomputation draws the same dropout mask"),
    Case("checkpoint_forgets_rng", "activation checkpointing", CheckpointForgetsRngState,
         _checkpoint_args,
         "broken: the recomputation draws another dropout mask, so the gradients are "
         "those of another function (and a second backward differs again)",
         failing={"gradcheck"}, noted={"backward.repeatable"}),
    Case("fused_cross_entropy_once_only", "once-only backward (fused cross-entropy)",
         FusedCrossEntropy, _cross_entropy_args,
         "correct for one backward per graph; a second scales the gradient again",
         noted={"backward.repeatable"}, skipped={"gradgradcheck": "once_differentiable"}),
    Case("frees_workspace_once_only", "once-only backward (frees ctx state)", FreesWorkspace,
         lambda: (sample(3, 4), sample(4, 2, seed=1)),
         "correct for one backward per graph; a second raises",
         noted={"backward.repeatable"}),
    Case("frees_workspace_wrong_gradient", "once-only backward (frees ctx state)",
         FreesWorkspaceWrongGradient, lambda: (sample(3, 4), sample(4, 2, seed=1)),
         "broken: tanh's derivative is 1 - tanh^2; still caught although backward runs once",
         failing={"gradcheck"}, noted={"backward.repeatable"}),
    Case("boxed_split_heads", "boxed_grads_call", SplitHeads, lambda: (sample(2, 6),),
         "correct: each gradient is freed once used", needs=("apply_boxed",)),
    Case("boxed_split_heads_keeps_grads", "boxed_grads_call", SplitHeadsKeepsGrads,
         lambda: (sample(2, 6),), "broken: a copy of the list on ctx keeps every gradient",
         failing={"boxed_grads.released"}, needs=("apply_boxed",)),
]
