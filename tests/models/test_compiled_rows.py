"""compiled_rows.py's calls on the CPU (dynamo's trace, a counting backend): which row counts share a
graph."""

import torch

from lockstep.models.layers import compiled_rows


def _scaled_rows(x: torch.Tensor, bias: torch.Tensor | None):
    y = x * 3 + 1
    return (y, None) if bias is None else (y, y + bias)


def test_one_row_runs_padded_through_the_graph_of_many(monkeypatch):
    """A one-row call is padded to two and takes the graph every count of 2 or more shares (inductor
    would compile 1 row as its own graph, with fusion choices of its own): no second graph, the first
    row's values, outputs trimmed to one row, None arguments and outputs passed through."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append([tuple(v.shape) for v in example_inputs if isinstance(v, torch.Tensor)])
        return gm.forward

    monkeypatch.setattr(compiled_rows, "_compiled", {})
    monkeypatch.setattr(compiled_rows, "backend", lambda on_cuda: counting)
    torch._dynamo.reset()
    x = torch.randn(5, 8)
    bias = torch.randn(5, 8)
    for rows in (5, 3, 1):
        y, z = compiled_rows.call_rows(_scaled_rows, None, x[:rows], bias[:rows])
        assert y.shape == (rows, 8) and torch.equal(y, x[:rows] * 3 + 1) and torch.equal(z, y + bias[:rows])
    y, none = compiled_rows.call_rows(_scaled_rows, None, x[:1], None)
    assert none is None and torch.equal(y, x[:1] * 3 + 1)
    # one graph with bias, one without: the 1-row calls reused them
    assert len(graphs) == 2, graphs
