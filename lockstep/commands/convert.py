"""`lockstep convert`: not implemented yet."""


def add_arguments(parser):
    pass


def run(args):
    raise SystemExit("lockstep convert: not implemented yet")
