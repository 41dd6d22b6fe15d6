"""FusedGRUCell: nn.GRUCell's outputs bit for bit and its gradients, batched or
not; every step after the first to run backward adds into the weights'
buffers; fuse() swaps it in; an unrolled cell allocates exactly what advise
promised less."""
import copy

import pytest
import torch
import torch.nn.functional as F

import torch_ctxext
from torch_ctxext.nn import FusedGRUCell, FusedGRUGatesFunction, fuse

from where_fusing_pays import Workload, report_of


def unrolled(cls, steps=5, batched=True, state=True, bias=True):
    torch.manual_seed(0)
    cell = cls(3, 4, bias=bias)
    xs = torch.randn(steps, 2, 3) if batched else torch.randn(steps, 3)
    h = (torch.zeros(2, 4) if batched else torch.zeros(4)) if state else None
    outputs = []
    with torch_ctxext.explain() as report:
        for x in xs:
            h = cell(x, h)
            outputs.append(h)
        torch.stack(outputs).pow(2).sum().backward()
    return cell, outputs, report


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("state", [True, False], ids=["given_state", "no_state"])
def test_fused_gru_cell_computes_nn_gru_cells_outputs_bit_for_bit_and_its_gradients(batched, state, bias):
    stock, stock_out, _ = unrolled(torch.nn.GRUCell, batched=batched, state=state, bias=bias)
    fused, fused_out, report = unrolled(FusedGRUCell, batched=batched, state=state, bias=bias)
    for a, b in zip(stock_out, fused_out):
        assert torch.equal(a, b)
    for (name, a), (_, b) in zip(stock.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    # Each parameter used at each of 5 steps: every step but the first to
    # run backward adds into its buffer.
    parameters = 4 if bias else 2
    assert report[FusedGRUGatesFunction].exposed >= parameters * (5 - 1)


def test_fused_gru_gates_function_passes_check_function():
    gen = torch.Generator().manual_seed(0)
    h, x = torch.randn(2, 4, generator=gen, requires_grad=True), torch.randn(2, 3, generator=gen, requires_grad=True)
    w_hh, w_ih = (torch.randn(12, n, generator=gen, requires_grad=True) for n in (4, 3))
    b_hh, b_ih = (torch.randn(12, generator=gen, requires_grad=True) for _ in range(2))
    report = torch_ctxext.testing.check_function(FusedGRUGatesFunction, h, w_hh, b_hh, x, w_ih, b_ih, True)
    assert report.passed, str(report)


def test_fused_gru_cell_rejects_input_of_the_wrong_rank():
    with pytest.raises(ValueError, match="Expected input to be 1D or 2D, got 3D"):
        FusedGRUCell(3, 4)(torch.randn(1, 2, 3))


def test_fuse_swaps_a_gru_cell_in_place_keeping_its_parameters_and_state_dict():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.GRUCell(3, 4))
    cell = model[0]
    parameters = list(cell.parameters())
    state = copy.deepcopy(model.state_dict())
    fuse(model)
    assert model[0] is cell and type(cell) is FusedGRUCell and list(cell.parameters()) == parameters
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


class UnrolledGRU(torch.nn.Module):
    def __init__(self, features=16, hidden=32, classes=10):
        super().__init__()
        self.cell = torch.nn.GRUCell(features, hidden)
        self.readout = torch.nn.Linear(hidden, classes)

    def forward(self, sequence):
        h = torch.zeros(sequence.shape[1], self.cell.hidden_size)
        for x in sequence:
            h = self.cell(x, h)
        return self.readout(h)


def gru(steps=16):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    sequence, targets = torch.randn(steps, 4, 16, generator=gen), torch.randint(10, (4,), generator=gen)
    return Workload("gru", UnrolledGRU(), (sequence, targets),
                    lambda m, sequence, targets: F.cross_entropy(m(sequence), targets))


def test_an_unrolled_gru_cell_fused_allocates_exactly_the_promise_less():
    """The measured drop equals advise's promise to the byte: the four
    parameters' later gradients, and the hidden state's (read by the next
    step's product and by its own update), which the cell's product adds
    into; the gates' arithmetic is not promised and not fused."""
    import bench_advise

    report = report_of(gru())
    assert report.drop_ins["cell"].drop_in == "FusedGRUCell"
    fused = gru()
    fuse(fused.model)
    stock_allocated, _ = bench_advise.allocations(gru())
    fused_allocated, _ = bench_advise.allocations(fused)
    fused_report = report_of(gru(), fused=True)
    assert stock_allocated - fused_allocated == report.avoidable_bytes > 0
    assert fused_report.avoided_bytes == report.avoidable_bytes and fused_report.avoidable_bytes == 0
