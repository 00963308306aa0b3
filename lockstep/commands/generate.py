"""`lockstep generate`: not implemented yet."""


def add_arguments(parser):
    pass


def run(args):
    raise SystemExit("lockstep generate: not implemented yet")
