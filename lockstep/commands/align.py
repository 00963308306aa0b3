"""`lockstep align`: not implemented yet."""


def add_arguments(parser):
    pass


def run(args):
    raise SystemExit("lockstep align: not implemented yet")
