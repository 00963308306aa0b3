"""The runtime side of scale (see ../shared/DISTRIBUTED.md): process groups and timeouts (groups.py),
launch through torch's own launcher (launch.py) or as Ray actors (ray_launch.py), the weight push
over torch.distributed (manifest.py, weight_push.py), and parallelisms applied to the one model from outside (fsdp.py)."""
