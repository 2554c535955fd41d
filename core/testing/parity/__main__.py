"""``python -m ppmedia.testing.parity``: :func:`~ppmedia.testing.parity.main`, as a plain command or under
``torchrun`` (then this process is a gloo worker and ends with :func:`~ppmedia.testing.parity.exit_worker`)."""

import sys

from . import exit_worker, launched_by_torchrun, main

if __name__ == "__main__":
    code = main()
    if launched_by_torchrun():
        exit_worker(code)  # this process was a gloo worker: skip the teardown (see exit_worker)
    sys.exit(code)
