"""recipes/train.py inside a DistPool's workers (tests/distributed: test_train, test_train_models, test_fault)."""

from __future__ import annotations

import contextlib
import io


def run_recipe(argv: list[str]) -> str:
    """recipes/train.py's train() with these arguments on this rank of a pool: its processes (gloo,
    one thread each), the process group up, which is what torchrun's launch gives the recipe (the
    launch itself is tests/distributed/test_recipes.py's and test_fault.py's); a launch of 4 fresh
    processes costs the suite ~15 s of imports. Returns what the recipe printed (rank 0's log)."""
    from dist_optim.plugins.cpu import install, quiet_colossal
    from recipes import train

    install()
    printed = io.StringIO()
    with quiet_colossal(), contextlib.redirect_stdout(printed):
        train.train(train.parse_args(argv))
    return printed.getvalue()
