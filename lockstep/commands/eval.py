"""`lockstep eval`: not implemented yet."""


def add_arguments(parser):
    pass


def run(args):
    raise SystemExit("lockstep eval: not implemented yet")
