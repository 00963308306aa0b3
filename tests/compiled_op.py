"""torch.compile of a custom op itself, for the kernel tests' "the compiled caller gets the kernel's
result" checks. Dynamo compiles every op handed to torch.compile directly through one shared wrapper
(torch/_dynamo/external_utils.py `inner`), so the ops compiled by the tests one xdist worker runs
add up in that wrapper's cache until dynamo's recompile limit (8) fails the ninth with fullgraph=True;
each test starts from an empty cache instead."""

import torch


def compile_op(op, **options):
    torch._dynamo.reset()
    return torch.compile(op, backend="eager", fullgraph=True, **options)
