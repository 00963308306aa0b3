"""What the engine's compiled layers see as symbols (models/layers/fixed_shapes.py): the token
dimensions only. The rollout cache, the rotary frequencies and the mHC streams' width are constants
in every graph (symbols there made dynamo's tracing ~1.5x slower on the 1b config), while one graph
still serves every batch size."""

from __future__ import annotations

import re

import torch

from conftest import greedy, make_engine, prompts, requests
from lockstep.engine.decode_path import start_graphs

CONSTANT = re.compile(r"cell_contents_(window|compressor|indexer)|inv_freq")  # the cache's tensors, the frequencies


def _placeholders(gm) -> dict[str, tuple]:
    shapes = {}
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            shapes[node.name] = tuple(value.shape)
    return shapes


def test_only_the_token_dimensions_are_symbols():
    torch._dynamo.reset()  # graphs compiled by other tests with another backend would be reused
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(_placeholders(gm))
        return gm.forward

    engine = make_engine(max_num_seqs=4, compile_prefill=False)  # the decode graphs: prefill's take the same marks
    start_graphs(engine.adapter, engine.config, capture=False, compile_backend=recording)
    engine.generate(requests(prompts(3), greedy(4)))  # decode steps at batch 3 -> bucket 4
    compiled = len(graphs)
    engine.generate(requests(prompts(2, lo=40, hi=50, seed=1), greedy(4)))  # another batch size
    assert len(graphs) == compiled, "another batch size compiled again"
    layer_graphs = [g for g in graphs if any(n.startswith("l_streams") for n in g)]
    assert layer_graphs
    cached = 0
    for shapes in layer_graphs:
        streams = next(s for n, s in shapes.items() if n.startswith("l_streams"))
        assert isinstance(streams[0], torch.SymInt), f"the batch dimension is a constant: {streams}"
        assert all(isinstance(d, int) for d in streams[2:]), f"the streams' width is a symbol: {streams}"
        for name, shape in shapes.items():
            if CONSTANT.search(name):
                cached += 1
                assert all(isinstance(d, int) for d in shape), f"{name} {shape}: a symbol"
    assert cached, "no cache tensor among the graphs' inputs (the names changed?)"
