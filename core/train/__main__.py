"""``python -m ppmedia.train``: the same as ``examples/train.py``."""

from .loop import main

if __name__ == "__main__":
    main()
